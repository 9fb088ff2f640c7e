"""The deduplicating image store: many checkpoints on a host share one set of chunks.

Files are cut into fixed-size chunks. GPU memory does not shift the way edited documents do,
so content-defined chunking would buy nothing; allocations are 2 MiB-granular, so chunks are
a multiple of that. CHUNK_SIZE = 4 MiB, measured with bench/store_path.py on this 2-core host
(bench/results/store_path-cpu-2026-12-03.json, median of 3 rounds over 0.54 GB):
  - throughput does not choose: ingest ran at 0.70 / 0.78 / 0.75 / 0.71 GB/s for 1 / 2 / 4 /
    16 MiB chunks (bound by sha256 + zstd on 2 cores; run-to-run noise ~30 %); verified
    read-back at 2.0 / 2.1 / 2.0 / 1.4 GB/s (16 MiB slower, not investigated further);
  - each chunk has a fixed cost, 0.7 ms here (temp file, fsync, link): per MiB that is 0.7 ms
    at 1 MiB chunks, 0.17 ms at 4 MiB, which matters where a GPU host moves 5-10 GB/s, and
    object stores charge and wait per request (S3's multipart parts are >= 5 MiB anyway);
  - dedup granularity: after 4 one-byte changes a second snapshot wrote 2.8 / 5.6 / 11.3 /
    45 MiB: 4 MiB costs ~3 MiB per changed region more than 1 MiB, little against GB-sized
    checkpoints, while 16 MiB costs 4x that.
It is a parameter (Store(chunk_size=...)): a snapshot records each chunk's length, so stores
and snapshots with other chunk sizes read the same way.

Reads verify every chunk (sha256 of the decompressed data against its name) and stream a
file's chunks in order with a bounded parallel read-ahead. gc keeps every chunk a snapshot
names and every chunk something else holds a hard link to (a checkpoint directory carrying its
chunks), and waits for writers to finish (their lock) before it looks.

A chunk is reused by its name without being read (writer.py), so one damaged on disk (a flipped
bit, a truncation) would be named by every later checkpoint of that data. verify() is the scrub
(`torpor gc --verify`): it reads and checks every chunk under the shared lock (checkpoints go
on), then removes those still damaged under the exclusive lock, so the next checkpoint of that
data stores it again; the snapshots that named them stay broken and are reported.

A failed write need not wait for gc: a Store remembers the chunks its writers created that
no snapshot they committed names, and discard_unnamed() removes them the way gc would, under
the exclusive lock (no writer can be taking them meanwhile), keeping any that a snapshot
names by then or that something links. Its caller calls it once nothing of its own needs
them and it holds the store's lock no more (store_packing.discard_unnamed).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Mapping

from ..errors import BusyError, CorruptCheckpointError, NotFoundError, UsageError
from ..files import private_dir, write_new
from . import chunk, snapshot
from .backend import BLOB_NAME, Backend, LocalBackend, check_snapshot_name
from .parallel import ordered_map
from .writer import Writer, WriteStats

CHUNK_SIZE = 4 << 20
log = logging.getLogger(__name__)


def _empty_dir(path: Path) -> None:
    """path as a new or empty private directory; UsageError when it holds anything."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UsageError(f"{path} is not an empty directory")
    private_dir(path)


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    name: str
    created: str
    files: int
    logical: int   # bytes of its files
    stored: int    # bytes its chunks take in the store (each chunk once)
    unique: int    # of those, bytes no other snapshot needs: what removing it frees
    owner: str     # whose checkpoint it is: its chunks are matched by fingerprint for
                   # that owner's only (fingerprints.owner_of); "" none


@dataclasses.dataclass(frozen=True)
class Discarded:
    removed: list[str]   # chunks a failed write created, removed
    freed: int           # bytes those took
    kept: int            # of its chunks, kept: a snapshot names them by now, or a link holds them


