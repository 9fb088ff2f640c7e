"""The checkpoint directory's layout: every file name torpor reads or writes in it, and the
check that a path named by a checkpoint stays inside it.

A leaf module (imports only errors): manifest.py, agent_data.py and store/ take their names from
here, so none of them imports another for a name.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from .errors import CorruptCheckpointError

MANIFEST = "torpor.json"               # the sealed manifest (manifest.py)
DRAFT = ".torpor.json.draft"           # everything but the file table, written before the dump
DAMAGED = "torpor-damaged.txt"         # why a sealed checkpoint can never be made whole
DUMP_LOG = "dump.log"                  # CRIU's log of the dump, kept with the images
DATA_DIR = "torpor-gpu"                # the agents' GPU memory files, one folder per PID
INDEX = "gpu-fingerprints.txt"         # beside a program's files: store/fingerprints.py
STREAMED = "gpu-streamed.txt"          # beside them: the parts streamed into the store
WRITING = ".torpor-writing"           # a --leave-running checkpoint's GPU data being written out
PACKED = "torpor-store.json"           # a packed directory's snapshot (store/images.py)
CHUNKS = "torpor-chunks"               # a packed directory's chunk links
REQUIRED_IMAGES = ("inventory.img", "pstree.img")  # CRIU writes both on every dump

# The most torpor reads of each kind of file from a checkpoint (they are untrusted: a link to
# /dev/zero or a huge file must not grow torpor without bound).
MAX_MANIFEST = 16 << 20
MAX_DAMAGED = 600
MAX_RECORD = 64 << 20                  # a fingerprint index or stream record
MAX_PACKED = 256 << 20                 # a packed directory's snapshot
MAX_PATH = 4096                        # PATH_MAX: longer paths in a file table are refused


def safe_relpath(rel: str) -> PurePosixPath:
    """rel as a path, when it is a plain relative path that stays inside the directory."""
    if not isinstance(rel, str) or len(rel) > MAX_PATH or "\0" in rel:
        raise CorruptCheckpointError(f"unsafe path in manifest: {str(rel)[:80]!r}")
    p = PurePosixPath(rel)
    if p.is_absolute() or not p.parts or ".." in p.parts or str(p) != rel \
            or any(len(part) > 255 for part in p.parts):
        raise CorruptCheckpointError(f"unsafe path in manifest: {rel[:80]!r}")
    return p
