"""A chunk reused by its name is looked at first (backend.has_blob, chunk.check_stored): one
that a truncation, a zeroing or something that is no regular file in its place damaged is
replaced by the data being stored, atomically, and logged once; a sound one is left alone."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from torpor.errors import CorruptCheckpointError
from torpor.store import Store, chunk, fingerprints

from tests.unit.test_store import CHUNK, read, store, write  # noqa: F401  (store: a fixture)

COMPRESSIBLE = b"torpor " * (CHUNK // 7) + b"x" * (CHUNK % 7)


def damage(path: Path, kind: str, tmp_path: Path) -> None:
    """What a crash, a full disk on an older torpor, bit rot or an admin leaves in a chunk's
    place."""
    blob = path.read_bytes()
    if kind == "truncated":                  # a raw chunk cut short
        path.write_bytes(blob[:len(blob) // 2])
    elif kind == "zstd cut to its magic":    # a zstd chunk cut inside its frame header
        assert chunk.HEADER.unpack_from(blob)[1] == chunk.ZSTD
        path.write_bytes(blob[:chunk.HEADER.size + 4])
    elif kind == "zero-length":
        path.write_bytes(b"")
    elif kind == "zeroed":                   # the right size, the data never written
        path.write_bytes(bytes(len(blob)))
    else:
        good = tmp_path / "good-copy"
        path.rename(good)
        if kind == "symlink to a good copy":
            path.symlink_to(good)
        elif kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "directory":
            path.mkdir()
            (path / "inside").write_bytes(b"x")
        else:
            raise AssertionError(kind)


KINDS = ["truncated", "zstd cut to its magic", "zero-length", "zeroed",
         "symlink to a good copy", "fifo", "directory"]


def _data(kind: str) -> bytes:
    return COMPRESSIBLE if "zstd" in kind else os.urandom(CHUNK)


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_chunk_is_rewritten_when_its_data_is_stored_again(store, tmp_path, kind,
                                                                   caplog):
    data, other = _data(kind), os.urandom(CHUNK)
    write(tmp_path / "a" / "f", data + other)
    store.ingest_dir(tmp_path / "a", "a")
    name = chunk.name_of(data)
    path = store.backend.blob_path(name)
    damage(path, kind, tmp_path)
    with pytest.raises(CorruptCheckpointError, match=name):
        read(store, "a", "f")
    assert not store.backend.has_blob(name) and store.backend.has_blob(chunk.name_of(other))

    write(tmp_path / "b" / "g", data)
    with caplog.at_level(logging.WARNING, logger="torpor.store.backend"):
        _doc, stats = store.ingest_dir(tmp_path / "b", "b")
    assert stats.new_chunks == 1 and stats.reused_chunks == 0
    assert read(store, "b", "g") == data
    assert read(store, "a", "f") == data + other          # the older checkpoint heals with it
    store.materialize("a", tmp_path / "out")
    assert (tmp_path / "out" / "f").read_bytes() == data + other
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert os.listdir(store.backend.tmp) == []             # nothing left aside
    assert store.verify(dry_run=True).damaged == []
    logged = [r for r in caplog.records if name in r.getMessage()]
    assert len(logged) == 1 and "replaced" in logged[0].getMessage()


def test_a_sound_chunk_is_reused_not_rewritten(store, tmp_path, caplog):
    """The look must not be stricter than a read: a raw and a zstd chunk, each sound, keep
    their inode (no rename over them) and their bytes."""
    raw, packed = os.urandom(CHUNK), COMPRESSIBLE
    write(tmp_path / "a" / "f", raw + packed)
    store.ingest_dir(tmp_path / "a", "a")
    paths = [store.backend.blob_path(chunk.name_of(d)) for d in (raw, packed)]
    assert [chunk.HEADER.unpack_from(p.read_bytes())[1] for p in paths] == [chunk.RAW, chunk.ZSTD]
    before = [os.stat(p) for p in paths]
    write(tmp_path / "b" / "g", packed + raw)
    with caplog.at_level(logging.WARNING, logger="torpor.store.backend"):
        _doc, stats = store.ingest_dir(tmp_path / "b", "b")
    assert stats.reused_chunks == 2 and stats.new_chunks == 0
    after = [os.stat(p) for p in paths]
    assert [(s.st_ino, s.st_mtime_ns) for s in after] == [(s.st_ino, s.st_mtime_ns)
                                                         for s in before]
    assert not caplog.records


def test_a_chunk_of_the_wrong_length_is_rewritten(store, tmp_path):
    """A blob whose header and size agree, but not with the data its name is the hash of (a
    chunk of another length moved over it)."""
    data, shorter = os.urandom(CHUNK), os.urandom(CHUNK - 1)
    write(tmp_path / "a" / "f", data)
    write(tmp_path / "a" / "g", shorter)
    store.ingest_dir(tmp_path / "a", "a")
    path = store.backend.blob_path(chunk.name_of(data))
    path.write_bytes(store.backend.blob_path(chunk.name_of(shorter)).read_bytes())
    write(tmp_path / "b" / "f", data)
    _doc, stats = store.ingest_dir(tmp_path / "b", "b")
    assert stats.new_chunks == 1 and read(store, "a", "f") == data


def test_a_writer_that_finds_the_chunk_repaired_meanwhile_keeps_that_one(store, tmp_path,
                                                                         monkeypatch):
    """put_blob looks again once its link fails: another writer's sound blob, put since its
    first look, is not replaced (and its inode stays)."""
    data = os.urandom(CHUNK)
    write(tmp_path / "a" / "f", data)
    store.ingest_dir(tmp_path / "a", "a")
    name = chunk.name_of(data)
    path = store.backend.blob_path(name)
    damage(path, "truncated", tmp_path)
    real_link = os.link

    def link(src, dst, *a, **kw):
        if Path(dst) == path:    # another writer renames the good blob in first
            (tmp_path / "theirs").write_bytes(chunk.encode(data))
            os.rename(tmp_path / "theirs", path)
        return real_link(src, dst, *a, **kw)

    monkeypatch.setattr(os, "link", link)
    assert store.backend.put_blob(name, chunk.encode(data)) is False
    ino = os.stat(path).st_ino
    monkeypatch.undo()
    assert read(store, "a", "f") == data and os.stat(path).st_ino == ino
    assert os.listdir(store.backend.tmp) == []


def test_a_reader_of_the_damaged_chunk_never_sees_half_of_the_new_one(store, tmp_path):
    """The replacement is one rename: a reader that opened the damaged file reads it whole
    (and fails, as it would have), one that opens the name after reads the new one whole."""
    data = os.urandom(CHUNK)
    write(tmp_path / "a" / "f", data)
    store.ingest_dir(tmp_path / "a", "a")
    path = store.backend.blob_path(chunk.name_of(data))
    damage(path, "truncated", tmp_path)
    damaged = path.read_bytes()
    with open(path, "rb") as opened_before:
        ino = os.fstat(opened_before.fileno()).st_ino
        write(tmp_path / "b" / "f", data)
        store.ingest_dir(tmp_path / "b", "b")
        assert opened_before.read() == damaged
    assert os.stat(path).st_ino != ino and path.read_bytes() == chunk.encode(data)


def test_host_fingerprints_take_no_damaged_chunk(store, tmp_path):
    """A chunk the owner's snapshot records by host fingerprint is looked at as it is taken:
    damaged, it is stored again from the data the pack read."""
    data = os.urandom(CHUNK)
    write(tmp_path / "a" / "f", data)
    store.ingest_dir(tmp_path / "a", "a", {"owner": "uid:1"}, known={})
    damage(store.backend.blob_path(chunk.name_of(data)), "zero-length", tmp_path)
    known = fingerprints.known(store, "uid:1")
    assert known.host                                       # recorded by fingerprint
    write(tmp_path / "b" / "f", data)
    _doc, stats = store.ingest_dir(tmp_path / "b", "b", {"owner": "uid:1"}, known=known.host)
    assert stats.by_fingerprint == 0 and stats.new_chunks == 1
    assert read(store, "a", "f") == data


def test_the_agents_are_not_handed_a_damaged_gpu_chunk(store, tmp_path):
    """known() leaves out a GPU chunk the store holds damaged: the agents would skip its data
    and nothing could fill it in."""
    sound, bad = os.urandom(CHUNK), os.urandom(CHUNK)
    with store.writer() as w:
        w.add_file("gpu", write(tmp_path / "gpu", sound + bad),
                   fingerprints=[[0, "a" * 32], [1, "b" * 32]])
        w.commit("a", {"owner": "uid:1"})
    damage(store.backend.blob_path(chunk.name_of(bad)), "fifo", tmp_path)
    assert set(fingerprints.known(store, "uid:1").gpu) == {"a" * 32}


def test_a_given_chunk_held_damaged_is_refused_not_named(store, tmp_path):
    """A chunk given without its data (a part the agent skipped) cannot be stored again here:
    the snapshot must not name it."""
    data = os.urandom(CHUNK)
    write(tmp_path / "a" / "f", data)
    store.ingest_dir(tmp_path / "a", "a")
    name = chunk.name_of(data)
    damage(store.backend.blob_path(name), "directory", tmp_path)
    with store.writer() as w, pytest.raises(CorruptCheckpointError, match=f"{name}.*damaged"):
        w.add_file("f", write(tmp_path / "b" / "f", bytes(CHUNK)), given={0: [name, CHUNK]})


def test_an_import_replaces_a_chunk_held_damaged(store, tmp_path):
    data = os.urandom(CHUNK)
    write(tmp_path / "a" / "f", data)
    store.ingest_dir(tmp_path / "a", "a")
    other = Store(tmp_path / "other", chunk_size=CHUNK, workers=2, lock_timeout=5)
    other.ingest_dir(tmp_path / "a", "a")
    name = chunk.name_of(data)
    damage(other.backend.blob_path(name), "symlink to a good copy", tmp_path)
    store.export_chunks("a", tmp_path / "export")
    assert other.import_chunks(tmp_path / "export") == 1
    assert read(other, "a", "f") == data


def test_check_stored_accepts_what_decode_accepts():
    """The look at reuse is never stricter than a read: every blob encode writes passes, and
    a blob decode refuses for its shape is refused by both."""
    for data in (b"\x01", os.urandom(100), COMPRESSIBLE, os.urandom(CHUNK), b"ab" * 50):
        blob = chunk.encode(data)
        codec, length = chunk.HEADER.unpack_from(blob)[1:]
        assert chunk._shape(blob[:chunk.HEAD], len(blob)) == (codec, length)
        assert chunk.decode(blob, chunk.name_of(data), "t") == data
    packed = chunk.encode(COMPRESSIBLE)
    too_long = chunk.HEADER.pack(chunk.MAGIC, chunk.ZSTD, 10) + packed[chunk.HEADER.size:]
    for bad in (packed[:chunk.HEAD], too_long, packed[:5]):
        assert isinstance(chunk._shape(bad[:chunk.HEAD], len(bad)), str)
        with pytest.raises(CorruptCheckpointError):
            chunk.decode(bad, chunk.name_of(COMPRESSIBLE), "t")
