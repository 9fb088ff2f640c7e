"""The checkpoint image's one layer: an uncompressed tar, written from a checkpoint directory or
archive, and unpacked from a registry (untrusted) with every member checked.

Written: plain files and directories only (a link or device in a checkpoint is refused), in
sorted order, owner 0, mode 0600/0700, mtime 0: the same checkpoint gives the same digest.
Unpacked: into a new private directory, nothing but plain files and directories, every path a
plain relative path inside it (layout.safe_relpath), never twice, never through a link, no
sparse member (it would grow past the bytes fetched), at most MAX_MEMBERS members; files 0600,
directories 0700.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Callable, Iterable

from .. import archive
from ..errors import CorruptCheckpointError, UsageError
from ..files import open_untrusted
from ..layout import safe_relpath

MAX_MEMBERS = 1 << 20
COPY = 8 << 20


class HashingWriter:
    """A write-only file object that hashes what passes through it and counts it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.h, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.h.update(data)
        self.size += len(data)
        return self.f.write(data)

    def digest(self) -> str:
        return "sha256:" + self.h.hexdigest()


def _info(name: str, kind: bytes, size: int = 0) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.size, ti.mtime, ti.uid, ti.gid = kind, size, 0, 0, 0
    ti.mode = 0o700 if kind == tarfile.DIRTYPE else 0o600
    return ti


def _norm(name: str) -> str:
    """A member name as a relative path: './x' and 'x/' read as 'x'."""
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/")


def write_dir(out: BinaryIO, src: Path, prefix: str, skip: Callable[[str], bool]) -> None:
    """The files of checkpoint directory src under prefix/ in a tar written to out; skip(rel)
    leaves some out (a packed directory's chunk links travel as their own blobs)."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(_info(prefix, tarfile.DIRTYPE))
        for root, dirs, names in os.walk(src):
            dirs.sort()
            rel_root = Path(root).relative_to(src)
            for d in list(dirs):
                rel = (rel_root / d).as_posix()
                if skip(rel):
                    dirs.remove(d)
                elif os.path.islink(os.path.join(root, d)):
                    raise UsageError(f"{src}/{rel} is a symbolic link: a checkpoint image holds "
                                     "plain files only")
                else:
                    tar.addfile(_info(f"{prefix}/{rel}", tarfile.DIRTYPE))
            for n in sorted(names):
                rel = (rel_root / n).as_posix()
                if skip(rel):
                    continue
                try:
                    fd, st = open_untrusted(src, rel)
                except CorruptCheckpointError as e:
                    raise UsageError(f"{e}: a checkpoint image holds plain files only") from None
                with open(fd, "rb") as f:
                    tar.addfile(_info(f"{prefix}/{rel}", tarfile.REGTYPE, st.st_size), f)


def write_archive(out: BinaryIO, src: Path,
                  skip: Callable[[str], bool] = lambda name: False) -> None:
    """The members of checkpoint archive src (podman's --export, the kubelet's archive, any
    compression) in a tar written to out, as podman's --create-image lays them out: the
    archive's own tree; skip(name) leaves some out (a packed checkpoint's chunk links)."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        def each(src_tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
            name = _norm(m.name)
            if not name or skip(name):
                return
            safe_relpath(name)
            if m.isdir():
                tar.addfile(_info(name, tarfile.DIRTYPE))
            elif m.isfile() and not m.issparse():
                tar.addfile(_info(name, tarfile.REGTYPE, m.size), src_tar.extractfile(m))
            else:
                raise UsageError(f"{src}: {name[:200]!r} is not a plain file: a checkpoint "
                                 "image holds plain files only")
        archive._members(src, each)


def _mkdirs(dest: Path, parts: Iterable[str]) -> Path:
    """dest/parts... as real directories (0700, made here where missing; a link is refused)."""
    here = dest
    for part in parts:
        here = here / part
        try:
            os.mkdir(here, 0o700)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(here).st_mode):
                raise CorruptCheckpointError(f"layer: {part!r} is a file and a directory") from None
    return here


def unpack(layer: BinaryIO, dest: Path, where: str, cap: int) -> list[str]:
    """Unpack the layer tar (plain or gzip) read from layer into dest (new, private, empty),
    at most cap bytes of files. The files written, relative to dest. CorruptCheckpointError
    (exit 9) on anything but plain files and directories at safe paths."""
    written: list[str] = []
    count = total = 0
    try:
        with tarfile.open(fileobj=layer, mode="r|*",
                          tarinfo=archive.TarInfo) as tar:
            for m in archive.each_member(tar):
                count += 1
                if count > MAX_MEMBERS:
                    raise CorruptCheckpointError(f"{where}: more than {MAX_MEMBERS} members")
                name = _norm(m.name)
                if not name:
                    continue
                try:
                    rel = safe_relpath(name)
                except CorruptCheckpointError:
                    raise CorruptCheckpointError(f"{where}: unsafe path {name[:80]!r} in the "
                                                 "layer: refused") from None
                if m.isdir():
                    _mkdirs(dest, rel.parts)
                elif m.isfile() and not m.issparse():
                    total += m.size
                    if total > cap:
                        raise CorruptCheckpointError(f"{where}: its files add up to more than "
                                                     f"{cap} bytes: refused")
                    _write_member(tar, m, _mkdirs(dest, rel.parts[:-1]) / rel.name, where)
                    written.append(name)
                else:
                    raise CorruptCheckpointError(f"{where}: {name[:80]!r} is not a plain file or "
                                                 "directory (a link, device or sparse file): "
                                                 "refused")
    except (tarfile.TarError, EOFError) as e:
        raise CorruptCheckpointError(f"{where}: not a readable tar layer: {e}") from None
    return written


def _write_member(tar: tarfile.TarFile, m: tarfile.TarInfo, path: Path, where: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except FileExistsError:
        raise CorruptCheckpointError(f"{where}: {PurePosixPath(m.name).as_posix()[:80]!r} is in "
                                     "the layer twice: refused") from None
    src = tar.extractfile(m)
    assert src is not None
    with open(fd, "wb") as f:
        left = m.size
        while left > 0:
            data = src.read(min(left, COPY))
            if not data:
                raise CorruptCheckpointError(f"{where}: {m.name[:80]!r} ends early")
            f.write(data)
            left -= len(data)
