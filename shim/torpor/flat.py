"""The flat layout of a runtime's image directory: torpor's subdirectory trees as plain files.

containerd 2.x's CRI CheckpointContainer copies the runtime's image directory into the
kubelet's archive as if every tar entry were a plain file (writeCriuCheckpointData: one
os.Create per entry, any name holding ".." refused), so a subdirectory there fails the
checkpoint after the dump. torpor's image directory has two trees:

    torpor-gpu/<pid>/gpu-memory-<k>.bin, gpu-fingerprints.txt   (agent_data.py)
    torpor-chunks/<sha256>                                      (store/images.py)

At the end of torpor-runtime's checkpoint (flatten) every file of them becomes a file of the
image directory itself, its path's parts joined by SEP:

    torpor-gpu/123/gpu-memory-0.bin  <->  torpor-gpu+123+gpu-memory-0.bin

by rename (a chunk stays a hard link into the store: nothing is copied). At the start of
torpor-runtime's restore (unflatten) the names go back; readers that must not write (inspect,
verify, archive verification) map names through decode / locate instead. torpor.json's file
table always names the tree paths.

Every name read back is untrusted: it decodes only when its first part is one of TREES and
every part is a plain name of PART characters (so no '..', '/', NUL, '+'), with at most
MAX_NAME bytes in all; a name that starts like one of TREES and does not decode is refused
(CorruptCheckpointError), as is an entry that is not a regular file, a decoded path whose
directory is a file or a link, and one that exists already (collision). Directories unflatten
makes are 0700, its files 0600; nothing is followed through a link.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path, PurePosixPath

from .errors import CorruptCheckpointError, TorporError
from .layout import CHUNKS, DATA_DIR

SEP = "+"
TREES = (DATA_DIR, CHUNKS)
MAX_NAME = 255                          # NAME_MAX: the flat name is one directory entry
PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _shown(name: str) -> str:
    return repr(name[:80])


def encode(rel: str | PurePosixPath) -> str:
    """The flat name of a path inside one of TREES (TorporError when it has none: torpor's own
    names always do)."""
    parts = PurePosixPath(rel).parts
    name = SEP.join(parts)
    if len(parts) < 2 or parts[0] not in TREES or not all(PART.fullmatch(p) for p in parts) \
            or ".." in name or len(name.encode()) > MAX_NAME:
        raise TorporError(f"{_shown(str(rel))} has no flat name in a checkpoint directory")
    return name


def is_flat(name: str) -> bool:
    """Whether a directory entry's name claims to be a flat name (decode judges it)."""
    return any(name.startswith(t + SEP) for t in TREES)


def decode(name: str) -> PurePosixPath | None:
    """The tree path a flat name stands for; None for a name that is not one (CRIU's images,
    torpor.json); CorruptCheckpointError for one that claims to be and is not well formed."""
    if not isinstance(name, str) or not is_flat(name):
        return None
    parts = name.split(SEP)
    if len(name.encode(errors="surrogateescape")) > MAX_NAME or ".." in name \
            or not all(PART.fullmatch(p) for p in parts):
        raise CorruptCheckpointError(f"checkpoint file name {_shown(name)} is not a valid "
                                     "flat name")
    return PurePosixPath(*parts)


def locate(images_dir: Path, rel: str | PurePosixPath) -> Path:
    """Where the file table's rel is in images_dir: its tree path, else its flat name where
    that exists (a flattened directory), else the tree path (missing)."""
    tree = images_dir / rel
    if os.path.lexists(tree):
        return tree
    try:
        flat = images_dir / encode(rel)
    except TorporError:
        return tree
    return flat if os.path.lexists(flat) else tree


# -- flatten: our own checkpoint, at the end of torpor-runtime's checkpoint ---------------------

