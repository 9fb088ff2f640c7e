"""torpor.json: the GPU manifest written into every checkpoint directory.

Schema (version 1), all keys always present:
  schema            1
  kind              "torpor-checkpoint"
  created           ISO 8601 UTC
  torpor_version, criu_version, host, kernel
  driver            {"version": NVML driver version or null, "cuda": e.g. 13000 or null}
  root_pid          the PID given to `torpor checkpoint` (the tree's root)
  shell_job         whether CRIU needed --shell-job
  leave_running     whether the program kept running after the dump
                    (optional "tcp_established": CRIU took established TCP connections along, and
                    the restore must say so too)
  gpus              [{"uuid", "name", "memory_total", "index"}]  (those the processes used)
  processes         [{"pid", "comm", "cuda", "gpus": [uuid], "gpu_memory", "state"}]
                    (optional "gpu_memory_by_gpu": {uuid: bytes}, NVML's figure on each GPU:
                    a restore's pre-flight needs it per target GPU, placement.py)
  timings           {phase: seconds}
  sizes             {"total": bytes, "gpu_memory": bytes}
  files             {relative path: {"size": bytes, "sha256": [hex per 64 MiB block] or null}}
                    (null for the agents' GPU memory files: the agent checks its own chunk sums)
Optional:
  container         {"id", "minors": [int], "visible": [str], "cdi": [str]}: written by
                    torpor-runtime, what the container's spec named (torpor.oci.GpuUse);
                    optional "agent": true when it had the agent's mounts (its restore needs
                    them again: CRIU maps the dumped mounts onto the new spec's)
  gpus[].minor      /dev/nvidia<minor> of that GPU, where NVML told
  agent             {"<pid>": {"nspid", "bytes", "chunks", "allocations", "cache_released",
                    "seconds", "files": [size of each data file]}}: the programs whose in-process
                    agent moved their GPU memory into torpor-gpu/<pid>/gpu-memory-<k>.bin
                    (agent_data.py), k < len(files), before the driver's checkpoint; a restore gives
                    it back through the agent (`resume`). pid: at checkpoint; nspid: in its own
                    pid namespace (finds the agent of a container's restored process).

Paths in `files` are the tree paths (torpor-gpu/<pid>/...) also where torpor-runtime left the
directory flattened (flat.py): those files are found under their flat names.
Paths in `files` are never trusted: each must be a plain relative path that stays inside the
checkpoint directory (layout.safe_relpath), or reading fails with CorruptCheckpointError.
The schema check is manifest_types.Manifest.from_json (every field's type and range, one
exit-9 line naming the field); read/validate still return the checked dict. Every file read
here from a checkpoint directory goes through files.read_untrusted (no link, no FIFO, size
caps); verify trusts torpor.json itself as strictly as the images (manifest_untrusted).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from . import agent_data, flat
from . import manifest_types
from .errors import CorruptCheckpointError, NotFoundError
from .files import (TRUSTED_UIDS, atomic_write, loads_json, printable, read_untrusted,
                    read_untrusted_tail, require_trusted_file, write_json)
from .layout import (CHUNKS, DAMAGED, DRAFT, DUMP_LOG, MANIFEST, MAX_DAMAGED, MAX_MANIFEST,
                     PACKED, REQUIRED_IMAGES, safe_relpath)
from .manifest_types import SCHEMA, Manifest  # noqa: F401  (SCHEMA: its users import it here)

__all__ = ["MANIFEST", "DRAFT", "DAMAGED", "DUMP_LOG", "safe_relpath"]  # old homes, still used
DUMP_OK = "Dumping finished successfully"
NOT_CHECKSUMMED = {MANIFEST, DRAFT, DAMAGED}



HASH_BLOCK = 64 << 20  # files are hashed in 64 MiB blocks, all blocks of all files in parallel


def _hash_block(path: Path, offset: int, length: int, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        end = offset + length
        while offset < end:
            block = os.pread(fd, min(chunk, end - offset), offset)
            if not block:
                break  # shorter than expected: the size check reports it
            h.update(block)  # hashlib drops the GIL for large buffers: blocks hash in parallel
            offset += len(block)
    finally:
        os.close(fd)
    return h.hexdigest()


def block_digests(paths: dict[str, Path]) -> dict[str, list[str]]:
    """sha256 of every HASH_BLOCK-sized block of every file: {rel: [hex, ...]}."""
    jobs = [(rel, path, off) for rel, path in paths.items()
            for off in range(0, max(path.stat().st_size, 1), HASH_BLOCK)]
    workers = min(16, os.cpu_count() or 2, max(1, len(jobs)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        digests = list(pool.map(lambda j: _hash_block(j[1], j[2], HASH_BLOCK), jobs))
    out: dict[str, list[str]] = {rel: [] for rel in paths}
    for (rel, _path, _off), d in zip(jobs, digests):
        out[rel].append(d)
    return out


def _image_files(images_dir: Path) -> list[str]:
    """The checkpoint's files. Not a stream record (agent_data.STREAMED): it says which store chunk
    each of a program's parts is while its data files are holes, torpor's state until the
    pack or a fill, never part of the checkpoint (the pack leaves it out of the snapshot). Nor
    a packed directory's snapshot and chunk links (store/images.py): a runtime's restore
    unpacks the rest beside them and streams the GPU data from the store."""
    out = []
    for root, dirs, names in os.walk(images_dir):
        if root == str(images_dir) and CHUNKS in dirs:
            dirs.remove(CHUNKS)
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), images_dir)
            if root == str(images_dir) and flat.is_flat(n):
                rel = str(flat.decode(n))   # a flattened directory's (flat.py): its tree path
            if rel not in NOT_CHECKSUMMED and rel != PACKED and not is_kept_out(rel) \
                    and not os.path.islink(os.path.join(root, n)):
                out.append(rel)
    twice = sorted(r for r, n in collections.Counter(out).items() if n > 1)
    if twice:
        raise CorruptCheckpointError(f"{images_dir}: {printable(twice[0])} is there both as a "
                                     "file of its folder and as a flat file")
    return sorted(out)


def _stream_record(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    return len(parts) == 3 and parts[0] == agent_data.DATA_DIR and parts[2] == agent_data.STREAMED


def is_kept_out(rel: str) -> bool:
    """Whether rel is in a checkpoint directory without being one of its files (_image_files)."""
    parts = PurePosixPath(rel).parts
    return rel == PACKED or parts[:1] == (CHUNKS,) or _stream_record(rel)


def _not_plain(images_dir: Path) -> list[str]:
    """The entries of a checkpoint directory that are neither plain files nor folders (links,
    devices, pipes, sockets), torpor's own places left out (is_kept_out: a packed
    directory's chunk links). _image_files passes them over; CRIU, as root, would open one
    named like an image it reads, and follow it."""
    out = []
    for root, dirs, names in os.walk(images_dir):
        if root == str(images_dir) and CHUNKS in dirs:
            dirs.remove(CHUNKS)
        for n in [*dirs, *names]:
            path = os.path.join(root, n)
            rel = os.path.relpath(path, images_dir)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)) and not is_kept_out(rel):
                out.append(rel)
    return sorted(out)


def manifest_untrusted(images_dir: Path, name: str = MANIFEST) -> str | None:
    """Why torpor.json (or name: torpor-store.json) could have been written by someone else,
    or None: as strict as the images (require_trusted_file), and never a link. Its owner may
    be root, us, or the directory's owner."""
    try:
        st = os.lstat(images_dir / name)
        owner = os.stat(images_dir).st_uid
    except FileNotFoundError:
        return None   # m came from elsewhere (the caller's own, in memory)
    except OSError as e:
        return f"{name}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        return f"{name} is not a plain file"
    if st.st_uid not in TRUSTED_UIDS | {owner} or st.st_mode & 0o022:
        return f"{name} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}"
    return None


