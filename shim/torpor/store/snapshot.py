"""A snapshot: one checkpoint's manifest in the store, naming the chunks of each file.

    {"schema": 1, "kind": "torpor-snapshot", "name": str, "created": ISO 8601 UTC,
     "meta": {...}  (the caller's, e.g. torpor.json's fields),
     "files": {relative path: {"size": bytes, "mode": permission bits at ingest,
                               "chunks": [[sha256 hex, or null for zeros, length], ...],
                               "fingerprints": [[chunk index, 32 hex], ...]  (optional: an
                               agent's data file, the GPU fingerprint of each chunk,
                               fingerprints.py),
                               "host_fingerprints": [[chunk index, 32 hex], ...]  (optional:
                               the host fingerprint of each chunk read, chunk.fingerprint)}}}

Chunks are listed in file order; their lengths add up to the size. Nothing read from a
snapshot is trusted: paths must be plain relative paths (layout.safe_relpath), chunk names
64 lowercase hex, lengths positive and bounded, or reading it fails with
CorruptCheckpointError.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import CorruptCheckpointError
from ..files import loads_json
from ..layout import safe_relpath
from .backend import BLOB_NAME, SNAPSHOT_NAME
from .chunk import MAX_CHUNK

SCHEMA = 1
FINGERPRINT = re.compile(r"[0-9a-f]{32}")
FINGERPRINT_FIELDS = ("fingerprints", "host_fingerprints")   # GPU (agent's), host (chunk.py)
KIND = "torpor-snapshot"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_chunk(ref: Any) -> int:
    """The length of one [name or null, length] pair; ValueError when malformed."""
    if not (isinstance(ref, list) and len(ref) == 2 and _is_int(ref[1])
            and 0 < ref[1] <= MAX_CHUNK
            and (ref[0] is None or (isinstance(ref[0], str) and BLOB_NAME.fullmatch(ref[0])))):
        raise ValueError(f"malformed chunk {ref!r}")
    return ref[1]


def _check_file(rel: str, entry: Any) -> None:
    safe_relpath(rel)
    if not (isinstance(entry, dict) and _is_int(entry.get("size")) and entry["size"] >= 0
            and _is_int(entry.get("mode")) and isinstance(entry.get("chunks"), list)):
        raise ValueError(f"entry for {rel!r} is malformed")
    if sum(_check_chunk(ref) for ref in entry["chunks"]) != entry["size"]:
        raise ValueError(f"chunks of {rel!r} do not add up to its size")
    for field in FINGERPRINT_FIELDS:
        fps = entry.get(field, [])
        if not isinstance(fps, list) or not all(
                isinstance(f, list) and len(f) == 2 and _is_int(f[0])
                and 0 <= f[0] < len(entry["chunks"]) and isinstance(f[1], str)
                and FINGERPRINT.fullmatch(f[1]) for f in fps):
            raise ValueError(f"{field} of {rel!r} are malformed")


def validate(doc: Any, origin: str) -> dict[str, Any]:
    try:
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            raise ValueError(f"not a torpor snapshot (kind is not '{KIND}')")
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"schema {doc.get('schema')!r} is not supported (this torpor "
                             f"reads schema {SCHEMA})")
        if not (isinstance(doc.get("name"), str) and SNAPSHOT_NAME.fullmatch(doc["name"])
                and isinstance(doc.get("created"), str) and isinstance(doc.get("meta"), dict)
                and isinstance(doc.get("files"), dict)):
            raise ValueError("name, created, meta or files is missing or malformed")
        for rel, entry in doc["files"].items():
            _check_file(rel, entry)
    except (ValueError, CorruptCheckpointError) as e:
        raise CorruptCheckpointError(f"{origin}: {e}") from None
    return doc


def parse(data: bytes, origin: str) -> dict[str, Any]:
    try:
        doc = loads_json(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{origin}: not valid JSON ({e})") from None
    return validate(doc, origin)


def dump(doc: dict[str, Any]) -> bytes:
    """One line: json's C encoder (an indent makes it fall back to Python, 8x slower on a
    16 GiB program's snapshot of ~4,700 chunks). The separators stay json's defaults
    (fingerprints.known looks for its owner's '"owner": ' entry)."""
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


def chunk_names(doc: dict[str, Any]) -> set[str]:
    """Every stored chunk the snapshot needs (zeros need none)."""
    return {ref[0] for entry in doc["files"].values() for ref in entry["chunks"]
            if ref[0] is not None}


def new_bytes_by_file(doc: dict[str, Any], base: dict[str, Any]) -> dict[str, int]:
    """For each file of doc, the logical bytes of its chunks that base does not have (zeros
    are never new): where a second checkpoint's new data lies. Files with none are left out."""
    have = chunk_names(base)
    out = {rel: sum(ref[1] for ref in entry["chunks"]
                    if ref[0] is not None and ref[0] not in have)
           for rel, entry in doc["files"].items()}
    return {rel: n for rel, n in out.items() if n}
