"""Fingerprints: what the image store holds already is neither copied over PCIe nor written
(the agent's GPU data), nor hashed again (everything else a checkpoint holds) (issue 5).

A checkpoint into the store (`torpor checkpoint --store`) hands each agent the fingerprints of
every GPU chunk the store's snapshots hold (`known`). The agent fingerprints every 4 MiB part
of its data on the GPU; a known part is skipped: its bytes stay a hole in the data file. The
agent's index (agent_data.INDEX, beside the data files) lists every part:

    torpor-gpu-fingerprints 2
    <file k> <offset> <data length> <store chunk length> <32 hex: fingerprint> <0|1|z>

the last field 0 (copied into the file), 1 (skipped) or z (zero: the part read all zero on the
GPU, issue 20; it is a hole that needs no filling, and its store chunk is zeros, which the
store holds as nothing). Version 1, written before zero parts, has 0|1 only and is still read;
a z there, a line naming a part twice, or one outside the data files is refused.

A part is exactly one store chunk of its data file (offsets are multiples of PART, the store's
chunk size), so its fingerprint names that chunk: a snapshot records, per data file, the
fingerprint of each chunk ("fingerprints": [[chunk index, fingerprint], ...]); pack (images.py)
takes the skipped chunks from there without reading them, and keeps a copy of the index with
nothing skipped (the store's copy of the file is complete).

Until a skipped part is filled, its data file is not the program's data. Only the checkpoint
that skipped it fills it from the store (fill): its rollback, before the agent's resume, and a
pack that fails (fill_dir), so the directory stands on its own. A restore does not: an index
from an archive must not make this host's store hand its chunks to a program (the engine
refuses data with skipped parts). The agent checks every part against its fingerprint on the
GPU as it reloads, so a hole left unfilled, or filled with other bytes, fails the resume and
loses nothing.

Nothing in an index is trusted: file numbers, offsets and lengths are checked against the files
before anything is written. Fingerprints are scoped by **owner** (owner_of: a container by
its name at torpor, container:<id>@<runtime root key>, or a bare program by its uid,
uid:<uid>): the agent runs inside the program, so whatever fingerprints it is handed, the
program can read, and whatever its index names, the program can write. Handed the whole
store's, a program could learn which chunks other tenants hold and, crafting data to match one
(the fold is not cryptographic), have its checkpoint name another tenant's chunk and read it
back at restore. So a checkpoint is only ever handed, and its index only ever resolved
against, the fingerprints of its owner's own snapshots (their meta's "owner", matched whole).
One container id may live under two runtime roots (containerd namespaces, podman beside ctr),
each perhaps another tenant's: the root key (runtime/markers.py root_key) makes them two
owners. A container an earlier torpor created (agent directory agents/<id>, no key) keeps
container:<id>, the owner its snapshots were packed under before keys; a keyed container never
matches those, so its first checkpoint after the upgrade copies and hashes its data whole
once (the store still keeps each chunk once by name).

A checkpoint whose agents streamed their data straight into the store (stream.py) leaves
every part a hole, and records beside the index which chunk each part is (agent_data.STREAMED):

    torpor-gpu-streamed 2
    <file k> <offset> <data length> <store chunk length> <sha256, or - for zeros>
        <host fingerprint: chunk.fingerprint of the chunk's data, or - for zeros>

Those holes are filled, and packed, like skipped ones (fill, pack_arguments), from the record
rather than from fingerprints: its chunks are named by sha256, and are this checkpoint's own.
The host fingerprint is torpor's, computed by the intake from the same private copy of the
part it named and stored (never the agent's fold); the pack records it as the file's
"host_fingerprints", so this host's store knows, for its own GPU data chunks, name -> XXH3-128
of the bytes it named. A streamed restore from the store's own snapshot then verifies those
chunks by that fingerprint instead of sha256 (own_fingerprints, chunk.py "Verifying by
fingerprint"). Version 1, without it, is still read (its parts verify by sha256).

Host fingerprints do for the rest of a checkpoint (CRIU's page images above all) what the
agent's do for GPU data, on the host: the pack fingerprints every chunk it reads (XXH3-128,
chunk.fingerprint, ~17x sha256's speed), and a chunk whose fingerprint one of the owner's
snapshots records is taken from there without its sha256 (writer.py). A program controls its
own memory, so the owner scoping above holds for these too; the worst a crafted collision can
do is give its own checkpoint its own older bytes.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable

from .. import agent_data, oci
from ..errors import (CorruptCheckpointError, DamagedRecordsError, NotFoundError, TorporError,
                      UsageError)
from ..files import atomic_write, fsync_dir, read_untrusted
from ..layout import MAX_RECORD
from .backend import BLOB_NAME
from .snapshot import FINGERPRINT
from .store import CHUNK_SIZE, Store
from .writer import StreamedRef

log = logging.getLogger(__name__)
PART = 4 << 20          # the agent's part (mover.c FILE_ALIGN): one store chunk
HEADER = "torpor-gpu-fingerprints 2"
HEADER_V1 = "torpor-gpu-fingerprints 1"   # before zero parts: still read
STREAMED_HEADER = "torpor-gpu-streamed 2"
STREAMED_HEADER_V1 = "torpor-gpu-streamed 1"   # before host fingerprints: still read


@dataclasses.dataclass(frozen=True)
class Part:
    file: int
    offset: int
    length: int      # the data the agent fingerprinted
    store_len: int   # the store chunk it is (data, and the hole after)
    fp: str
    skipped: bool
    zero: bool = False   # all zero on the GPU: never copied, written nor stored

    @property
    def chunk(self) -> int:
        return self.offset // PART

    @property
    def flag(self) -> str:
        return "z" if self.zero else "1" if self.skipped else "0"


@dataclasses.dataclass(frozen=True)
class Streamed:
    """A part the agent streamed into the store (stream.py): its place, and its chunk."""
    file: int
    offset: int
    length: int
    store_len: int
    sha: str | None   # None: zeros, stored as nothing
    fp: str | None = None   # chunk.fingerprint of its data (None: zeros, or a version 1 record)

    @property
    def chunk(self) -> int:
        return self.offset // PART

    @property
    def ref(self) -> list[Any]:
        return [self.sha, self.store_len]


def usable(store: Store) -> bool:
    """Fingerprints name store chunks only where a chunk is an agent's part."""
    return store.chunk_size == PART == CHUNK_SIZE


