"""Reading torpor.json out of a checkpoint archive without unpacking it, and verifying the
archive's members against it.

Archives are tar files, plain or compressed (gzip, bzip2, xz, or zstd: podman's
`checkpoint --export` default). Nothing is extracted, so paths inside an archive are never
used on the host; the archive file is opened without blocking (a FIFO cannot hang torpor) and
must be a regular file. Members with flat names (flat.py) are checked as the tree paths they
stand for.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Callable, Iterator

from . import flat, manifest
from .errors import CorruptCheckpointError, NotFoundError, UsageError
from .layout import MANIFEST, MAX_MANIFEST, PACKED

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_EXTENDED_HEADER = 1 << 20   # a pax or GNU long-name header: a path and a few numbers
EXTENDED = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
            tarfile.GNUTYPE_LONGLINK)


class TarInfo(tarfile.TarInfo):
    """Members as tarfile reads them, but an extended header (pax, GNU long name) is refused
    past MAX_EXTENDED_HEADER: tarfile reads one whole into memory, and a few MB of gzip can
    declare gigabytes of it. Every reader of an untrusted tar opens it with tarinfo=TarInfo."""

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:   # tarfile's hook
        if self.type in EXTENDED and self.size > MAX_EXTENDED_HEADER:
            raise tarfile.ReadError(f"an extended header of {self.size} bytes (at most "
                                    f"{MAX_EXTENDED_HEADER}): refused")
        return super()._proc_member(tar)  # type: ignore[misc]


def each_member(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """tar's members in order, none kept: tarfile keeps every member it has read in
    tar.members, streaming too, and a few MB of gzip can hold a million long-named entries
    (gigabytes of TarInfo). Nothing here looks a member up by name (links are refused)."""
    while True:
        member = tar.next()
        if member is None:
            return
        tar.members.clear()
        yield member


def _open_stream(path: Path) -> BinaryIO:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{path} is neither a checkpoint directory nor an archive file")
    f = open(fd, "rb")
    head = f.read(4)
    f.seek(0)
    if head == ZSTD_MAGIC:
        import zstandard
        return zstandard.ZstdDecompressor().stream_reader(f, closefd=True)  # type: ignore[return-value]
    return f


def _members(path: Path, each: Callable[[tarfile.TarFile, tarfile.TarInfo], None]) -> None:
    """Call each(tar, member) for every member of the archive, in one streaming pass."""
    if not os.path.lexists(path):
        raise NotFoundError(f"no such file {path}")
    try:
        stream = _open_stream(path)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    try:
        with stream, tarfile.open(fileobj=stream, mode="r|*", tarinfo=TarInfo) as tar:
            for member in each_member(tar):
                each(tar, member)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise CorruptCheckpointError(f"{path} is not a readable tar archive: {e}") from e
    except RecursionError:
        raise CorruptCheckpointError(f"{path}: nested too deeply") from None
    except Exception as e:  # zstandard.ZstdError and friends
        if type(e).__module__.startswith("zstandard"):
            raise CorruptCheckpointError(f"{path}: bad zstd data: {e}") from e
        raise


def _find(path: Path) -> tuple[PurePosixPath, bytes]:
    """(the directory inside the archive, the bytes) of the shallowest torpor.json."""
    best: list[tuple[int, PurePosixPath, bytes]] = []

    def each(tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        name = PurePosixPath(member.name)
        if name.name != MANIFEST or not member.isfile():
            return
        if member.size > MAX_MANIFEST:
            raise CorruptCheckpointError(f"{path}: {member.name} is implausibly large")
        data = tar.extractfile(member).read()  # type: ignore[union-attr]
        if not best or len(name.parts) < best[0][0]:
            best[:] = [(len(name.parts), name.parent, data)]

    _members(path, each)
    if not best:
        raise NotFoundError(f"{path} holds no {MANIFEST}: not a torpor checkpoint")
    return best[0][1], best[0][2]


def manifest_from_archive(path: Path) -> dict[str, Any]:
    return manifest.parse(_find(path)[1], f"{path}:{MANIFEST}")


def _blocks(f: BinaryIO, size: int) -> Iterator[str]:
    left = size
    while left > 0 or size == 0:
        h, n = hashlib.sha256(), min(left, manifest.HASH_BLOCK)
        while n > 0:
            data = f.read(min(n, 8 << 20))
            if not data:
                raise CorruptCheckpointError("archive member ended early")
            h.update(data)
            n -= len(data)
            left -= len(data)
        yield h.hexdigest()
        if size == 0:
            return


def _tree_path(name: PurePosixPath) -> PurePosixPath:
    """A member's name with a flat file name (flat.py: torpor-runtime's image directory, as
    containerd 2's CRI archives it) put back as the tree path the file table lists."""
    tree = flat.decode(name.name) if flat.is_flat(name.name) else None
    return name.parent / tree if tree is not None else name


