"""Files a reader of small regular files (files.read_small_file and the like) must refuse in
one line, without hanging on them or filling memory with them: planted by one helper for every
reader's test."""

from __future__ import annotations

import os
from pathlib import Path

KINDS = ("fifo", "dev-zero", "dir", "huge")


def plant(path: Path, kind: str, cap: int) -> None:
    """Put at path: "fifo" (an open would wait for a writer for good), "dev-zero" (a link to
    /dev/zero: endless bytes), "dir", or "huge" (a sparse file of cap + 1 bytes, one over
    the reader's cap)."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "dir":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(cap + 1)
    else:
        raise ValueError(f"no such hostile file kind {kind!r}")