def _lines(text: str, origin: str, sizes: list[int], headers: dict[str, int], what: str,
           make: Callable[[list[str], int], Part | Streamed]) -> list[Any]:
    """The records of an index or a stream record (one of headers, then one a line; make
    builds one from its fields and the header's version or raises ValueError), each checked
    against the data files' sizes; DamagedRecordsError when any line is malformed, points
    outside its file, or names a part another line names."""
    lines = text.splitlines()
    if not lines or lines[0] not in headers:
        raise DamagedRecordsError(f"{origin}: not a {what} ({next(iter(headers))!r})")
    version = headers[lines[0]]
    parts = []
    seen: set[tuple[int, int]] = set()
    for n, line in enumerate(lines[1:], 2):
        try:
            p = make(line.split(), version)
            if not (0 <= p.file < len(sizes) and p.offset % PART == 0 and p.offset >= 0
                    and 0 < p.length <= p.store_len <= PART
                    and p.offset + p.store_len <= sizes[p.file]
                    and (p.file, p.offset) not in seen):
                raise ValueError
            seen.add((p.file, p.offset))
        except ValueError:
            raise DamagedRecordsError(f"{origin}, line {n}: malformed or outside the data "
                                      f"files: {line[:120]!r}") from None
        parts.append(p)
    return parts


def _part(f: list[str], version: int) -> Part:
    if len(f) != 6 or not FINGERPRINT.fullmatch(f[4]) \
            or f[5] not in (("0", "1", "z") if version >= 2 else ("0", "1")):
        raise ValueError
    return Part(int(f[0]), int(f[1]), int(f[2]), int(f[3]), f[4], f[5] == "1", f[5] == "z")


def _streamed(f: list[str], version: int) -> Streamed:
    if len(f) != (6 if version >= 2 else 5) or not (f[4] == "-" or BLOB_NAME.fullmatch(f[4])):
        raise ValueError
    fp = None
    if version >= 2:   # zeros have neither a name nor a fingerprint; a chunk has both
        if (f[4] == "-") != (f[5] == "-") or not (f[5] == "-" or FINGERPRINT.fullmatch(f[5])):
            raise ValueError
        fp = None if f[5] == "-" else f[5]
    return Streamed(int(f[0]), int(f[1]), int(f[2]), int(f[3]), None if f[4] == "-" else f[4],
                    fp)


