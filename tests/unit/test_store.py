"""The image store on real files: round trips, dedup, gc safety, crashes, corruption, imports."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import is_root, torpor_cmd
from torpor.errors import (BusyError, CorruptCheckpointError, NotFoundError, TorporError,
                           UsageError, no_space)
from torpor.store import Store, chunk, snapshot

CHUNK = 64 << 10


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", chunk_size=CHUNK, workers=2, lock_timeout=5)


def blobs(s: Store) -> set[str]:
    return {b.name for b in s.backend.blobs()}


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def ingest(s: Store, src: Path, name: str):
    return s.ingest_dir(src, name, {"why": "test"})


def read(s: Store, name: str, rel: str) -> bytes:
    return b"".join(s.read_file(name, rel))


def test_round_trip_is_bit_exact(store, tmp_path):
    src = tmp_path / "src"
    sizes = {"empty": 0, "one": 1, "short": CHUNK - 1, "exact": CHUNK, "odd": 3 * CHUNK + 17,
             "sub/dir/deep.img": 2 * CHUNK}
    want = {rel: os.urandom(n) for rel, n in sizes.items()}
    for rel, data in want.items():
        write(src / rel, data)
    doc, stats = ingest(store, src, "one")
    assert stats.logical == sum(sizes.values()) and doc["meta"] == {"why": "test"}
    for rel, data in want.items():
        assert read(store, "one", rel) == data
        assert doc["files"][rel]["size"] == len(data)
    assert doc["files"]["odd"]["chunks"][-1][1] == 17
    store.materialize("one", tmp_path / "out")
    for rel, data in want.items():
        out = tmp_path / "out" / rel
        assert out.read_bytes() == data and stat.S_IMODE(out.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "out" / "sub").stat().st_mode) == 0o700


def test_streams_are_stored_like_files(store, tmp_path):
    data = os.urandom(2 * CHUNK + 5)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a writer that hands over the data in small pieces: short reads
        os.close(r)
        for i in range(0, len(data), 1000):
            os.write(w, data[i:i + 1000])
        os._exit(0)
    os.close(w)
    with store.writer() as wr, open(r, "rb", buffering=0) as f:
        entry = wr.add_file("piped", f)
        wr.commit("piped")
    os.waitpid(pid, 0)
    assert [c[1] for c in entry["chunks"]] == [CHUNK, CHUNK, 5] and entry["mode"] == 0o600
    assert read(store, "piped", "piped") == data


def test_same_data_twice_writes_nothing_new(store, tmp_path):
    src = tmp_path / "src"
    write(src / "a", os.urandom(4 * CHUNK))
    _, first = ingest(store, src, "one")
    before = blobs(store)
    _, second = ingest(store, src, "two")
    assert first.new_chunks == 4 and second.new_chunks == 0 and second.reused_chunks == 4
    assert blobs(store) == before


def test_second_snapshot_writes_only_the_changed_chunk(store, tmp_path):
    src = tmp_path / "src"
    data = bytearray(os.urandom(8 * CHUNK))
    write(src / "gpu-memory.bin", bytes(data))
    ingest(store, src, "one")
    before = blobs(store)
    data[5 * CHUNK + 3] ^= 0xFF
    write(src / "gpu-memory.bin", bytes(data))
    _, stats = ingest(store, src, "two")
    assert stats.new_chunks == 1 and len(blobs(store) - before) == 1
    assert read(store, "two", "gpu-memory.bin") == bytes(data)
    assert read(store, "one", "gpu-memory.bin") != bytes(data)
    # where the new data lies, as the benchmark reports it: the one changed chunk's bytes
    write(src / "zeros.bin", bytes(2 * CHUNK))
    ingest(store, src, "three")
    assert snapshot.new_bytes_by_file(store.load("three"), store.load("one")) == {
        "gpu-memory.bin": CHUNK}


def test_zero_chunks_store_nothing(store, tmp_path):
    src = tmp_path / "src"
    write(src / "zeros", bytes(3 * CHUNK + 100))
    doc, stats = ingest(store, src, "z")
    assert blobs(store) == set() and stats.zero_chunks == 4
    assert all(c[0] is None for c in doc["files"]["zeros"]["chunks"])
    assert read(store, "z", "zeros") == bytes(3 * CHUNK + 100)


def test_zero_chunks_come_back_as_holes(store, tmp_path):
    data = os.urandom(CHUNK) + bytes(6 * CHUNK) + os.urandom(CHUNK) + bytes(CHUNK + 7)
    write(tmp_path / "src" / "gpu-memory-0.bin", data)
    ingest(store, tmp_path / "src", "h")
    store.materialize("h", tmp_path / "out")
    out = tmp_path / "out" / "gpu-memory-0.bin"
    assert out.read_bytes() == data
    assert out.stat().st_blocks * 512 <= 4 * CHUNK      # the zeros cost no disk


def test_compressible_data_shrinks_and_random_data_stays_raw(store, tmp_path):
    src = tmp_path / "src"
    write(src / "text", b"torpor " * (CHUNK // 7) + b"!" * (CHUNK % 7))
    write(src / "noise", os.urandom(CHUNK))
    doc, _ = ingest(store, src, "c")
    for rel, codec in (("text", chunk.ZSTD), ("noise", chunk.RAW)):
        name = doc["files"][rel]["chunks"][0][0]
        blob = store.backend.read_blob(name)
        assert chunk.HEADER.unpack_from(blob)[1] == codec
    text_blob = store.backend.read_blob(doc["files"]["text"]["chunks"][0][0])
    assert len(text_blob) < CHUNK // 20
    assert len(store.backend.read_blob(doc["files"]["noise"]["chunks"][0][0])) == \
        chunk.HEADER.size + CHUNK


def test_store_is_private(store, tmp_path):
    src = tmp_path / "src"
    write(src / "a", os.urandom(CHUNK))
    ingest(store, src, "p")
    for root, dirs, files in os.walk(store.backend.root):
        for d in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o700, d
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o600, f
    assert stat.S_IMODE(os.stat(store.backend.root).st_mode) == 0o700


def test_gc_removes_exactly_what_no_snapshot_needs(store, tmp_path):
    shared, only_a, only_b = (os.urandom(2 * CHUNK) for _ in range(3))
    write(tmp_path / "a" / "f", shared + only_a)
    write(tmp_path / "b" / "f", shared + only_b)
    doc_a, _ = ingest(store, tmp_path / "a", "a")
    doc_b, _ = ingest(store, tmp_path / "b", "b")
    a_only = {c[0] for c in doc_a["files"]["f"]["chunks"][2:]}
    assert store.gc().removed == []
    store.remove(["a"])
    dry = store.gc(dry_run=True)
    assert set(dry.removed) == a_only and a_only <= blobs(store)
    result = store.gc()
    assert set(result.removed) == a_only and not a_only & blobs(store)
    assert result.freed == 2 * (chunk.HEADER.size + CHUNK)
    assert read(store, "b", "f") == shared + only_b
    info = store.snapshots()
    assert [i.name for i in info] == ["b"] and info[0].unique == info[0].stored


def test_gc_keeps_chunks_a_checkpoint_directory_links(store, tmp_path):
    write(tmp_path / "src" / "f", os.urandom(3 * CHUNK))
    ingest(store, tmp_path / "src", "s")
    assert store.export_chunks("s", tmp_path / "ckpt" / "chunks") == 3
    exported = set(os.listdir(tmp_path / "ckpt" / "chunks"))
    assert exported == blobs(store)
    assert os.stat(tmp_path / "ckpt" / "chunks" / exported.pop()).st_nlink == 2  # a hard link
    store.remove(["s"])
    r = store.gc()
    assert r.removed == [] and r.kept_linked == 3
    for f in (tmp_path / "ckpt" / "chunks").iterdir():
        f.unlink()
    assert len(store.gc().removed) == 3 and blobs(store) == set()


WRITER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from torpor.store import Store
    s = Store(Path(sys.argv[1]), chunk_size=int(sys.argv[3]), workers=2)
    with s.writer() as w:
        w.add_file("f", Path(sys.argv[2]))
        print("added", flush=True)
        sys.stdin.readline()
        w.commit("late")
""")


