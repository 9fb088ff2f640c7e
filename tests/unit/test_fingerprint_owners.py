"""Whose fingerprints a container's checkpoint gets (store/fingerprints.py owner_of): a
container is an owner by its name at torpor, <id>@<runtime root key> (oci.container_name), so
one id under two runtime roots (containerd namespaces, podman beside ctr: perhaps two tenants)
is two owners, neither handed nor resolving the other's chunks; a container an earlier torpor
created (no key: agents/<id>) keeps container:<id>, its snapshots' owner before keys. With the
real agent on the fake driver through torpord's flow (flows/container.py), whose rollback
fills what the agent skipped by the owner the checkpoint recorded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.unit.test_agent import gpu, probe  # noqa: F401  (fixtures)
from tests.unit.test_agent_mover import ctl_fds
from tests.unit.test_store_fingerprints import MIB, _checkpoint_dir, _program
from torpor.errors import UsageError
from torpor.store import Store, fingerprints, images

KEY_A, KEY_B = "0123456789abcdef", "fedcba9876543210"    # two runtime roots' keys
A, B = f"ctr@{KEY_A}", f"ctr@{KEY_B}"                    # one id under each


def test_a_containers_owner_is_its_id_and_root_key():
    assert fingerprints.owner_of(A) == f"container:ctr@{KEY_A}"
    assert fingerprints.owner_of(B) == f"container:ctr@{KEY_B}" != fingerprints.owner_of(A)
    assert fingerprints.owner_of("ctr") == "container:ctr"   # an earlier torpor's container
    assert fingerprints.owner_of(uid=1000) == "uid:1000"
    assert fingerprints.owner_of("", 1000) == "uid:1000"     # no container: the program's uid
    for owner in (fingerprints.owner_of(A), "container:ctr", "uid:0", "uid:4242"):
        assert fingerprints.check_owner(owner) == owner
    with pytest.raises(UsageError, match="^bad uid"):
        fingerprints.owner_of(uid=-1)


@pytest.mark.parametrize("name", [
    "ctr@", f"ctr@{KEY_A[:15]}", f"ctr@{KEY_A}0", f"ctr@{KEY_A.upper()}", f"ctr@{KEY_A}\n",
    f"ctr@{KEY_A}@{KEY_B}", f"@{KEY_A}", "..", ".", "a/b", "ctr\n", "c" * 129, "ctr:x"])
def test_a_malformed_container_name_is_no_owner(name):
    with pytest.raises(UsageError, match="^bad container name"):
        fingerprints.owner_of(name)


@pytest.mark.parametrize("owner", [
    "ctr", "container:", f"container:ctr@{KEY_A[:15]}", f"container:ctr@{KEY_A}\n",
    f"container:ctr@{KEY_A}@{KEY_B}", "container:a/b", "uid:", "uid:-1", "uid:01", "uid:1 ",
    "uid:x", "uid:１", f"Container:{A}", f"container:{A}\x00", "pid:1", 7])
def test_a_malformed_owner_is_refused_before_the_store_is_read(tmp_path, owner):
    store = Store(tmp_path / "store")
    with pytest.raises(UsageError, match="^bad fingerprint owner"):
        fingerprints.known(store, owner)
    with pytest.raises(UsageError, match="^bad fingerprint owner"):
        images.pack(store, tmp_path / "nothing-here", "one", owner)


CHUNK = 64 << 10


def test_known_is_each_containers_own(tmp_path):
    """Host fingerprints (CRIU's page images): each snapshot's owner alone gets them."""
    store = Store(tmp_path / "store", chunk_size=CHUNK, workers=2)
    owners = {n: fingerprints.owner_of(n) for n in (A, B, "ctr")}
    for i, owner in enumerate(owners.values()):
        src = tmp_path / f"src-{i}"
        src.mkdir()
        (src / "pages-1.img").write_bytes(os.urandom(3 * CHUNK))
        store.ingest_dir(src, f"snap-{i}", {"owner": owner}, known={})
    fps = {n: set(fingerprints.known(store, o).host) for n, o in owners.items()}
    assert all(len(f) == 3 for f in fps.values()), fps
    assert not fps[A] & fps[B] and not fps[A] & fps["ctr"] and not fps[B] & fps["ctr"]
    assert fingerprints.known(store, "container:ctr@" + "0" * 16) == fingerprints.Known({}, {})


# -- through torpord's flow, with the real agent on the fake driver ----------------------------

def _engine(gpu, tmp_path: Path, store: Store, stream: bool):
    from torpor import config
    from torpor.engine import Engine
    gpu.activate()
    return Engine(config.load(env={**gpu.env(), "TORPOR_STATE_DIR": str(tmp_path / "state"),
                                   "TORPOR_STORE_DIR": str(store.backend.root),
                                   "TORPOR_AGENT_FILES": "2",
                                   "TORPOR_STORE_STREAM": "1" if stream else "0"}))


def _checkpoint_and_roll_back(engine, p, name: str, data: Path, handed: list[set[str]]):
    """torpord's LockAndCheckpoint of the container `name` (its one program p) into the store,
    then its rollback (the dump failed): what its agent moved, and the owner its journal
    entry recorded for it."""
    from torpor.engine.agents import targets_of
    from torpor.flows import container, policy
    opened = []
    handed.clear()
    ck = container.lock_and_checkpoint(
        engine, [p.pid], data=data, agent_dir=p.sock.parent, owner_container=name,
        mode=policy.FingerprintMode.SKIP, opened=lambda op, cuda: opened.append((op, cuda)))
    (op, cuda), = opened
    owners = {t.owner for t in targets_of(op.entry.agents).values()}
    container.roll_back(engine, op, cuda)
    (moved,) = ck.moved
    return moved, owners


@pytest.mark.parametrize("stream", [False, True], ids=["files", "streamed"])
def test_one_id_under_two_roots_shares_no_fingerprints(gpu, probe, tmp_path, monkeypatch,
                                                       stream):
    """ctr under root A packed a checkpoint. ctr under root B (and an earlier torpor's ctr)
    is handed none of its fingerprints and skips nothing; ctr under A itself is handed them
    and skips what did not change, and its rollback fills those parts by the owner its
    checkpoint recorded (filled by another's, it would fail)."""
    p = probe()
    a, b = _program(p)
    store = Store(tmp_path / "store")
    one, _ = _checkpoint_dir(tmp_path, "one", p, store, skip=False)
    images.pack(store, one, "one", fingerprints.owner_of(A))
    assert ctl_fds(p.sock, "abort")["ok"]
    theirs = set(fingerprints.known(store, fingerprints.owner_of(A)).gpu)
    assert theirs

    handed: list[set[str]] = []
    real = fingerprints.known_fd
    monkeypatch.setattr(fingerprints, "known_fd",
                        lambda fps: handed.append(set(fps)) or real(fps))
    engine = _engine(gpu, tmp_path, store, stream)
    for i, name in enumerate((B, "ctr")):
        moved, owners = _checkpoint_and_roll_back(engine, p, name, tmp_path / f"d{i}", handed)
        assert handed == [set()], name                    # none of A's
        assert moved.fingerprinted > 0 and moved.skipped == 0, moved
        assert owners == {f"container:{name}"}
        assert p.call(f"@check {a} {48 * MIB} 3")["ok"] and p.call(f"@check {b} {8 * MIB} 4")["ok"]

    moved, owners = _checkpoint_and_roll_back(engine, p, A, tmp_path / "d2", handed)
    assert handed == [theirs]
    assert moved.skipped == moved.fingerprinted > 0, moved       # nothing changed: all known
    assert owners == {f"container:{A}"}
    assert "fill" in engine.progress.timings or stream        # files: filled before the resume
    assert p.call(f"@check {a} {48 * MIB} 3")["ok"] and p.call(f"@check {b} {8 * MIB} 4")["ok"]


def test_a_restore_takes_fingerprints_from_its_own_snapshot_not_another_roots(tmp_path):
    """own_fingerprints (a streamed restore's check by host fingerprint) lends those of the
    store's own snapshot of the packed checkpoint, keyed owner and all, and none to a packed
    doc of B's that names A's snapshot: its chunks are not A's. (It does not match the
    restoring container's owner: the name picks the chunk, the fingerprint only checks the
    bytes; fingerprints.own_fingerprints says why.)"""
    store = Store(tmp_path / "store", chunk_size=CHUNK, workers=2)
    rel = "torpor-gpu/1/gpu-memory-0.bin"
    docs = {}
    for snap, n in (("a", A), ("b", B)):
        src = tmp_path / f"src-{snap}"
        (src / rel).parent.mkdir(parents=True)
        (src / rel).write_bytes(os.urandom(3 * CHUNK))
        docs[snap], _ = store.ingest_dir(src, snap, {"owner": fingerprints.owner_of(n)}, known={})
    own = {s: fingerprints.own_fingerprints(store, d, [rel]) for s, d in docs.items()}
    assert all(len(f) == 3 for f in own.values()) and not set(own["a"]) & set(own["b"])
    claims_a = {**docs["b"], "name": "a"}
    assert fingerprints.own_fingerprints(store, claims_a, [rel]) == {}
