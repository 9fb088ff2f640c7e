"""Reading torpor.json out of a checkpoint archive without unpacking it, and verifying the
archive's members against it.

Archives are tar files, plain or compressed (gzip, bzip2, xz, or zstd: podman's
`checkpoint --export` default). Nothing is extracted, so paths inside an archive are never
used on the host; the archive file is opened without blocking (a FIFO cannot hang torpor) and
must be a regular file.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Callable, Iterator

from . import manifest
from .errors import CorruptCheckpointError, NotFoundError, UsageError
from .layout import MANIFEST, MAX_MANIFEST, PACKED

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


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
        with stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
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


def verify_archive(path: Path, m: dict[str, Any]) -> None:
    """Stream the archive's members against m's file table: every listed file present once,
    a regular file of the listed size and checksum, nothing unlisted. A packed checkpoint's
    archive (its files are chunks) is refused: unpack it, then verify the directory."""
    top, _data = _find(path)
    seen: dict[str, str] = {}
    bad: list[str] = []

    def each(tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        name = PurePosixPath(member.name)
        if top != PurePosixPath(".") and top not in name.parents:
            return
        rel = name.relative_to(top).as_posix() if top != PurePosixPath(".") else name.as_posix()
        if rel == PACKED:
            raise UsageError(f"{path} holds a checkpoint packed into an image store: "
                             "--verify checks its directory, not the archive")
        if member.isdir() or rel in manifest.NOT_CHECKSUMMED or rel == ".":
            return
        info = m["files"].get(rel)
        if info is None:
            if not manifest.is_kept_out(rel):
                bad.append(f"{manifest.printable(rel)} is not listed in the manifest")
            return
        if not member.isfile():
            bad.append(f"{manifest.printable(rel)} is not a plain file")
            return
        if rel in seen:
            bad.append(f"{manifest.printable(rel)} is in the archive twice")
            return
        seen[rel] = rel
        if member.size != info["size"]:
            bad.append(f"{manifest.printable(rel)} has {member.size} bytes, manifest says "
                       f"{info['size']}")
            return
        if info.get("sha256"):
            f = tar.extractfile(member)
            got = list(_blocks(f, member.size))  # type: ignore[arg-type]
            if got != info["sha256"]:
                bad.append(f"{manifest.printable(rel)} checksum mismatch")

    _members(path, each)
    bad += [f"{manifest.printable(rel)} is missing" for rel in m["files"] if rel not in seen]
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CorruptCheckpointError(f"archive {path} is damaged: " + "; ".join(bad[:3]) + more)


def read_any(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory or archive."""
    if path.is_dir():
        return manifest.read(path)
    return manifest_from_archive(path)
