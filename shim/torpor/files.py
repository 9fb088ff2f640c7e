"""Private files and atomic writes: checkpoints hold process memory, secrets included."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from .errors import CorruptCheckpointError, UsageError

TRUSTED_UIDS = {0, os.geteuid()}


def private_dir(path: Path) -> Path:
    """Create path (and parents) as 0700; tighten an existing one we own."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_mode & 0o077 and st.st_uid == os.geteuid():
        os.chmod(path, 0o700)
    return path


def _writable_by_others(st: os.stat_result) -> bool:
    """Can anyone but a trusted uid add, remove or rename entries (or write the file)?"""
    if st.st_uid not in TRUSTED_UIDS:
        return True
    open_to_others = st.st_mode & 0o022
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    return bool(open_to_others) and not sticky_dir


def require_trusted_location(path: Path, what: str) -> None:
    """Refuse a checkpoint location that someone other than root (or us) could swap.

    torpor runs as root and a checkpoint holds process memory; CRIU restores credentials from
    images. A directory whose parent another user can write could be replaced by a symlink
    mid-operation (root would then write or delete elsewhere), and images another user can
    write could make root restore anything. So every directory from / down to path must be
    changeable by trusted uids only (sticky ones like /tmp are fine), as sshd's StrictModes.
    """
    real = Path(os.path.realpath(path))
    for component in [*reversed(real.parents), real]:
        try:
            st = os.lstat(component)
        except FileNotFoundError:
            return  # the rest does not exist yet: we create it, 0700
        if _writable_by_others(st):
            raise UsageError(f"{what} {path}: {component} can be changed by uid {st.st_uid} "
                             f"(mode {stat.S_IMODE(st.st_mode):o}); checkpoints hold process "
                             "memory: use a directory only root can change")


def require_trusted_file(path: Path) -> str | None:
    """Why path (an image file) could have been written by someone else, or None."""
    st = os.lstat(path)
    if _writable_by_others(st):
        return f"{path.name} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}"
    return None


def _open_in(directory: Path, rel: str) -> int:
    """fd of rel inside directory, read-only, never through a link below directory."""
    parts = rel.split("/")
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=dfd)
            os.close(dfd)
            dfd = nfd
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                       dir_fd=dfd)
    finally:
        os.close(dfd)


def open_untrusted(directory: Path, rel: str) -> tuple[int, os.stat_result]:
    """Open rel (a file torpor reads from a checkpoint directory) safely: no link followed
    below directory (openat from its fd, O_NOFOLLOW), no blocking open (O_NONBLOCK: a FIFO
    cannot hang torpor), a regular file only (fstat after the open). Returns (fd, its stat).
    FileNotFoundError when it is not there; CorruptCheckpointError (exit 9) for anything else
    that is wrong."""
    where = f"{directory}/{rel}"
    try:
        fd = _open_in(directory, rel)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CorruptCheckpointError(f"{where} is a symbolic link or lies under one: "
                                         "refused") from None
        raise CorruptCheckpointError(f"cannot read {where}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{where} is not a regular file: refused")
    return fd, st


def read_untrusted(directory: Path, rel: str, cap: int) -> bytes:
    """The whole of rel in directory (open_untrusted), refused past cap bytes."""
    fd, st = open_untrusted(directory, rel)
    try:
        if st.st_size > cap:
            raise CorruptCheckpointError(f"{directory}/{rel} is implausibly large "
                                         f"({st.st_size} bytes, at most {cap} expected)")
        chunks, left = [], cap + 1
        while left > 0:
            block = os.read(fd, min(left, 1 << 20))
            if not block:
                break
            chunks.append(block)
            left -= len(block)
        data = b"".join(chunks)
    except OSError as e:
        raise CorruptCheckpointError(f"cannot read {directory}/{rel}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > cap:
        raise CorruptCheckpointError(f"{directory}/{rel} grew past {cap} bytes while read")
    return data


def read_untrusted_tail(directory: Path, rel: str, n: int) -> bytes:
    """The last n bytes of rel in directory (open_untrusted)."""
    fd, st = open_untrusted(directory, rel)
    try:
        return os.pread(fd, n, max(0, st.st_size - n))
    finally:
        os.close(fd)


def printable(text: object, limit: int = 200) -> str:
    """text (from a checkpoint, untrusted) fit for a terminal: control characters and
    escapes become '?', at most limit characters. Every printer of checkpoint strings uses it."""
    s = str(text)
    out = "".join(c if c.isprintable() else "?" for c in s[:limit])
    return out + ("..." if len(s) > limit else "")


def write_new(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write data into a file that must not exist yet (O_EXCL refuses anything planted) and
    fsync it; nothing is left behind if that fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    """Make the names in a directory (a rename, a new link) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o600, tmp_dir: Path | None = None) -> None:
    """Write to a temporary name, fsync, rename, fsync the directory. The temporary file is in
    path's directory, or in tmp_dir (same filesystem) where leftovers are collected."""
    tmp = (tmp_dir or path.parent) / f".{path.name}.tmp.{os.getpid()}"
    tmp.unlink(missing_ok=True)  # a leftover of ours
    write_new(tmp, data, mode)
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json(path: Path, obj: object) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def tree_size(path: Path) -> int:
    total = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
            except FileNotFoundError:
                pass
    return total