def parse(text: str, origin: str, sizes: list[int]) -> list[Part]:
    """The index text of a program with data files of these sizes, checked."""
    return _lines(text, origin, sizes, {HEADER: 2, HEADER_V1: 1}, "GPU fingerprint index",
                  _part)


def parse_streamed(text: str, origin: str, sizes: list[int]) -> list[Streamed]:
    """A stream record's parts, checked as an index's are."""
    return _lines(text, origin, sizes, {STREAMED_HEADER: 2, STREAMED_HEADER_V1: 1},
                  "stream record", _streamed)


def dump_streamed(parts: Iterable[Streamed]) -> str:
    """A stream record (version 2); a part of a chunk without its fingerprint is refused."""
    lines = [STREAMED_HEADER + "\n"]
    for p in parts:
        if (p.sha is None) != (p.fp is None):
            raise ValueError(f"streamed part {p} needs both a name and a fingerprint, or none")
        lines.append(f"{p.file} {p.offset} {p.length} {p.store_len} {p.sha or '-'} "
                     f"{p.fp or '-'}\n")
    return "".join(lines)


def dump(parts: Iterable[Part]) -> str:
    return "".join([HEADER + "\n"] + [
        f"{p.file} {p.offset} {p.length} {p.store_len} {p.fp} {p.flag}\n"
        for p in parts])


def _read(path: Path, sizes: list[int], parser: Callable[[str, str, list[int]], list[Any]]
          ) -> list[Any] | None:
    try:
        text = read_untrusted(path.parent, path.name, MAX_RECORD).decode()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as e:
        raise DamagedRecordsError(f"{path}: not text ({e})") from None
    except OSError as e:           # an I/O error may pass: not damaged for good
        raise CorruptCheckpointError(f"{path}: unreadable ({e})") from None
    return parser(text, str(path), sizes)


def read(data_dir: Path, sizes: list[int]) -> list[Part] | None:
    """The index of one program's data directory; None when it has none."""
    return _read(data_dir / agent_data.INDEX, sizes, parse)


def read_streamed(data_dir: Path, sizes: list[int]) -> list[Streamed] | None:
    """The stream record of one program's data directory; None when it has none."""
    return _read(data_dir / agent_data.STREAMED, sizes, parse_streamed)


def has_skipped(data_dir: Path) -> bool:
    """Does the program in data_dir have parts still to fill (fill): skipped, or streamed?"""
    if os.path.lexists(data_dir / agent_data.STREAMED):
        return True
    if not os.path.lexists(data_dir / agent_data.INDEX):
        return False
    sizes = [(data_dir / agent_data.file_name(k)).stat().st_size for k in range(_file_count(data_dir))]
    return any(p.skipped for p in read(data_dir, sizes) or ())


def any_skipped(images_dir: Path) -> bool:
    """Does a checkpoint directory hold GPU data still to fill from the store?"""
    return any(has_skipped(p) for p in (images_dir / agent_data.DATA_DIR).glob("*")
               if p.is_dir() and not p.is_symlink())


CONTAINER_OWNER = "container:"
UID_OWNER = "uid:"
_UID = re.compile(r"0|[1-9][0-9]{0,9}")


def owner_of(container: str = "", uid: int | None = None) -> str:
    """The owner key of a container's checkpoints, or of a bare program's (by its uid).
    container: the container's name at torpor (oci.container_name), as its agent directory
    and torpord's record are named: <id>@<root key> (container:<id>@<root key>), so one id
    under two runtime roots (two containerd namespaces, podman beside ctr: perhaps two
    tenants) is two owners; <id> alone for a container an earlier torpor created (its agent
    directory agents/<id>), which keeps the owner its snapshots were packed under,
    container:<id>. No id holds '@' (oci.validate_container_id), so neither form is the
    other's. UsageError for a name that is neither, or a negative uid."""
    if container:
        return CONTAINER_OWNER + oci.validate_container_name(container)
    if uid is None:
        raise ValueError("an owner is a container or a uid")
    if int(uid) < 0:
        raise UsageError(f"bad uid {uid!r} for a fingerprint owner")
    return f"{UID_OWNER}{int(uid)}"


