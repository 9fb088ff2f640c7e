"""Where the store keeps its bytes: blobs (chunks) and snapshots (manifests), by name.

`Backend` is the whole contract a store needs, so a shared-filesystem or S3-compatible backend
can implement it: blobs by name (has, a cheap look at whether what is there can be the chunk /
put, atomic, never overwriting a sound blob but replacing a damaged one / read / delete / list
with size and link count), snapshots by name (put, atomic / get / delete / list), a lock that
keeps gc away from writers, and the removal of temporary leftovers. Names reaching a backend
are already checked by the store (chunk.NAME, SNAPSHOT_NAME); backends check them again where
a bad one would escape their root.

`LocalBackend(root)` lays a store out on one filesystem:

    <root>/chunks/<2 hex>/<64 hex>   blobs (chunk.py's format), 0600
    <root>/snapshots/<name>.json     snapshots, 0600
    <root>/tmp/                      temporary files, renamed into place (same filesystem)
    <root>/lock                      flock: writers shared, gc exclusive

Directories are 0700: a store holds process memory.

A chunk is reused by its name, so whatever holds a name is checked before it is taken as
stored (`has_blob`, chunk.check_stored: its type, header and size): a truncated chunk, or a
link, FIFO or directory in its place, reads as absent, and `put_blob` renames the fresh blob
over it (a directory is first moved aside into tmp/). Every path that reuses a chunk by name
asks `has_blob` (the writer and the stream's put_data, host fingerprints, given chunks, import,
a registry's chunk fetch, the agents' known fingerprints); a reader, under the shared lock as
the writer, opens the damaged file or the new one, never half of one.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import time
from pathlib import Path
from typing import Iterator

from ..errors import BusyError, TorporError, UsageError
from ..files import (fsync_dir, private_dir, read_untrusted, require_trusted_location,
                     write_new)
from ..layout import MAX_PACKED
from . import chunk

BLOB_NAME = re.compile(r"[0-9a-f]{64}")
SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SNAPSHOT_SUFFIX = ".json"

log = logging.getLogger(__name__)


def check_snapshot_name(name: str) -> str:
    """A snapshot name is a plain file name: letters, digits, '.', '_', '-'; 128 at most."""
    if not isinstance(name, str) or not SNAPSHOT_NAME.fullmatch(name):
        raise UsageError(f"bad snapshot name {name!r}: use letters, digits, '.', '_' and '-' "
                         "(128 at most, starting with a letter or digit)")
    return name


@dataclasses.dataclass(frozen=True)
class BlobInfo:
    name: str
    size: int    # bytes the blob takes (compressed)
    links: int   # > 1: a checkpoint directory holds a hard link to it (gc keeps it); the
                 # store's own temporary files never count


class Backend(abc.ABC):
    """Blobs and snapshots by name; see the module docstring."""

    @abc.abstractmethod
    def __str__(self) -> str:
        """Where the store is (a directory, a bucket), for messages."""

    @abc.abstractmethod
    def has_blob(self, name: str, length: int | None = None) -> bool:
        """Whether a blob that can be chunk name (of length bytes, when given) is there, as
        far as a cheap look tells (no hash: chunk.check_stored); one that cannot reads as
        absent, and put_blob replaces it. Ask this before reusing a chunk by its name."""

    @abc.abstractmethod
    def put_blob(self, name: str, data: bytes) -> bool:
        """Store data under name atomically (readers see all of it or nothing, also after a
        crash); False, writing nothing, when a sound blob (has_blob) is there already. A
        damaged one is replaced, atomically too, and logged."""

    @abc.abstractmethod
    def read_blob(self, name: str) -> bytes:
        """The blob's bytes; FileNotFoundError when it is not there, CorruptCheckpointError
        when what is there is no blob (a link, a directory)."""

    @abc.abstractmethod
    def delete_blob(self, name: str) -> None: ...

    @abc.abstractmethod
    def blobs(self) -> Iterator[BlobInfo]: ...

    def blob_info(self, name: str) -> BlobInfo | None:
        """One blob as blobs() lists it; None when it is not there."""
        return next((b for b in self.blobs() if b.name == name), None)

    def blob_path(self, name: str) -> Path | None:
        """A local file holding the blob, to hard-link it; None where there is none."""
        return None

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every blob put so far durable: called before a snapshot names them."""

    @abc.abstractmethod
    def put_snapshot(self, name: str, data: bytes) -> None:
        """Store a new snapshot atomically and durably; FileExistsError, writing nothing, when
        one by that name is there (never replaced: two writers may race for a name)."""

    @abc.abstractmethod
    def get_snapshot(self, name: str) -> bytes:
        """The snapshot's bytes; FileNotFoundError when there is none by that name."""

    @abc.abstractmethod
    def delete_snapshot(self, name: str) -> None:
        """Remove a snapshot; FileNotFoundError when there is none by that name."""

    @abc.abstractmethod
    def snapshots(self) -> list[str]: ...

    @abc.abstractmethod
    def lock(self, exclusive: bool, timeout: float) -> contextlib.AbstractContextManager[None]:
        """Held shared by writers (from their first chunk to commit or abort) and exclusive by
        gc; BusyError after timeout seconds."""

    @abc.abstractmethod
    def clean_temp(self, remove: bool) -> int:
        """Temporary leftovers of writers that died (called under the exclusive lock): the
        bytes they take, removed when remove is true."""


