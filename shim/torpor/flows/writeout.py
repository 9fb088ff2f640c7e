"""Short pauses: a --leave-running checkpoint stages its agents' GPU data in host memory and
writes it into the checkpoint directory once the program runs again.

    staging()   where the agents put their data: a private directory under suspend_dir (host
                memory, as a suspend's), when it fits there (MemAvailable, and the room left on
                suspend_dir's filesystem); None (and one line why) when it does not, or when
                config leave_running_staging is off: the data then goes straight into the
                checkpoint directory while the program waits, as before
    begin()     the directory marked WRITING before the dump: until write_out() ends, it is no
                checkpoint (no torpor.json; a recovery marks it damaged instead of sealing it)
    write_out() after the agents' resume (the program runs again): every staged file copied
                into <images dir>/torpor-gpu/<pid>/ (0700 dirs, 0600 files, holes kept,
                fsynced, and CRIU's images with them), at most config writeout_rate_mbps;
                the staged files are unlinked first (held open), so that nothing of them
                stays in host memory should torpor die, and each range is punched out of
                them once written (the staging shrinks as the write-out goes); then the
                mark goes and the caller seals
    abandon()   a write-out that failed (a full disk, Ctrl-C): the directory emptied but for
                CRIU's log and marked damaged (torpor-damaged.txt), never taken for a
                checkpoint; the caller's program runs on

The driver path (a program without the agent) cannot do this: its GPU data comes out through
CRIU's dump of the driver's host copy, which CRIU writes while the program is frozen.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import os
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from .. import agent_data, manifest, procs
from ..agent import AgentClient
from ..engine import Engine, STATUS_TIMEOUT_S
from ..errors import ExitCode, RolledBackError, TorporError, describe
from ..files import TRUSTED_UIDS, fsync_dir
from ..layout import INDEX, WRITING
from ..progress import human_bytes, human_rate

HEADROOM = 256 << 20          # host memory left free beside the staged data
COPY_CHUNK = 64 << 20         # one sendfile
SYNC_EVERY = 1 << 30          # written back (and dropped from the page cache) every GiB a file
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


# -- where the agents' data goes -----------------------------------------------------------------

def staged_need(engine: Engine, pids: list[int], nvml: int, agent_dir: Path | None = None
                ) -> tuple[dict[int, Path], int]:
    """The agents of pids (pid -> socket; agent_dir: a container's, see engine.agent_sockets)
    and the host memory staging their data takes: the larger of NVML's figure (nvml) and
    what the agents say they can move."""
    sockets = engine.agent_sockets(pids, agent_dir)
    movable = 0
    for pid, path in sockets.items():
        try:
            with AgentClient(path, procs.owner_uid(pid), STATUS_TIMEOUT_S, expect_pid=pid) as a:
                movable += int(a.status().get("movable_bytes", 0) or 0)
        except (TorporError, OSError, ValueError):
            pass   # the prepare's own probe says what is wrong with it
    return sockets, max(nvml, movable)


def room(suspend_dir: Path, tmpfs: bool) -> tuple[int, str]:
    """(bytes, what bounds them) host memory and suspend_dir's filesystem have room for."""
    avail = procs.mem_available()
    best = (max(0, avail - HEADROOM), "MemAvailable") if avail is not None else None
    where = Path(os.path.abspath(suspend_dir))
    # another user's entry there is taken back before use (agent_data.claim_suspend_dir):
    # as good as missing, and never looked into
    ours = _trusted_entry(where)
    fresh = tmpfs and os.geteuid() == 0 and not agent_data._private_mount_namespace() \
        and not os.path.ismount(where) and not (ours and where.is_dir() and any(where.iterdir()))
    if not fresh:   # a huge-page tmpfs mounted there gets all of memory (agent_data.py)
        probe = where if ours else where.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        if best is None or free < best[0]:
            best = (free, f"free space in {probe}")
    return best if best is not None else (0, "unknown memory")


def _trusted_entry(path: Path) -> bool:
    """Is path there, and root's or ours (not another user's)?"""
    try:
        return os.lstat(path).st_uid in TRUSTED_UIDS
    except OSError:
        return False


def staging(engine: Engine, pids: list[int], nvml: int, agent_dir: Path | None = None
            ) -> agent_data.DataDir | None:
    """A private directory under suspend_dir for the agents' data of a --leave-running
    checkpoint of pids (their agents' sockets in agent_dir, a container's), or None (said
    why) when it goes straight into the images."""
    cfg, say = engine.cfg, engine.progress.say
    if not pids:
        return None
    sockets, need = staged_need(engine, pids, nvml, agent_dir)
    if not sockets:
        how = "a GPU container has it unless annotated org.torpor.agent=off" \
            if agent_dir is not None else "'torpor run -- CMD' starts a program under it"
        say("the driver path pauses the program for the whole dump (its GPU memory comes out "
            "through CRIU's dump of the driver's host copy); under the agent "
            f"({how}) it is paused only while its GPU memory is copied to host memory")
        return None
    if not cfg.leave_running_staging:
        return None
    have, bound = room(cfg.suspend_dir, cfg.suspend_tmpfs)
    if need > have:
        say(f"staging the GPU data in host memory needs {human_bytes(need)}, {bound} leaves "
            f"{human_bytes(have)}: the program stays paused while it is written to the "
            "checkpoint directory")
        return None
    return agent_data.DataDir.scratch(cfg, min(sockets))


def begin(images_dir: Path) -> None:
    """The directory is no checkpoint until write_out() ends (a recovery marks it damaged)."""
    fd = os.open(images_dir / WRITING, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, b"the GPU data of this --leave-running checkpoint is being written out\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(images_dir)


# -- the write-out ---------------------------------------------------------------------------

class Throttle:
    """At most rate bytes/s over every thread together (0: no limit)."""

    def __init__(self, rate: float):
        self.rate, self.done, self.start = rate, 0, time.monotonic()
        # a tenth of a second's worth at a time: the limit holds from the first bytes on
        self.chunk = COPY_CHUNK if rate <= 0 else int(min(COPY_CHUNK, max(64 << 10, rate / 10)))
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """n more bytes written (by any thread): wait until the rate allows them."""
        with self._lock:
            self.done += n
            due = self.start + self.done / self.rate if self.rate > 0 else 0.0
        time.sleep(max(0.0, due - time.monotonic()))


@contextlib.contextmanager
def _opened(stage: agent_data.DataDir, pids: list[int], counts: Mapping[int, int]
            ) -> Iterator[list[tuple[int, str, int]]]:
    """(pid, name, fd read-write) of every staged file; the staged directory is removed as
    soon as they are open (their memory goes with the last fd: torpor dead or done, or as the
    write-out punches it out)."""
    out: list[tuple[int, str, int]] = []
    try:
        for pid in pids:
            fds = stage.for_fill(pid, counts[pid])
            out += [(pid, agent_data.file_name(k), fd) for k, fd in enumerate(fds)]
            d = os.open(stage.path(pid), _DIR)
            try:
                fd = os.open(INDEX, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise TorporError(f"{stage.path(pid)}/{INDEX} is not a regular file")
                out.append((pid, INDEX, fd))
            except FileNotFoundError:
                pass
            finally:
                os.close(d)
        stage.remove()
        yield out
    finally:
        for _pid, _name, fd in out:
            os.close(fd)


_FALLOC_PUNCH = 0x01 | 0x02   # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _release(fd: int, off: int, length: int) -> None:
    """Give the host memory of a staged range back (a hole punched in the tmpfs file) once it
    is written out: the staging shrinks as the write-out goes. Best effort."""
    _libc.fallocate(fd, _FALLOC_PUNCH, off, length)


def _copy(src: int, dst: int, throttle: Throttle, release: bool = False) -> int:
    """src's data (its holes stay holes) into dst at the same offsets; fsynced. Bytes copied.
    release: each range of src (open read-write) is punched out once copied."""
    size = os.fstat(src).st_size
    copied = synced = 0
    off = 0
    while off < size:
        try:
            off = os.lseek(src, off, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:   # only a hole is left
                break
            raise
        end = os.lseek(src, off, os.SEEK_HOLE)
        while off < end:
            os.lseek(dst, off, os.SEEK_SET)
            n = os.sendfile(dst, src, off, min(throttle.chunk, end - off))
            if n <= 0:
                raise OSError(f"the staged GPU data ended at {off} of {size} bytes")
            if release:
                _release(src, off, n)
            off += n
            copied += n
            throttle.take(n)
            if copied - synced >= SYNC_EVERY:   # bounded dirty pages, and none kept cached
                os.fdatasync(dst)
                os.posix_fadvise(dst, 0, off, os.POSIX_FADV_DONTNEED)
                synced = copied
    os.ftruncate(dst, size)
    os.fsync(dst)
    os.posix_fadvise(dst, 0, 0, os.POSIX_FADV_DONTNEED)
    return copied


def write_out(engine: Engine, stage: agent_data.DataDir, images_dir: Path,
              moved: Mapping[int, Mapping[str, Any]]) -> int:
    """Every staged file of the programs in moved into <images dir>/torpor-gpu/<pid>/, fsynced,
    then the WRITING mark removed. Raises (OSError, TorporError, KeyboardInterrupt) with the
    directory as the failure left it: the caller abandon()s it. Returns the bytes written."""
    pids = sorted(moved)
    counts = {p: len(moved[p]["files"]) for p in pids}
    total = sum(int(n) for p in pids for n in moved[p]["files"])
    rate = engine.cfg.writeout_rate_mbps * 1e6
    dest = images_dir / agent_data.DATA_DIR
    start = time.monotonic()
    throttle = Throttle(rate)
    with engine.progress.phase("writeout", f"{human_bytes(total)} of GPU data staged in host "
                               f"memory to {dest} while the program runs"
                               + (f" (at most {engine.cfg.writeout_rate_mbps:g} MB/s)"
                                  if rate else ""), measure=lambda: throttle.done), \
            _opened(stage, pids, counts) as staged:
        os.mkdir(dest, 0o700)
        for pid in pids:
            os.mkdir(dest / str(pid), 0o700)

        def one(item: tuple[int, str, int]) -> int:
            pid, name, src = item
            fd = os.open(dest / str(pid) / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                         | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                return _copy(src, fd, throttle, release=True)
            finally:
                os.close(fd)
        workers = max(1, min(16, os.cpu_count() or 2, len(staged)))
        with concurrent.futures.ThreadPoolExecutor(workers, "torpor-writeout") as pool:
            written = sum(pool.map(one, staged))
        for pid in pids:
            fsync_dir(dest / str(pid))
        fsync_dir(dest)
        _sync_images(images_dir)
    os.unlink(images_dir / WRITING)
    fsync_dir(images_dir)
    engine.progress.say(f"  writeout: {human_bytes(written)} in {time.monotonic() - start:.2f} s "
                        f"({human_rate(written, time.monotonic() - start)})")
    return written


def _sync_images(images_dir: Path) -> None:
    """CRIU's images (the regular files directly in images_dir) fsynced too: the checkpoint is
    durable, not only its GPU data, once the write-out ends."""
    d = os.open(images_dir, _DIR)
    try:
        for name in os.listdir(d):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                             dir_fd=d)
            except OSError:
                continue   # a link, or gone
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        os.close(d)


def abandon(images_dir: Path, error: BaseException) -> str:
    """A write-out that failed: the directory emptied (its space back) but for CRIU's log and
    marked damaged; returns why, as the mark says it."""
    why = (f"incomplete: writing out the GPU data of this --leave-running checkpoint failed "
           f"({describe(error)}); the program ran on")
    with contextlib.suppress(OSError):
        manifest.clear_partial(images_dir, keep=(WRITING,))
    with contextlib.suppress(OSError):
        manifest.mark_damaged(images_dir, why)
        os.unlink(images_dir / WRITING)
    return why


def failed(error: BaseException, stage: agent_data.DataDir, images_dir: Path, op: Any,
           what: str = "the program", prefix: str = "", advice: str = "") -> RolledBackError:
    """A write-out that raised `error`: nothing staged, images_dir abandoned (marked
    damaged), the operation closed; the error to raise (exit 8, as a rolled-back checkpoint;
    what: who runs on)."""
    stage.remove()
    why = abandon(images_dir, error)
    op.close()
    return RolledBackError(
        f"{prefix}writeout failed: {describe(error)}; {what} runs on (it was resumed before its "
        f"GPU data was written out), and {images_dir} is no checkpoint ({why.split(':')[0]}, "
        f"marked damaged){advice}",
        exit_code=ExitCode.INTERRUPTED if isinstance(error, KeyboardInterrupt) else None)


def abandoned_by_dead(images_dir: Path) -> bool:
    """Recovery: a write-out whose torpor died left images_dir (marked WRITING): abandon it
    (never sealed: its GPU data is not all there). False when it is no such directory."""
    if not os.path.lexists(images_dir / WRITING):
        return False
    abandon(images_dir, TorporError("torpor died before it was written out"))
    return True
