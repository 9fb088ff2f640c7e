"""Will the agent load in this container? Its libc, read from its root filesystem at create.

torpor-runtime preloads the agent library from the host into a container's own C library. The
dynamic linker refuses a library that needs a symbol version its libc.so.6 does not define
(and musl, or an image without any libc, cannot load a glibc library at all): with the preload
in the environment, every process of the container would then fail to start. So before the
preload, create finds the container's libc.so.6 and compares the versions it defines with what
the agent needs (elf_versions.py); where they do not fit the preload is skipped with a reason.

The root filesystem is untrusted (it is the image's): paths are resolved here component by
component as they will be inside the container (the spec's root plus its bind mounts, which
podman and containerd have not mounted yet at create), symbolic links are followed only as
they resolve inside that view (an absolute link or ".." never leaves it, at most MAX_LINKS of
them), nothing but a regular file is opened (O_NOFOLLOW), and elf_versions caps what it reads.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

from .. import elf_versions

MAX_LINKS = 40
MAX_COMPONENTS = 256
MULTIARCH = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu",
             "ppc64le": "powerpc64le-linux-gnu", "s390x": "s390x-linux-gnu"}


@dataclasses.dataclass(frozen=True)
class Fit:
    """loads: the agent can be preloaded; libc: what the container has ("glibc at
    /usr/lib64/libc.so.6, versions up to GLIBC_2.28", "musl", "no glibc"); reason: why not
    (empty when it loads)."""

    loads: bool
    libc: str
    reason: str = ""


class _View:
    """The container's file system as its processes will see it: root plus bind mounts."""

    def __init__(self, root: Path, binds: list[tuple[PurePosixPath, Path]]):
        self.root = root
        self.binds = sorted(binds, key=lambda b: len(b[0].parts), reverse=True)

    def is_mount(self, path: PurePosixPath) -> bool:
        return any(path == dest for dest, _src in self.binds)

    def host(self, path: PurePosixPath) -> Path:
        """The host path behind container path (absolute, already resolved)."""
        for dest, src in self.binds:
            if path == dest or dest in path.parents:
                return src / path.relative_to(dest)
        return self.root / path.relative_to("/")

    def resolve(self, path: str) -> Path | None:
        """The host path of a regular file at container path `path`, symlinks resolved inside
        the view; None when there is none."""
        todo = [p for p in PurePosixPath(path).parts if p != "/"]
        todo.reverse()
        done = PurePosixPath("/")
        links = 0
        while todo:
            if len(todo) > MAX_COMPONENTS:
                return None
            part = todo.pop()
            if part in (".", ""):
                continue
            if part == "..":
                done = done.parent
                continue
            here = done / part
            try:   # a mount point is its source, as the kernel resolved it when mounting
                st = os.stat(self.host(here)) if self.is_mount(here) else os.lstat(self.host(here))
            except (OSError, ValueError):
                return None
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_LINKS:
                    return None
                try:
                    target = os.readlink(self.host(here))
                except OSError:
                    return None
                if target.startswith("/"):
                    done = PurePosixPath("/")
                parts = [p for p in PurePosixPath(target).parts if p != "/"]
                todo.extend(reversed(parts))
                continue
            if todo and not stat.S_ISDIR(st.st_mode):
                return None
            if not todo and not stat.S_ISREG(st.st_mode):
                return None
            done = here
        return self.host(done) if done != PurePosixPath("/") else None


def _view(spec: Mapping[str, Any], bundle: Path) -> _View | None:
    root = spec.get("root") if isinstance(spec.get("root"), dict) else {}
    path = root.get("path") if isinstance(root.get("path"), str) else ""
    if not path:
        return None
    binds = []
    mounts = spec.get("mounts") if isinstance(spec.get("mounts"), list) else []
    for m in mounts:
        if not isinstance(m, dict):
            continue
        dest, src = m.get("destination"), m.get("source")
        opts = m.get("options") if isinstance(m.get("options"), list) else []
        if not isinstance(dest, str) or not dest.startswith("/"):
            continue
        if m.get("type") == "bind" or "bind" in opts or "rbind" in opts:
            if isinstance(src, str) and src.startswith("/"):
                binds.append((PurePosixPath(os.path.normpath(dest)), Path(src)))
        else:   # tmpfs, proc...: nothing of the image's below it
            binds.append((PurePosixPath(os.path.normpath(dest)), Path("/nonexistent-torpor")))
    return _View(bundle / path, binds)


def candidates(arch: str) -> list[str]:
    """Where a glibc of this architecture keeps libc.so.6, the likeliest first."""
    triplet = MULTIARCH.get(arch)
    dirs = ([f"/lib/{triplet}", f"/usr/lib/{triplet}"] if triplet else []) + \
        ["/lib64", "/usr/lib64", "/lib", "/usr/lib"]
    return [f"{d}/libc.so.6" for d in dirs]


def container_libc(spec: Mapping[str, Any], bundle: Path, machine: int
                   ) -> tuple[str, elf_versions.Versions | None]:
    """The container's libc: ("glibc", versions) with the path in the first item's text,
    ("musl", None) or ("no libc", None). machine: only a libc.so.6 of this ELF machine counts
    (a 32-bit /lib/libc.so.6 beside a 64-bit one is not the one the agent meets)."""
    view = _view(spec, bundle)
    if view is None:
        return "no root filesystem in the spec", None
    arch = platform.machine()
    problems = []
    for path in candidates(arch):
        host = view.resolve(path)
        if host is None:
            continue
        try:
            v = elf_versions.read(host)
        except (OSError, elf_versions.ElfError) as e:
            problems.append(f"{path}: {e}")
            continue
        if v.machine == machine:   # a release adds no version of its own when it adds no
            # symbol (2.31's newest is GLIBC_2.30): say what the file defines, not a release
            return f"glibc at {path}, versions up to {elf_versions.newest_glibc(v.defined)}", v
    musl = f"/lib/ld-musl-{arch}.so.1"
    if view.resolve(musl) is not None:
        return "musl", None
    return "no glibc" + (f" ({'; '.join(problems[:2])})" if problems else ""), None


def agent_fit(spec: Mapping[str, Any], bundle: Path, library: Path) -> Fit:
    """Does the agent library load with the container's libc? Never raises for a bad image:
    a libc that cannot be read is a Fit that does not load."""
    try:
        needs = elf_versions.read(library)
    except (OSError, elf_versions.ElfError) as e:
        return Fit(False, "?", f"the agent library {library} is unreadable: {e}")
    try:
        what, libc = container_libc(spec, bundle, needs.machine)
    except (OSError, ValueError) as e:
        return Fit(False, "?", f"the container's libc could not be read: {e}")
    if libc is None:
        return Fit(False, what, f"the agent needs glibc (the container has {what})")
    missing = needs.needed.get("libc.so.6", frozenset()) - libc.defined
    if missing:
        newest = elf_versions.newest_glibc(missing) or sorted(missing)[0]
        return Fit(False, what, f"the agent needs {newest} ({', '.join(sorted(missing))} "
                                f"missing from the container's {what})")
    return Fit(True, what)