def flatten(images_dir: Path) -> int:
    """Turn TREES in images_dir into flat files (module docstring). Every name is checked and
    every target found free before the first rename, so a refusal changes nothing. The number
    of files moved."""
    plan: list[tuple[Path, Path]] = []
    dirs: list[Path] = []
    for tree in TREES:
        top = images_dir / tree
        try:
            st = os.lstat(top)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise TorporError(f"{top} is not a directory: the checkpoint is left as it is")
        for root, subdirs, names in os.walk(top):
            dirs.append(Path(root))
            for n in subdirs + names:
                path = Path(root, n)
                mode = os.lstat(path).st_mode
                if stat.S_ISDIR(mode):
                    continue
                if not stat.S_ISREG(mode):
                    raise TorporError(f"{path} is not a regular file: the checkpoint is left "
                                      "as it is")
                target = images_dir / encode(path.relative_to(images_dir).as_posix())
                if os.path.lexists(target):
                    raise TorporError(f"{target} exists already: the checkpoint is left as "
                                      "it is")
                plan.append((path, target))
    for src, dst in plan:
        os.rename(src, dst)
    for d in reversed(dirs):   # os.walk lists parents first
        os.rmdir(d)
    return len(plan)


def remove_flat(images_dir: Path) -> None:
    """An earlier checkpoint's flat files in an image path used again (they would otherwise
    count as this checkpoint's)."""
    for entry in os.scandir(images_dir):
        if is_flat(entry.name) and not entry.is_dir(follow_symlinks=False):
            os.unlink(entry.path)


# -- unflatten: an untrusted checkpoint, at the start of torpor-runtime's restore ---------------

def flat_names(images_dir: Path) -> dict[str, PurePosixPath]:
    """The flat names in images_dir -> the tree paths they stand for (validated)."""
    out = {}
    for n in sorted(os.listdir(images_dir)):
        p = decode(n)
        if p is not None:
            out[n] = p
    return out


def unflatten(images_dir: Path) -> int:
    """Put the flat files of images_dir back into their trees (module docstring). Everything
    is checked before the first rename: regular files only, no tree path twice, no directory
    a file or a link, nothing overwritten. The number of files moved."""
    names = flat_names(images_dir)
    if not names:
        return 0
    where = f"checkpoint {images_dir}"
    files = set(names.values())
    needed = {parent for p in files for parent in p.parents if parent != PurePosixPath(".")}
    clash = files & needed
    if clash:
        raise CorruptCheckpointError(f"{where}: {_shown(str(min(clash)))} is both a file and a "
                                     "directory")
    root = os.open(images_dir, _DIR_FLAGS)
    try:
        for d in sorted(needed):
            _check_dir(root, d, where)
        for name, rel in names.items():
            _check_source(root, name, where)
            if _exists(root, rel):
                raise CorruptCheckpointError(f"{where}: {_shown(name)} and {_shown(str(rel))} "
                                             "are both there (collision)")
        for name, rel in names.items():
            parent = _make_dirs(root, rel.parent, where)
            try:
                _check_source(root, name, where, private=True)
                if _exists(parent, PurePosixPath(rel.name)):
                    raise CorruptCheckpointError(f"{where}: {_shown(str(rel))} appeared "
                                                 "during the restore")
                os.rename(name, rel.name, src_dir_fd=root, dst_dir_fd=parent)
            finally:
                os.close(parent)
    finally:
        os.close(root)
    return len(names)


def _exists(dir_fd: int, rel: PurePosixPath) -> bool:
    try:
        os.lstat(str(rel), dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        return True   # a file on the way: _check_dir refuses it
    return True


def _check_dir(root: int, rel: PurePosixPath, where: str) -> None:
    """rel is absent or a real directory (not a link, not a file)."""
    try:
        st = os.lstat(str(rel), dir_fd=root)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        st = None
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise CorruptCheckpointError(f"{where}: {_shown(str(rel))} is not a directory (a file "
                                     "or a link where a directory should be)")


def _check_source(root: int, name: str, where: str, private: bool = False) -> None:
    """name is a regular file in root (opened without following a link or blocking on a
    FIFO); private: made 0600 when others could read it."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=root)
    except OSError as e:
        raise CorruptCheckpointError(f"{where}: {_shown(name)} is not a regular file "
                                     f"({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{where}: {_shown(name)} is not a regular file")
        if private and stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _make_dirs(root: int, rel: PurePosixPath, where: str) -> int:
    """An fd of directory rel below root, each part made 0700 where missing and opened without
    following a link."""
    fd = os.dup(root)
    for part in rel.parts:
        try:
            os.mkdir(part, 0o700, dir_fd=fd)
        except FileExistsError:
            pass
        try:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as e:
            os.close(fd)
            raise CorruptCheckpointError(f"{where}: {_shown(str(rel))} is not a directory "
                                         f"({e.strerror})") from None
        os.close(fd)
        fd = nxt
    return fd
