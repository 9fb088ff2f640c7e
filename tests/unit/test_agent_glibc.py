"""The agent library loads under the glibc of old CUDA images (CentOS 7: 2.17, UBI 8: 2.28,
Ubuntu 20.04: 2.31), built here on a new one (agent/src/glibc_compat.h, agent/Makefile).

What the dynamic linker checks before it loads a library is its version needs
(.gnu.version_r): every (file, version) must be defined by that file in the process. So: the
library built from agent/ (and the one the package installed, which torpor-runtime preloads)
needs no GLIBC_x.y newer than 2.17 and nothing private, read two ways (readelf and
torpor.elf_versions), and it names libpthread.so.0 and libdl.so.2 (where glibc < 2.34 keeps
pthread_* and dl*). This machine has no older glibc to load it with; the load under this one
is tests/unit/test_agent.py's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_agent import build_agent
from torpor import agent, elf_versions

OLDEST = (2, 17)    # CentOS 7, and aarch64's first glibc
READELF = shutil.which("readelf")


def too_new(names) -> list[str]:
    """GLIBC_x.y newer than OLDEST, and any GLIBC_ version that is not a release."""
    out = []
    for n in names:
        v = elf_versions.glibc_version(n)
        if (v is not None and v > OLDEST) or (v is None and n.startswith("GLIBC_")):
            out.append(n)
    return sorted(out)


def readelf_needs(lib: Path) -> dict[str, set[str]]:
    """file -> versions, from `readelf --version-info`'s .gnu.version_r listing."""
    text = subprocess.run([READELF, "--version-info", "-W", str(lib)], capture_output=True,
                          text=True, check=True).stdout
    section = text.split(".gnu.version_r", 1)[1] if ".gnu.version_r" in text else ""
    needs: dict[str, set[str]] = {}
    current = None
    for line in section.splitlines():
        m = re.search(r"File: (\S+)", line)
        if m:
            current = needs.setdefault(m.group(1), set())
        m = re.search(r"Name: (\S+)", line)
        if m and current is not None:
            current.add(m.group(1))
    return needs


def libraries() -> list[Path]:
    libs = [build_agent()]
    try:
        libs.append(agent.library())
    except Exception:   # not installed: the tree's build is the one that counts
        pass
    return libs


@pytest.mark.parametrize("which", ["built", "installed"])
def test_agent_needs_no_glibc_newer_than_2_17(which):
    libs = libraries()
    if which == "installed" and len(libs) < 2:
        pytest.skip("torpor is not installed with its agent library")
    lib = libs[0] if which == "built" else libs[1]
    mine = elf_versions.read(lib).needed
    assert mine.get("libc.so.6"), f"{lib} needs nothing from libc.so.6?"
    for file, versions in mine.items():
        assert too_new(versions) == [], \
            f"{lib} needs {too_new(versions)} from {file}: an older glibc refuses to load it"
    if READELF:
        theirs = readelf_needs(lib)
        assert {f: set(v) for f, v in mine.items()} == theirs   # the parser agrees with binutils


def test_agent_names_libpthread_and_libdl():
    """Before glibc 2.34 pthread_create and dlopen live there only: a program that links
    neither (a container's /bin/sh) must still resolve the agent's."""
    if not shutil.which("readelf"):
        pytest.skip("needs readelf (binutils)")
    dyn = subprocess.run(["readelf", "-d", str(build_agent())], capture_output=True, text=True,
                         check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
    assert {"libpthread.so.0", "libdl.so.2", "libc.so.6"} <= set(needed)


def test_too_new_catches_what_it_must():
    """The check itself: a plain build on glibc >= 2.34 needs GLIBC_2.34 (pthread_create),
    2.33 (fstat), 2.32 (pthread_sigmask)."""
    assert too_new({"GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.3.4"}) == []
    assert too_new({"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.18"}) == ["GLIBC_2.18", "GLIBC_2.34"]
    assert too_new({"GLIBC_PRIVATE", "GLIBC_ABI_DT_RELR"}) == ["GLIBC_ABI_DT_RELR",
                                                               "GLIBC_PRIVATE"]
