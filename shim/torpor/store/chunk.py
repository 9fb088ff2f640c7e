"""The chunk format: a chunk is named by the sha256 of its raw data and stored as one blob.

Name: sha256 of the RAW (uncompressed) data, 64 lowercase hex. Collision resistance matters:
imported folders are untrusted, and a chunk that collided with another checkpoint's would be
restored into it. hashlib's sha256 runs on OpenSSL (SHA-NI where the CPU has it, ~1.5 GB/s a
core on this machine) and drops the GIL, so chunks hash in parallel.

Blob: a 16-byte header, then the payload:
    magic  b"TPC1"   (4 bytes)
    codec  0 raw, 1 zstd  (1 byte), then 3 zero bytes
    length of the raw data, little-endian (8 bytes)
zstd (level 1: on GPU-shaped data levels 1 and 3 gave the same ratio, 1 ran faster) is used
when it makes the chunk smaller, else the payload is the raw data: random bytes and dense
float tensors barely compress, and storing them raw saves decompressing them at restore.
So the header and the blob's size must agree (`_shape`): a raw payload is exactly the length,
a zstd one starts with zstd's frame magic, is at least the smallest frame and is shorter than
the length. Every read checks that first; a chunk about to be reused by its name is checked
for that alone (`check_stored`: one open, fstat and 20-byte read, no hash), which finds a
truncated chunk, a zeroed one, a link, a FIFO or a directory in its place, though not a
flipped bit inside a chunk of the right size (`torpor gc --verify` reads everything).
The "several threads" are the store's worker pool, one chunk each, rather than zstd's own
threads: the pool also hashes and writes, and zstandard releases the GIL while it works.

Chunks of zeros are never stored: a snapshot records them as null (GPU memory holds many
untouched or cleared regions).

Fingerprint: XXH3-128 of the raw data, 32 lowercase hex; ~17x sha256's speed (28 GB/s a core
against 1.7 on this machine). Not a name: it is not collision resistant, so it only ever
stands for a chunk of the same owner's own snapshots (fingerprints.py), to spare a second
checkpoint the sha256 of what did not change.

Verifying by fingerprint: every chunk read is verified, by its sha256 name, or, for a GPU data
chunk this host itself streamed into its store (store/stream.py), by the fingerprint the host
computed of the very bytes it named, when it named them (read_blob_into's fp; ~20x cheaper: a
streamed restore of 17 GB spent most of its ~64 thread-seconds in sha256). That catches what
the sha256 check is there for on a chunk of this host's own: a blob damaged on disk or
replaced by other bytes. It is used only where the fingerprint comes from a record this host
wrote and kept (its store's own snapshot of a checkpoint, with an owner: never an imported
one, never what a checkpoint directory says: fingerprints.own_fingerprints), so a checkpoint
cannot pick the check its chunks pass; every other chunk, those imported from elsewhere
above all, is verified by sha256.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
import threading
from pathlib import Path

import xxhash
import zstandard

from ..errors import CorruptCheckpointError

MAGIC = b"TPC1"
HEADER = struct.Struct("<4sB3xQ")
RAW, ZSTD = 0, 1
LEVEL = 1
MAX_CHUNK = 256 << 20   # the largest chunk a blob may claim: refuses decompression bombs
ZSTD_FRAME = b"\x28\xb5\x2f\xfd"   # every zstd frame starts with it (RFC 8878)
ZSTD_MIN = 9            # the smallest zstd frame: magic, 2-byte frame header, one block header
HEAD = HEADER.size + len(ZSTD_FRAME)   # what _shape reads of a blob

_local = threading.local()


def _contexts() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    """zstd contexts are not thread-safe; each worker thread keeps its own pair."""
    if not hasattr(_local, "ctx"):
        _local.ctx = (zstandard.ZstdCompressor(level=LEVEL), zstandard.ZstdDecompressor())
    return _local.ctx


def name_of(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


_ZEROS: dict[int, bytes] = {}


def zeros(length: int) -> bytes:
    """A shared read-only buffer of length zero bytes (one per chunk length seen)."""
    buf = _ZEROS.get(length)
    if buf is None:
        buf = _ZEROS.setdefault(length, bytes(length))
    return buf


_ZERO_NAMES: dict[int, str] = {}


def zero_name(length: int) -> str:
    """The sha256 name of length zero bytes: data with that name is zeros (no second pass)."""
    name = _ZERO_NAMES.get(length)
    if name is None:
        name = _ZERO_NAMES.setdefault(length, name_of(zeros(length)))
    return name


def is_zero(data: bytes) -> bool:
    return data == zeros(len(data))   # memcmp: ~9 GB/s, against ~1.7 GB/s for any()


def encode(data: bytes | memoryview) -> bytes:
    """The blob for data: zstd when that is smaller, else raw."""
    packed = _contexts()[0].compress(data)
    if len(packed) < len(data):
        return HEADER.pack(MAGIC, ZSTD, len(data)) + packed
    return HEADER.pack(MAGIC, RAW, len(data)) + data


def read_blob_file(path: Path, where: str) -> bytes:
    """The bytes of a blob file that may come from anywhere (an imported folder, a copied
    checkpoint directory): never through a link, never blocking on a FIFO, a regular file only,
    and no more than a blob can hold (a chunk's worst-case zstd size). FileNotFoundError when
    it is not there; CorruptCheckpointError when it is no plain file."""
    fd = _open_blob(path, where)
    with open(fd, "rb") as f:
        return f.read(HEADER.size + MAX_CHUNK + 1024)


def _open_blob(path: Path, where: str) -> int:
    """An fd of the blob file at path, read-only: never through a link, never blocking on a
    FIFO, a regular file only. FileNotFoundError when it is not there (the caller says what a
    missing chunk means); CorruptCheckpointError when it is no plain file."""
    opened = _open_regular(path)
    if isinstance(opened, str):
        raise CorruptCheckpointError(f"chunk {path.name} ({where}) {opened}")
    return opened[0]


def _open_regular(path: Path) -> tuple[int, os.stat_result] | str:
    """_open_blob's fd and its fstat, or what is wrong with the file ("is not a regular
    file")."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                     | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:   # ELOOP: a link; ENXIO: a socket
        return f"cannot be read: {e.strerror}"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return "is not a regular file"
    return fd, st


def _damaged(name: str, where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"chunk {name} ({where}) is damaged: {why}")


def _shape(head: bytes | memoryview, size: int) -> tuple[int, int] | str:
    """A blob's header checked against the blob's size (head: its first HEAD bytes, fewer
    only when it is shorter): (codec, length of its data), or what is wrong. What encode
    writes: raw, exactly the length; zstd, a frame shorter than the length (else it is raw)."""
    if size < HEADER.size or len(head) < HEADER.size:
        return f"{size} bytes, shorter than its header"
    magic, codec, length = HEADER.unpack_from(head)
    if magic != MAGIC or codec not in (RAW, ZSTD) or length > MAX_CHUNK:
        return "bad header"
    payload = size - HEADER.size
    if codec == RAW and payload != length:
        return f"{payload} bytes where the header says {length}"
    if codec == ZSTD and not (ZSTD_MIN <= payload < length
                              and bytes(head[HEADER.size:HEAD]) == ZSTD_FRAME):
        return f"{payload} bytes are no zstd frame of {length} bytes"
    return codec, length


def _header(head: bytes | memoryview, size: int, name: str, where: str) -> tuple[int, int]:
    """A blob's header, checked against its size (_shape): (codec, length of its data)."""
    shape = _shape(head, size)
    if isinstance(shape, str):
        raise _damaged(name, where, shape)
    return shape


def check_stored(path: Path, length: int | None = None) -> str | None:
    """Whether the blob file at path can be the chunk it is named after (of length bytes,
    when given), as far as its type, header and size tell: None when it can, else what is
    wrong. FileNotFoundError when nothing is there. For a chunk about to be reused by its
    name (backend.has_blob), so cheap: one open (never through a link, never blocking on a
    FIFO), one fstat and one 20-byte read; no decompression, no hash. 10,000 looks took 90 ms
    on a 2-core VM against 59 for the os.path.lexists they replace (3 us more a reused chunk,
    where its xxh3 takes 160 us and its sha256 2.5 ms); ~110 us each when the chunk's first
    page is not in the page cache (docs/store.md). Every read makes these checks first
    (_header), so a blob they accept passes here too: a chunk refused here is one no restore
    could read."""
    opened = _open_regular(path)   # a link, a FIFO, a directory, a socket: refused
    if isinstance(opened, str):
        return f"it {opened}"
    fd, size = opened[0], opened[1].st_size
    try:
        head = os.pread(fd, HEAD, 0)
    except OSError as e:   # EIO from a failing disk
        return f"it cannot be read: {e.strerror}"
    finally:
        os.close(fd)
    shape = _shape(head, size)
    if isinstance(shape, str):
        return shape
    if length is not None and shape[1] != length:
        return f"it holds {shape[1]} bytes, {length} were expected"
    return None


def read_blob_into(path: Path, name: str, dest: memoryview, where: str,
                   fp: str | None = None) -> None:
    """The raw data of the blob file at path into dest (exactly its length), verified against
    its name: a raw chunk read straight into dest, a zstd one decompressed into it, without a
    copy of the data in between (a restore streams tens of GB through here). Same checks as
    read_blob_file and decode; FileNotFoundError when the file is not there. fp: the
    fingerprint this host recorded of the chunk's data when it named it (module docstring,
    "Verifying by fingerprint"): the data is checked against it instead of its sha256, every
    other check the same; only ever from a trusted record, never from a checkpoint."""
    fd = _open_blob(path, where)
    with open(fd, "rb", buffering=0):   # closes fd
        size = os.fstat(fd).st_size
        codec, length = _header(os.pread(fd, HEAD, 0), size, name, where)
        if length != len(dest):
            raise _damaged(name, where, f"it holds {length} bytes, {len(dest)} were expected")
        if codec == RAW:
            done = 0
            while done < length:
                n = os.preadv(fd, [dest[done:]], HEADER.size + done)
                if n <= 0:
                    raise _damaged(name, where, "it ends early")
                done += n
        else:
            payload = os.pread(fd, min(size, HEADER.size + MAX_CHUNK + 1024), HEADER.size)
            try:
                with _contexts()[1].stream_reader(payload, read_across_frames=True) as r:
                    done = 0
                    while done < length and (n := r.readinto(dest[done:])):
                        done += n
                    extra = r.read(1)
            except zstandard.ZstdError as e:
                raise _damaged(name, where, f"bad zstd data ({e})") from None
            if done != length or extra:
                raise _damaged(name, where, f"its data is not the {length} bytes the header says")
    if fp is not None:
        if fingerprint(dest) != fp:
            raise _damaged(name, where, "its content does not match the fingerprint this host "
                           "recorded when it stored it")
    elif name_of(dest) != name:
        raise _damaged(name, where, "its content does not match its sha256 name")


def decode(blob: bytes, name: str, where: str) -> bytes:
    """The raw data of a blob, verified against its name; CorruptCheckpointError naming the
    chunk and where it was needed otherwise."""
    codec, length = _header(blob, len(blob), name, where)
    payload = memoryview(blob)[HEADER.size:]
    if codec == ZSTD:
        try:
            data = _contexts()[1].decompress(payload, max_output_size=length)
        except zstandard.ZstdError as e:
            raise _damaged(name, where, f"bad zstd data ({e})") from None
    else:
        data = bytes(payload)
    if len(data) != length:
        raise _damaged(name, where, f"{len(data)} bytes where the header says {length}")
    if name_of(data) != name:
        raise _damaged(name, where, "its content does not match its sha256 name")
    return data
