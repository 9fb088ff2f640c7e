"""The image store's stream (issue 5, item 2): an agent's GPU data straight into the store at a
checkpoint, and straight out of it onto the GPU at a restore, through a bounded ring of shared
memory (agent/PROTOCOL.md, "Streaming").

Saving (Intake): the agent copies each 4 MiB part of its data from its pinned staging buffers
into a free slot of the ring and sends a record (slot, file, offset, length, store length) on a
SOCK_SEQPACKET socket; torpor's pool names, compresses and writes the part as a chunk from a
private copy of the slot (the ring is shared with the agent, which runs inside the program: a
part changed under the pool must not get one name and other bytes), then sends the slot's
number back. Host memory holds at most the ring, however large the program; the data files stay
holes, and no GPU byte is written twice (before, the agent wrote the data files and the pack
read them back). Once the agent has sent every part, torpor makes the chunks durable and writes
the program's stream record (agent_data.STREAMED: the chunk each part is, and the host
fingerprint (XXH3-128) of the data it named, store/fingerprints.py fills holes from it), and
only then commits. The agent releases nothing before the commit, so a torpor that fails or dies
mid-stream costs the program nothing: it runs on from its GPU memory.

Loading (feed): torpor's pool reads each chunk of the program's data from the store into a free
slot (a raw chunk straight from its file, a zstd one decompressed into it), checks it there,
against its sha256 or, for a chunk this host streamed into its own store, against the
fingerprint it recorded then (Source.fp, fingerprints.own_fingerprints), and sends its record;
the agent copies the part onto the GPU and sends the slot back. A chunk of zeros (stored as
nothing: the parts the agent found zero on the GPU, issue 20) goes as a record alone, slot
ZERO: no slot, no bytes, the agent memsets it. Reading, decompressing and copying to the GPU
overlap, and nothing is unpacked into files first.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import mmap
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from .. import agent_data
from ..errors import CorruptCheckpointError, TorporError, describe
from ..files import atomic_write
from . import chunk, fingerprints
from .fingerprints import PART, Streamed
from .store import Store
from .writer import Writer

SLOTS = 64                          # 256 MiB of ring: 4 parts in flight per pool thread at 16
RECORD = struct.Struct("<IIQQQ")    # slot, file, offset, length, store length (mover.c)
SLOT_NO = struct.Struct("<I")
END = 0xFFFFFFFF                    # a record: no more parts; a slot number: commit
ZERO = 0xFFFFFFFE                   # a record's slot (loading): the part is zeros, in no slot


log = logging.getLogger(__name__)


class StreamError(TorporError):
    pass


class Ring:
    """The shared slots (a memfd, mapped here and in the agent) and our end of the socket."""

    def __init__(self, slots: int = SLOTS):
        self.slots = slots
        fd = os.memfd_create("torpor-stream-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, slots * PART)
            self.map = mmap.mmap(fd, slots * PART)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self.sock, self._theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def agent_fds(self) -> list[int]:
        """The ring and the agent's end of the socket, for the command that hands them over."""
        if self._fd is None:
            raise StreamError("the stream was handed over already")
        return [self._fd, self._theirs.fileno()]

    def handed(self) -> None:
        """Drop our copies of what the agent got: its going away is then our EOF."""
        self._theirs.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def slot(self, n: int, length: int) -> memoryview:
        if not 0 <= n < self.slots or not 0 <= length <= PART:
            raise StreamError(f"the agent named slot {n} ({length} bytes) of a ring of "
                              f"{self.slots}")
        return memoryview(self.map)[n * PART:n * PART + length]

    def close(self) -> None:
        self.handed()
        self.sock.close()
        try:
            self.map.close()
        except BufferError:   # a view still held by a thread that failed: the GC frees it
            pass


def _recv(sock: socket.socket, size: int, what: str) -> bytes | None:
    """One message of size bytes; None at EOF."""
    msg = sock.recv(size + 1)
    if not msg:
        return None
    if len(msg) != size:
        raise StreamError(f"the agent sent a {len(msg)}-byte message where {what} "
                          f"({size} bytes) was due")
    return msg


@dataclasses.dataclass
class IntakeStats:
    parts: int = 0
    bytes: int = 0          # of GPU data received
    new_chunks: int = 0
    new_bytes: int = 0      # what they take in the store
    reused_chunks: int = 0
    zero_chunks: int = 0
    seconds: float = 0.0
    # where the time went, summed over the pool's threads (to find what bounds a stream):
    # naming (sha256), compressing, writing (with its fsync), copying the slot and taking its
    # fingerprint (XXH3-128); then, in seconds of wall time, the store's sync and the stream
    # record before the commit
    hash_s: float = 0.0
    compress_s: float = 0.0
    write_s: float = 0.0
    copy_s: float = 0.0
    fingerprint_s: float = 0.0
    publish_s: float = 0.0
    threads: int = 0

    def to_json(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v
                for k, v in dataclasses.asdict(self).items()}