def check_owner(owner: str) -> str:
    """owner as owner_of makes one (container:<container name>, uid:<decimal>), else
    UsageError: an owner is matched as a whole string against the snapshots' "owner", so one
    spelled otherwise could only ever name another's, or none."""
    if isinstance(owner, str):
        if owner.startswith(CONTAINER_OWNER):
            try:
                oci.validate_container_name(owner[len(CONTAINER_OWNER):])
                return owner
            except UsageError:
                pass
        elif owner.startswith(UID_OWNER) and _UID.fullmatch(owner[len(UID_OWNER):]):
            return owner
    raise UsageError(f"bad fingerprint owner {owner!r}: container:<id>[@<root key: 16 "
                     "lowercase hex>] or uid:<decimal uid>")


@dataclasses.dataclass(frozen=True)
class Known:
    """The chunks of an owner's snapshots by fingerprint: fingerprint -> [sha256 or None,
    length]."""
    gpu: dict[str, list[Any]]    # the agents' ("fingerprints")
    host: dict[str, list[Any]]   # chunk.fingerprint of what the host read ("host_fingerprints")


def known(store: Store, owner: str, check: bool = True) -> Known:
    """The fingerprints of every snapshot of owner in the store (hold the store's lock,
    shared, until what uses them is committed: gc then keeps those chunks). A GPU chunk the
    store holds damaged (backend.has_blob) is left out: the agents would skip its data, and
    nothing could fill it in; left out, they copy it and the pack stores it again. Host
    fingerprints are checked as each is used (writer.py), where the data is at hand. Without
    check (a restore filling what was skipped: the read of each chunk then names a damaged
    one) no chunk is looked at: the look costs one open and read each, over every chunk of
    the owner's snapshots."""
    if not owner:
        raise ValueError("fingerprints need an owner")
    check_owner(owner)
    out = Known({}, {})
    mine = b'"owner": ' + json.dumps(owner).encode()   # as snapshot.dump writes it
    for name in store.backend.snapshots():
        try:   # others' snapshots are not parsed (~8 ms each for a 16 GiB program's)
            if mine not in store.backend.get_snapshot(name):
                continue
        except FileNotFoundError:
            continue   # removed since it was listed
        doc = store.load(name)
        if doc["meta"].get("owner") != owner:
            continue
        for entry in doc["files"].values():
            for field, into in (("fingerprints", out.gpu), ("host_fingerprints", out.host)):
                for index, fp in entry.get(field, ()):
                    into[fp] = entry["chunks"][index]
    if not check:
        return out
    sound = store.sound_chunks({r[0]: r[1] for r in out.gpu.values() if r[0] is not None})
    for fp in [fp for fp, r in out.gpu.items() if r[0] is not None and r[0] not in sound]:
        del out.gpu[fp]
    return out


def known_fd(fps: Iterable[str]) -> int:
    """The agent's `known` file: 16 bytes a fingerprint, in memory (memfd); close it."""
    fd = os.memfd_create("torpor-known-fingerprints", os.MFD_CLOEXEC)
    try:
        os.write(fd, b"".join(bytes.fromhex(fp) for fp in fps)) if fps else None
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def given(parts: list[Part], refs: dict[str, list[Any]], file: int) -> dict[int, list[Any]]:
    """For data file `file`: chunk index -> the stored chunk each part the store knows is
    (Writer takes them without reading: skipped, or copied and the same), and zeros (stored
    as nothing) for each zero part. TorporError when the store no longer names a skipped
    one."""
    out: dict[int, list[Any]] = {}
    for p in parts:
        if p.file != file:
            continue
        if p.zero:
            out[p.chunk] = [None, p.store_len]
            continue
        ref = refs.get(p.fp)
        if ref is not None and ref[1] == p.store_len:
            out[p.chunk] = ref
        elif p.skipped:
            raise TorporError(f"GPU chunk {p.fp} (file {p.file}, offset {p.offset}) that "
                              "the agent skipped is not in the image store any more")
    return out


def holes(store: Store, data_dir: Path, sizes: list[int], owner: str
          ) -> list[tuple[Part | Streamed, list[Any]]]:
    """Every part of the program in data_dir that is a hole the store fills (skipped: found by
    its owner's fingerprints; streamed: named by its stream record), with its chunk's ref.
    TorporError when the store no longer has one. Hold the store's lock meanwhile."""
    return _holes(store, data_dir, read(data_dir, sizes) or [],
                  read_streamed(data_dir, sizes) or [], owner)