class LocalBackend(Backend):
    """A store in a local (or shared POSIX) directory; see the module docstring."""

    def __init__(self, root: Path):
        require_trusted_location(root, "store")
        self.root = private_dir(root)
        self.chunks = private_dir(root / "chunks")
        self.snaps = private_dir(root / "snapshots")
        self.tmp = private_dir(root / "tmp")
        self._dirty: set[Path] = set()   # chunk directories that gained names since sync()

    def __str__(self) -> str:
        return str(self.root)

    def _blob(self, name: str) -> Path:
        if not BLOB_NAME.fullmatch(name):
            raise UsageError(f"bad chunk name {name!r}")
        return self.chunks / name[:2] / name

    def _snap(self, name: str) -> Path:
        return self.snaps / (check_snapshot_name(name) + SNAPSHOT_SUFFIX)

    def has_blob(self, name: str, length: int | None = None) -> bool:
        try:
            return chunk.check_stored(self._blob(name), length) is None
        except FileNotFoundError:
            return False

    def put_blob(self, name: str, data: bytes) -> bool:
        final = self._blob(name)
        length = chunk.HEADER.unpack_from(data)[2]
        if self.has_blob(name, length):
            return False
        tmp = self.tmp / f"{name[:16]}.{os.getpid()}.{time.monotonic_ns()}"
        write_new(tmp, data)  # fsynced: a crash never leaves a named blob with missing data
        try:
            final.parent.mkdir(mode=0o700, exist_ok=True)
            try:
                os.link(tmp, final)  # link, not rename: never replaces a blob another writer put
            except FileExistsError:
                if not self._replace(final, tmp, length):
                    return False
        finally:
            tmp.unlink(missing_ok=True)   # renamed over a damaged blob: gone already
        self._dirty.add(final.parent)
        return True

    def _replace(self, final: Path, tmp: Path, length: int) -> bool:
        """The new blob tmp over what holds final's name, if that is damaged (checked again:
        another writer may have put the chunk meanwhile; then False). One rename, so a
        reader opens the damaged file or tmp's, whole; a directory is moved aside first."""
        try:
            why = chunk.check_stored(final, length)
        except FileNotFoundError:
            why = ""   # removed since the link failed: nothing to replace, just put it there
        if why is None:
            return False
        if stat.S_ISDIR(_lstat_mode(final)):   # rename cannot replace one with a file
            aside = self.tmp / f"{final.name[:16]}.{os.getpid()}.{time.monotonic_ns()}.dir"
            try:
                os.rename(final, aside)
                shutil.rmtree(aside, ignore_errors=True)   # else clean_temp does
            except FileNotFoundError:
                pass   # another writer moved it aside first: the name is free for ours
        os.rename(tmp, final)
        if why:
            log.warning("chunk %s in store %s was damaged (%s): replaced by the data being "
                        "stored", final.name, self.root, why)
        return True

    def read_blob(self, name: str) -> bytes:
        # never through a link, never blocking on a FIFO, never more than a blob can hold (a
        # link to /dev/zero was read until memory ran out); CorruptCheckpointError otherwise
        return chunk.read_blob_file(self._blob(name), f"store {self.root}")

    def delete_blob(self, name: str) -> None:
        self._blob(name).unlink()

    def blob_info(self, name: str) -> BlobInfo | None:
        try:
            st = os.lstat(self._blob(name))
        except FileNotFoundError:
            return None
        in_tmp = sum(1 for e in os.scandir(self.tmp)   # as blobs() counts links
                     if (t := _stat(e)) is not None and t.st_ino == st.st_ino
                     and t.st_dev == st.st_dev)
        return BlobInfo(name, st.st_size, st.st_nlink - in_tmp)

    def blobs(self) -> Iterator[BlobInfo]:
        # a writer killed between put_blob's link and unlink leaves its temporary file as a
        # second link to the blob: that link is not a checkpoint directory's and must not keep
        # the blob from gc
        # Writers may run meanwhile (ls holds no lock): an entry gone between the listing and
        # its stat (a writer's temporary file renamed or removed, a blob gc took) is skipped.
        in_tmp: dict[tuple[int, int], int] = {}
        for e in os.scandir(self.tmp):
            if (st := _stat(e)) is not None:
                in_tmp[st.st_dev, st.st_ino] = in_tmp.get((st.st_dev, st.st_ino), 0) + 1
        for sub in sorted(os.scandir(self.chunks), key=lambda e: e.name):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(sub.path):
                if BLOB_NAME.fullmatch(e.name) and e.name[:2] == sub.name \
                        and (st := _stat(e)) is not None:
                    links = st.st_nlink - in_tmp.get((st.st_dev, st.st_ino), 0)
                    yield BlobInfo(e.name, st.st_size, links)

    def blob_path(self, name: str) -> Path | None:
        return self._blob(name)

    def sync(self) -> None:
        dirs, self._dirty = self._dirty, set()
        for d in sorted(dirs | {self.chunks}):
            fsync_dir(d)

    def put_snapshot(self, name: str, data: bytes) -> None:
        final = self._snap(name)
        tmp = self.tmp / f".{final.name}.{os.getpid()}.{time.monotonic_ns()}"
        write_new(tmp, data)
        try:
            os.link(tmp, final)  # link, not rename: never replaces another writer's snapshot
        finally:
            tmp.unlink()
        fsync_dir(self.snaps)

    def get_snapshot(self, name: str) -> bytes:
        path = self._snap(name)   # no link, no FIFO, no file past the cap (files.read_untrusted)
        return read_untrusted(path.parent, path.name, MAX_PACKED)

    def delete_snapshot(self, name: str) -> None:
        self._snap(name).unlink()
        fsync_dir(self.snaps)

    def snapshots(self) -> list[str]:
        return sorted(n[:-len(SNAPSHOT_SUFFIX)] for n in os.listdir(self.snaps)
                      if n.endswith(SNAPSHOT_SUFFIX)
                      and SNAPSHOT_NAME.fullmatch(n[:-len(SNAPSHOT_SUFFIX)]))

    @contextlib.contextmanager
    def lock(self, exclusive: bool, timeout: float) -> Iterator[None]:
        path = self.root / "lock"
        try:   # never through a link, never a FIFO's open: the one file every command opens
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o600)
        except OSError as e:   # ELOOP: a link; EISDIR: a directory
            raise TorporError(f"store {self.root}: cannot open its lock file {path}: "
                              f"{e.strerror}", hint=f"remove {path}: it is made again") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise TorporError(f"store {self.root}: its lock file {path} is not a regular "
                                  "file", hint=f"remove {path}: it is made again")
            _flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, timeout,
                   f"store {self.root}")
            yield
        finally:
            os.close(fd)  # drops the lock; the kernel drops it too when a holder dies

    def clean_temp(self, remove: bool) -> int:
        freed = 0
        for e in os.scandir(self.tmp):
            freed += e.stat(follow_symlinks=False).st_size
            if remove and e.is_dir(follow_symlinks=False):   # a damaged chunk moved aside
                shutil.rmtree(e.path, ignore_errors=True)
            elif remove:
                os.unlink(e.path)
        return freed


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0


def _stat(e: os.DirEntry[str]) -> os.stat_result | None:
    try:
        return e.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None


def _flock(fd: int, how: int, timeout: float, what: str) -> None:
    """flock, retried until timeout: a plain blocking flock could not be given up on."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        if time.monotonic() >= deadline:
            busy = "being written or read" if how == fcntl.LOCK_EX else "being collected (gc)"
            raise BusyError(f"{what} is {busy}; gave up after {timeout:g} s")
        time.sleep(0.05)

