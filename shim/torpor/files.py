"""Private files and atomic writes: checkpoints hold process memory, secrets included."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .errors import UsageError

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
