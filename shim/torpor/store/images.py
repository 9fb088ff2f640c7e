"""A checkpoint directory kept in the image store (`torpor checkpoint --store NAME`).

Packed, a checkpoint directory holds:

    torpor.json              the manifest, as written (`torpor inspect` reads it as before)
    inventory.img, pstree.img, dump.log   CRIU's, small, kept as they are (KEPT): podman looks
                             for inventory.img before it lets the runtime restore
    torpor-store.json        the store snapshot naming the chunks of every file of the
                             checkpoint (torpor.json included)
    torpor-chunks/<sha256>   those chunks: hard links into the host's store (same filesystem),
                             else copies

CRIU's page images are cut by virtual-address window (pages.py), the rest into fixed-size
chunks, so host memory that did not change dedups too.

So a packed directory stays self-contained: copied or archived, it carries every chunk it
needs, and a restore on another host first brings them into that host's store, each verified.
On the host that made it, a chunk costs its space once however many checkpoints hold it (a
second checkpoint of a program whose weights did not change adds only what changed), and gc
keeps every chunk such a directory links.

A restore writes the files back into a private directory inside the checkpoint directory
(UNPACKED_PREFIX, same filesystem), every chunk verified, restores from there and removes it.
The checkpoint itself is written as before and packed after its seal. Its agents' GPU data that
the store holds already was skipped (fingerprints.py): holes in the data files, which the pack
takes from the store's snapshots without reading them.

Order, so that no interruption loses a checkpoint: the snapshot is committed, its chunks are
linked into a temporary folder renamed to torpor-chunks, torpor-store.json is written
(atomically), and only then are the original files removed. Until torpor-store.json exists the
directory is an ordinary checkpoint (with holes where its agents skipped GPU data, which a
failed pack fills in: fingerprints.fill_dir); from then on its chunks are complete.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any, Iterable

from .. import agent_data, flat
from ..errors import CorruptCheckpointError, UsageError
from ..files import atomic_write
from ..files import read_untrusted
from ..layout import CHUNKS, DUMP_LOG, MANIFEST, MAX_PACKED, PACKED, REQUIRED_IMAGES
from . import chunk, fingerprints, pages, snapshot
from .store import Store
from .writer import WriteStats

UNPACKED_PREFIX = ".torpor-unpacked-"
KEPT = {MANIFEST, DUMP_LOG, *REQUIRED_IMAGES}   # stay in a packed directory (also in the snapshot)


def is_packed(images_dir: Path) -> bool:
    return os.path.lexists(images_dir / PACKED)   # a link or FIFO there is refused on reading


def pack(store: Store, images_dir: Path, name: str, owner: str = "",
         known: fingerprints.Known | None = None) -> tuple[dict[str, Any], WriteStats]:
    """Put the sealed checkpoint in images_dir into the store as snapshot name and leave the
    directory packed (module docstring). owner (fingerprints.owner_of): whose snapshots' chunks
    it may take by fingerprint (its agents' GPU data, and on the host), recorded in the
    snapshot; "" none. known: owner's fingerprints, read under the store's lock held since
    (else read here). Returns (snapshot, what was written)."""
    if owner:
        fingerprints.check_owner(owner)   # before anything: its snapshot records it
    if is_packed(images_dir):
        raise UsageError(f"{images_dir} is packed into a store already")
    if not (images_dir / MANIFEST).is_file():
        raise UsageError(f"{images_dir} holds no sealed checkpoint ({MANIFEST})")
    if not owner and fingerprints.any_skipped(images_dir):
        raise UsageError(f"{images_dir} holds GPU data its agents skipped: packing it needs "
                         "their owner")
    meta = {"kind": "torpor-checkpoint", "images_dir": str(images_dir.absolute()),
            **({"owner": owner} if owner else {})}
    if not owner:
        known = None
    elif known is None:
        known = fingerprints.known(store, owner)
    doc, stats = store.ingest_dir(images_dir, name, meta,
                                  pages.page_image_pieces(images_dir, store.chunk_size),
                                  fingerprints.pack_arguments(store, images_dir, known.gpu)
                                  if known else None,
                                  known.host if known else None)
    tmp = images_dir / f".{CHUNKS}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    store.export_chunks(name, tmp)
    os.rename(tmp, images_dir / CHUNKS)
    atomic_write(images_dir / PACKED, snapshot.dump(doc))
    for rel in doc["files"]:
        if rel not in KEPT:
            (images_dir / rel).unlink()
    for record in images_dir.glob(f"{agent_data.DATA_DIR}/*/{agent_data.STREAMED}"):   # left out of doc
        record.unlink()
    for root, dirs, _names in os.walk(images_dir, topdown=False):
        for d in dirs:
            path = Path(root, d)
            if path != images_dir / CHUNKS and not any(path.iterdir()):
                path.rmdir()
    return doc, stats


def forget_packed(images_dir: Path) -> None:
    """A directory about to take a new checkpoint (a runtime's image path, used again) loses
    what an earlier one packed there: its snapshot file and chunk links (the store keeps its
    snapshot)."""
    (images_dir / PACKED).unlink(missing_ok=True)
    shutil.rmtree(images_dir / CHUNKS, ignore_errors=True)


def verify(images_dir: Path) -> int:
    """Check a packed checkpoint directory on its own: its snapshot, and every chunk it names
    present in torpor-chunks/ (or flat: flat.py) and matching its name. The number of chunks
    checked."""
    doc = snapshot.parse(read_untrusted(images_dir, PACKED, MAX_PACKED), f"{images_dir}/{PACKED}")
    names = sorted(snapshot.chunk_names(doc))
    for name in names:
        try:
            blob = chunk.read_blob_file(flat.locate(images_dir, f"{CHUNKS}/{name}"),
                                        f"{images_dir}/{CHUNKS}")
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{images_dir}: chunk {name} is missing from "
                                         f"{CHUNKS}/") from None
        chunk.decode(blob, name, f"{images_dir}/{CHUNKS}")
    return len(names)


def packed_doc(images_dir: Path) -> dict[str, Any]:
    """The snapshot of the packed checkpoint in images_dir, validated."""
    return snapshot.parse(read_untrusted(images_dir, PACKED, MAX_PACKED), f"{images_dir}/{PACKED}")


def unpacked_size(images_dir: Path, leave_out: Iterable[str] = ()) -> int:
    """The bytes the packed checkpoint in images_dir takes once unpacked (but leave_out)."""
    out = set(leave_out)
    return sum(f["size"] for rel, f in packed_doc(images_dir)["files"].items() if rel not in out)


def gpu_data_files(doc: dict[str, Any]) -> dict[str, int]:
    """The agents' data files a packed checkpoint's snapshot holds -> their sizes: what a
    restore streams from the store to the GPU (store/stream.py) rather than unpacking."""
    names = {agent_data.file_name(k) for k in range(agent_data.MAX_FILES)}
    out = {}
    for rel, entry in doc["files"].items():
        parts = rel.split("/")
        if len(parts) == 3 and parts[0] == agent_data.DATA_DIR and parts[1].isdigit() \
                and parts[2] in names:
            out[rel] = entry["size"]
    return out


def unpack(store: Store, images_dir: Path, into: Path | None = None,
           leave_out: Iterable[str] = ()) -> Path:
    """The files of the packed checkpoint in images_dir (but leave_out), written into a new
    private directory (remove it when done) inside into (a private directory, e.g. in host
    memory), else inside images_dir. Chunks the host's store lacks come from torpor-chunks,
    each verified before it enters (those of leave_out too: they are read from the store
    later); every chunk is verified again as it is read."""
    doc = packed_doc(images_dir)
    if MANIFEST not in doc["files"]:
        raise CorruptCheckpointError(f"{images_dir}/{PACKED} names no {MANIFEST}")
    # a chunk the store holds damaged counts as missing: import_chunks replaces it
    missing = [c for c in snapshot.chunk_names(doc) if not store.backend.has_blob(c)]
    if missing:
        if not (images_dir / CHUNKS).is_dir():
            raise CorruptCheckpointError(f"{images_dir}: {len(missing)} chunk(s) of the packed "
                                         f"checkpoint are in neither {CHUNKS}/ nor store "
                                         f"{store.where} (or are damaged there), e.g. "
                                         f"{missing[0]}")
        store.import_chunks(images_dir / CHUNKS)
    for base in {images_dir, into or images_dir}:
        _remove_leftovers(base)
    dest = (into or images_dir) / f"{UNPACKED_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    try:
        store.materialize_doc(doc, dest, set(leave_out))
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest


def _remove_leftovers(base: Path) -> None:
    """Unpacked copies whose torpor died (killed mid-restore): their PID is gone. A shared base
    (host memory) may hold the copies of restores running now, which are kept."""
    for leftover in base.glob(f"{UNPACKED_PREFIX}*"):
        owner = leftover.name[len(UNPACKED_PREFIX):].partition("-")[0]
        if owner.isdigit() and int(owner) != os.getpid() and os.path.exists(f"/proc/{owner}"):
            continue
        shutil.rmtree(leftover, ignore_errors=True)


def unpack_in_place(store: Store, images_dir: Path, leave_out: Iterable[str] = ()) -> None:
    """unpack(), for a runtime that restores from the directory itself (runc's --image-path):
    the files go back where they were, then the snapshot and the chunk links leave the
    directory, an ordinary checkpoint again (the store keeps its snapshot). Interrupted, it can
    be run again: torpor-store.json goes only once every file is back. With leave_out (the
    agents' data files, which stream from the store: gpu_data_files), the directory stays
    packed: those files are only in its chunks."""
    leave_out = set(leave_out)
    unpacked = unpack(store, images_dir, leave_out=leave_out)
    try:
        for root, _dirs, names in os.walk(unpacked):
            for n in names:
                rel = Path(root, n).relative_to(unpacked)
                for parent in reversed(rel.parents[:-1]):
                    _real_dir(images_dir / parent)
                os.replace(unpacked / rel, images_dir / rel)
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)
    if leave_out:
        return
    (images_dir / PACKED).unlink()
    shutil.rmtree(images_dir / CHUNKS, ignore_errors=True)


def _real_dir(path: Path) -> None:
    """path as a directory of its own, made 0700 if missing: never a link planted by whoever
    made the archive the directory came from (the files would be written where it points)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise CorruptCheckpointError(f"{path} is not a directory (a link?): refused, the "
                                         "checkpoint's files are not written through it") from None
