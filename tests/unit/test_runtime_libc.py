"""Will the agent load in a container? torpor.elf_versions (version sections of hostile ELF
files) and runtime/libc.py (the container's libc.so.6, found in its untrusted root filesystem
as its processes will see it), and torpor-runtime's create: the preload where the libc fits,
skipped with a warning and the annotation org.torpor.agent-skipped where it does not (an
old glibc, musl, no libc), the container started either way."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from tests.fakes.fake_elf import EM_X86_64, elf_with_versions, fake_libc, glibc_versions
from tests.unit.test_runtime_flows import CID, GPU, Exec, world  # noqa: F401 (fixture)
from torpor import agent, elf_versions, oci
from torpor.runtime import libc
from torpor.runtime import main as rt_main

HOST_LIBC = next((Path(p) for p in libc.candidates(os.uname().machine)
                  if Path(p).is_file() and not Path(p).is_symlink()), None) or \
    next((Path(p).resolve() for p in libc.candidates(os.uname().machine) if Path(p).exists()),
         None)
x86_64 = pytest.mark.skipif(os.uname().machine != "x86_64",
                            reason="the fake libcs carry x86_64's version history")


def agent_library() -> Path:
    try:
        return agent.library()
    except Exception:
        pytest.skip("torpor is not installed with its agent library")


def spec_for(root: Path, mounts: list | None = None, gpu: bool = True) -> dict:
    return {"ociVersion": "1.0.2", "root": {"path": str(root)}, "mounts": mounts or [],
            "process": {"args": ["python3"],
                        "env": ["PATH=/usr/bin"] + ([f"NVIDIA_VISIBLE_DEVICES={GPU}"] if gpu
                                                    else [])},
            "linux": {}}


def fit(root: Path, mounts: list | None = None) -> libc.Fit:
    return libc.agent_fit(spec_for(root, mounts), root.parent, agent_library())


# -- elf_versions -------------------------------------------------------------------------------

def test_reads_the_versions_binutils_wrote():
    """A library linked here with a version script: what its verdefs say, the base (its
    soname) left out."""
    if not shutil.which("gcc"):
        pytest.skip("needs gcc")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"torpor-elfv-{os.getpid()}"
    work.mkdir(exist_ok=True)
    try:
        (work / "v.map").write_text("GLIBC_2.2.5 { global: a; local: *; };\n"
                                    "GLIBC_2.17 { global: b; } GLIBC_2.2.5;\n")
        (work / "x.c").write_text("int a(void){return 1;} int b(void){return 2;}\n")
        subprocess.run(["gcc", "-shared", "-fPIC", "-nostdlib", "-Wl,-soname,libc.so.6",
                        f"-Wl,--version-script={work / 'v.map'}", "-o", str(work / "libc.so.6"),
                        str(work / "x.c")], check=True, capture_output=True)
        v = elf_versions.read(work / "libc.so.6")
        assert v.defined == {"GLIBC_2.2.5", "GLIBC_2.17"}
        assert v.bits == 64 and v.needed == {}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_reads_the_hosts_libc():
    if HOST_LIBC is None:
        pytest.skip("no glibc here")
    v = elf_versions.read(HOST_LIBC)
    assert elf_versions.newest_glibc(v.defined) and v.machine in elf_versions.EM_NAMES
    base = {"x86_64": "GLIBC_2.2.5", "aarch64": "GLIBC_2.17"}.get(os.uname().machine)
    assert base is None or base in v.defined


@pytest.mark.parametrize("bits,machine", [(64, EM_X86_64), (32, 3)])
def test_synthetic_elf_round_trip(tmp_path, bits, machine):
    path = tmp_path / "lib.so"
    path.write_bytes(elf_with_versions(["GLIBC_2.0", "GLIBC_2.1"],
                                       {"libc.so.6": ["GLIBC_2.0"], "ld.so": ["X_1"]},
                                       machine=machine, bits=bits))
    v = elf_versions.read(path)
    assert (v.bits, v.machine, v.defined) == (bits, machine, {"GLIBC_2.0", "GLIBC_2.1"})
    assert v.needed == {"libc.so.6": {"GLIBC_2.0"}, "ld.so": {"X_1"}}


def test_version_order():
    assert elf_versions.newest_glibc({"GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.3.4",
                                      "GLIBC_PRIVATE"}) == "GLIBC_2.17"
    assert elf_versions.newest_glibc(set()) == ""
    assert elf_versions.glibc_version("GLIBC_2.2.5") == (2, 2, 5)
    assert elf_versions.glibc_version("GLIBC_PRIVATE") is None


def _patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def test_hostile_files_are_elf_errors(tmp_path):
    good = elf_with_versions(glibc_versions("2.17"), {"libc.so.6": ["GLIBC_2.2.5"]})
    shoff = struct.unpack_from("<Q", good, 0x28)[0]
    verdef_hdr = shoff + 2 * 64
    verdef_off = struct.unpack_from("<Q", good, verdef_hdr + 24)[0]
    bad = {
        "empty": b"",
        "not elf": b"#!/bin/sh\n" * 10,
        "truncated": good[:len(good) // 2],
        "section headers past the end": _patch(good, 0x28, "<Q", 1 << 40),
        "huge section": _patch(good, verdef_hdr + 32, "<Q", 1 << 40),
        "huge count": _patch(good, verdef_hdr + 44, "<I", 1 << 30),
        "next outside": _patch(good, verdef_off + 16, "<I", 1 << 20),
        "name outside": _patch(good, verdef_off + 28 + 20, "<I", 1 << 30),   # 2nd entry's
        "string table not a strtab": _patch(good, verdef_hdr + 40, "<I", 2),
        "bad class": _patch(good, 4, "<B", 7),
    }
    for what, data in bad.items():
        path = tmp_path / "x.so"
        path.write_bytes(data)
        with pytest.raises(elf_versions.ElfError):
            print(what, elf_versions.read(path))


def test_version_chain_loop_is_refused(tmp_path):
    """A verdef whose next points back at itself: refused, not read forever."""
    good = elf_with_versions(glibc_versions("2.17"))
    shoff = struct.unpack_from("<Q", good, 0x28)[0]
    verdef_off = struct.unpack_from("<Q", good, shoff + 2 * 64 + 24)[0]
    b = bytearray(good)
    struct.pack_into("<I", b, verdef_off + 28 + 16, (-28) & 0xFFFFFFFF)  # 2nd -> 1st
    path = tmp_path / "loop.so"
    path.write_bytes(bytes(b))
    with pytest.raises(elf_versions.ElfError):
        elf_versions.read(path)


def test_too_large_file_is_not_read(tmp_path):
    path = tmp_path / "big.so"
    with open(path, "wb") as f:
        f.write(elf_with_versions(["GLIBC_2.17"]))
        f.truncate(elf_versions.MAX_FILE + 1)       # sparse
    with pytest.raises(elf_versions.ElfError, match="too large"):
        elf_versions.read(path)


def test_random_corruption_is_only_ever_an_elf_error(tmp_path):
    good = elf_with_versions(glibc_versions("2.36"), {"libc.so.6": ["GLIBC_2.2.5", "GLIBC_2.3"]})
    rng = random.Random(20)
    path = tmp_path / "fuzz.so"
    for _ in range(400):
        b = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        path.write_bytes(bytes(b))
        try:
            elf_versions.read(path)
        except elf_versions.ElfError:
            pass


def test_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(elf_versions.ElfError):
        elf_versions.read(tmp_path / "fifo")        # not opened for reading: no hang
    (tmp_path / "link").symlink_to(HOST_LIBC or "/etc/hostname")
    with pytest.raises(OSError):
        elf_versions.read(tmp_path / "link")        # O_NOFOLLOW


# -- the container's libc -----------------------------------------------------------------------

@x86_64
def test_old_glibc_rootfs_skips_the_agent(tmp_path):
    """CentOS 6's glibc (2.12): the agent needs 2.17 (clock_gettime)."""
    root = tmp_path / "rootfs"
    fake_libc(root / "lib64" / "libc.so.6", newest="2.12")
    f = fit(root)
    assert not f.loads and f.libc == "glibc at /lib64/libc.so.6, versions up to GLIBC_2.12"
    assert "GLIBC_2.17" in f.reason and "missing" in f.reason