class Intake:
    """One program's GPU data, streamed by its agent during a `prepare ... fp stream`, into
    the store; data_dir: the program's data directory (nfiles data files), where the stream
    record goes.

        intake = Intake(store, data_dir)
        try:
            intake.start()
            agent.prepare(..., stream=intake.agent_fds())
        finally:
            intake.finish()      # raises StreamError if the store did not take it all
    """

    def __init__(self, store: Store, data_dir: Path, nfiles: int, slots: int = SLOTS):
        self.store = store
        self.data_dir = data_dir
        self.nfiles = nfiles
        self.ring = Ring(slots)
        self.parts: list[Streamed] = []
        self.stats = IntakeStats()
        self.committed = False
        self.error: BaseException | None = None
        self._clocks: list[list[float]] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="torpor-intake", daemon=True)
        try:
            for n in range(slots):              # every slot free (fits the socket's buffer)
                self.ring.sock.send(SLOT_NO.pack(n))
        except BaseException:
            self.ring.close()
            raise

    def agent_fds(self) -> list[int]:
        return self.ring.agent_fds()

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> IntakeStats:
        """After the agent's prepare (answered or failed): the intake is over. StreamError
        when it did not commit (the agent then released nothing)."""
        self.ring.handed()
        self._thread.join()
        self.ring.close()
        if not self.committed:
            why = self.error
            raise StreamError("the GPU data did not reach the image store"
                              + (f": {describe(why)}" if why else " (the agent stopped)"))
        return self.stats

    def abandon(self) -> str:
        """The agent's prepare failed, or ours gave up on it: stop the intake (the agent's
        wait ends at once, unless it has the commit already) and say what went wrong in the
        store, if anything did."""
        error = self.error
        if not self.committed:
            self._stop(StreamError("torpor gave up on the prepare"))
        try:
            self.finish()
        except StreamError:
            pass
        return describe(error) if error is not None else ""

    def _run(self) -> None:
        start = time.monotonic()
        try:
            with self.store.writer() as w:
                futures = []
                while (msg := _recv(self.ring.sock, RECORD.size, "a part's record")) is not None:
                    slot, file, offset, length, store_len = RECORD.unpack(msg)
                    if slot == END:
                        break
                    if not (file < agent_data.MAX_FILES and offset % PART == 0
                            and 0 < length <= store_len <= PART):
                        raise StreamError(f"the agent sent a malformed record: {file} "
                                          f"{offset} {length} {store_len}")
                    f = w.submit(self._take, w, slot, file, offset, length, store_len)
                    f.add_done_callback(self._done)
                    futures.append(f)
                else:   # EOF: the agent stopped (its prepare fails and says why)
                    concurrent.futures.wait(futures)
                    return
                concurrent.futures.wait(futures)
                if self.error is not None:
                    return
                t = time.monotonic()
                self.store.backend.sync()
                self._record()
                self.stats.publish_s = time.monotonic() - t
            self.stats.seconds = time.monotonic() - start
            for i, field in enumerate(("hash_s", "compress_s", "write_s", "copy_s",
                                       "fingerprint_s")):
                setattr(self.stats, field, sum(c[i] for c in self._clocks))
            self.stats.threads = len(self._clocks)
            self.ring.sock.send(SLOT_NO.pack(END))   # commit: the agent may release now
            self.committed = True
        except BaseException as e:   # noqa: BLE001 - finish() says it
            self._stop(e)

    def _done(self, f: concurrent.futures.Future[None]) -> None:
        if not f.cancelled() and f.exception() is not None:
            self._stop(f.exception())  # type: ignore[arg-type]

    def _stop(self, e: BaseException) -> None:
        """The first failure stops the stream: the agent's wait ends at once (EOF), and so
        does ours."""
        with self._lock:
            if self.error is None:
                self.error = e
        try:
            self.ring.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _take(self, w: Writer, slot: int, file: int, offset: int, length: int,
              store_len: int) -> None:
        local = self._local
        if not hasattr(local, "clock"):
            local.clock = [0.0, 0.0, 0.0, 0.0, 0.0]
            local.buf = bytearray(PART)   # this thread's private copy of a slot, reused
            with self._lock:
                self._clocks.append(local.clock)
        t0 = time.perf_counter()
        view = self.ring.slot(slot, length)
        data = memoryview(local.buf)[:store_len]
        try:
            # The name, the blob and the fingerprint all come from one private copy: the
            # agent (the program) can write the slot at any time, and a blob stored under a
            # name its bytes do not have would poison every later checkpoint that reuses the
            # name; a fingerprint of other bytes than those named would verify the wrong ones.
            # The store chunk is the part and the hole after it (zeros), as the pack reads it.
            data[:length] = view
            if store_len > length:
                data[length:] = chunk.zeros(store_len - length)
        finally:
            view.release()
        self.ring.sock.send(SLOT_NO.pack(slot))   # copied: the agent may fill it again
        t1 = time.perf_counter()
        ref, stored = w.put_data(data, local.clock)
        t2 = time.perf_counter()
        fp = None if ref[0] is None else chunk.fingerprint(data)
        local.clock[3] += t1 - t0
        local.clock[4] += time.perf_counter() - t2
        with self._lock:
            s = self.stats
            s.parts += 1
            s.bytes += length
            if ref[0] is None:
                s.zero_chunks += 1
            elif stored < 0:
                s.reused_chunks += 1
            else:
                s.new_chunks += 1
                s.new_bytes += stored
            self.parts.append(Streamed(file, offset, length, store_len, ref[0], fp))

    def _record(self) -> None:
        """The stream record, durable, before the commit: without it the holes the parts
        left could not be filled (a rollback) nor packed. The agent runs inside the program,
        so its records are checked first against the data files it sized (it does before
        its end): one a fill or a pack could not read would leave a checkpoint nothing can
        complete, whose recovery would hold gc off for good. Refused, nothing is committed
        and the agent releases nothing."""
        self.parts.sort(key=lambda p: (p.file, p.offset))
        text = fingerprints.dump_streamed(self.parts)
        sizes = [os.path.getsize(self.data_dir / agent_data.file_name(k)) for k in range(self.nfiles)]
        fingerprints.parse_streamed(text, f"the stream of {self.data_dir}", sizes)
        atomic_write(self.data_dir / agent_data.STREAMED, text.encode())


