"""The store's scrub (Store.verify, `torpor gc --verify`): a chunk damaged on disk is found
before a restore needs it, removed so that the next checkpoint of that data stores it again,
and the checkpoints that named it are reported."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import torpor_cmd
from torpor.errors import CorruptCheckpointError
from torpor.store import Store, chunk

from tests.unit.test_store import CHUNK, blobs, read, store  # noqa: F401  (store: a fixture)


def ingest(s: Store, tmp_path: Path, name: str, files: dict[str, bytes]) -> dict:
    src = tmp_path / f"src-{name}"
    src.mkdir()
    for rel, data in files.items():
        (src / rel).write_bytes(data)
    return s.ingest_dir(src, name)[0]


def damaged_store(store: Store, tmp_path: Path):
    """Four snapshots; three chunks damaged: a flipped byte (named by a and b), a truncation
    (named by c), a symlink to a good copy (named by c); d names none of them."""
    shared, own_c, more_c, own_d = (os.urandom(CHUNK) for _ in range(4))
    docs = {
        "a": ingest(store, tmp_path, "a", {"f": shared + os.urandom(CHUNK)}),
        "b": ingest(store, tmp_path, "b", {"g": shared}),
        "c": ingest(store, tmp_path, "c", {"h": own_c + more_c}),
        "d": ingest(store, tmp_path, "d", {"i": own_d}),
    }
    flipped = chunk.name_of(shared)
    truncated = chunk.name_of(own_c)
    linked = chunk.name_of(more_c)
    path = store.backend.blob_path(flipped)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    path = store.backend.blob_path(truncated)
    path.write_bytes(path.read_bytes()[:20])
    path = store.backend.blob_path(linked)
    good = tmp_path / "good-copy"
    path.rename(good)
    path.symlink_to(good)
    return docs, {flipped: shared, truncated: own_c, linked: more_c}


def test_verify_finds_removes_and_reports_damaged_chunks(store, tmp_path):
    docs, bad = damaged_store(store, tmp_path)
    before = blobs(store)
    r = store.verify()
    assert sorted(r.damaged) == sorted(bad) == sorted(r.removed)
    assert r.snapshots == ["a", "b", "c"]
    assert r.missing == []
    assert r.checked == len(before)
    assert blobs(store) == before - set(bad)
    assert read(store, "d", "i")          # untouched snapshots still read back
    with pytest.raises(CorruptCheckpointError, match="missing"):
        read(store, "b", "g")
    # a second scrub finds nothing damaged, but still names the checkpoints that are broken
    again = store.verify()
    assert again.damaged == [] and sorted(again.missing) == sorted(bad)
    assert again.snapshots == ["a", "b", "c"]


def test_after_verify_a_new_checkpoint_of_the_data_stores_it_again(store, tmp_path):
    _docs, bad = damaged_store(store, tmp_path)
    store.verify()
    data = b"".join(bad.values())
    ingest(store, tmp_path, "e", {"all": data})
    assert set(bad) <= blobs(store)
    assert read(store, "e", "all") == data
    assert read(store, "b", "g") == bad[next(iter(bad))]  # the old ones heal with it
    r = store.verify()
    assert r.damaged == [] and r.missing == [] and r.snapshots == []


def test_dry_run_reports_and_removes_nothing(store, tmp_path):
    _docs, bad = damaged_store(store, tmp_path)
    before = blobs(store)
    r = store.verify(dry_run=True)
    assert sorted(r.damaged) == sorted(bad) and r.removed == []
    assert r.snapshots == ["a", "b", "c"]
    assert blobs(store) == before


def test_a_clean_store_reports_none(store, tmp_path):
    ingest(store, tmp_path, "a", {"f": os.urandom(3 * CHUNK)})
    seen = []
    r = store.verify(seen=seen.append)
    assert r.checked == 3 and r.damaged == r.removed == r.snapshots == r.missing == []
    assert r.bytes == sum(b.size for b in store.backend.blobs()) == sum(seen)


def test_a_chunk_repaired_before_removal_is_kept(store, tmp_path, monkeypatch):
    """Phase 2 checks again under the exclusive lock: a chunk sound by then stays."""
    _docs, bad = damaged_store(store, tmp_path)
    flipped = next(iter(bad))
    real = store.backend.lock

    def lock(exclusive, timeout):
        if exclusive:   # meanwhile someone put the good blob back
            store.backend.blob_path(flipped).write_bytes(chunk.encode(bad[flipped]))
        return real(exclusive, timeout)

    monkeypatch.setattr(store.backend, "lock", lock)
    r = store.verify()
    assert flipped in r.damaged and flipped not in r.removed and len(r.removed) == 2
    assert flipped in blobs(store)


def test_an_unreadable_chunk_counts_as_damaged(store, tmp_path, monkeypatch):
    ingest(store, tmp_path, "a", {"f": os.urandom(CHUNK)})
    (name,) = blobs(store)

    def eio(n):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store.backend, "read_blob", eio)
    r = store.verify(dry_run=True)
    assert r.damaged == [name] and r.snapshots == ["a"]


def test_cli_gc_verify(tmp_path, torpor_env):
    env = {**os.environ, "TORPOR_STORE_DIR": str(tmp_path / "store")}
    s = Store(tmp_path / "store", chunk_size=CHUNK)
    ingest(s, tmp_path, "ckpt-1", {"f": os.urandom(CHUNK)})

    def torpor(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(torpor_cmd(*args), env=env, capture_output=True, text=True)

    clean = torpor("gc", "--verify")
    assert clean.returncode == 0, clean.stderr
    assert "verified 1 chunk(s)" in clean.stdout and "none damaged" in clean.stdout
    (name,) = blobs(s)
    path = s.backend.blob_path(name)
    path.write_bytes(path.read_bytes()[:-1])
    dry = torpor("--json", "gc", "--dry-run", "--verify")
    assert dry.returncode == 9, dry.stderr
    out = json.loads(dry.stdout)
    assert out["verify"]["damaged"] == [name] and out["verify"]["removed"] == []
    assert out["verify"]["snapshots"] == ["ckpt-1"] and out["dry_run"] is True
    assert blobs(s) == {name}
    gc = torpor("gc", "--verify")
    assert gc.returncode == 9, gc.stderr
    assert "1 damaged, removed" in gc.stdout and "no longer restore): ckpt-1" in gc.stdout
    assert "removed 0 chunk(s)" in gc.stdout and blobs(s) == set()
