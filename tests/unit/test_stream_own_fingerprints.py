"""A streamed restore verifies the GPU data chunks this host streamed into its own store by the
host fingerprint (XXH3-128) it recorded when it named them, and every other chunk by sha256
(issue 20, item 4; store/chunk.py "Verifying by fingerprint", fingerprints.own_fingerprints):
the stream record carries the fingerprint (version 2), the pack records it in the store's
snapshot, and only the store's own snapshot (with an owner, the same chunks) lends it to a
restore, never the checkpoint directory's doc."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from tests.unit.test_agent import gpu, probe  # noqa: F401  (fixtures)
from tests.unit.test_agent_stream import _streamed_checkpoint
from torpor import agent_data
from torpor.errors import CorruptCheckpointError, DamagedRecordsError, TorporError
from torpor.layout import PACKED
from torpor.store import chunk, fingerprints, images, snapshot, stream
from torpor.store.fingerprints import PART, Streamed
from torpor.store.store import Store

MIB = 1 << 20
OWNER = "uid:0"


# -- the stream record ------------------------------------------------------------------------

def test_a_stream_record_carries_host_fingerprints_and_version_1_is_still_read():
    sha, fp = "ab" * 32, "cd" * 16
    parts = [Streamed(0, 0, PART, PART, sha, fp), Streamed(0, PART, 100, PART, None, None),
             Streamed(1, 0, 5, PART, "ef" * 32, "01" * 16)]
    text = fingerprints.dump_streamed(parts)
    assert text.splitlines()[0] == "torpor-gpu-streamed 2"
    assert text.splitlines()[1] == f"0 0 {PART} {PART} {sha} {fp}"
    assert fingerprints.parse_streamed(text, "t", [2 * PART, PART]) == parts

    v1 = f"torpor-gpu-streamed 1\n0 0 {PART} {PART} {sha}\n0 {PART} 100 {PART} -\n"
    assert fingerprints.parse_streamed(v1, "t", [2 * PART]) == [
        Streamed(0, 0, PART, PART, sha, None), Streamed(0, PART, 100, PART, None, None)]


@pytest.mark.parametrize("bad", [
    "torpor-gpu-streamed 2\n0 0 4194304 4194304 " + "ab" * 32 + "\n",           # no fingerprint
    "torpor-gpu-streamed 2\n0 0 4194304 4194304 " + "ab" * 32 + " -\n",         # a chunk, none
    "torpor-gpu-streamed 2\n0 0 4194304 4194304 - " + "cd" * 16 + "\n",         # zeros with one
    "torpor-gpu-streamed 2\n0 0 4194304 4194304 " + "ab" * 32 + " " + "CD" * 16 + "\n",
    "torpor-gpu-streamed 1\n0 0 4194304 4194304 " + "ab" * 32 + " " + "cd" * 16 + "\n",
])
def test_a_malformed_stream_record_is_refused(bad):
    with pytest.raises(DamagedRecordsError):
        fingerprints.parse_streamed(bad, "t", [PART])


# -- feed, on its own (a stand-in for the agent takes the ring's parts) -----------------------

def _feed(store: Store, parts: list[stream.Source]) -> tuple[stream.FeedStats, dict]:
    """feed() to a stand-in agent that copies every part out and hands its slot back:
    (the stats, (file, offset) -> the bytes it got)."""
    ring = stream.Ring(4)
    got: dict = {}
    theirs = socket.socket(fileno=os.dup(ring.agent_fds()[1]))
    ring.handed()

    def agent() -> None:
        with theirs:
            while msg := theirs.recv(stream.RECORD.size):
                slot, file, offset, length, _ = stream.RECORD.unpack(msg)
                if slot != stream.ZERO:
                    got[file, offset] = bytes(ring.map[slot * PART:slot * PART + length])
                    theirs.send(stream.SLOT_NO.pack(slot))
    t = threading.Thread(target=agent)
    t.start()
    stats = stream.FeedStats()
    try:
        stream.feed(store, ring, parts, "test", stats)
    finally:
        t.join(10)
        ring.close()
    return stats, got


def _raw_chunks(tmp_path: Path, n: int = 3) -> tuple[Store, list[bytes], list[list]]:
    store = Store(tmp_path / "store", workers=2)
    datas = [os.urandom(PART) for _ in range(n)]   # random: stored raw
    with store.writer() as w:
        refs = [w.put_data(d)[0] for d in datas]
    return store, datas, refs


def _flip(store: Store, name: str) -> None:
    """One byte of a stored chunk changed on disk, its size the same."""
    path = store.backend.blob_path(name)
    blob = bytearray(path.read_bytes())
    blob[-7] ^= 0x40
    os.chmod(path, 0o600)
    path.write_bytes(bytes(blob))


def test_feed_verifies_by_the_fingerprint_given_and_finds_a_changed_chunk(tmp_path):
    store, datas, refs = _raw_chunks(tmp_path)
    parts = [stream.Source(0, i * PART, ref, chunk.fingerprint(d))
             for i, (ref, d) in enumerate(zip(refs, datas))]
    parts.append(stream.Source(0, 3 * PART, [None, PART]))
    stats, got = _feed(store, parts)
    assert (stats.by_fingerprint, stats.by_sha256, stats.zero_chunks) == (3, 0, 1)
    assert stats.bytes == 3 * PART and got == {(0, i * PART): d for i, d in enumerate(datas)}

    stats, _ = _feed(store, [stream.Source(p.file, p.offset, p.ref) for p in parts])
    assert (stats.by_fingerprint, stats.by_sha256) == (0, 3)      # no fingerprint: sha256

    _flip(store, refs[1][0])
    with pytest.raises(CorruptCheckpointError,
                       match=f"{refs[1][0]}.*fingerprint this host recorded"):
        _feed(store, parts)
    with pytest.raises(CorruptCheckpointError, match="does not match its sha256 name"):
        _feed(store, [stream.Source(0, 0, refs[1])])


# -- the engine: a streamed checkpoint, packed, restored ------------------------------------

def _packed(gpu, probe, tmp_path):  # noqa: F811
    """A streamed checkpoint of 12 MiB of random bytes, packed as snapshot "one": (program,
    store, engine, directory, its snapshot)."""
    p, store, engine, d = _streamed_checkpoint(gpu, probe, tmp_path)
    doc, _ = images.pack(store, d, "one", OWNER)
    return p, store, engine, d, doc


def _target(p, d: Path, unpacked: Path):
    from torpor.engine import AgentTarget
    return AgentTarget(p.pid, p.sock, unpacked / agent_data.DATA_DIR, p.pid, 2, packed=str(d))


def _data_entries(doc: dict) -> dict:
    return {rel: doc["files"][rel] for rel in images.gpu_data_files(doc)}


def _named(doc: dict) -> int:
    """How many stored chunks (not zeros) the GPU data files of doc have (12 MiB: 3 or 4,
    as the agent cut the allocation)."""
    return sum(r[0] is not None for e in _data_entries(doc).values() for r in e["chunks"])


def test_a_pack_of_a_streamed_checkpoint_records_the_host_fingerprints_of_its_gpu_chunks(
        gpu, probe, tmp_path):  # noqa: F811
    p, store, engine, d, doc = _packed(gpu, probe, tmp_path)
    entries = _data_entries(doc)
    assert len(entries) == 2
    named = 0
    for entry in entries.values():
        fps = dict(entry.get("host_fingerprints", []))
        for i, ref in enumerate(entry["chunks"]):
            if ref[0] is None:
                assert i not in fps
                continue
            named += 1
            assert fps[i] == chunk.fingerprint(store.read_chunk(ref, "test"))
    assert named == _named(doc) >= 3
    assert store.load("one")["files"] == doc["files"]


def _restore(p, engine, d: Path, store: Store) -> dict:
    in_store = images.gpu_data_files(images.packed_doc(d))
    unpacked = images.unpack(store, d, leave_out=in_store)
    with engine.begin("restore", [p.pid]) as op:
        return engine.restore_and_unlock(op, [p.pid], agents={p.pid: _target(p, d, unpacked)})


def _rewrite_packed(d: Path, change) -> None:
    doc = images.packed_doc(d)
    change(doc)
    (d / PACKED).write_bytes(snapshot.dump(doc))


def test_a_restore_from_the_stores_own_snapshot_verifies_by_fingerprint(
        gpu, probe, tmp_path):  # noqa: F811
    p, store, engine, d, doc = _packed(gpu, probe, tmp_path)
    back = _restore(p, engine, d, store)[p.pid]
    assert back["streamed"] and back["bytes"] == 12 * MIB
    assert (back["fed"]["by_fingerprint"], back["fed"]["by_sha256"]) == (_named(doc), 0), \
        back["fed"]
    assert p.status()["state"] == "running"


def test_a_chunk_changed_on_disk_fails_the_fingerprint_check(gpu, probe, tmp_path):  # noqa: F811
    p, store, engine, d, doc = _packed(gpu, probe, tmp_path)
    entry = next(iter(_data_entries(doc).values()))
    name = next(ref[0] for ref in entry["chunks"] if ref[0] is not None)
    _flip(store, name)                                  # same size, one byte: raw data
    with pytest.raises(TorporError, match=f"{name}.*fingerprint this host recorded"):
        _restore(p, engine, d, store)
    st = p.status()
    assert (st["state"], st["gate"]) == ("detached", "closed"), st   # nothing given to it


def _sources(engine, p, d: Path) -> list[stream.Source]:
    _store, parts = engine._packed_sources(_target(p, d, d))
    return [s for s in parts if s.ref[0] is not None]


# where the 12 MiB falls on the agent's 32 MiB windows: chance (mmap's), or chosen; 26 MiB past
# a window cuts it 6 + 6 MiB, one chunk in each data file and no file with two whole parts (CI
# met that layout about 1 run in 16)
LAYOUTS = [None, 0, 26 * MIB, 30 * MIB]


@pytest.mark.parametrize("phase", LAYOUTS, ids=["chance", "12+0", "6+6", "2+10"])
def test_only_the_stores_own_snapshot_lends_its_fingerprints(gpu, probe, tmp_path,  # noqa: F811
                                                             phase):
    gpu.va_phase(phase)
    p, store, engine, d, doc = _packed(gpu, probe, tmp_path)
    own = _sources(engine, p, d)
    n = _named(doc)
    assert len(own) == n >= 3 and all(s.fp for s in own)

    # the packed doc's own host fingerprints, forged, change nothing: the store's are used
    forged = "0" * 32

    def forge(doc):
        for entry in _data_entries(doc).values():
            entry["host_fingerprints"] = [[i, forged] for i, r in enumerate(entry["chunks"])
                                          if r[0] is not None]
    _rewrite_packed(d, forge)
    assert _sources(engine, p, d) == own

    # a packed doc whose chunks differ from the store's snapshot's: sha256 for all of them
    def swap(doc):
        """The first two whole parts of the data files traded places: the sizes stay, the
        chunks differ. Which file holds them varies: a chunk is a 32 MiB window of the fake
        device's addresses, its mmap()'s, so the 12 MiB may cut into 12 + 0 MiB, 8 + 4, 6 + 6
        (4 + 2 in each file: no file has two whole parts)... but any cut has two in all."""
        a, b = [r for e in _data_entries(doc).values() for r in e["chunks"]
                if r[0] is not None and r[1] == PART][:2]
        assert a[0] != b[0]                             # random bytes: two names
        a[:], b[:] = b[:], a[:]
    _rewrite_packed(d, swap)
    assert images.packed_doc(d)["files"] != store.load("one")["files"]
    assert [s.fp for s in _sources(engine, p, d)] == [None] * n
    _rewrite_packed(d, swap)                            # swapped back: the store's again
    assert _sources(engine, p, d) == own

    # an imported snapshot (no owner) lends none, though it carries them
    store.remove(["one"])
    store.import_snapshot(snapshot.dump(doc), "import")
    assert "host_fingerprints" in json.dumps(store.load("one"))
    assert [s.fp for s in _sources(engine, p, d)] == [None] * n

    # nor does a store without the snapshot
    store.remove(["one"])
    assert [s.fp for s in _sources(engine, p, d)] == [None] * n


def test_a_forged_fingerprint_in_the_packed_doc_does_not_pass_a_changed_chunk(
        gpu, probe, tmp_path):  # noqa: F811
    """The store's copy imported (no owner), the directory's doc claims the fingerprint of the
    changed bytes: the chunk is checked by sha256, and refused."""
    p, store, engine, d, doc = _packed(gpu, probe, tmp_path)
    entry = next(iter(_data_entries(doc).values()))
    i, ref = next((i, r) for i, r in enumerate(entry["chunks"]) if r[0] is not None)
    _flip(store, ref[0])
    changed = store.backend.blob_path(ref[0]).read_bytes()[chunk.HEADER.size:]   # raw
    store.remove(["one"])
    store.import_snapshot(snapshot.dump(doc), "import")

    def forge(doc):
        e = doc["files"][next(iter(_data_entries(doc)))]
        e["host_fingerprints"] = [[i, chunk.fingerprint(changed)]]
    _rewrite_packed(d, forge)
    with pytest.raises(TorporError, match=f"{ref[0]}.*does not match its sha256 name"):
        _restore(p, engine, d, store)
    st = p.status()
    assert (st["state"], st["gate"]) == ("detached", "closed"), st


def test_a_rollback_of_a_streamed_checkpoint_verifies_its_own_parts_by_fingerprint(
        gpu, probe, tmp_path):  # noqa: F811
    """A rollback feeds the parts its own stream record names, by the record's fingerprints."""
    p, store, engine, d = _streamed_checkpoint(gpu, probe, tmp_path)
    prog = d / agent_data.DATA_DIR / str(p.pid)
    from torpor.engine import AgentTarget
    t = AgentTarget(p.pid, p.sock, d / agent_data.DATA_DIR, p.pid, 2, owner=OWNER)
    _store, parts = engine._own_sources(t)
    named = [s for s in parts if s.ref[0] is not None]
    assert len(named) >= 3 and all(s.fp == chunk.fingerprint(store.read_chunk(s.ref, "t"))
                                   for s in named)
    assert (prog / agent_data.STREAMED).exists()
