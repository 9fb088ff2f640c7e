"""GPU fingerprints through the image store (store/fingerprints.py) with the real agent on the
fake driver: the second checkpoint's agent skips what the store has, pack takes those chunks
from the snapshots without reading the holes, a restore's unpack gives the complete files, and
fill() completes a directory that was never packed (a rollback, a failed pack)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.conftest import torpor_cmd
from tests.unit.test_agent import gpu, probe  # noqa: F401  (fixtures)
from tests.unit.test_agent_mover import ctl_fds
from tests.unit.test_manifest import _manifest as sealed
from torpor import agent_data, manifest
from torpor.errors import CorruptCheckpointError, TorporError, UsageError
from torpor.store import Store, chunk, fingerprints, images, snapshot

MIB = 1 << 20
OWNER = "uid:0"      # whose snapshots these checkpoints' fingerprints are matched against


def _checkpoint_dir(tmp_path: Path, name: str, p, store: Store, skip: bool = True
                    ) -> tuple[Path, dict]:
    """What `torpor checkpoint --store` leaves before its pack: a directory (a stand-in page
    image) whose agent data went through a prepare with fingerprints, sealed without
    checksums (the store names every chunk by its sha256)."""
    d = tmp_path / name
    d.mkdir(mode=0o700)
    for image in ("pages-1.img", *manifest.REQUIRED_IMAGES):
        (d / image).write_bytes(f"a stand-in {image}".encode())
    data = agent_data.DataDir(d / agent_data.DATA_DIR).make()
    fds = data.for_prepare(p.pid, 2)
    fds += [data.new_index(p.pid),
            fingerprints.known_fd(fingerprints.known(store, OWNER).gpu if skip else ())]
    try:
        r = ctl_fds(p.sock, "prepare 5000 fp", [*fds[:2], fds[3], fds[2]])
    finally:
        for fd in fds:
            os.close(fd)
    assert r["ok"], r
    manifest.write(d, sealed(manifest.file_table(d, checksums=False)))
    return d, r


def _stored_once(p, tmp_path: Path) -> tuple[int, int, Store]:
    """A program with 56 MiB, checkpointed into a new store once (packed), then running."""
    a, b = _program(p)
    store = Store(tmp_path / "store")
    one, _ = _checkpoint_dir(tmp_path, "one", p, store)
    images.pack(store, one, "one", OWNER)
    assert ctl_fds(p.sock, "abort")["ok"]
    return a, b, store


def _program(p) -> tuple[int, int]:
    assert p.call("init dlsym")["rc"] == 0
    a = p.call(f"@alloc {48 * MIB} dlsym")["ptr"]
    b = p.call(f"@alloc {8 * MIB} dlsym")["ptr"]
    assert p.call(f"@fill {a} {48 * MIB} 3")["rc"] == 0
    assert p.call(f"@fill {b} {8 * MIB} 4")["rc"] == 0
    return a, b


def test_a_second_checkpoint_skips_what_the_store_has_and_restores_whole(probe, tmp_path):
    p = probe()
    a, b = _program(p)
    store = Store(tmp_path / "store")
    one, r1 = _checkpoint_dir(tmp_path, "one", p, store)
    assert r1["fingerprints"]["parts"] > 0 and r1["fingerprints"]["skipped"] == 0
    whole = {f.name: f.read_bytes() for f in (one / agent_data.DATA_DIR / str(p.pid)).iterdir()
             if f.name.startswith("gpu-memory")}
    doc1, _ = images.pack(store, one, "one", OWNER)
    fps = [f for e in doc1["files"].values() for f in e.get("fingerprints", [])]
    assert len(fps) == r1["fingerprints"]["parts"]
    assert ctl_fds(p.sock, "abort")["ok"]

    assert p.call(f"@fill {b} {8 * MIB} 5")["rc"] == 0        # b changes, a does not
    two, r2 = _checkpoint_dir(tmp_path, "two", p, store)
    f2 = r2["fingerprints"]
    assert f2["skipped"] > 0 and f2["skipped_bytes"] >= 40 * MIB, f2
    assert r2["bytes"] <= 16 * MIB                            # b's parts crossed PCIe, not a's
    assert fingerprints.any_skipped(two)
    doc2, st = images.pack(store, two, "two", OWNER)
    assert st.new_bytes < 20 * MIB, st                       # b's chunks, the index, the rest
    assert not any(e.get("fingerprints") is None for rel, e in doc2["files"].items()
                   if rel.endswith(".bin"))
    new = snapshot.new_bytes_by_file(doc2, doc1)
    assert sum(n for rel, n in new.items() if rel.endswith(".bin")) <= 16 * MIB, new

    # the restore's files: complete, and the agent's fingerprints check what the store gave
    unpacked = images.unpack(store, two)
    prog = unpacked / agent_data.DATA_DIR / str(p.pid)
    assert not fingerprints.has_skipped(prog)                 # the store's index is complete
    fds = agent_data.DataDir(unpacked / agent_data.DATA_DIR).for_resume(p.pid, 2)
    try:
        assert ctl_fds(p.sock, "detach")["ok"]
        r = ctl_fds(p.sock, "resume", fds)
    finally:
        for fd in fds:
            os.close(fd)
    assert r["ok"], r
    assert p.call(f"@check {a} {48 * MIB} 3")["ok"] and p.call(f"@check {b} {8 * MIB} 5")["ok"]
    # the first checkpoint's files are unchanged by all this
    for f in (images.unpack(store, one) / agent_data.DATA_DIR / str(p.pid)).iterdir():
        if f.name in whole:
            assert f.read_bytes() == whole[f.name]


def test_copied_parts_the_store_knows_are_packed_without_being_read(probe, tmp_path,
                                                                    monkeypatch):
    """--leave-running: the agent skips nothing (its program needs the data back at once),
    and the pack takes what the store has by fingerprint, neither reading nor hashing it."""
    p = probe()
    a, b, store = _stored_once(p, tmp_path)
    two, r2 = _checkpoint_dir(tmp_path, "two", p, store, skip=False)
    assert r2["fingerprints"]["skipped"] == 0 and r2["bytes"] == 56 * MIB
    hashed: list[int] = []
    real = chunk.name_of
    monkeypatch.setattr(chunk, "name_of", lambda d: hashed.append(len(d)) or real(d))
    doc, st = images.pack(store, two, "two", OWNER)
    assert sum(hashed) < 1 * MIB, hashed       # CRIU-less stand-in: the index and torpor.json
    assert st.new_chunks <= 2 and st.reused_chunks >= 14, st
    assert ctl_fds(p.sock, "abort")["ok"]
    assert p.call(f"@check {a} {48 * MIB} 3")["ok"] and p.call(f"@check {b} {8 * MIB} 4")["ok"]


def test_fill_completes_an_unpacked_directory_and_checks_the_index(probe, tmp_path):
    p = probe()
    a, b, store = _stored_once(p, tmp_path)
    two, r2 = _checkpoint_dir(tmp_path, "two", p, store)      # nothing changed: all skipped
    assert r2["bytes"] == 0 and r2["fingerprints"]["skipped"] == r2["fingerprints"]["parts"]
    data = agent_data.DataDir(two / agent_data.DATA_DIR)
    prog = data.path(p.pid)
    index = (prog / agent_data.INDEX).read_text()

    # an index pointing outside its files is refused before anything is written
    first = index.splitlines()[1].split()
    bad = index.replace(" ".join(first), " ".join([first[0], str(1 << 40), *first[2:]]), 1)
    (prog / agent_data.INDEX).write_text(bad)
    fds = data.for_fill(p.pid, 2)
    sizes = [os.fstat(fd).st_size for fd in fds]
    with pytest.raises(CorruptCheckpointError, match="outside the data files"):
        fingerprints.fill(store, prog, fds, sizes, OWNER)
    (prog / agent_data.INDEX).write_text(index)

    # a store that lost the snapshot: fill says which chunk it needs
    other = Store(tmp_path / "empty")
    with pytest.raises(TorporError, match="no longer has it"):
        fingerprints.fill(other, prog, fds, sizes, OWNER)
    for fd in fds:
        os.close(fd)
    assert fingerprints.any_skipped(two)
    assert fingerprints.fill_dir(store, two, OWNER) == 56 * MIB    # as a failed pack does
    assert not fingerprints.any_skipped(two) and fingerprints.fill_dir(store, two, OWNER) == 0
    assert not fingerprints.has_skipped(prog)
    assert oct((prog / agent_data.INDEX).stat().st_mode & 0o777) == "0o600"
    assert ctl_fds(p.sock, "abort")["ok"]                      # from the kept, now filled, fds
    assert p.call(f"@check {a} {48 * MIB} 3")["ok"] and p.call(f"@check {b} {8 * MIB} 4")["ok"]


def test_a_rollback_fills_what_the_agent_skipped_then_resumes(gpu, probe, tmp_path):
    """The engine's own path, with the real agent on the fake driver: a checkpoint into the
    store whose driver lock fails after the agent skipped every part; the rollback fills the
    holes from the store before its resume, and the program has its memory back."""
    from torpor import config
    from torpor.engine import Engine
    from torpor.errors import RolledBackError

    gpu.activate()
    p = probe()
    a, b, store = _stored_once(p, tmp_path)
    cfg = config.load(env={**gpu.env(), "TORPOR_STATE_DIR": str(tmp_path / "state"),
                           "TORPOR_STORE_DIR": str(store.backend.root),
                           "TORPOR_AGENT_FILES": "2"})
    engine = Engine(cfg)
    data = agent_data.DataDir(tmp_path / "two-data")
    gpu.fail("lock", "CUDA_ERROR_UNKNOWN", p.pid)
    with store.backend.lock(False, 10), pytest.raises(RolledBackError):
        with engine.begin("checkpoint", [p.pid]) as op:
            engine.lock_and_checkpoint(op, [p.pid], data=data, agent_dir=p.sock.parent,
                                       known_fingerprints=fingerprints.known(store, OWNER).gpu,
                                       owner=OWNER)
    assert "fill" in engine.progress.timings     # the skipped parts were filled, then resumed
    st = p.status()
    assert (st["state"], st["gate"]) == ("running", "open"), st
    assert p.call(f"@check {a} {48 * MIB} 3")["ok"] and p.call(f"@check {b} {8 * MIB} 4")["ok"]


def test_a_restore_does_not_fill_skipped_parts_from_the_store(gpu, probe, tmp_path):
    """Only the checkpoint that skipped parts fills them (its pack, or its rollback): an index
    in an imported directory must not make this host's store hand its chunks to a program."""
    from torpor import config
    from torpor.engine import AgentTarget, Engine

    gpu.activate()
    p = probe()
    a, b, store = _stored_once(p, tmp_path)
    two, r2 = _checkpoint_dir(tmp_path, "two", p, store)
    assert r2["fingerprints"]["skipped"] > 0
    assert ctl_fds(p.sock, "detach")["ok"]
    cfg = config.load(env={**gpu.env(), "TORPOR_STATE_DIR": str(tmp_path / "state"),
                           "TORPOR_STORE_DIR": str(store.backend.root)})
    engine = Engine(cfg)
    target = AgentTarget(p.pid, p.sock, two / agent_data.DATA_DIR, p.pid, 2)
    with engine.begin("restore", [p.pid]) as op, \
            pytest.raises(TorporError, match="only the checkpoint that skipped them fills"):
        engine.restore_and_unlock(op, [], agents={p.pid: target})
    assert fingerprints.any_skipped(two) and "fill" not in engine.progress.timings
    assert p.status()["state"] == "detached"                  # nothing reloaded: nothing lost
    assert fingerprints.fill_dir(store, two, OWNER) > 0     # what its pack does on failure
    with engine.begin("restore", [p.pid]) as op:
        engine.restore_and_unlock(op, [], agents={p.pid: target})
    assert p.call(f"@check {a} {48 * MIB} 3")["ok"] and p.call(f"@check {b} {8 * MIB} 4")["ok"]