def test_gc_waits_for_a_writer_in_another_process(store, tmp_path):
    write(tmp_path / "big", os.urandom(4 * CHUNK))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store.backend.root), str(tmp_path / "big"),
                             str(CHUNK)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "added\n"
        pending = blobs(store)
        assert len(pending) == 4   # written, named by no snapshot yet
        start = time.monotonic()
        with pytest.raises(BusyError, match="being written"):
            store.gc(timeout=0.5)
        assert time.monotonic() - start >= 0.5
        assert blobs(store) == pending
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert store.gc().removed == []
    assert read(store, "late", "f") == (tmp_path / "big").read_bytes()


def test_writer_killed_mid_ingest_harms_nothing(store, tmp_path):
    base = os.urandom(3 * CHUNK)
    write(tmp_path / "base" / "f", base)
    ingest(store, tmp_path / "base", "base")
    kept = blobs(store)
    write(tmp_path / "big", os.urandom(64 << 20))
    # the writer reads a pipe that is fed half the file and never closed: killed mid-ingest
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store.backend.root), "/dev/stdin",
                             str(CHUNK)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    with open(tmp_path / "big", "rb") as f:
        for _ in range(32):
            proc.stdin.write(f.read(1 << 20))
    deadline = time.monotonic() + 30
    while len(blobs(store)) < len(kept) + 100 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdin.close()
    orphans = blobs(store) - kept
    assert len(orphans) >= 100 and store.backend.snapshots() == ["base"]
    write(store.backend.tmp / "0123.999.1", b"half a chunk")  # what a kill mid-put leaves
    assert read(store, "base", "f") == base
    r = store.gc()
    assert set(r.removed) == orphans and r.temp_freed >= 12
    assert blobs(store) == kept and os.listdir(store.backend.tmp) == []
    assert read(store, "base", "f") == base