def require_trusted_records(images_dir: Path) -> None:
    """Refuse (exit 9) a checkpoint whose torpor.json or torpor-store.json someone other than
    root, us or the directory's owner could have written (a packed checkpoint's restore)."""
    for name in (MANIFEST, PACKED):
        why = manifest_untrusted(images_dir, name) if os.path.lexists(images_dir / name) else None
        if why:
            raise CorruptCheckpointError(f"checkpoint {images_dir} is not trusted: {why}")


def _checked_by_agent(rel: str) -> bool:
    """The agents' GPU memory files: their own checksum per 32 MiB chunk, kept in the process
    image and verified by the agent as it reloads them, guards them; a sha256 here would read
    tens of GB twice more (seal and verify) for what the resume checks anyway. Their sizes
    are still listed and verified."""
    return PurePosixPath(rel).parts[:1] == (agent_data.DATA_DIR,)


def file_table(images_dir: Path, checksums: bool) -> dict[str, dict[str, Any]]:
    """Size and (optionally) per-block sha256 of every file in the image directory (sizes only
    for the agents' data, see _checked_by_agent)."""
    rels = _image_files(images_dir)
    sums = block_digests({r: images_dir / r for r in rels if not _checked_by_agent(r)}) \
        if checksums else {}
    return {r: {"size": (images_dir / r).stat().st_size, "sha256": sums.get(r)} for r in rels}