def test_a_pack_that_fails_fills_the_skipped_parts_back_in(gpu, probe, tmp_path, monkeypatch):
    """torpor checkpoint --store whose pack fails (a full disk, say): the directory is left
    unpacked and whole, what its agent skipped written back from the store."""
    from torpor.flows import process
    from torpor.engine import Engine

    p, ab, store, two, cfg = _skipping_checkpoint(gpu, probe, tmp_path)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(images, "pack", full)
    assert manifest.read(two)["files"]["pages-1.img"]["sha256"] is None
    with pytest.raises(TorporError, match="No space left on device; the checkpoint in .* is "
                                          "complete, not packed"):
        process.store_checkpoint(Engine(cfg), store, two, "two", OWNER)
    manifest.verify(two, manifest.read(two))     # with the checksums it was sealed without
    assert manifest.read(two)["files"]["pages-1.img"]["sha256"]
    _whole_and_resumes(p, two, ab)


def _skipping_checkpoint(gpu, probe, tmp_path):
    """A program stored once, then checkpointed with parts skipped, not yet packed; a config
    with the store and a journal."""
    from torpor import config

    # not held: an abort then reads the files, whose skipped parts are holes (held, the agent
    # would map its own memory back and need none of them)
    p = probe({"TORPOR_AGENT_VMM_EXPORT": "0"})
    a, b, store = _stored_once(p, tmp_path)
    two, r2 = _checkpoint_dir(tmp_path, "two", p, store)
    assert r2["fingerprints"]["skipped"] > 0 and fingerprints.any_skipped(two)
    cfg = config.load(env={**gpu.env(), "TORPOR_STATE_DIR": str(tmp_path / "state"),
                           "TORPOR_STORE_DIR": str(store.backend.root)})
    return p, (a, b), store, two, cfg