def test_listing_blobs_skips_files_that_vanish_meanwhile(store, tmp_path, monkeypatch):
    # ls holds no lock: a writer's temporary file renamed, or a blob gc takes, between the
    # listing and its stat (a CI failure of session 9: FileNotFoundError from a test's poll)
    write(tmp_path / "src" / "f", os.urandom(3 * CHUNK))
    ingest(store, tmp_path / "src", "s")
    write(store.backend.tmp / "0123.999.1", b"a writer's temporary file")
    victim = sorted(blobs(store))[0]
    real = os.scandir

    def vanishing(path):
        entries = list(real(path))
        for e in entries:
            if e.name in ("0123.999.1", victim):
                os.unlink(e.path)
        return iter(entries)
    monkeypatch.setattr(os, "scandir", vanishing)
    assert len(list(store.backend.blobs())) == 2


def test_writer_killed_between_link_and_unlink_leaves_nothing_gc_keeps(store, tmp_path):
    # put_blob links its temporary file to the blob's name, then unlinks the temporary file; a
    # writer killed in between leaves a blob of two links, the second in tmp/ (the CI failure
    # of stop 11: gc took that link for a checkpoint directory's and kept the orphan)
    write(tmp_path / "src" / "f", os.urandom(2 * CHUNK))
    doc, _ = ingest(store, tmp_path / "src", "s")
    orphan = doc["files"]["f"]["chunks"][0][0]
    store.remove(["s"])
    os.link(store.backend.blob_path(orphan), store.backend.tmp / f"{orphan[:16]}.999.1")
    linked_elsewhere = doc["files"]["f"]["chunks"][1][0]
    os.link(store.backend.blob_path(linked_elsewhere), tmp_path / "held-by-a-checkpoint")
    dry = store.gc(dry_run=True)
    assert orphan in dry.removed and linked_elsewhere not in dry.removed and dry.kept_linked == 1
    r = store.gc()
    assert orphan in r.removed and linked_elsewhere not in r.removed
    assert not store.backend.has_blob(orphan) and store.backend.has_blob(linked_elsewhere)
    assert os.listdir(store.backend.tmp) == []


