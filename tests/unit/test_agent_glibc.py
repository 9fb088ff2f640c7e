"""The agent library loads under the glibc of old CUDA images (CentOS 7: 2.17, UBI 8: 2.28,
Ubuntu 20.04: 2.31), built here on a new one (agent/src/glibc_compat.h, agent/Makefile).

What the dynamic linker checks before it loads a library is its version needs
(.gnu.version_r): every (file, version) must be defined by that file in the process. So: the
library built from agent/ (and the one the package installed, which torpor-runtime preloads)
needs no GLIBC_x.y newer than 2.17 and nothing private, read two ways (readelf and
torpor.elf_versions), and it names libpthread.so.0 and libdl.so.2 (where glibc < 2.34 keeps
pthread_* and dl*).

And, given an older glibc (TORPOR_OLD_GLIBC=DIR; tests/fakes/fetch_old_glibc.sh DIR extracts
Debian 11's 2.31 there), the agent is loaded by that glibc's own dynamic linker, with every
symbol bound at load (LD_BIND_NOW), into that glibc's own getconf, and serves a fake-driver
program there: its wrappers count the allocations, its control socket answers. Without the
variable that test skips (this machine's glibc is 2.36; the load under it is test_agent.py's).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_agent import ROOT, build_agent, control, gpu  # noqa: F401 (fixture)
from torpor import agent, elf_versions
from torpor.runtime import libc

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


ARM_CC = "aarch64-linux-gnu-gcc"


@pytest.mark.skipif(shutil.which(ARM_CC) is None, reason=f"needs {ARM_CC} (gcc-aarch64-linux-gnu)")
def test_aarch64_build_needs_no_glibc_newer_than_2_17(tmp_path):
    """aarch64's first glibc is 2.17: every binding there is GLIBC_2.17."""
    r = subprocess.run(["make", "-s", "-C", str(ROOT / "agent"), f"CC={ARM_CC}",
                        f"BUILD={tmp_path}", "EXTRA_CFLAGS=-Werror"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    v = elf_versions.read(tmp_path / "libtorpor-agent.so")
    assert v.arch == "aarch64"
    assert v.needed.get("libc.so.6") == {"GLIBC_2.17"}, v.needed
    assert all(too_new(versions) == [] for versions in v.needed.values()), v.needed


def _new_glibc() -> Path:
    new = os.environ.get("TORPOR_NEW_GLIBC", "")
    if not new:
        pytest.skip("set TORPOR_NEW_GLIBC=DIR to a newer glibc with its headers (SUITE=unstable "
                    "PACKAGES='libc6 libc-bin libc6-dev linux-libc-dev' tests/fakes/"
                    "fetch_old_glibc.sh DIR; test.sh does)")
    if os.uname().machine != "x86_64":
        pytest.skip("the newer-glibc build is written for x86_64")
    return Path(new)


def test_built_against_a_glibc_newer_than_2_38_it_still_needs_no_more_than_2_17(tmp_path):
    """Hosts of glibc >= 2.38 (Ubuntu 24.04, Debian 13, the GPU host's 2.39) redirect strtol,
    strtoull and fscanf to __isoc23_* (GLIBC_2.38) under _GNU_SOURCE: built there, the agent
    needed 2.38, and every container of an older libc (most CUDA images) was left on the
    driver's slow path. Built here against such a glibc's own headers and libraries (a
    sysroot), it must still need no more than 2.17 (glibc_compat.h turns the redirect off)."""
    root = _new_glibc()
    libc6 = root / "usr" / "lib" / "x86_64-linux-gnu" / "libc.so.6"
    if not (libc6.exists() and (root / "usr" / "include" / "stdlib.h").exists()):
        pytest.skip(f"{root} lacks libc6 or libc6-dev")
    if "GLIBC_2.38" not in elf_versions.read(libc6).defined:
        pytest.skip(f"{root}'s glibc is older than 2.38: it redirects nothing")
    inc = tmp_path / "include"          # xxhash.h (header-only), which the sysroot lacks
    inc.mkdir()
    shutil.copy("/usr/include/xxhash.h", inc)
    lib = root / "usr" / "lib" / "x86_64-linux-gnu"
    r = subprocess.run(["make", "-s", "-C", str(ROOT / "agent"), f"BUILD={tmp_path / 'b'}",
                        f"EXTRA_CFLAGS=--sysroot={root} -I{inc} -Werror",
                        f"LDFLAGS=-B{lib} -L{lib} -Wl,--sysroot={root} -Wl,-rpath-link,{lib}",
                        "lib"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    built = tmp_path / "b" / "libtorpor-agent.so"
    needs = elf_versions.read(built).needed
    assert needs.get("libc.so.6"), needs
    assert all(too_new(versions) == [] for versions in needs.values()), needs
    nm = shutil.which("nm")
    if nm:
        undefined = subprocess.run([nm, "-D", "--undefined-only", str(built)], capture_output=True,
                                   text=True, check=True).stdout
        assert "__isoc23_" not in undefined, undefined


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


def _old_glibc() -> Path:
    old = os.environ.get("TORPOR_OLD_GLIBC", "")
    if not old:
        pytest.skip("set TORPOR_OLD_GLIBC=DIR to an older glibc (tests/fakes/fetch_old_glibc.sh "
                    "DIR extracts Debian 11's 2.31)")
    if os.uname().machine != "x86_64":
        pytest.skip("the older-glibc run is written for x86_64")
    return Path(old)


def _build_for_old_glibc(work: Path) -> tuple[Path, Path]:
    """The fake libcuda and agent_plain as a constructor library, built here with the same
    bindings as the agent (tests/fakes/old_glibc.h)."""
    fakes = ROOT / "tests" / "fakes"
    flags = ["-D_GNU_SOURCE", "-include", str(fakes / "old_glibc.h"), "-shared", "-fPIC", "-O1"]
    libs = ["-Wl,--no-as-needed", "-l:libpthread.so.0", "-l:libdl.so.2"]
    cuda = work / "libcuda.so.1"
    subprocess.run(["gcc", *flags, "-fvisibility=hidden", f"-I{ROOT / 'agent' / 'src'}",
                    "-Wl,-soname,libcuda.so.1", "-o", str(cuda), str(fakes / "fake_libcuda.c"),
                    *libs], check=True, capture_output=True)
    ctor = work / "agent_plain_ctor.so"
    subprocess.run(["gcc", *flags, "-Dmain=agent_plain_main", "-o", str(ctor),
                    str(fakes / "agent_plain.c"), str(fakes / "agent_plain_ctor.c"),
                    f"-L{work}", "-l:libcuda.so.1", *libs], check=True, capture_output=True)
    return cuda, ctor


def _run(ld_so: Path, lib_path: list[Path], preload: list[Path], program: list[str],
         env: dict) -> subprocess.Popen:
    argv = [str(ld_so), "--library-path", ":".join(map(str, lib_path)),
            "--preload", " ".join(map(str, preload)), *program]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_agent_loads_and_serves_under_an_older_glibc(gpu, tmp_path):  # noqa: F811
    old = _old_glibc()
    old_lib = old / "lib" / "x86_64-linux-gnu"
    ld_so, getconf = old_lib / "ld-linux-x86-64.so.2", old / "usr" / "bin" / "getconf"
    version = subprocess.run([str(ld_so), "--library-path", str(old_lib), str(getconf),
                              "GNU_LIBC_VERSION"], capture_output=True, text=True, check=True)
    assert elf_versions.glibc_version("GLIBC_" + version.stdout.split()[-1]) < (2, 34), \
        f"{old} is not an older glibc: {version.stdout}"
    lib = build_agent()
    # runtime/libc.py, shown that glibc as a container's root, says the agent fits it
    fit = libc.agent_fit({"root": {"path": str(old)}}, tmp_path, lib)
    assert fit.loads, fit
    cuda, ctor = _build_for_old_glibc(tmp_path)
    agents = tmp_path / "agents"
    env = {"PATH": os.environ.get("PATH", "/usr/bin"), "LD_BIND_NOW": "1",
           "FAKE_CUDA_STATE_DIR": str(gpu.state_dir), "TORPOR_AGENT_DIR": str(agents),
           "TORPOR_AGENT_LIBCUDA": str(cuda)}
    proc = _run(ld_so, [old_lib, tmp_path], [lib, ctor], [str(getconf), "GNU_LIBC_VERSION"], env)
    try:
        line = proc.stdout.readline()
        assert line, proc.communicate(timeout=10)
        doc = json.loads(line)
        assert doc["rc"] == 0, doc
        st = control(agents / f"agent-{proc.pid}.sock", "status")
        assert (st["allocations"], st["bytes"], st["contexts"]) == (1, 3 << 20, 1)
    finally:
        out, err = proc.communicate("\n", timeout=10)
    assert proc.returncode == 0, err
    # the same run under this host's glibc answers the same (next_same: the ctor library
    # comes after the agent in both)
    host_ld = Path(os.path.realpath("/lib64/ld-linux-x86-64.so.2"))
    host = _run(host_ld, [tmp_path], [lib, ctor], ["/usr/bin/getconf", "GNU_LIBC_VERSION"],
                {**env, "TORPOR_AGENT_DIR": str(tmp_path / "agents-host")})
    host_line = host.stdout.readline()
    host.communicate("\n", timeout=10)
    assert json.loads(host_line) == doc