def _whole_and_resumes(p, two: Path, ab: tuple[int, int]) -> None:
    a, b = ab
    assert not fingerprints.any_skipped(two) and not images.is_packed(two)
    assert ctl_fds(p.sock, "abort")["ok"]               # from its own files, now whole
    assert p.call(f"@check {a} {48 * MIB} 3")["ok"] and p.call(f"@check {b} {8 * MIB} 4")["ok"]


def test_ctrl_c_during_the_pack_leaves_the_checkpoint_whole(gpu, probe, tmp_path, monkeypatch):
    from torpor.flows import process
    from torpor.engine import Engine
    from torpor.errors import ExitCode

    p, ab, store, two, cfg = _skipping_checkpoint(gpu, probe, tmp_path)

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt
    monkeypatch.setattr(images, "pack", interrupted)
    engine = Engine(cfg)
    with pytest.raises(TorporError, match="interrupted; the checkpoint in .* is complete, not "
                                          "packed") as e:
        process.store_checkpoint(engine, store, two, "two", OWNER)
    assert e.value.exit_code == ExitCode.INTERRUPTED
    assert list(engine.journal.orphans()) == []         # nothing left for recovery
    _whole_and_resumes(p, two, ab)


def test_a_fill_that_fails_is_left_to_recovery(gpu, probe, tmp_path, monkeypatch):
    from torpor.flows import process
    from torpor.engine import Engine

    p, ab, store, two, cfg = _skipping_checkpoint(gpu, probe, tmp_path)
    fill_dir = fingerprints.fill_dir

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(images, "pack", full)
    monkeypatch.setattr(fingerprints, "fill_dir", full)
    with pytest.raises(TorporError, match="could not be made whole .*the next torpor command "
                                          "tries again"):
        process.store_checkpoint(Engine(cfg), store, two, "two", OWNER)
    assert fingerprints.any_skipped(two)
    monkeypatch.setattr(fingerprints, "fill_dir", fill_dir)   # the disk has room again
    messages = Engine(cfg).recover()
    assert any("pack into the image store was interrupted" in m and "filled in" in m
               for m in messages), messages
    assert Engine(cfg).recover() == []                  # done: the entry is gone
    _whole_and_resumes(p, two, ab)