def _one_blob(store: Store, tmp_path: Path) -> tuple[str, Path]:
    write(tmp_path / "src" / "f", os.urandom(2 * CHUNK))
    doc, _ = ingest(store, tmp_path / "src", "s")
    name = doc["files"]["f"]["chunks"][1][0]
    return name, store.backend.blob_path(name)


def test_flipped_byte_is_detected_naming_chunk_and_file(store, tmp_path):
    name, path = _one_blob(store, tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"chunk {name} .snapshot s, file f.*match"):
        read(store, "s", "f")
    with pytest.raises(CorruptCheckpointError):
        store.materialize("s", tmp_path / "out")


@pytest.mark.parametrize("keep", [0, 10, chunk.HEADER.size + 100])
def test_truncated_blob_is_detected(store, tmp_path, keep):
    name, path = _one_blob(store, tmp_path)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CorruptCheckpointError, match=f"chunk {name}"):
        read(store, "s", "f")


@pytest.mark.parametrize("kind", ["link to a good copy", "link to /dev/zero", "directory",
                                  "fifo"])
def test_a_blob_that_is_no_regular_file_is_refused_not_followed(store, tmp_path, kind):
    """Read through the link (a good copy: taken silently; /dev/zero: read until memory ran
    out), or an internal error (a directory): every read of the store's chunks opens them
    as an import does, and a checkpoint's pack links none but regular files."""
    name, path = _one_blob(store, tmp_path)
    good = tmp_path / "good"
    path.rename(good)
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(good if "good" in kind else "/dev/zero")
    with pytest.raises(CorruptCheckpointError, match=f"chunk {name}"):
        read(store, "s", "f")
    with pytest.raises(CorruptCheckpointError, match=f"chunk {name}"):
        store.materialize("s", tmp_path / "out")
    with pytest.raises(CorruptCheckpointError, match=f"chunk {name}"):
        store.export_chunks("s", tmp_path / "export")
    assert not (tmp_path / "export" / name).exists()
    assert os.stat(good).st_nlink == 1                       # not linked out through the link


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_a_lock_file_that_is_no_regular_file_is_one_clear_error(store, tmp_path, kind):
    """Every command opens the store's lock: a link or a directory there was an internal
    error (ELOOP, EISDIR), a FIFO was taken as a lock."""
    _one_blob(store, tmp_path)
    lock = store.backend.root / "lock"
    lock.unlink(missing_ok=True)
    if kind == "symlink":
        lock.symlink_to(tmp_path / "elsewhere")
    elif kind == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    for call in (store.gc, lambda: ingest(store, tmp_path / "src", "t"),
                 lambda: store.materialize("s", tmp_path / "out")):
        with pytest.raises(TorporError, match=f"lock file {lock}") as e:
            call()
        assert type(e.value) is TorporError and e.value.hint == f"remove {lock}: it is made again"
    assert not (tmp_path / "elsewhere").exists()


def test_missing_blob_is_detected(store, tmp_path):
    name, path = _one_blob(store, tmp_path)
    path.unlink()
    with pytest.raises(CorruptCheckpointError, match=f"chunk {name} .* missing"):
        read(store, "s", "f")


def test_export_import_fills_another_store(store, tmp_path):
    data = os.urandom(3 * CHUNK) + bytes(CHUNK) + b"x" * CHUNK
    write(tmp_path / "src" / "f", data)
    ingest(store, tmp_path / "src", "s")
    store.export_chunks("s", tmp_path / "export")
    other = Store(tmp_path / "other", chunk_size=CHUNK, workers=2)
    assert other.import_chunks(tmp_path / "export") == 4
    assert other.import_chunks(tmp_path / "export") == 0
    other.import_snapshot(store.backend.get_snapshot("s"), "export s")
    assert read(other, "s", "f") == data
    with pytest.raises(UsageError, match="not an empty directory"):
        store.export_chunks("s", tmp_path / "export")
    with pytest.raises(NotFoundError, match="no chunk folder"):
        other.import_chunks(tmp_path / "nowhere")