def _holes(store: Store, data_dir: Path, parts: list[Part], streamed: list[Streamed],
           owner: str) -> list[tuple[Part | Streamed, list[Any]]]:
    out: list[tuple[Part | Streamed, list[Any]]] = []
    skipped = [p for p in parts if p.skipped]
    if skipped:
        refs = known(store, owner, check=False).gpu
        for p in skipped:
            ref = refs.get(p.fp)
            if ref is None or ref[1] != p.store_len:
                raise TorporError(f"the GPU data of {data_dir} needs chunk {p.fp} (file "
                                  f"{p.file}, offset {p.offset}) from store {store.where}, "
                                  "which no longer has it (or holds it damaged)")
            out.append((p, ref))
    return out + [(s, s.ref) for s in streamed]


def fill(store: Store, data_dir: Path, fds: list[int], sizes: list[int], owner: str) -> int:
    """Write every skipped or streamed part of the program in data_dir from the store into its
    hole (fds: its data files, read-write, in order), then mark the index filled and drop the
    stream record. The bytes written; 0 when nothing is to fill."""
    parts = read(data_dir, sizes) or []
    streamed = read_streamed(data_dir, sizes) or []
    skipped = any(p.skipped for p in parts)
    if not skipped and not streamed:
        return 0
    done = 0
    with store.backend.lock(False, store.lock_timeout):
        for p, ref in _holes(store, data_dir, parts, streamed, owner):
            if ref[0] is not None:             # zeros: the hole reads as them
                data = memoryview(store.read_chunk(ref, f"GPU data of {data_dir}"))[:p.length]
                at = 0
                while at < len(data):          # a short write goes on where it stopped
                    at += os.pwrite(fds[p.file], data[at:], p.offset + at)
            done += p.length
        for fd in fds:
            os.fsync(fd)
    if skipped:   # every part is in the files now
        atomic_write(data_dir / agent_data.INDEX,
                     dump(dataclasses.replace(p, skipped=False) for p in parts).encode())
    if streamed:
        (data_dir / agent_data.STREAMED).unlink()
        fsync_dir(data_dir)
    return done


def _file_count(prog: Path) -> int:
    """How many data files a program's directory holds (gpu-memory-0.bin ...)."""
    k = 0
    while (prog / agent_data.file_name(k)).is_file():
        k += 1
    return k


def streamed_chunks(images_dir: Path) -> set[str]:
    """The chunks the stream records of a checkpoint directory name (zeros are none)."""
    names: set[str] = set()
    for prog in sorted((images_dir / agent_data.DATA_DIR).glob("*")):
        if not prog.name.isdigit() or prog.is_symlink() or not prog.is_dir():
            continue
        sizes = [(prog / agent_data.file_name(k)).stat().st_size
                 for k in range(_file_count(prog))]
        names |= {p.sha for p in read_streamed(prog, sizes) or () if p.sha is not None}
    return names


def fill_dir(store: Store, images_dir: Path, owner: str) -> int:
    """fill() for every program of a checkpoint directory (its pack failed): the bytes."""
    done = 0
    data = agent_data.DataDir(images_dir / agent_data.DATA_DIR)
    for prog in sorted(data.root.glob("*")):
        if not prog.name.isdigit() or not has_skipped(prog):
            continue
        fds = data.for_fill(int(prog.name), _file_count(prog))
        try:
            done += fill(store, prog, fds, [os.fstat(fd).st_size for fd in fds], owner)
        finally:
            for fd in fds:
                os.close(fd)
    return done