def test_a_journal_that_cannot_be_written_still_leaves_the_checkpoint_whole(
        gpu, probe, tmp_path, monkeypatch):
    from torpor.flows import process
    from torpor.engine import Engine

    p, ab, store, two, cfg = _skipping_checkpoint(gpu, probe, tmp_path)
    engine = Engine(cfg)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(engine.journal, "begin", full)
    with pytest.raises(TorporError, match="No space left on device; the checkpoint in .* is "
                                          "complete, not packed"):
        process.store_checkpoint(engine, store, two, "two", OWNER)
    _whole_and_resumes(p, two, ab)


KILLED_PACK = """
import sys, time
from pathlib import Path
from torpor import config
from torpor.flows import process
from torpor.engine import Engine
from torpor.store import Store, images
def stuck(store, images_dir, *a, **k):   # the pack's chunks half written, then torpor dies
    (images_dir / images.CHUNKS).mkdir()
    Path(sys.argv[2]).write_text("packing")
    time.sleep(60)
images.pack = stuck
cfg = config.load()
process.store_checkpoint(Engine(cfg), Store(cfg.store_dir), Path(sys.argv[1]), "two",
                         sys.argv[3])
"""


def test_torpor_killed_mid_pack_the_next_one_makes_the_checkpoint_whole(gpu, probe, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from torpor.engine import Engine

    p, ab, store, two, cfg = _skipping_checkpoint(gpu, probe, tmp_path)
    marker = tmp_path / "packing"
    env = {**os.environ, **gpu.env(), "TORPOR_STATE_DIR": str(tmp_path / "state"),
           "TORPOR_STORE_DIR": str(store.backend.root),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", KILLED_PACK, str(two), str(marker), OWNER],
                             env=env)
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert child.poll() is None and time.monotonic() < deadline, "the pack did not start"
        time.sleep(0.02)
    assert Engine(cfg).recover() == []                  # a live pack is not recovered
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert fingerprints.any_skipped(two) and (two / images.CHUNKS).is_dir()
    # the next torpor command, be it one that removes what the holes need, fills them first
    r = subprocess.run(torpor_cmd("rm", "one"), env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "is complete, not packed" in r.stderr \
        and "filled in from the store" in r.stderr, r.stderr
    assert Engine(cfg).recover() == []
    assert not (two / images.CHUNKS).exists()           # the dead pack's links are gone
    _whole_and_resumes(p, two, ab)


def test_gc_waits_for_a_pack_its_recovery_could_not_finish(gpu, probe, tmp_path):
    """A dead torpor's pack whose recovery fails (here: its chunks' snapshot was removed
    meanwhile) keeps its entry, and gc refuses to take the chunks its holes need."""
    import subprocess
    import sys

    from torpor.engine import Engine
    from torpor.errors import ExitCode

    p, ab, store, two, cfg = _skipping_checkpoint(gpu, probe, tmp_path)
    op = Engine(cfg).journal.begin("pack", [])
    op.phase("pack", images_dir=str(two), store_owner=OWNER)
    op.release()                                         # its torpor is gone
    store.remove(["one"])
    before = {b.name for b in store.backend.blobs()}
    env = {**os.environ, **gpu.env(), "TORPOR_STATE_DIR": str(tmp_path / "state"),
           "TORPOR_STORE_DIR": str(store.backend.root), "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(torpor_cmd("gc"), env=env, capture_output=True, text=True)
    assert r.returncode == ExitCode.BUSY and "could not recover interrupted pack" in r.stderr \
        and "is not whole yet" in r.stderr, r.stderr
    assert {b.name for b in store.backend.blobs()} == before and fingerprints.any_skipped(two)


def _garble_index(two: Path) -> None:
    """What a program can do to its own agent's index (the agent runs inside it)."""
    index = next((two / agent_data.DATA_DIR).glob(f"*/{agent_data.INDEX}"))
    header, first, rest = index.read_text().split("\n", 2)
    index.write_text(f"{header}\n{first[:-1]}7\n{rest}")    # skipped: neither 0 nor 1


def test_a_pack_whose_index_the_program_garbled_is_given_up_not_retried(
        gpu, probe, tmp_path):
    """No retry could say what the holes of a checkpoint with a damaged index are: its pack
    fails, it is marked damaged, and nothing is left for recovery to hold rm and gc off with."""
    from torpor.flows import process
    from torpor.engine import Engine
    from torpor.errors import DamagedRecordsError

    p, ab, store, two, cfg = _skipping_checkpoint(gpu, probe, tmp_path)
    _garble_index(two)
    engine = Engine(cfg)
    with pytest.raises(DamagedRecordsError, match=r"storing .* as two: it cannot be made whole: "
                                                  r".*line 2: malformed.*marked damaged"):
        process.store_checkpoint(engine, store, two, "two", OWNER)
    assert list(engine.journal.orphans()) == []
    with pytest.raises(CorruptCheckpointError, match="is damaged and can only be removed: its "
                                                     "GPU data lacks parts"):
        manifest.read(two)
    assert list(store.backend.snapshots()) == ["one"]
    r = ctl_fds(p.sock, "abort")              # its parts still holes: the agent refuses them
    assert not r["ok"] and "fingerprint" in r["error"], r
    os.kill(p.pid, 0)                         # held, not gone


def test_gc_goes_on_once_a_dead_packs_checkpoint_is_found_damaged(gpu, probe, tmp_path):
    """A dead torpor's pack whose index is then garbled: the next command gives that
    checkpoint up, says so, and gc runs (before, the entry refused rm and gc for good)."""
    import subprocess
    import sys

    from torpor.engine import Engine

    p, ab, store, two, cfg = _skipping_checkpoint(gpu, probe, tmp_path)
    op = Engine(cfg).journal.begin("pack", [])
    op.phase("pack", images_dir=str(two), store_owner=OWNER)
    op.release()                                         # its torpor is gone
    _garble_index(two)
    env = {**os.environ, **gpu.env(), "TORPOR_STATE_DIR": str(tmp_path / "state"),
           "TORPOR_STORE_DIR": str(store.backend.root), "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(torpor_cmd("gc"), env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "was interrupted: it cannot be made whole" in r.stderr \
        and "marked damaged" in r.stderr and "removed" in r.stdout, (r.stdout, r.stderr)
    assert Engine(cfg).recover() == []
    r = subprocess.run(torpor_cmd("restore", "-D", str(two)), env=env, capture_output=True,
                       text=True)
    assert r.returncode == 9 and "is damaged and can only be removed" in r.stderr, r.stderr


def test_fingerprints_are_the_owners_own(probe, tmp_path):
    """The agent runs in the program: it is handed only its owner's fingerprints, and its
    index resolves only against them, so no program learns of, or gets, another's chunks."""
    p = probe()
    a, b, store = _stored_once(p, tmp_path)                  # OWNER's snapshot "one"
    assert fingerprints.known(store, OWNER).gpu and fingerprints.known(store, OWNER).host
    assert fingerprints.known(store, "uid:4242") == fingerprints.Known({}, {}) \
        == fingerprints.known(store, "container:x")
    two, r2 = _checkpoint_dir(tmp_path, "two", p, store)      # skipped: OWNER's chunks
    with pytest.raises(TorporError, match="not in the image store"):
        # another owner cannot name them
        fingerprints.pack_arguments(store, two, fingerprints.known(store, "uid:4242").gpu)
    with pytest.raises(UsageError, match="needs their owner"):
        images.pack(store, two, "anyone")
    doc, _ = images.pack(store, two, "two", OWNER)
    assert doc["meta"]["owner"] == OWNER


# -- host fingerprints: what the host reads (CRIU's page images) --------------------------------

HOST_CHUNK = 64 << 10


def _hashing(monkeypatch) -> list[int]:
    """The lengths chunk.name_of (sha256) is asked for from now on."""
    hashed: list[int] = []
    real = chunk.name_of
    monkeypatch.setattr(chunk, "name_of", lambda d: hashed.append(len(d)) or real(d))
    return hashed


def _host_store(tmp_path: Path) -> tuple[Store, Path, bytearray]:
    store = Store(tmp_path / "store", chunk_size=HOST_CHUNK, workers=2, lock_timeout=5)
    data = bytearray(os.urandom(6 * HOST_CHUNK + 100))
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(data)
    doc, st = store.ingest_dir(src, "one", {"owner": OWNER}, known={})
    assert st.new_chunks == 7 and st.by_fingerprint == 0
    assert [i for i, _ in doc["files"]["pages-1.img"]["host_fingerprints"]] == list(range(7))
    return store, src, data


def test_host_fingerprints_spare_a_second_pack_the_sha256_of_what_did_not_change(
        tmp_path, monkeypatch):
    store, src, data = _host_store(tmp_path)
    data[2 * HOST_CHUNK + 5] ^= 0xFF
    (src / "pages-1.img").write_bytes(data)
    hashed = _hashing(monkeypatch)
    doc, st = store.ingest_dir(src, "two", {"owner": OWNER},
                               known=fingerprints.known(store, OWNER).host)
    assert hashed == [HOST_CHUNK], hashed                  # the changed chunk only
    assert (st.new_chunks, st.by_fingerprint, st.reused_chunks) == (1, 6, 6), st
    store.materialize("two", tmp_path / "out")
    assert (tmp_path / "out" / "pages-1.img").read_bytes() == data


def test_a_fingerprint_stands_only_for_its_owners_chunk_that_the_store_still_has(
        tmp_path, monkeypatch):
    store, src, data = _host_store(tmp_path)
    hashed = _hashing(monkeypatch)
    _, st = store.ingest_dir(src, "other", {"owner": "uid:4242"},
                             known=fingerprints.known(store, "uid:4242").host)
    assert len(hashed) == 7 and st.by_fingerprint == 0     # another owner: all hashed
    first = chunk.fingerprint(bytes(data[:HOST_CHUNK]))
    stale = {first: ["f" * 64, HOST_CHUNK],                # a chunk the store lacks
             chunk.fingerprint(bytes(data[HOST_CHUNK:2 * HOST_CHUNK])):
                 [chunk.name_of(bytes(data[:HOST_CHUNK])), HOST_CHUNK + 1]}   # wrong length
    hashed.clear()
    doc, st = store.ingest_dir(src, "three", {"owner": OWNER}, known=stale)
    assert len(hashed) == 7 and st.by_fingerprint == 0, st
    store.materialize("three", tmp_path / "out")
    assert (tmp_path / "out" / "pages-1.img").read_bytes() == data


def test_an_imported_snapshot_lends_no_fingerprints(tmp_path):
    """Its fingerprints were never checked against its chunks: it loses its owner."""
    store, _src, _data = _host_store(tmp_path)
    other = Store(tmp_path / "other", chunk_size=HOST_CHUNK, workers=2)
    store.export_chunks("one", tmp_path / "export")
    other.import_chunks(tmp_path / "export")
    doc = other.import_snapshot(store.backend.get_snapshot("one"), "export of one")
    assert "owner" not in doc["meta"] and "owner" not in other.load("one")["meta"]
    assert fingerprints.known(other, OWNER) == fingerprints.Known({}, {})


@pytest.mark.parametrize("bad", [[[7, "0" * 32]], [[0, "0" * 31]], [[0, "X" * 32]], [0], "x"])
def test_a_snapshot_with_malformed_host_fingerprints_is_refused(tmp_path, bad):
    store, _src, _data = _host_store(tmp_path)
    doc = store.load("one")
    doc["files"]["pages-1.img"]["host_fingerprints"] = bad
    with pytest.raises(CorruptCheckpointError, match="host_fingerprints of 'pages-1.img'"):
        snapshot.parse(snapshot.dump(doc), "test")