@dataclasses.dataclass(frozen=True)
class GcResult:
    removed: list[str]   # chunks removed (or that would be, dry run)
    freed: int           # bytes: those chunks and temporary leftovers
    kept_linked: int     # unreferenced chunks kept: a checkpoint directory links them
    temp_freed: int


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    checked: int          # chunks read and checked
    bytes: int            # bytes read
    damaged: list[str]    # chunks that failed the check (header, zstd, sha256, no plain file)
    missing: list[str]    # chunks snapshots name that are not in the store (an earlier scrub
                          # removed them damaged): those snapshots stay broken until torpor rm
    snapshots: list[str]  # snapshots naming a damaged or missing chunk: they no longer restore
    removed: list[str]    # of the damaged, removed (none in a dry run)


class Store:
    """A store on a backend (a directory: LocalBackend)."""

    def __init__(self, root: Path | Backend, *, chunk_size: int = CHUNK_SIZE,
                 workers: int | None = None, lock_timeout: float = 60.0):
        if not 0 < chunk_size <= chunk.MAX_CHUNK:
            raise UsageError(f"chunk size must be 1 to {chunk.MAX_CHUNK} bytes")
        self.backend = root if isinstance(root, Backend) else LocalBackend(root)
        self.where = str(self.backend)
        self.chunk_size = chunk_size
        self.workers = workers or os.cpu_count() or 2
        self.lock_timeout = lock_timeout
        # chunks this Store's writers created that no snapshot they committed names (yet)
        self._unnamed: set[str] = set()
        self._unnamed_lock = threading.Lock()

    def writer(self, known: Mapping[str, list[Any]] | None = None) -> Writer:
        """A Writer; known: host fingerprints of its owner's chunks (writer.py)."""
        return Writer(self, known)

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(self.workers, "torpor-store")

    # --- reading ---------------------------------------------------------------------------

    def load(self, name: str) -> dict[str, Any]:
        """The snapshot called name, validated; NotFoundError when there is none."""
        check_snapshot_name(name)
        try:
            data = self.backend.get_snapshot(name)
        except FileNotFoundError:
            raise NotFoundError(f"no snapshot {name} in store {self.where}") from None
        doc = snapshot.parse(data, f"snapshot {name}")
        if doc["name"] != name:
            raise CorruptCheckpointError(f"snapshot {name} calls itself {doc['name']!r}")
        return doc

    def read_chunk(self, ref: list[Any], where: str, clock: list[float] | None = None
                   ) -> bytes:
        """One chunk ([name or None, length]) verified; where names it in errors. clock: the
        seconds spent reading and verifying are added to its first two items."""
        name, length = ref
        if name is None:
            return chunk.zeros(length)
        t = time.perf_counter()
        try:
            blob = self.backend.read_blob(name)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"chunk {name} ({where}) is missing from store "
                                         f"{self.where}") from None
        t1 = time.perf_counter()
        data = chunk.decode(blob, name, where)
        if clock is not None:
            clock[0] += t1 - t
            clock[1] += time.perf_counter() - t1
        if len(data) != length:
            raise CorruptCheckpointError(f"chunk {name} ({where}) holds {len(data)} bytes, "
                                         f"the snapshot says {length}")
        return data

    def read_chunk_into(self, ref: list[Any], dest: memoryview, where: str,
                        fp: str | None = None) -> bool:
        """read_chunk() into dest (exactly the chunk's length), without an intermediate copy
        where the backend has local files (store/stream.py feeds GPU data this way). fp: the
        fingerprint this host recorded of the chunk (chunk.read_blob_into; from a trusted
        record only): the data is checked against it rather than its sha256. Whether it was
        (else sha256 was, or the chunk is zeros)."""
        name, length = ref
        if len(dest) != length:
            raise CorruptCheckpointError(f"chunk {name} ({where}): {length} bytes do not fit "
                                         f"{len(dest)}")
        path = None if name is None else self.backend.blob_path(name)
        if path is None:
            dest[:] = self.read_chunk(ref, where)
            return False
        try:
            chunk.read_blob_into(path, name, dest, where, fp)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"chunk {name} ({where}) is missing from store "
                                         f"{self.where}") from None
        return fp is not None

    def read_entry(self, entry: dict[str, Any], where: str) -> Iterator[bytes]:
        """The chunks of one file entry of a validated snapshot, in order, each verified;
        where names it in errors. Reads ahead at most 2 chunks per worker."""
        with self._pool() as pool:
            yield from ordered_map(pool, lambda ref: self.read_chunk(ref, where),
                                   entry["chunks"], 2 * self.workers)

    def sound_chunks(self, refs: Mapping[str, int]) -> set[str]:
        """Of refs (chunk name -> its length), those the store holds and can be reused by
        name (backend.has_blob: a damaged one is not), looked at on the pool (each look is a
        read from disk when the chunk is not in the page cache)."""
        if not refs:
            return set()
        with self._pool() as pool:
            return {n for n, ok in zip(refs, pool.map(self.backend.has_blob, refs,
                                                      refs.values())) if ok}

    def read_file(self, name: str, relpath: str) -> Iterator[bytes]:
        """The content of relpath in snapshot name, chunk by chunk, verified."""
        doc = self.load(name)
        if relpath not in doc["files"]:
            raise NotFoundError(f"snapshot {name} holds no file {relpath}")
        return self.read_entry(doc["files"][relpath], f"snapshot {name}, file {relpath}")

    def materialize(self, name: str, dest: Path) -> dict[str, Any]:
        """Write snapshot name's files under dest (a new or empty directory, 0700; files
        0600), every chunk verified; the snapshot."""
        with self.backend.lock(False, self.lock_timeout):  # loaded under it: no gc in between
            doc = self.load(name)
            self._write_files(doc, dest)
        return doc

    def materialize_doc(self, doc: dict[str, Any], dest: Path,
                        leave_out: Collection[str] = ()) -> None:
        """materialize() for a snapshot validated elsewhere (one carried by a checkpoint
        directory), its chunks in this store; the files in leave_out are not written."""
        with self.backend.lock(False, self.lock_timeout):
            self._write_files(doc, dest, leave_out)

    def _write_files(self, doc: dict[str, Any], dest: Path,
                     leave_out: Collection[str] = ()) -> None:
        """Every file of doc under dest: made first (0600, at full size: zero chunks stay
        holes), then every chunk of every file read, verified and written at its offset by
        the pool at once, files and chunks in any order: a restore's GPU data is 16 files,
        which one after another left most cores idle (8.8 s for 17 GB on the H200 host)."""
        _empty_dir(dest)
        fds: dict[str, int] = {}
        start = time.perf_counter()
        clocks: list[list[float]] = []     # per worker thread: read, verify, write seconds
        local = threading.local()
        try:
            jobs = []
            for rel, entry in doc["files"].items():
                if rel in leave_out:
                    continue
                for parent in reversed(Path(rel).parents[:-1]):  # each 0700, not only the last
                    private_dir(dest / parent)
                fd = os.open(dest / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600)
                fds[rel] = fd
                os.ftruncate(fd, entry["size"])
                at = 0
                for ref in entry["chunks"]:
                    if ref[0] is not None:
                        jobs.append((fd, at, ref, f"snapshot {doc['name']}, file {rel}"))
                    at += ref[1]

            def write(job: tuple[int, int, list[Any], str]) -> None:
                fd, at, ref, where = job
                if not hasattr(local, "clock"):
                    local.clock = [0.0, 0.0, 0.0]
                    clocks.append(local.clock)   # list.append: atomic
                data = memoryview(self.read_chunk(ref, where, local.clock))
                t = time.perf_counter()
                done = 0
                while done < len(data):           # a short write goes on where it stopped
                    done += os.pwrite(fd, data[done:], at + done)
                local.clock[2] += time.perf_counter() - t

            with self._pool() as pool:
                for _ in ordered_map(pool, write, jobs, 2 * self.workers):
                    pass
        finally:
            for fd in fds.values():
                os.close(fd)
        # where an unpack's time goes, to find what bounds it (summed over the threads)
        log.info("snapshot %s written to %s: %d chunks in %.2f s by %d threads; thread-seconds: "
                 "read %.2f, verify %.2f, write %.2f", doc["name"], dest, len(jobs),
                 time.perf_counter() - start, len(clocks), sum(c[0] for c in clocks),
                 sum(c[1] for c in clocks), sum(c[2] for c in clocks))

    # --- writing ---------------------------------------------------------------------------

    def ingest_dir(self, src: Path, name: str, meta: dict[str, Any] | None = None,
                   pieces: dict[str, list[int]] | None = None,
                   extra: dict[str, dict[str, Any]] | None = None,
                   known: Mapping[str, list[Any]] | None = None
                   ) -> tuple[dict[str, Any], WriteStats]:
        """Every regular file under src as snapshot name; (snapshot, WriteStats). pieces: where
        to cut some files; extra: more Writer.add_file arguments for some files (given,
        fingerprints; src: another content; leave_out: not stored); known: the writer's
        (writer.py). Symlinks and
        special files are refused rather than left out silently."""
        rels = []
        for root, dirs, names in os.walk(src):
            dirs.sort()
            for n in sorted(names):
                path = Path(root, n)
                if path.is_symlink() or not path.is_file():
                    raise UsageError(f"{path} is not a regular file: the store keeps only those")
                rels.append(path.relative_to(src).as_posix())
        with self.writer(known) as w:
            for rel in rels:
                more = dict((extra or {}).get(rel, {}))
                if more.pop("leave_out", False):
                    continue
                w.add_file(rel, more.pop("src", src / rel), (pieces or {}).get(rel, ()), **more)
            return w.commit(name, meta), w.stats

    def created(self, name: str) -> None:
        """A writer put chunk name into the store (it was not there): no snapshot names it.
        Also a chunk a failed checkpoint's own stream put there through another process's
        Store (store_packing.stand_alone, once its directory holds the data)."""
        with self._unnamed_lock:
            self._unnamed.add(name)

    def named(self, names: Collection[str]) -> None:
        """A snapshot naming these chunks was committed."""
        with self._unnamed_lock:
            self._unnamed.difference_update(names)

    def unnamed(self) -> set[str]:
        """The chunks this Store's writers created that no snapshot they committed names."""
        with self._unnamed_lock:
            return set(self._unnamed)

    def discard_unnamed(self, timeout: float = 5.0) -> Discarded | None:
        """Remove the chunks unnamed() lists, as gc would: under the exclusive lock (waiting
        at most timeout seconds; None, nothing removed, when writers hold it that long: gc
        takes them later), every chunk a snapshot names by now, or that something else links,
        kept. Only chunks this Store created: a chunk another writer put stays whatever it is.
        Call it without holding the lock (it would wait for itself) and once nothing of the
        caller's needs them (a failed checkpoint whose directory is whole)."""
        todo = self.unnamed()
        if not todo:
            return Discarded([], 0, 0)
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.backend.lock(True, timeout))
            except BusyError:
                return None
            live: set[str] = set()
            for n in self.backend.snapshots():
                live |= snapshot.chunk_names(self.load(n))
            removed, freed, kept = [], 0, 0
            for name in sorted(todo):
                b = self.backend.blob_info(name)
                if b is None:
                    continue
                if name in live or b.links > 1:
                    kept += 1
                    continue
                self.backend.delete_blob(name)
                removed.append(name)
                freed += b.size
        self.named(todo)     # removed, or named or linked now: none is this Store's to remove
        return Discarded(removed, freed, kept)

    # --- listing and removing --------------------------------------------------------------

    def snapshots(self) -> list[SnapshotInfo]:
        """Every snapshot with its sizes. Takes no lock (ls must not wait for a checkpoint): one
        removed between the listing and its reading (torpor rm meanwhile) is left out."""
        sizes = {b.name: b.size for b in self.backend.blobs()}
        docs = []
        for n in self.backend.snapshots():
            try:
                docs.append(self.load(n))
            except NotFoundError:
                continue
        users: dict[str, int] = {}
        for doc in docs:
            for c in snapshot.chunk_names(doc):
                users[c] = users.get(c, 0) + 1
        out = []
        for doc in docs:
            names = snapshot.chunk_names(doc)
            out.append(SnapshotInfo(
                doc["name"], doc["created"], len(doc["files"]),
                sum(e["size"] for e in doc["files"].values()),
                sum(sizes.get(c, 0) for c in names),
                sum(sizes.get(c, 0) for c in names if users[c] == 1),
                str(doc["meta"].get("owner", ""))))
        return out

    def require_new(self, name: str) -> str:
        """name, when it is a good snapshot name (check_snapshot_name) that no snapshot here
        has yet; UsageError otherwise. A checkpoint into the store asks before it starts;
        Writer.commit asks again as it names what it wrote."""
        check_snapshot_name(name)
        if name in self.backend.snapshots():
            raise UsageError(f"snapshot {name} exists already in store {self.where} "
                             f"(torpor rm {name} first)")
        return name

    def remove(self, names: Collection[str]) -> list[str]:
        """Remove snapshots (all named must exist, or none is removed); their chunks stay
        until gc. A name given twice is removed once. Under the store's lock, held as every
        writer holds it (shared: gc waits, and never sees half of it). Returns the names
        removed, in the order given."""
        names = list(dict.fromkeys(names))
        for n in names:
            check_snapshot_name(n)
        with self.backend.lock(False, self.lock_timeout):
            known = set(self.backend.snapshots())
            missing = [n for n in names if n not in known]
            if missing:
                raise NotFoundError(f"no snapshot {', '.join(missing)} in store {self.where}")
            for n in names:
                try:
                    self.backend.delete_snapshot(n)
                except FileNotFoundError:
                    pass   # another rm took it meanwhile: gone, as asked
        return names

    def gc(self, dry_run: bool = False, timeout: float | None = None) -> GcResult:
        """Remove chunks no snapshot names and no checkpoint directory links, and the
        temporary files of writers that died. Waits (timeout, BusyError) for writers to end;
        a snapshot it cannot read stops it: it would not know which chunks that one needs."""
        with self.backend.lock(True, self.lock_timeout if timeout is None else timeout):
            live: set[str] = set()
            for n in self.backend.snapshots():
                live |= snapshot.chunk_names(self.load(n))
            removed, freed, linked = [], 0, 0
            for b in self.backend.blobs():
                if b.name in live:
                    continue
                if b.links > 1:
                    linked += 1
                    continue
                removed.append(b.name)
                freed += b.size
                if not dry_run:
                    self.backend.delete_blob(b.name)
            temp = self.backend.clean_temp(remove=not dry_run)
        return GcResult(removed, freed + temp, linked, temp)

    def verify(self, dry_run: bool = False, timeout: float | None = None,
               seen: Callable[[int], None] | None = None) -> VerifyResult:
        """Read and check every chunk (chunk.decode: header, zstd, sha256 against its name) on
        the pool, under the shared lock: checkpoints go on meanwhile. Unless dry_run, then take
        the exclusive lock (as gc, waiting at most timeout), check each damaged chunk again (a
        writer storing its data may have replaced it meanwhile, backend.put_blob; another scrub
        may have removed it) and remove those still damaged: a checkpoint of that data stores
        it again. seen(n): n more bytes were read."""
        wait = self.lock_timeout if timeout is None else timeout
        with self.backend.lock(False, wait):
            # snapshots first: a chunk they name was in the store before the blobs are listed,
            # and no chunk leaves it while the shared lock is held
            named: dict[str, set[str]] = {}
            for n in self.backend.snapshots():
                try:
                    named[n] = snapshot.chunk_names(self.load(n))
                except NotFoundError:
                    continue    # torpor rm meanwhile
            sizes = {b.name: b.size for b in self.backend.blobs()}
            checked, nbytes, damaged = 0, 0, []
            with self._pool() as pool:
                for name, size, ok in ordered_map(pool, self._check_blob, sorted(sizes),
                                                  2 * self.workers):
                    if size < 0:
                        continue    # gone meanwhile
                    checked += 1
                    nbytes += size
                    if seen is not None:
                        seen(size)
                    if not ok:
                        damaged.append(name)
        missing = sorted(set().union(*named.values()) - sizes.keys()) if named else []
        bad = set(damaged) | set(missing)
        removed = []
        if damaged and not dry_run:
            with self.backend.lock(True, wait):
                for name in damaged:
                    if not self._check_blob(name)[2]:
                        try:
                            self.backend.delete_blob(name)
                        except OSError as e:   # a directory in its place: reported, kept
                            log.warning("cannot remove damaged chunk %s from store %s: %s",
                                        name, self.where, e.strerror)
                            continue
                        removed.append(name)
                        log.warning("removed damaged chunk %s from store %s", name, self.where)
        return VerifyResult(checked, nbytes, damaged, missing,
                            sorted(n for n, names in named.items() if names & bad), removed)

    def _check_blob(self, name: str) -> tuple[str, int, bool]:
        """(name, bytes read or -1 when it is not there, whether it is sound)."""
        blob = b""
        try:
            blob = self.backend.read_blob(name)
            chunk.decode(blob, name, f"store {self.where}")
        except FileNotFoundError:
            return name, -1, True
        except (CorruptCheckpointError, OSError) as e:   # OSError: EIO from a failing disk
            log.warning("chunk %s in store %s is damaged: %s", name, self.where, e)
            return name, len(blob), False
        return name, len(blob), True

    # --- moving checkpoints between hosts --------------------------------------------------

    def export_chunks(self, name: str, dest: Path) -> int:
        """Every chunk snapshot name needs, as files <64 hex> in dest (hard links when on the
        store's filesystem, else copies): a self-contained folder for import_chunks on another
        host (with the snapshot: import_snapshot). dest must be new or empty. The number of
        chunks."""
        with self.backend.lock(False, self.lock_timeout):
            names = sorted(snapshot.chunk_names(self.load(name)))
            _empty_dir(dest)
            # links one after another: they change one directory, which takes them one at a
            # time whatever the threads (a pool only added its overhead: 0.2 s for 4,160)
            copies = [c for c in names if not self._link(c, dest / c)]
            if copies:
                with self._pool() as pool:
                    for _ in pool.map(lambda c: write_new(dest / c, self.backend.read_blob(c)),
                                      copies):
                        pass
        return len(names)

    def _link(self, name: str, target: Path) -> bool:
        """Hard-link blob name to target; False where it must be copied instead (another
        filesystem, or a backend with no local files)."""
        src = self.backend.blob_path(name)
        if src is None:
            return False
        try:
            os.link(src, target, follow_symlinks=False)   # a link's target is no chunk of ours
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            return False
        if not stat.S_ISREG(os.lstat(target).st_mode):
            target.unlink()
            raise CorruptCheckpointError(f"chunk {name} in store {self.where} is not a regular "
                                         "file")
        return True

    def import_chunks(self, src: Path) -> int:
        """Bring every chunk file of an exported folder (untrusted) into the store; each is
        verified (name, format, content against its name) before it enters. The number of
        chunks new to the store."""
        try:
            names = sorted(os.listdir(src))
        except FileNotFoundError:
            raise NotFoundError(f"no chunk folder {src}") from None
        for n in names:
            if not BLOB_NAME.fullmatch(n) or not (src / n).is_file() or (src / n).is_symlink():
                raise CorruptCheckpointError(f"{src}: {n!r} is not a chunk (a regular file "
                                             "named by 64 lowercase hex digits)")
        with self.backend.lock(False, self.lock_timeout), self._pool() as pool:
            new = sum(pool.map(lambda n: self._import_one(src / n), names))
            self.backend.sync()
        return new

    def _import_one(self, path: Path) -> bool:
        if self.backend.has_blob(path.name):   # one held damaged is replaced by this one
            return False
        where = f"import from {path.parent}"
        blob = chunk.read_blob_file(path, where)
        chunk.decode(blob, path.name, where)
        return self.backend.put_blob(path.name, blob)

    def import_snapshot(self, data: bytes, origin: str) -> dict[str, Any]:
        """Add an exported snapshot (untrusted bytes) once all its chunks are in the store.
        It loses its owner: fingerprints it brings were never checked against its chunks, so
        no checkpoint may take chunks by them (fingerprints.py)."""
        doc = snapshot.parse(data, origin)
        doc["meta"].pop("owner", None)
        missing = [c for c in sorted(snapshot.chunk_names(doc)) if not self.backend.has_blob(c)]
        if missing:
            raise CorruptCheckpointError(f"{origin}: {len(missing)} chunk(s) missing from store "
                                         f"{self.where}, e.g. {missing[0]}")
        self.require_new(doc["name"])
        self.backend.put_snapshot(doc["name"], snapshot.dump(doc))
        return doc