def own_fingerprints(store: Store, packed: dict[str, Any], rels: Iterable[str]
                     ) -> dict[str, str]:
    """For a streamed restore of the packed checkpoint whose snapshot is `packed` (read from
    the checkpoint directory: untrusted): chunk name -> the host fingerprint this host recorded
    of it when it stored it, for the chunks of the files rels (its agents' data files) that
    may be verified by that fingerprint instead of sha256 (chunk.py, "Verifying by
    fingerprint"). Taken only from the store's OWN copy of a snapshot of the same name, and
    only when:
      - the store holds it and it has an owner: written here by a pack (Writer.commit), not
        imported (Store.import_snapshot drops the owner: fingerprints that came with it were
        never computed here);
      - every file of rels lists, in the store's copy, exactly the chunks the packed doc lists
        (else the checkpoint is not the one the store holds: all its chunks verify by sha256);
      - the store's entry records a host fingerprint for the chunk ("host_fingerprints").
    Nothing is ever taken from the packed doc's own fingerprints: a directory could carry any.
    Every other chunk is left out: verified by sha256, as before.

    The owner need not be the restoring program's: the owner scoping above (known) is about
    resolving a NAME by a fingerprint, where a crafted collision could hand a program another
    tenant's chunk. Here the name comes first, and the fingerprint only verifies the bytes
    read for it, and is the XXH3-128 of the data the host itself named by that sha256 (the
    intake fingerprints the same private copy it names and stores: stream.Intake._take; the
    writer the bytes it read). So the check accepts the bytes that name stands for, and a
    blob damaged or replaced on disk fails it (not cryptographically: the blob is in this
    host's store, which only torpor writes). A chunk named twice with two fingerprints is
    left to sha256."""
    try:
        own = store.load(packed["name"])
    except (NotFoundError, CorruptCheckpointError) as e:
        log.info("the store's copy of snapshot %s is not usable (%s): its GPU data verifies "
                 "by sha256", packed["name"], e)
        return {}
    owner = own["meta"].get("owner")
    if not isinstance(owner, str) or not owner:
        return {}                       # imported, or never an owner's: sha256
    rels = list(rels)
    for rel in rels:
        mine, theirs = own["files"].get(rel), packed["files"].get(rel)
        if mine is None or theirs is None or mine["chunks"] != theirs["chunks"]:
            log.info("snapshot %s in the store differs from the packed checkpoint's (%s): its "
                     "GPU data verifies by sha256", packed["name"], rel)
            return {}
    out: dict[str, str] = {}
    clash: set[str] = set()
    for rel in rels:
        mine = own["files"][rel]
        for index, fp in mine.get("host_fingerprints", ()):
            name = mine["chunks"][index][0]
            if name is None:
                continue
            if out.setdefault(name, fp) != fp:
                clash.add(name)
    for name in clash:
        del out[name]
    return out


def pack_arguments(store: Store, images_dir: Path, refs: dict[str, list[Any]]
                   ) -> dict[str, dict[str, Any]]:
    """For Store.ingest_dir's extra: every agent data file of the checkpoint in images_dir
    that has an index gets its skipped chunks (given, from refs: its owner's known GPU
    fingerprints) and its fingerprints, and its streamed chunks (the stream record) with the
    host fingerprints the intake recorded of them; each index goes in with nothing skipped
    (the snapshot's file is complete)."""
    out: dict[str, dict[str, Any]] = {}
    root = images_dir / agent_data.DATA_DIR
    if not usable(store) or not root.is_dir():
        return out
    for index in sorted(root.glob(f"*/{agent_data.INDEX}")):
        prog = index.parent
        files = [prog / agent_data.file_name(k) for k in range(_file_count(prog))]
        sizes = [f.stat().st_size for f in files]
        parts = _read(index, sizes, parse) or []
        streamed = read_streamed(prog, sizes) or []
        for k, f in enumerate(files):
            rel = f.relative_to(images_dir).as_posix()
            chunks = given(parts, refs, k)
            chunks.update({s.chunk: StreamedRef(s.ref) for s in streamed if s.file == k})
            out[rel] = {"given": chunks,   # zero parts: no fingerprint, their chunk is none
                        "fingerprints": [[p.chunk, p.fp] for p in parts
                                         if p.file == k and not p.zero],
                        # the host's own, of what it named (the stream record is torpor's)
                        "host_fingerprints": [[s.chunk, s.fp] for s in streamed
                                              if s.file == k and s.fp is not None]}
        if streamed:   # the snapshot's files are whole: no record of holes goes with them
            out[(prog / agent_data.STREAMED).relative_to(images_dir).as_posix()] = {"leave_out": True}
        out[index.relative_to(images_dir).as_posix()] = {"src": io.BytesIO(dump(
            dataclasses.replace(p, skipped=False) for p in parts).encode())}
    return out