def test_import_snapshot_refuses_missing_chunks(store, tmp_path):
    _one_blob(store, tmp_path)
    other = Store(tmp_path / "other", chunk_size=CHUNK)
    with pytest.raises(CorruptCheckpointError, match="2 chunk.s. missing"):
        other.import_snapshot(store.backend.get_snapshot("s"), "export s")
    assert other.backend.snapshots() == []


@pytest.mark.parametrize("bad", ["ABCDEF" + "0" * 58, "0" * 63, "0" * 64 + ".tmp", "notes.txt"])
def test_import_refuses_a_bad_blob_name(store, tmp_path, bad):
    name, path = _one_blob(store, tmp_path)
    folder = tmp_path / "export"
    store.export_chunks("s", folder)
    target = folder / bad
    target.write_bytes(path.read_bytes())
    other = Store(tmp_path / "other", chunk_size=CHUNK)
    with pytest.raises(CorruptCheckpointError, match="is not a chunk"):
        other.import_chunks(folder)
    assert blobs(other) == set()


def test_import_refuses_content_that_does_not_match_its_name(store, tmp_path):
    name, path = _one_blob(store, tmp_path)
    folder = tmp_path / "export"
    folder.mkdir()
    lie = "f" * 64
    (folder / lie).write_bytes(path.read_bytes())
    other = Store(tmp_path / "other", chunk_size=CHUNK)
    with pytest.raises(CorruptCheckpointError, match=f"chunk {lie} .import.*match"):
        other.import_chunks(folder)
    assert blobs(other) == set()


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_import_refuses_what_is_not_a_regular_file(store, tmp_path, kind):
    name, path = _one_blob(store, tmp_path)
    folder = tmp_path / "export"
    folder.mkdir()
    if kind == "symlink":
        (folder / name).symlink_to(path)
    else:
        (folder / name).mkdir()
    with pytest.raises(CorruptCheckpointError, match="is not a chunk"):
        Store(tmp_path / "other").import_chunks(folder)