@x86_64
@pytest.mark.parametrize("newest", ["2.17", "2.28", "2.31"])
def test_glibc_2_17_and_later_rootfs_loads_the_agent(tmp_path, newest):
    """CentOS 7, UBI 8, Ubuntu 20.04: the library built with glibc_compat.h fits them all
    (a plain build on this host needs GLIBC_2.34 and fits none)."""
    root = tmp_path / "rootfs"
    (root / "usr" / "lib64").mkdir(parents=True)
    (root / "lib64").symlink_to("usr/lib64")                        # usr-merge
    (root / "usr" / "lib64" / "libc-x.so").write_bytes(
        elf_with_versions(glibc_versions(newest)))
    (root / "usr" / "lib64" / "libc.so.6").symlink_to("libc-x.so")  # as glibc installs it
    f = fit(root)
    assert f.loads and f.reason == "" and \
        f.libc == f"glibc at /lib64/libc.so.6, versions up to GLIBC_{newest}", f


def test_current_rootfs_loads_the_agent(tmp_path):
    if HOST_LIBC is None:
        pytest.skip("no glibc here")
    root = tmp_path / "rootfs"
    dest = root / HOST_LIBC.parent.relative_to("/") / "libc.so.6"
    dest.parent.mkdir(parents=True)
    shutil.copyfile(HOST_LIBC, dest)
    f = fit(root)
    assert f.loads, f