def write_draft(images_dir: Path, draft: dict[str, Any]) -> None:
    write_json(images_dir / DRAFT, draft)


def draft(**kw: Any) -> dict[str, Any]:
    """A draft torpor.json (no file table yet) from manifest_types.draft's typed arguments,
    as the dict the rest of torpor still passes around."""
    return manifest_types.draft(**kw).to_json()


def seal(images_dir: Path, checksums: bool, timings: dict[str, float] | None = None) -> dict[str, Any]:
    """Draft + file table -> torpor.json; the draft goes. Also finishes the seal of a
    checkpoint whose torpor died after a successful dump (journal recovery)."""
    try:
        draft = loads_json(read_untrusted(images_dir, DRAFT, MAX_MANIFEST))
    except (OSError, ValueError, RecursionError, CorruptCheckpointError) as e:
        raise CorruptCheckpointError(f"{images_dir}: no readable draft manifest ({e})") from e
    if timings:
        draft["timings"] = {k: round(v, 4) for k, v in timings.items()}
    draft["files"] = file_table(images_dir, checksums)
    draft["sizes"]["total"] = sum(f["size"] for f in draft["files"].values())
    write(images_dir, draft)
    (images_dir / DRAFT).unlink(missing_ok=True)
    return draft


def add_checksums(images_dir: Path) -> bool:
    """Give a sealed checkpoint the checksums it was sealed without (it was to go into the
    image store, which names every chunk by its sha256, and did not: store_packing.py). False when
    it had them."""
    m = read(images_dir)
    if all(f["sha256"] is not None or _checked_by_agent(rel) for rel, f in m["files"].items()):
        return False
    m["files"] = file_table(images_dir, True)
    m["sizes"]["total"] = sum(f["size"] for f in m["files"].values())
    write(images_dir, m)
    return True


