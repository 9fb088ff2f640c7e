"""ELF symbol versions: what a shared library needs (.gnu.version_r) and what one defines
(.gnu.version_d), read from files that may be hostile.

Used to tell whether the agent library loads with a container's libc.so.6 (runtime/libc.py):
the dynamic linker refuses a library that needs a version (GLIBC_2.34) its libc does not define.
The file is untrusted (it comes from a container image): every offset, size and count is
checked against the file and capped (MAX_FILE, MAX_SECTION, MAX_ENTRIES, MAX_NAME); a file that
is not a well-formed ELF shared object of the expected kind is ElfError (a ValueError), never
anything else. Only section headers are read (libc.so.6 always has them).
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct

MAX_FILE = 64 << 20        # a libc.so.6 is ~2 MiB; a bigger "libc" is not read
MAX_SECTION = 4 << 20      # string tables and version sections (libc's: a few KiB)
MAX_ENTRIES = 4096         # version definitions / needs per file (libc: ~50)
MAX_NAME = 256             # a version or file name
SHT_STRTAB = 3
SHT_GNU_VERDEF = 0x6FFFFFFD
SHT_GNU_VERNEED = 0x6FFFFFFE
VER_FLG_BASE = 1
EM_NAMES = {3: "i386", 62: "x86_64", 183: "aarch64", 40: "arm", 21: "ppc64", 22: "s390x",
            243: "riscv"}
_GLIBC_RE = re.compile(r"^GLIBC_(\d+(?:\.\d+){1,3})$")


class ElfError(ValueError):
    """Not a readable ELF object, or one whose version sections are malformed."""


@dataclasses.dataclass(frozen=True)
class Versions:
    """One ELF file's versions. machine: e_machine; bits: 32 or 64; defined: the version
    names it defines (verdefs, the base entry, its soname, left out); needed: file name ->
    version names it needs from that file (verneeds)."""

    machine: int
    bits: int
    defined: frozenset[str]
    needed: dict[str, frozenset[str]]

    @property
    def arch(self) -> str:
        return EM_NAMES.get(self.machine, f"machine {self.machine}")


def glibc_version(name: str) -> tuple[int, ...] | None:
    """GLIBC_2.17 -> (2, 17); GLIBC_2.2.5 -> (2, 2, 5); anything else (GLIBC_PRIVATE) None."""
    m = _GLIBC_RE.match(name)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def newest_glibc(names: frozenset[str] | set[str]) -> str:
    """The newest GLIBC_x.y among names, "" when there is none."""
    known = [(v, n) for n in names if (v := glibc_version(n)) is not None]
    return max(known)[1] if known else ""


class _Reader:
    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ElfError(f"reference past the end of the file ({offset}+{length} > {self.size})")
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise ElfError("the file changed while it was read")
        return data


@dataclasses.dataclass(frozen=True)
class _Section:
    type: int
    offset: int
    size: int
    link: int
    info: int


def _string(table: bytes, offset: int) -> str:
    if not 0 <= offset < len(table):
        raise ElfError(f"string offset {offset} outside its table")
    end = table.find(b"\0", offset, offset + MAX_NAME + 1)
    if end < 0:
        raise ElfError("unterminated or overlong name")
    try:
        return table[offset:end].decode("ascii")
    except UnicodeDecodeError:
        raise ElfError("a name that is not ASCII") from None


def _chain(data: bytes, first: int, count: int, entry: int, next_at: int, fmt: str
           ) -> list[int]:
    """The offsets of a chain of count entries of `entry` bytes, each linking to the next
    by the relative offset at next_at (the last links 0)."""
    if count > MAX_ENTRIES:
        raise ElfError(f"{count} version entries (at most {MAX_ENTRIES})")
    out, at, seen = [], first, set()
    for _ in range(count):
        if at in seen or not 0 <= at <= len(data) - entry:
            raise ElfError("a version entry outside its section (or a loop)")
        seen.add(at)
        out.append(at)
        (step,) = struct.unpack_from(fmt, data, at + next_at)
        if step == 0:
            break
        at += step
    return out


def read_fd(fd: int) -> Versions:
    """The versions of the ELF object open on fd (a regular file, at most MAX_FILE bytes)."""
    size = os.fstat(fd).st_size
    if size > MAX_FILE:
        raise ElfError(f"{size} bytes: too large for a shared library here (> {MAX_FILE})")
    r = _Reader(fd, size)
    ident = r.read(0, 16) if size >= 16 else b""
    if ident[:4] != b"\x7fELF" or ident[4] not in (1, 2) or ident[5] not in (1, 2):
        raise ElfError("not an ELF file")
    bits = 64 if ident[4] == 2 else 32
    end = "<" if ident[5] == 1 else ">"
    if bits == 64:
        machine, = struct.unpack(end + "H", r.read(18, 2))
        shoff, = struct.unpack(end + "Q", r.read(0x28, 8))
        shentsize, shnum = struct.unpack(end + "HH", r.read(0x3A, 4))
        shfmt, shsize = end + "IIQQQQIIQQ", 64
    else:
        machine, = struct.unpack(end + "H", r.read(18, 2))
        shoff, = struct.unpack(end + "I", r.read(0x20, 4))
        shentsize, shnum = struct.unpack(end + "HH", r.read(0x2E, 4))
        shfmt, shsize = end + "IIIIIIIIII", 40
    if shnum == 0 or shnum > MAX_ENTRIES or shentsize != shsize:
        raise ElfError("no usable section headers")
    table = r.read(shoff, shnum * shsize)
    sections = []
    for i in range(shnum):
        f = struct.unpack_from(shfmt, table, i * shsize)
        sections.append(_Section(f[1], f[4], f[5], f[6], f[7]))

    def body(s: _Section) -> bytes:
        if s.size > MAX_SECTION:
            raise ElfError(f"a section of {s.size} bytes (at most {MAX_SECTION})")
        return r.read(s.offset, s.size)

    def strings(s: _Section) -> bytes:
        if not 0 < s.link < len(sections) or sections[s.link].type != SHT_STRTAB:
            raise ElfError("a version section without its string table")
        return body(sections[s.link])

    defined: set[str] = set()
    needed: dict[str, set[str]] = {}
    for s in sections:
        if s.type == SHT_GNU_VERDEF:
            data, names = body(s), strings(s)
            for at in _chain(data, 0, s.info, 20, 16, end + "I"):
                _version, flags, _ndx, cnt, _hash, aux, _next = \
                    struct.unpack_from(end + "HHHHIII", data, at)
                if flags & VER_FLG_BASE or cnt == 0:
                    continue
                a = at + aux
                if not 0 <= a <= len(data) - 8:
                    raise ElfError("a version definition's name outside its section")
                defined.add(_string(names, struct.unpack_from(end + "I", data, a)[0]))
        elif s.type == SHT_GNU_VERNEED:
            data, names = body(s), strings(s)
            for at in _chain(data, 0, s.info, 16, 12, end + "I"):
                _version, cnt, file_off, aux, _next = struct.unpack_from(end + "HHIII", data, at)
                versions = needed.setdefault(_string(names, file_off), set())
                for a in _chain(data, at + aux, cnt, 16, 12, end + "I"):
                    versions.add(_string(names, struct.unpack_from(end + "I", data, a + 8)[0]))
    return Versions(machine, bits, frozenset(defined),
                    {k: frozenset(v) for k, v in needed.items()})


def read(path: str | os.PathLike) -> Versions:
    """read_fd of a path (not following a final symlink; a regular file only)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not _is_regular(fd):
            raise ElfError(f"{path} is not a regular file")
        return read_fd(fd)
    finally:
        os.close(fd)


def _is_regular(fd: int) -> bool:
    import stat
    return stat.S_ISREG(os.fstat(fd).st_mode)