# -- loading ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Source:
    """One part the agent needs: where it goes, and the store chunk it is (the part and the
    hole after it: the agent takes the part's bytes)."""
    file: int
    offset: int
    ref: list[Any]   # [sha256 or None, length]
    fp: str | None = None   # the host fingerprint to verify it by instead of its sha256: only
                            # ever from a record this host wrote (chunk.py)


def data_rels(prog_rel: str, count: int) -> list[str]:
    """The snapshot paths of one program's count data files (prog_rel: torpor-gpu/<pid>)."""
    return [f"{prog_rel}/{agent_data.file_name(k)}" for k in range(count)]


def sources(doc: dict[str, Any], prog_rel: str, count: int,
            trusted: dict[str, str] | None = None) -> list[Source]:
    """The parts of one program's data files (prog_rel: torpor-gpu/<pid> in the snapshot doc,
    count files), from the snapshot's chunks: each data file is cut into PART chunks, and
    every one is a part (mover.c: chunks start at multiples of PART, and a part's store chunk
    runs on to the next), so chunk i of file k is the part at offset i * PART. trusted: chunk
    name -> the host fingerprint to verify it by (fingerprints.own_fingerprints: never the
    doc's own); the others verify by sha256."""
    out = []
    for k in range(count):
        rel = f"{prog_rel}/{agent_data.file_name(k)}"
        entry = doc["files"].get(rel)
        if entry is None:
            raise CorruptCheckpointError(f"snapshot {doc['name']} holds no {rel}")
        at = 0
        for ref in entry["chunks"]:
            if ref[1] > PART or (at % PART and ref[1]):
                raise CorruptCheckpointError(f"snapshot {doc['name']}: {rel} is not cut into "
                                             f"{PART}-byte chunks, so it cannot be streamed")
            out.append(Source(k, at, list(ref), (trusted or {}).get(ref[0] or "")))
            at += ref[1]
    return out


