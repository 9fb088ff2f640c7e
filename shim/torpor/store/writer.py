"""Writing a snapshot: files cut into chunks (fixed-size, or the caller's piece lengths, see
pages.py), each hashed, compressed and stored by a bounded pool of threads, then one snapshot
naming them all.

A writer holds the store's lock shared from its start to its end, so gc (exclusive) never
removes the chunks of a checkpoint still being written. Chunks already in the store are not
written again, zero chunks not at all; a chunk is in the store when backend.has_blob finds a
blob there that can be it (a damaged one is replaced by the data being stored). A writer
handed `known` (host fingerprint -> chunk, of its owner's snapshots: fingerprints.py)
fingerprints every chunk it reads, takes a chunk whose fingerprint is known without computing
its sha256, and records the fingerprints (the file's "host_fingerprints"). Until commit
nothing names the new chunks: a writer that fails or is killed leaves only temporary files and
unreferenced chunks, which gc removes; no earlier snapshot is touched. The store remembers the
chunks a writer created until a snapshot names them, so that a failed checkpoint removes them
itself (Store.discard_unnamed) rather than leave a full store full until gc.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import io
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Iterator, Mapping, Sequence

from ..errors import CorruptCheckpointError, TorporError, UsageError
from ..layout import safe_relpath
from . import chunk, snapshot
from .parallel import ordered_map

if TYPE_CHECKING:
    from .store import Store


@dataclasses.dataclass
class WriteStats:
    logical: int = 0        # bytes of the files added
    chunks: int = 0
    zero_chunks: int = 0    # stored as nothing
    reused_chunks: int = 0  # already in the store: not written again
    new_chunks: int = 0
    new_bytes: int = 0      # what the new blobs take in the store (compressed)
    by_fingerprint: int = 0  # of the reused, taken by fingerprint: not read, or not hashed
    streamed: int = 0       # given chunks the agent's stream stored already (StreamedRef)


class StreamedRef(list):  # type: ignore[type-arg]
    """A given chunk ([name or None, length]) that this checkpoint's own stream put into the
    store (store/stream.py): the stream counted it (new, reused or zero), the pack does not."""


def _read_full(f: BinaryIO, size: int) -> bytes:
    """size bytes, fewer only at the end (pipes and sockets return short reads)."""
    data = f.read(size)
    while data and len(data) < size:
        more = f.read(size - len(data))
        if not more:
            break
        data += more
    return data


def _pieces(f: BinaryIO, size: int, lengths: Sequence[int] = (),
            given: Mapping[int, list[Any]] | None = None) -> Iterator[bytes | list[Any]]:
    """The file cut at lengths first (each at most size), then into pieces of size; a piece
    whose index is in given is not read: its ref (given[index]) comes instead."""
    for n in lengths:
        if not (data := _read_full(f, n)):
            return
        yield data
    index = len(lengths)
    while True:
        if given and index in given:
            f.seek(given[index][1], os.SEEK_CUR)
            yield given[index]
        elif not (data := _read_full(f, size)):
            return
        else:
            yield data
        index += 1


def _mode(f: BinaryIO) -> int:
    """Permission bits of the file behind f; 0600 for a stream that has none (a pipe's or an
    in-memory buffer's bits say nothing about the data)."""
    try:
        st = os.fstat(f.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        return 0o600
    return stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else 0o600


class Writer:
    """`with store.writer() as w: w.add_file(rel, src); w.commit(name, meta)`."""

    def __init__(self, store: Store, known: Mapping[str, list[Any]] | None = None):
        self.store = store
        self.known = known
        self.files: dict[str, dict[str, Any]] = {}
        self.stats = WriteStats()
        self._stack = contextlib.ExitStack()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def __enter__(self) -> Writer:
        with self._stack.pop_all() as stack:  # undone if the pool cannot start
            stack.enter_context(self.store.backend.lock(False, self.store.lock_timeout))
            self._pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(
                self.store.workers, thread_name_prefix="torpor-store"))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _put(self, data: bytes | list[Any]) -> tuple[list[Any], int, str]:
        """Store one chunk: ([name or None, length], bytes newly stored, -1 if reused or -2 if
        reused by fingerprint, -3 if streamed, and its host fingerprint or ""); a ref (a given
        chunk) is taken as it is, once the store has it."""
        backend = self.store.backend
        if isinstance(data, list):
            if data[0] is not None and not backend.has_blob(data[0], data[1]):
                # not read, so not to be stored again here: the checkpoint needs the store's
                raise CorruptCheckpointError(f"chunk {data[0]} is not in store "
                                             f"{self.store.where}, or is damaged there")
            return list(data), -3 if isinstance(data, StreamedRef) else \
                0 if data[0] is None else -2, ""
        if chunk.is_zero(data):
            return [None, len(data)], 0, ""
        fp = ""
        if self.known is not None:
            fp = chunk.fingerprint(data)
            ref = self.known.get(fp)
            if ref is not None and ref[0] is not None and ref[1] == len(data) \
                    and backend.has_blob(ref[0], ref[1]):   # else stored (again) below
                return list(ref), -2, fp
        return (*self.put_data(data), fp)

    def put_data(self, data: bytes | memoryview, clock: list[float] | None = None
                 ) -> tuple[list[Any], int]:
        """One chunk's data stored, and nothing else: its ref, and the bytes newly stored (-1:
        the store had it). For add_file's pieces, and for a caller that names chunks itself
        (store/stream.py), from any thread; no file names it until a snapshot does. clock: the
        seconds spent naming, compressing and writing are added to its first three items."""
        length = len(data)
        t0 = time.perf_counter()
        name = chunk.name_of(data)
        t1 = time.perf_counter()
        if clock is not None:
            clock[0] += t1 - t0
        if name == chunk.zero_name(length):
            return [None, length], 0
        backend = self.store.backend
        if backend.has_blob(name, length):   # a damaged one reads as absent: replaced below
            return [name, length], -1
        blob = chunk.encode(data)
        t2 = time.perf_counter()
        stored = -1
        if backend.put_blob(name, blob):
            self.store.created(name)   # until a snapshot names it (Store.discard_unnamed)
            stored = len(blob)
        if clock is not None:
            clock[1] += t2 - t1
            clock[2] += time.perf_counter() - t2
        return [name, length], stored

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any]:
        """fn(*args) on the writer's pool."""
        if self._pool is None:
            raise UsageError("a store writer is used outside its `with` block")
        return self._pool.submit(fn, *args)

    def _count(self, ref: list[Any], stored: int, fp: str) -> tuple[list[Any], str]:
        s = self.stats
        s.chunks += 1
        s.logical += ref[1]
        if stored == -3:
            s.streamed += 1
        elif ref[0] is None:
            s.zero_chunks += 1
        elif stored < 0:
            s.reused_chunks += 1
            s.by_fingerprint += stored == -2
        else:
            s.new_chunks += 1
            s.new_bytes += stored
        return ref, fp

    def add_file(self, relpath: str, src: Path | BinaryIO, pieces: Sequence[int] = (),
                 given: Mapping[int, list[Any]] | None = None,
                 fingerprints: Sequence[list[Any]] = (),
                 host_fingerprints: Sequence[list[Any]] = ()) -> dict[str, Any]:
        """Store one file (a path, or a binary stream read to its end) as relpath, cut at the
        lengths in pieces first (each at most the chunk size), the rest into fixed chunks.
        given: chunk index -> a chunk of the store that those bytes are (not read: a hole
        the agent left, fingerprints.py); fingerprints: [[chunk index, fingerprint], ...],
        recorded with the file; host_fingerprints: the same, for given chunks, of host
        fingerprints torpor computed of their data as it named them (a stream record's:
        fingerprints.pack_arguments; only ever torpor's own), recorded with those the writer
        computes."""
        if any(not 0 < ref[1] <= self.store.chunk_size for ref in (given or {}).values()):
            raise UsageError(f"given chunks of {relpath} must be 1 to "
                             f"{self.store.chunk_size} bytes")
        if self._pool is None:
            raise UsageError("a store writer is used outside its `with` block")
        if any(not 0 < n <= self.store.chunk_size for n in pieces):
            raise UsageError(f"pieces of {relpath} must be 1 to {self.store.chunk_size} bytes")
        try:
            safe_relpath(relpath)
        except CorruptCheckpointError:
            raise UsageError(f"bad file name for the store: {relpath!r}") from None
        if relpath in self.files:
            raise UsageError(f"{relpath} was added twice")
        with contextlib.ExitStack() as stack:
            f = stack.enter_context(open(src, "rb")) if isinstance(src, Path) else src
            mode = _mode(f)
            try:
                done = [self._count(*r) for r in ordered_map(
                    self._pool, self._put, _pieces(f, self.store.chunk_size, pieces, given),
                    2 * self.store.workers, inline=lambda piece: isinstance(piece, list))]
            except OSError as e:
                raise TorporError(f"store {self.store.where}: cannot store {relpath}: "
                                  f"{e.strerror or e}; earlier snapshots are intact") from e
        refs = [ref for ref, _fp in done]
        entry = {"size": sum(r[1] for r in refs), "mode": mode, "chunks": refs}
        if fingerprints:
            entry["fingerprints"] = [list(f) for f in fingerprints]
        mine = {i: fp for i, (_ref, fp) in enumerate(done) if fp}
        for i, fp in host_fingerprints:
            if not (0 <= i < len(refs) and given and i in given and refs[i][0] is not None):
                raise UsageError(f"host fingerprint for chunk {i} of {relpath}, which is no "
                                 "given chunk")
            mine[i] = fp
        if mine:
            entry["host_fingerprints"] = [[i, mine[i]] for i in sorted(mine)]
        self.files[relpath] = entry
        return entry

    def commit(self, name: str, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Name what was added: make the chunks durable, then write the snapshot."""
        self.store.require_new(name)
        backend = self.store.backend
        doc = {"schema": snapshot.SCHEMA, "kind": snapshot.KIND, "name": name,
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"),
               "meta": dict(meta or {}), "files": self.files}
        try:
            backend.sync()
            backend.put_snapshot(name, snapshot.dump(doc))
        except FileExistsError:   # another writer took the name since require_new
            raise UsageError(f"snapshot {name} exists already in store {self.store.where} "
                             "(another checkpoint took the name meanwhile)") from None
        except OSError as e:
            raise TorporError(f"store {self.store.where}: cannot write snapshot {name}: "
                              f"{e.strerror or e}; earlier snapshots are intact") from e
        self.store.named(snapshot.chunk_names(doc))
        return doc