def verify_archive(path: Path) -> dict[str, Any]:
    """The archive's manifest, after one streaming pass checked its members against the file
    table: every listed file present once, a regular file of the listed size and checksum,
    nothing unlisted beside it. A packed checkpoint's archive (its files are chunks) is
    refused: unpack it, then verify the directory."""
    found: list[tuple[int, PurePosixPath, bytes]] = []
    members: dict[PurePosixPath, tuple[str, int, list[str] | None]] = {}   # name -> kind, size, sums
    wanted: set[str] = set()   # names a table may list: hashed as they pass, judged at the end
    twice: list[PurePosixPath] = []
    unnamed: list[tuple[PurePosixPath, str]] = []   # flat names that do not decode: why

    def each(tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        name = PurePosixPath(member.name)
        try:
            name = _tree_path(name)
        except CorruptCheckpointError as e:
            unnamed.append((name, str(e)))
            return
        if name.name == MANIFEST and member.isfile() and not found:
            if member.size > MAX_MANIFEST:
                raise CorruptCheckpointError(f"{path}: {member.name} is implausibly large")
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            found.append((len(name.parts), name.parent, data))
            wanted.update(manifest.parse(data, f"{path}:{member.name}")["files"])
        elif name.name == MANIFEST and member.isfile() and len(name.parts) < found[0][0]:
            raise UsageError(f"{path} holds torpor.json at two depths: verify its directory")
        kind = "file" if member.isfile() else "dir" if member.isdir() else "other"
        sums = None
        if kind == "file" and (not found or any(
                "/".join(name.parts[i:]) in wanted for i in range(len(name.parts)))):
            sums = list(_blocks(tar.extractfile(member), member.size))  # type: ignore[arg-type]
        if name in members:
            twice.append(name)
        members.setdefault(name, (kind, member.size, sums))

    _members(path, each)
    if not found:
        raise NotFoundError(f"{path} holds no {MANIFEST}: not a torpor checkpoint")
    _depth, top, data = found[0]
    m = manifest.parse(data, f"{path}:{MANIFEST}")
    bad = [f"{manifest.printable(n)} is in the archive twice" for n in twice if top in n.parents]
    bad += [why for n, why in unnamed if top in n.parents]
    seen: set[str] = set()
    for name, (kind, size, sums) in members.items():
        if top not in name.parents:
            continue
        rel = name.as_posix() if top == PurePosixPath(".") else name.relative_to(top).as_posix()
        if rel == PACKED:
            raise UsageError(f"{path} holds a checkpoint packed into an image store: "
                             "--verify checks its directory, not the archive")
        info = m["files"].get(rel)
        if kind == "dir" or rel in manifest.NOT_CHECKSUMMED:
            continue
        if info is None:
            if not manifest.is_kept_out(rel):
                bad.append(f"{manifest.printable(rel)} is not listed in the manifest")
        elif kind != "file":
            bad.append(f"{manifest.printable(rel)} is not a plain file")
        elif size != info["size"]:
            bad.append(f"{manifest.printable(rel)} has {size} bytes, manifest says {info['size']}")
        elif info.get("sha256") and sums != info["sha256"]:
            bad.append(f"{manifest.printable(rel)} checksum mismatch")
        seen.add(rel)
    bad += [f"{manifest.printable(rel)} is missing" for rel in m["files"] if rel not in seen]
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CorruptCheckpointError(f"archive {path} is damaged: " + "; ".join(bad[:3]) + more)
    return m


def read_any(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory or archive."""
    if path.is_dir():
        return manifest.read(path)
    return manifest_from_archive(path)