def spread(parts: list[Source], ways: int) -> list[Source]:
    """parts in the order to feed them, ways at a time: in the agent's chunk order (part i of
    each file in turn: mover.c deals its chunks out to the files in turn) cut into `ways`
    stretches, then one part of each stretch in turn. The agent's chunks are sorted by GPU, so
    in plain order every part in flight would be for one GPU at a time; spread, the parts in
    flight come from all over the program's memory, and a program on several GPUs has each of
    them loaded at once (issue 6), as the agent's own movers do from files."""
    ordered = sorted(parts, key=lambda p: (p.offset, p.file))
    step = max(1, -(-len(ordered) // max(1, ways)))    # ceil: stretches of step parts
    stretches = [ordered[b:b + step] for b in range(0, len(ordered), step)]
    return [s[i] for i in range(step) for s in stretches if i < len(s)]


@dataclasses.dataclass
class FeedStats:
    bytes: int = 0              # sent (zeros not counted)
    by_fingerprint: int = 0     # chunks verified by the host fingerprint recorded here
    by_sha256: int = 0          # chunks verified by their sha256 name
    zero_chunks: int = 0        # sent as a record alone


def feed(store: Store, ring: Ring, parts: Iterable[Source], where: str,
         stats: FeedStats | None = None) -> int:
    """Send every part to the agent through the ring (its `resume stream` runs meanwhile), each
    chunk read from the store straight into a free slot and verified there, by its sha256 or
    by its Source.fp (zeros: a record alone); then EOF. Returns, with the bytes sent (zeros
    not counted), once the agent has closed its end (its resume is over); a caller that gives
    up on the agent shuts ring.sock down to end it sooner. stats: filled in as it goes.
    StreamError or CorruptCheckpointError on failure (the agent's resume then fails: its gate
    stays closed, nothing lost)."""
    free: list[int] = []
    cond = threading.Condition()
    closed = [False]

    def slots_back() -> None:            # the agent's freed slots, as they come
        try:
            while (msg := _recv(ring.sock, SLOT_NO.size, "a slot number")) is not None:
                with cond:
                    free.append(SLOT_NO.unpack(msg)[0])
                    cond.notify()
        except (OSError, StreamError):
            pass
        with cond:
            closed[0] = True
            cond.notify_all()

    def take_slot() -> int:
        with cond:
            while not free and not closed[0]:
                cond.wait()
            if not free or closed[0]:
                raise StreamError("the agent stopped taking GPU data")
            return free.pop()

    clocks: list[list[float]] = []       # per thread: waiting for a slot, reading into it
    local = threading.local()

    def send(part: Source) -> int:
        if not hasattr(local, "clock"):
            local.clock = [0.0, 0.0, 0, 0]   # ..., chunks checked by fingerprint, by sha256
            clocks.append(local.clock)    # list.append: atomic
        if part.ref[0] is None:           # zeros: a record alone (the agent memsets them)
            try:
                ring.sock.send(RECORD.pack(ZERO, part.file, part.offset, part.ref[1],
                                           part.ref[1]))
            except (BrokenPipeError, ConnectionResetError):
                raise StreamError("the agent stopped taking GPU data") from None
            return 0
        t0 = time.perf_counter()
        n = take_slot()
        t1 = time.perf_counter()
        length = part.ref[1]
        view = ring.slot(n, length)
        try:
            by_fp = store.read_chunk_into(part.ref, view, where, part.fp)
        finally:
            view.release()
        local.clock[2 if by_fp else 3] += 1
        try:
            ring.sock.send(RECORD.pack(n, part.file, part.offset, length, length))
        except (BrokenPipeError, ConnectionResetError):
            raise StreamError("the agent stopped taking GPU data") from None
        local.clock[0] += t1 - t0
        local.clock[1] += time.perf_counter() - t1
        return length

    with cond:
        free.extend(range(ring.slots))
    back = threading.Thread(target=slots_back, name="torpor-feed", daemon=True)
    back.start()
    total = 0
    zeros = [0]
    start = time.perf_counter()
    try:
        with store.backend.lock(False, store.lock_timeout), \
                concurrent.futures.ThreadPoolExecutor(store.workers, "torpor-feed") as pool:
            todo = [p for p in parts if p.ref[1]]
            zeros = [sum(p.ref[0] is None for p in todo)]
            futures = [pool.submit(send, p) for p in spread(todo, store.workers)]
            try:
                for f in futures:
                    total += f.result()
            except BaseException:
                for f in futures:            # the first failure stops the rest at once
                    f.cancel()
                with cond:
                    closed[0] = True
                    cond.notify_all()
                raise
    finally:
        try:
            ring.sock.shutdown(socket.SHUT_WR)   # EOF: every part sent (or none will be)
        except OSError:
            pass
    back.join()   # no thread left reading a socket that its caller closes next
    st = stats if stats is not None else FeedStats()
    st.bytes = total
    st.by_fingerprint = sum(int(c[2]) for c in clocks)
    st.by_sha256 = sum(int(c[3]) for c in clocks)
    st.zero_chunks = zeros[0]
    # where a stream's time goes (what bounds it), as the store logs its unpacks
    log.info("fed %d bytes of %s in %.2f s by %d threads; thread-seconds: waiting for a slot "
             "%.2f, reading and verifying %.2f; chunks verified by the fingerprint this host "
             "recorded %d, by sha256 %d, zeros %d", total, where, time.perf_counter() - start,
             len(clocks), sum(c[0] for c in clocks), sum(c[1] for c in clocks),
             st.by_fingerprint, st.by_sha256, st.zero_chunks)
    return total