def test_libc_from_a_bind_mount(tmp_path):
    """The tests' images (and some users'): /usr bound from elsewhere, lib -> usr/lib in the
    image. The mount is not made yet at create: the spec's mounts are read."""
    if HOST_LIBC is None:
        pytest.skip("no glibc here")
    root, usr = tmp_path / "rootfs", tmp_path / "hostusr"
    (root / "usr").mkdir(parents=True)
    for d in ("lib", "lib64"):
        (root / d).symlink_to(f"usr/{d}")
    triplet = libc.MULTIARCH.get(os.uname().machine)
    dest = usr / "lib" / triplet if triplet else usr / "lib64"
    dest.mkdir(parents=True)
    shutil.copyfile(HOST_LIBC, dest / "libc.so.6")
    assert not fit(root).loads                       # without the mount: nothing there
    mounts = [{"destination": "/usr", "type": "bind", "source": str(usr),
               "options": ["rbind", "ro"]}]
    assert fit(root, mounts).loads
    tmpfs = [*mounts, {"destination": "/usr/lib", "type": "tmpfs", "source": "tmpfs"}]
    assert not fit(root, tmpfs).loads                # a tmpfs over it hides it


def test_musl_rootfs_skips_the_agent(tmp_path):
    root = tmp_path / "rootfs"
    (root / "lib").mkdir(parents=True)
    (root / "lib" / f"ld-musl-{os.uname().machine}.so.1").write_bytes(b"\x7fELF musl")
    (root / "lib" / "libc.musl-x86_64.so.1").symlink_to(f"ld-musl-{os.uname().machine}.so.1")
    f = fit(root)
    assert not f.loads and f.libc == "musl" and "needs glibc" in f.reason


def test_no_libc_rootfs_skips_the_agent(tmp_path):
    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "static-server").write_bytes(b"\x7fELF")
    f = fit(root)
    assert not f.loads and f.libc == "no glibc"


def test_links_never_leave_the_rootfs(tmp_path):
    """An image whose libc.so.6 points at the host's (absolute, or up with ..): resolved
    inside the image, where there is nothing: the host's libc is never what is read."""
    if HOST_LIBC is None:
        pytest.skip("no glibc here")
    for target in (str(HOST_LIBC), "../" * 12 + str(HOST_LIBC).lstrip("/")):
        root = tmp_path / f"rootfs{len(target)}"
        for d in ("lib64", "lib", f"lib/{os.uname().machine}-linux-gnu"):
            (root / d).mkdir(parents=True, exist_ok=True)
            (root / d / "libc.so.6").symlink_to(target)
        f = fit(root)
        assert not f.loads and f.libc == "no glibc", (target, f)


def test_link_loops_and_odd_files_end(tmp_path):
    root = tmp_path / "rootfs"
    (root / "lib64").mkdir(parents=True)
    (root / "lib64" / "libc.so.6").symlink_to("libc.so.6")          # itself
    (root / "lib").symlink_to("lib")
    (root / "usr").mkdir()
    (root / "usr" / "lib64").mkdir()
    os.mkfifo(root / "usr" / "lib64" / "libc.so.6")                  # never opened
    assert fit(root).libc == "no glibc"


