"""Reading torpor.json out of a checkpoint archive without unpacking it.

Archives are tar files, plain or compressed (gzip, bzip2, xz, or zstd: podman's
`checkpoint --export` default). Only the manifest member is read; nothing is extracted, so
paths inside an archive are never used on the host.
"""

from __future__ import annotations

import tarfile
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from . import manifest
from .errors import CorruptCheckpointError, NotFoundError, UsageError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
MAX_MANIFEST = 16 << 20


def _open_stream(path: Path) -> BinaryIO:
    f = open(path, "rb")
    head = f.read(4)
    f.seek(0)
    if head == ZSTD_MAGIC:
        import zstandard
        return zstandard.ZstdDecompressor().stream_reader(f, closefd=True)  # type: ignore[return-value]
    return f


def manifest_from_archive(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise NotFoundError(f"no such file {path}")
    if not path.is_file():
        raise UsageError(f"{path} is neither a checkpoint directory nor an archive file")
    try:
        stream = _open_stream(path)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    best: tuple[int, bytes] | None = None
    try:
        with stream, tarfile.open(fileobj=stream, mode="r|*") as tar:
            for member in tar:
                if PurePosixPath(member.name).name != manifest.MANIFEST or not member.isfile():
                    continue
                if member.size > MAX_MANIFEST:
                    raise CorruptCheckpointError(f"{path}: {member.name} is implausibly large")
                depth = len(PurePosixPath(member.name).parts)
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                if best is None or depth < best[0]:
                    best = (depth, data)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise CorruptCheckpointError(f"{path} is not a readable tar archive: {e}") from e
    except Exception as e:  # zstandard.ZstdError and friends
        if type(e).__module__.startswith("zstandard"):
            raise CorruptCheckpointError(f"{path}: bad zstd data: {e}") from e
        raise
    if best is None:
        raise NotFoundError(f"{path} holds no {manifest.MANIFEST}: not a torpor checkpoint")
    return manifest.parse(best[1], f"{path}:{manifest.MANIFEST}")


def read_any(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory or archive."""
    if path.is_dir():
        return manifest.read(path)
    return manifest_from_archive(path)