def _plant(store: Store, name: str, files: dict) -> None:
    doc = {"schema": 1, "kind": "torpor-snapshot", "name": name, "created": "now", "meta": {},
           "files": files}
    (store.backend.snaps / f"{name}.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("rel", ["../escape", "/etc/passwd", "a/../../b", "./a", ""])
def test_snapshot_with_unsafe_paths_is_refused(store, tmp_path, rel):
    _plant(store, "evil", {rel: {"size": 0, "mode": 0o600, "chunks": []}})
    with pytest.raises(CorruptCheckpointError, match="unsafe path"):
        store.materialize("evil", tmp_path / "out")
    assert not (tmp_path / "escape").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("chunks", [[["zz" * 32, 4]], [[None, 0]], [[None, 5]], [["0" * 64]],
                                    [[None, True]]])
def test_snapshot_with_malformed_chunks_is_refused(store, chunks):
    _plant(store, "bad", {"f": {"size": 4, "mode": 0o600, "chunks": chunks}})
    with pytest.raises(CorruptCheckpointError, match="snapshot bad"):
        store.load("bad")
    with pytest.raises(CorruptCheckpointError):
        store.gc()   # it would not know which chunks that snapshot needs


def test_a_name_given_twice_is_removed_once_and_removing_waits_for_gc(store, tmp_path):
    """`torpor rm NAME NAME` removed the first, then crashed on the second (FileNotFoundError);
    and rm held no lock, so a gc could look at the store mid-removal."""
    write(tmp_path / "src" / "f", b"x")
    ingest(store, tmp_path / "src", "a")
    ingest(store, tmp_path / "src", "b")
    quick = Store(store.backend, chunk_size=CHUNK, workers=2, lock_timeout=0.2)
    with store.backend.lock(True, 1):          # gc's lock
        with pytest.raises(BusyError, match="being collected"):
            quick.remove(["a"])
    assert store.backend.snapshots() == ["a", "b"]
    with store.backend.lock(False, 1):         # a writer's: removing goes on beside it
        assert store.remove(["a", "a", "b", "a"]) == ["a", "b"]
    assert store.backend.snapshots() == []


def test_bad_names_are_usage_errors(store, tmp_path):
    write(tmp_path / "src" / "f", b"x")
    for bad in ["../x", "a/b", "", ".hidden", "x" * 129]:
        with pytest.raises(UsageError, match="bad snapshot name"):
            ingest(store, tmp_path / "src", bad)
    with store.writer() as w:
        with pytest.raises(UsageError, match="bad file name"):
            w.add_file("../outside", tmp_path / "src" / "f")
    with pytest.raises(NotFoundError, match="no snapshot nope"):
        store.load("nope")
    with pytest.raises(NotFoundError, match="no snapshot nope"):
        store.remove(["nope"])
    ingest(store, tmp_path / "src", "dup")
    with pytest.raises(UsageError, match="exists already"):
        ingest(store, tmp_path / "src", "dup")


@pytest.fixture
def small_fs(tmp_path: Path):
    if not is_root():
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("mount -t tmpfs is not permitted here")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_is_a_clear_error_and_harms_nothing(small_fs, tmp_path):
    s = Store(small_fs / "store", chunk_size=CHUNK, workers=2)
    small = os.urandom(2 * CHUNK)
    write(tmp_path / "small" / "f", small)
    s.ingest_dir(tmp_path / "small", "small")
    kept = blobs(s)
    write(tmp_path / "big" / "f", os.urandom(8 << 20))
    with pytest.raises(TorporError, match="cannot store f: No space left on device") as e:
        s.ingest_dir(tmp_path / "big", "big")
    assert no_space(e.value)                 # what store_packing makes exit 8 of
    assert os.listdir(s.backend.tmp) == [] and s.backend.snapshots() == ["small"]
    assert b"".join(s.read_file("small", "f")) == small
    added = s.unnamed()
    assert added and not added & kept and blobs(s) == kept | added
    done = s.discard_unnamed()               # the failed writer's own chunks, without gc
    assert sorted(done.removed) == sorted(added) and done.kept == 0 and done.freed > 0
    assert blobs(s) == kept and s.unnamed() == set()
    write(tmp_path / "again" / "f", os.urandom(2 * CHUNK))
    s.ingest_dir(tmp_path / "again", "again")   # room as before
    assert s.gc().removed == [] and len(blobs(s)) == len(kept) + 2


def test_two_writers_racing_for_a_name_never_replace_each_others_snapshot(store, tmp_path,
                                                                          monkeypatch):
    """Two checkpoints given the same --store NAME at once both pass require_new; the one that
    committed second replaced the first's snapshot (rename), which ls then lost. Now the
    second is refused (exit 2), the first's snapshot stays, and the second's chunks are its
    own to take back."""
    write(tmp_path / "a" / "f", os.urandom(2 * CHUNK))
    write(tmp_path / "b" / "f", os.urandom(2 * CHUNK))
    sync = store.backend.sync
    first = []

    def other_writer_commits_meanwhile() -> None:
        sync()
        if not first:
            first.append(Store(store.backend.root, chunk_size=CHUNK).ingest_dir(
                tmp_path / "a", "same")[0])
    monkeypatch.setattr(store.backend, "sync", other_writer_commits_meanwhile)
    with pytest.raises(UsageError, match="snapshot same exists already") as e:
        ingest(store, tmp_path / "b", "same")
    assert e.value.exit_code == 2
    assert store.load("same") == first[0]
    assert read(store, "same", "f") == (tmp_path / "a" / "f").read_bytes()
    assert len(store.discard_unnamed().removed) == 2 and os.listdir(store.backend.tmp) == []


def test_ls_leaves_out_a_snapshot_removed_while_it_lists(store, tmp_path, monkeypatch):
    """ls holds no lock: an rm between its listing and its reading made ls fail (exit 3, 'no
    snapshot ...') rather than list what is there."""
    write(tmp_path / "src" / "f", os.urandom(CHUNK))
    ingest(store, tmp_path / "src", "kept")
    ingest(store, tmp_path / "src", "going")
    listed = store.backend.snapshots()
    monkeypatch.setattr(store.backend, "snapshots", lambda: listed)
    store.remove(["going"])
    assert [r.name for r in store.snapshots()] == ["kept"]


def test_a_failed_writer_takes_back_only_what_nothing_else_holds(store, tmp_path):
    """discard_unnamed removes the chunks this Store's writers created and no snapshot they
    committed names, as gc would: not a chunk another writer created, nor one a snapshot
    names by now (another writer took it meanwhile), nor one a checkpoint directory links;
    and nothing while another writer holds the store (it could be taking them)."""
    a, b, c, d = (os.urandom(CHUNK) for _ in range(4))
    write(tmp_path / "theirs" / "f", b)
    other = Store(store.backend.root, chunk_size=CHUNK, workers=2, lock_timeout=5)
    with other.writer() as w:                # another writer (another torpor), not committed
        w.add_file("f", tmp_path / "theirs" / "f")
    write(tmp_path / "mine" / "f", a + b + c + d)
    with store.writer() as w:                # a writer that fails before its commit
        w.add_file("f", tmp_path / "mine" / "f")
    names = {p: chunk.name_of(p) for p in (a, b, c, d)}
    assert store.unnamed() == {names[a], names[c], names[d]}   # b was there: not its own
    write(tmp_path / "c" / "f", c)
    ingest(other, tmp_path / "c", "takes-c")                   # c is named now
    os.link(store.backend.blob_path(names[d]), tmp_path / "link")   # d is linked
    with other.backend.lock(False, 5):       # a writer at work: nothing can go
        assert store.discard_unnamed(timeout=0.2) is None
    assert blobs(store) == set(names.values())
    done = store.discard_unnamed()
    assert done.removed == [names[a]] and done.kept == 2 and done.freed > 0
    assert blobs(store) == {names[b], names[c], names[d]}
    assert read(store, "takes-c", "f") == c
    assert store.unnamed() == set() and store.discard_unnamed().removed == []


def test_a_committed_writer_leaves_nothing_to_take_back(store, tmp_path):
    write(tmp_path / "src" / "f", os.urandom(3 * CHUNK))
    ingest(store, tmp_path / "src", "one")
    assert store.unnamed() == set()
    assert store.discard_unnamed().removed == [] and len(blobs(store)) == 3


def test_cli_ls_rm_gc(tmp_path, torpor_env):
    env = {**os.environ, "TORPOR_STORE_DIR": str(tmp_path / "store")}
    s = Store(tmp_path / "store", chunk_size=CHUNK)
    write(tmp_path / "src" / "f", os.urandom(2 * CHUNK))
    s.ingest_dir(tmp_path / "src", "ckpt-1")

    def torpor(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(torpor_cmd(*args), env=env, capture_output=True, text=True)

    ls = torpor("ls", "--json")
    assert ls.returncode == 0, ls.stderr
    rows = json.loads(ls.stdout)["snapshots"]
    assert [(r["name"], r["files"], r["logical"]) for r in rows] == [("ckpt-1", 1, 2 * CHUNK)]
    assert "ckpt-1" in torpor("ls").stdout
    missing = torpor("rm", "nope")
    assert missing.returncode == 3 and missing.stderr.strip().count("\n") == 0
    assert "no snapshot nope" in missing.stderr
    assert torpor("rm", "ckpt-1").returncode == 0
    dry = torpor("--json", "gc", "--dry-run")
    assert len(json.loads(dry.stdout)["removed"]) == 2 and len(blobs(s)) == 2
    gc = torpor("gc")
    assert gc.returncode == 0 and "removed 2 chunk(s)" in gc.stdout and blobs(s) == set()


def test_cli_ls_shows_a_containers_owner_by_its_id_and_root_key(tmp_path, torpor_env):
    """One id under two runtime roots is two owners: ls tells them apart (the ID shortened as
    podman does, the root's key whole); --json has the owner whole."""
    env = {**os.environ, "TORPOR_STORE_DIR": str(tmp_path / "store")}
    s = Store(tmp_path / "store", chunk_size=CHUNK)
    cid = "c0ffee" * 10 + "0123"
    owners = [f"container:{cid}@0123456789abcdef", f"container:{cid}@fedcba9876543210",
              f"container:{cid}", "uid:1000"]
    for i, owner in enumerate(owners):
        write(tmp_path / f"src{i}" / "f", os.urandom(CHUNK))
        s.ingest_dir(tmp_path / f"src{i}", f"ckpt-{i}", {"owner": owner})
    ls = subprocess.run(torpor_cmd("ls"), env=env, capture_output=True, text=True)
    assert ls.returncode == 0, ls.stderr
    shown = {line.split()[0]: line.split()[-1] for line in ls.stdout.splitlines()[1:]}
    assert shown == {"ckpt-0": "container:c0ffeec0ffee@0123456789abcdef",
                     "ckpt-1": "container:c0ffeec0ffee@fedcba9876543210",
                     "ckpt-2": "container:c0ffeec0ffee", "ckpt-3": "uid:1000"}
    ls = subprocess.run(torpor_cmd("ls", "--json"), env=env, capture_output=True, text=True)
    assert sorted(r["owner"] for r in json.loads(ls.stdout)["snapshots"]) == sorted(owners)


def test_ordered_map_keeps_order_with_items_done_inline():
    import concurrent.futures
    import threading

    from torpor.store.parallel import ordered_map

    where: dict[int, str] = {}

    def fn(i: int) -> int:
        if i == 7:
            raise ValueError("seven")
        where[i] = threading.current_thread().name
        time.sleep(0.001 * (i % 3))    # pool items finish out of order
        return i * i

    with concurrent.futures.ThreadPoolExecutor(2, "pool") as pool:
        it = ordered_map(pool, fn, range(10), 4, inline=lambda i: i % 2 == 0)
        assert [next(it) for _ in range(7)] == [i * i for i in range(7)]
        with pytest.raises(ValueError, match="seven"):   # an error comes at its own place
            next(it)
    assert {where[i] for i in (0, 2, 4, 6)} == {threading.main_thread().name}
    assert all(where[i].startswith("pool") for i in (1, 3, 5))


def test_a_failed_checkpoint_leaves_its_chunks_to_recovery_and_gc_when_they_may_be_needed(
        store, tmp_path, cfg):
    """store_packing.discard_unnamed (what a failed `checkpoint --store` calls) leaves the
    chunks to gc, and says so, while a dead torpor's pack awaits its recovery (it may name
    them) or while the checkpoint directory still has holes the store fills."""
    from torpor import agent_data, store_packing
    from torpor.journal import Journal

    write(tmp_path / "src" / "f", os.urandom(2 * CHUNK))
    with store.writer() as w:
        w.add_file("f", tmp_path / "src" / "f")
    said: list[str] = []
    journal = Journal(cfg)
    op = journal.begin("pack", [])
    op.phase("pack", images_dir=str(tmp_path / "dead"), store_owner="uid:0")
    op.release()                                      # its torpor died
    store_packing.discard_unnamed(journal, store, None, said.append)
    assert len(blobs(store)) == 2 and len(store.unnamed()) == 2
    assert said[-1].startswith("2 chunk(s) it added to store") and "`torpor gc`" in said[-1] \
        and "is not whole yet" in said[-1]
    op.close()                                        # recovered
    holes = tmp_path / "ck" / agent_data.DATA_DIR / "7"
    holes.mkdir(parents=True)
    (holes / agent_data.STREAMED).write_text("")      # a stream record: holes to fill
    store_packing.discard_unnamed(journal, store, tmp_path / "ck", said.append)
    assert len(blobs(store)) == 2 and f"{tmp_path / 'ck'} still needs them" in said[-1]
    (holes / agent_data.STREAMED).unlink()
    store_packing.discard_unnamed(journal, store, tmp_path / "ck", said.append)
    assert blobs(store) == set() and said[-1].startswith("removed the 2 chunk(s)")