def test_other_machines_libc_is_not_the_one(tmp_path):
    """A 32-bit libc.so.6 (multilib /lib) is not what a 64-bit agent meets."""
    root = tmp_path / "rootfs"
    fake_libc(root / "lib" / "libc.so.6", newest="2.36", machine=3, bits=32)
    assert fit(root).libc == "no glibc"


def test_unreadable_libc_is_said(tmp_path):
    root = tmp_path / "rootfs"
    (root / "lib64").mkdir(parents=True)
    (root / "lib64" / "libc.so.6").write_bytes(b"\x7fELF\x02\x01" + b"\0" * 100)
    f = fit(root)
    assert not f.loads and "/lib64/libc.so.6" in f.libc


# -- torpor-runtime create ----------------------------------------------------------------------

def create(world, root: Path, annotations: dict | None = None, gpu: bool = True) -> dict:
    spec = spec_for(root, gpu=gpu)
    spec["annotations"] = annotations or {}
    (world["bundle"] / "config.json").write_text(json.dumps(spec))
    argv = ["create", "--bundle", str(world["bundle"]), CID]
    with pytest.raises(Exec) as e:
        rt_main.main(argv)
    assert e.value.argv == [str(world["runc"].path), *argv]    # the container starts anyway
    return json.loads((world["bundle"] / "config.json").read_text())


def preloaded(spec: dict) -> bool:
    return any(e.startswith("LD_PRELOAD=") and oci.AGENT_LIBRARY_IN_CONTAINER in e
               for e in spec["process"]["env"]) and oci.has_agent(spec)


def test_create_preloads_the_agent_by_default(world, tmp_path):
    if HOST_LIBC is None:
        pytest.skip("no glibc here")
    agent_library()
    root = tmp_path / "rootfs"
    (root / HOST_LIBC.parent.relative_to("/")).mkdir(parents=True)
    shutil.copyfile(HOST_LIBC, root / HOST_LIBC.parent.relative_to("/") / "libc.so.6")
    spec = create(world, root)
    assert preloaded(spec)
    assert oci.AGENT_SKIPPED_ANNOTATION not in spec["annotations"]


def test_create_opt_out_by_annotation(world, tmp_path):
    root = tmp_path / "rootfs"
    root.mkdir()
    spec = create(world, root, {"org.torpor.agent": "off"})
    assert not preloaded(spec) and oci.AGENT_SKIPPED_ANNOTATION not in spec["annotations"]


def test_create_leaves_cpu_containers_alone(world, tmp_path):
    root = tmp_path / "rootfs"
    root.mkdir()
    spec = create(world, root, gpu=False)
    assert not preloaded(spec) and spec["annotations"] == {}


@x86_64
@pytest.mark.parametrize("image", ["old-glibc", "musl"])
def test_create_skips_the_agent_where_it_cannot_load(world, tmp_path, caplog, image):
    agent_library()
    root = tmp_path / "rootfs"
    if image == "old-glibc":
        fake_libc(root / "lib64" / "libc.so.6", newest="2.12")
    else:
        (root / "lib").mkdir(parents=True)
        (root / "lib" / f"ld-musl-{os.uname().machine}.so.1").write_bytes(b"musl")
    with caplog.at_level(logging.WARNING, logger="torpor.runtime"):
        spec = create(world, root, {"org.torpor.agent": "on"})
    assert not preloaded(spec)
    reason = spec["annotations"][oci.AGENT_SKIPPED_ANNOTATION]
    assert ("GLIBC_2.17" in reason) if image == "old-glibc" else ("musl" in reason)
    assert any("agent not preloaded" in r.getMessage() and reason in r.getMessage()
               for r in caplog.records)


def test_doctor_tells_about_the_agent(cfg):
    """`torpor doctor` says where the agent goes by default and how a bare program gets it."""
    from torpor import doctor
    agent_library()
    (check,) = [c for c in doctor.run_checks(cfg) if c.name == "agent"]
    assert check.status == doctor.OK and "glibc >= 2.17" in check.detail
    assert "org.torpor.agent=off" in check.detail and "`torpor run -- CMD`" in check.detail