def clear_partial(images_dir: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove what a failed dump left (it may fill the disk, and holds memory); keep CRIU's
    log, which says why (and the names in keep: the agents' data, until they are resumed)."""
    for child in images_dir.iterdir():
        if child.name != DUMP_LOG and child.name not in keep:
            shutil.rmtree(child) if child.is_dir() else child.unlink(missing_ok=True)


def dump_succeeded(images_dir: Path) -> bool:
    """CRIU's own word, from the tail of its dump log."""
    try:
        return DUMP_OK.encode() in read_untrusted_tail(images_dir, DUMP_LOG, 4096)
    except (OSError, CorruptCheckpointError):
        return False


def images_whole(images_dir: Path) -> bool:
    """Whether CRIU wrote the images it writes last on every dump (its inventory after all
    the rest): a dump whose CRIU ended the program and then died before saying so."""
    return all((images_dir / name).is_file() for name in REQUIRED_IMAGES)


def write(images_dir: Path, manifest: dict[str, Any]) -> Path:
    validate(manifest)
    path = images_dir / MANIFEST
    write_json(path, manifest)
    return path


def validate(m: Any) -> dict[str, Any]:
    """m, when it is a well-formed manifest (manifest_types.Manifest.from_json checks every
    field); CorruptCheckpointError naming the field otherwise."""
    Manifest.from_json(m)
    return m


def agents(m: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The manifest's "agent" entries by PID at checkpoint ({} when none), checked."""
    raw = m.get("agent", {})
    checked = manifest_types._agents(raw) if raw is not None else {}
    return {pid: raw[str(pid)] for pid in checked}


def parse(data: bytes, origin: str) -> dict[str, Any]:
    try:
        m = loads_json(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{origin}: manifest is not valid JSON ({e})") from e
    try:
        return validate(m)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{origin}: {e}") from e


def mark_damaged(images_dir: Path, why: str) -> None:
    """A sealed checkpoint that nothing can make whole (its own records of its GPU data are
    malformed, store_packing.py): every later read refuses it with why, and it can only be
    removed."""
    atomic_write(images_dir / DAMAGED, why.encode() + b"\n")


def read(images_dir: Path) -> dict[str, Any]:
    path = images_dir / MANIFEST
    if not images_dir.is_dir():
        raise NotFoundError(f"no checkpoint directory {images_dir}")
    try:
        said = read_untrusted(images_dir, DAMAGED, MAX_DAMAGED).decode(errors="replace").strip()
    except FileNotFoundError:
        pass
    else:   # shown on a terminal, and the directory may be another host's: printable only
        raise CorruptCheckpointError(f"{images_dir} is damaged and can only be removed: "
                                     f"{printable(said, MAX_DAMAGED)}")
    try:
        data = read_untrusted(images_dir, MANIFEST, MAX_MANIFEST)
    except FileNotFoundError:
        raise NotFoundError(f"{images_dir} holds no torpor checkpoint (no {MANIFEST})") from None
    return parse(data, str(path))


def verify(images_dir: Path, m: dict[str, Any], checksums: bool = True,
           elsewhere: Mapping[str, int] | None = None) -> None:
    """Every listed file present, inside the directory, of the right size and hash.
    elsewhere: files kept out of the directory (the GPU data a restore streams from the image
    store) -> their sizes there."""
    root = images_dir.resolve()
    elsewhere = elsewhere or {}
    bad: list[str] = [f"{printable(rel)} is not listed in the manifest"
                      for rel in _image_files(images_dir) if rel not in m["files"]]
    bad += [f"{printable(rel)} is a symbolic link or a special file: a checkpoint holds plain "
            "files only" for rel in _not_plain(images_dir)]
    untrusted = manifest_untrusted(images_dir)
    if untrusted:
        bad.append(untrusted)
    bad += [f"{name} is not listed in the manifest" for name in REQUIRED_IMAGES
            if name not in m["files"]]
    todo: dict[str, tuple[Path, list[str]]] = {}
    for rel, info in m["files"].items():
        if rel in elsewhere:
            if elsewhere[rel] != info["size"]:
                bad.append(f"{printable(rel)} has {elsewhere[rel]} bytes in the image store, manifest "
                           f"says {info['size']}")
            continue
        path = flat.locate(images_dir, safe_relpath(rel))
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):   # missing, a link loop, a name too long
            bad.append(f"{printable(rel)} is missing")
            continue
        if root not in real.parents or path.is_symlink() or not real.is_file():
            bad.append(f"{printable(rel)} is not a plain file inside the checkpoint")
            continue
        untrusted = require_trusted_file(real)
        if untrusted:
            bad.append(untrusted)
            continue
        if real.stat().st_size != info["size"]:
            bad.append(f"{printable(rel)} has {real.stat().st_size} bytes, manifest says {info['size']}")
            continue
        if checksums and info.get("sha256"):
            todo[rel] = (real, info["sha256"])
    if todo:
        got = block_digests({rel: real for rel, (real, _want) in todo.items()})
        bad += [f"{printable(rel)} checksum mismatch" for rel, (_real, want) in todo.items()
                if got[rel] != want]
    for pid, entry in agents(m).items():   # the agents' data: all there, as the agent wrote it
        for rel, size in zip(agent_data.rel_paths(pid, len(entry["files"])), entry["files"]):
            if m["files"].get(rel, {}).get("size") != size:
                bad.append(f"{printable(rel)} (GPU memory of PID {pid}) is not in the file table with "
                           f"the {size} bytes its agent wrote")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CorruptCheckpointError(f"checkpoint {images_dir} is damaged: "
                                     + "; ".join(bad[:3]) + more)
