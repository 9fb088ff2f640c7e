"""Synthetic ELF shared objects with version definitions, for tests of torpor.elf_versions and
runtime/libc.py: a "libc.so.6" whose verdefs stop at a chosen GLIBC version (an old glibc as far
as the dynamic linker's version check goes), of any machine and class.

    fake_libc(path, newest="2.17")        GLIBC_2.2.5 ... GLIBC_2.17 (x86_64's history)
    elf_with_versions(defined=[...], needed={"libc.so.6": [...]}, machine=62)  -> bytes
"""

from __future__ import annotations

import struct
from pathlib import Path

# The version nodes of x86_64 glibc, oldest first (each release that added one).
X86_64_GLIBC = ["2.2.5", "2.2.6", "2.3", "2.3.2", "2.3.3", "2.3.4", "2.4", "2.5", "2.6", "2.7",
                "2.8", "2.9", "2.10", "2.11", "2.12", "2.13", "2.14", "2.15", "2.16", "2.17",
                "2.18", "2.22", "2.23", "2.24", "2.25", "2.26", "2.27", "2.28", "2.29", "2.30",
                "2.31", "2.32", "2.33", "2.34", "2.35", "2.36"]
EM_X86_64 = 62
SHT_STRTAB, SHT_VERDEF, SHT_VERNEED = 3, 0x6FFFFFFD, 0x6FFFFFFE


def _hash(name: str) -> int:
    h = 0
    for c in name.encode():
        h = (h << 4) + c
        g = h & 0xF0000000
        if g:
            h ^= g >> 24
        h &= ~g & 0xFFFFFFFF
    return h


def elf_with_versions(defined: list[str] = (), needed: dict[str, list[str]] | None = None,
                      machine: int = EM_X86_64, soname: str = "libc.so.6",
                      bits: int = 64) -> bytes:
    """An ELF ET_DYN of `bits` (little-endian) with .dynstr, .gnu.version_d (the base entry
    named soname, then `defined`) and .gnu.version_r (`needed`), and section headers."""
    needed = needed or {}
    strtab = bytearray(b"\0")

    def s(name: str) -> int:
        at = strtab.find(name.encode() + b"\0")
        if at > 0:
            return at
        at = len(strtab)
        strtab.extend(name.encode() + b"\0")
        return at

    verdef = bytearray()
    names = [soname, *defined]
    for i, name in enumerate(names):
        last = i == len(names) - 1
        verdef += struct.pack("<HHHHIII", 1, 1 if i == 0 else 0, i + 1, 1, _hash(name), 20,
                              0 if last else 28)
        verdef += struct.pack("<II", s(name), 0)
    verneed = bytearray()
    files = list(needed.items())
    for i, (file, versions) in enumerate(files):
        size = 16 + 16 * len(versions)
        verneed += struct.pack("<HHIII", 1, len(versions), s(file), 16,
                               0 if i == len(files) - 1 else size)
        for j, v in enumerate(versions):
            verneed += struct.pack("<IHHII", _hash(v), 0, 0, s(v),
                                   0 if j == len(versions) - 1 else 16)
    shstr = b"\0.dynstr\0.gnu.version_d\0.gnu.version_r\0.shstrtab\0"
    ehsize, shsize = (64, 64) if bits == 64 else (52, 40)
    body = bytearray(b"\0" * ehsize)
    offsets = []
    for blob in (bytes(strtab), bytes(verdef), bytes(verneed), shstr):
        while len(body) % 8:
            body += b"\0"
        offsets.append(len(body))
        body += blob
    while len(body) % 8:
        body += b"\0"
    shoff = len(body)
    sections = [(0, 0, 0, 0, 0, 0),
                (1, SHT_STRTAB, offsets[0], len(strtab), 0, 0),
                (9, SHT_VERDEF, offsets[1], len(verdef), 1, len(names)),
                (24, SHT_VERNEED, offsets[2], len(verneed), 1, len(files)),
                (39, SHT_STRTAB, offsets[3], len(shstr), 0, 0)]
    for name, typ, off, size, link, info in sections:
        if bits == 64:
            body += struct.pack("<IIQQQQIIQQ", name, typ, 0, 0, off, size, link, info, 8, 0)
        else:
            body += struct.pack("<IIIIIIIIII", name, typ, 0, 0, off, size, link, info, 4, 0)
    ident = b"\x7fELF" + bytes([2 if bits == 64 else 1, 1, 1, 0]) + b"\0" * 8
    if bits == 64:
        header = ident + struct.pack("<HHIQQQIHHHHHH", 3, machine, 1, 0, 0, shoff, 0, ehsize,
                                     0, 0, shsize, len(sections), 4)
    else:
        header = ident + struct.pack("<HHIIIIIHHHHHH", 3, machine, 1, 0, 0, shoff, 0, ehsize,
                                     0, 0, shsize, len(sections), 4)
    body[:ehsize] = header
    return bytes(body)


def glibc_versions(newest: str) -> list[str]:
    """GLIBC_2.2.5 ... GLIBC_<newest> (x86_64's nodes)."""
    return [f"GLIBC_{v}" for v in X86_64_GLIBC[:X86_64_GLIBC.index(newest) + 1]]


def fake_libc(path: Path, newest: str = "2.17", machine: int = EM_X86_64, bits: int = 64
              ) -> Path:
    """Write a libc.so.6 defining GLIBC_2.2.5 ... GLIBC_<newest> at path (parents made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(elf_with_versions(glibc_versions(newest), machine=machine, bits=bits))
    return path
