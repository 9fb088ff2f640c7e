"""Markers: the containers torpor-runtime took over, read by its native front (shim/front).

The front execs runc itself for every call that names a container without a marker; so each
container whose spec names GPUs (torpor.oci.detect) gets one when it is created or restored
here, before the real runtime runs, and loses it when the real runtime has deleted it. One
container id may live under two runtime roots (--root: containerd namespaces, podman and ctr
side by side), so a marker is named by the pair:

    <run_dir>/containers/<container id>@<key>    0600, in a 0700 directory
    key: FNV-1a 64 of the bytes of --root, normalized ("" where none is), 16 lowercase hex
    JSON {"roots": [<--root, normalized>, ...]}

--root is read lexically (normalize_root: repeated '/' collapsed, '.' components and a
trailing '/' dropped; '..' and links left as they are, for the runtime to resolve), so
"/run/runc", "/run/runc/" and "/run/./runc" are one root. The front derives the same name
from the same argv (root_key here and the front's root_key must agree;
tests/unit/test_runtime_front.py checks them against each other) and only looks whether the
file is there: it keeps no GPU rule and reads no JSON. "roots" is the list of roots sharing
that key: two roots whose keys collide share one file, each listed, and the file goes with
the last of them. A collision thus only sends the other root's calls of that id through
Python, which passes them on; it never takes a marker away. No '@' is in a container id, so
no name of this form is an id.

A marker of torpor before this naming, <run_dir>/containers/<container id> holding
{"root": ...}, is still honoured: the front sends every call of that id to Python, which
reads it as the marker of the root it names, removes it at that root's delete, and replaces
it by the new name when it marks the same (root, id) again. So is one keyed by the root as
given before roots were normalized (raw_key: a container created under "/r/" before the
upgrade and deleted after it): where the spelling differs from its normal form, the front
and Python look there too, and Python moves it to the normal name when it marks that root
again.

The same name, <id>@<key> (name(): oci.container_name), is the container's agent socket
directory's (runtime/lifecycle.py agent_name) and torpord's record's.

run_dir (/run/torpor) is a tmpfs like the runtimes' own state: markers go with a reboot as
the containers do. Beyond that lexical reading, roots are compared as given: "/run/runc" and
no --root (runc's default) are two roots here, as each engine names a container's root the
same way in every call. A marker that is stale (its container is gone without a delete) only
sends that id's calls through Python, which passes them on. Writing or removing one never
fails the command: the container must still start or go.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
from pathlib import Path

from .. import oci
from ..config import Config
from ..errors import TorporError
from ..files import atomic_write, loads_json, open_trusted_dir
from .argv import Invocation

log = logging.getLogger("torpor.runtime")
DIR = "containers"
SEP = oci.NAME_SEP     # in no container id (oci.validate_container_id)
MAX_MARKER = 1 << 16
UNREADABLE = "?"     # what roots_of says of a marker it cannot read

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def marker_dir(cfg: Config) -> Path:
    return cfg.run_dir / DIR


def normalize_root(root: str) -> str:
    """root read lexically, as the front's root_key reads it: repeated '/' collapsed, '.'
    components and a trailing '/' dropped. '..' and links stay (resolving them is the
    runtime's business, and may change under us). "" (no --root) stays "", "/" stays "/",
    a relative root that is all '.' reads ".": neither is another root's spelling."""
    if not root:
        return root
    parts = [p for p in root.split("/") if p not in ("", ".")]
    return ("/" if root.startswith("/") else "") + "/".join(parts) or "."


def _fnv1a64(data: bytes) -> str:
    h = _FNV_OFFSET
    for b in data:
        h = ((h ^ b) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def root_key(root: str) -> str:
    """FNV-1a 64 of normalize_root(root)'s bytes (as the kernel passed them in argv), 16
    lowercase hex digits: the front's root_key, bit for bit."""
    return _fnv1a64(os.fsencode(normalize_root(root)))


def raw_key(root: str) -> str:
    """The key torpor gave root before roots were normalized: FNV-1a 64 of root as given."""
    return _fnv1a64(os.fsencode(root))


def root_of_invocation(inv: Invocation) -> str:
    """--root, normalized (normalize_root); "" where none is (runc's default root)."""
    root = inv.global_opts.get("root")
    return normalize_root(root) if isinstance(root, str) else ""


def raw_root_of_invocation(inv: Invocation) -> str:
    """--root as given; "" where none is."""
    root = inv.global_opts.get("root")
    return root if isinstance(root, str) else ""


def key(inv: Invocation) -> str:
    """The key of inv's runtime root (root_key of its --root)."""
    return root_key(root_of_invocation(inv))


def name(inv: Invocation) -> str:
    """inv's container's name at torpor: <id>@<root key> (oci.container_name), the name of
    its marker, its agent socket directory and torpord's record of it; UsageError for an id
    that cannot name a file."""
    return oci.container_name(inv.container_id, key(inv))


def path(cfg: Config, container_id: str, root: str) -> Path:
    """The marker of (root, container_id); UsageError for an id that cannot name a file."""
    return marker_dir(cfg) / oci.container_name(container_id, root_key(root))


def raw_path(cfg: Config, inv: Invocation) -> Path | None:
    """Where torpor before normalized roots marked inv's container, where its --root is
    spelled otherwise than its normal form (None where not: path() is that name)."""
    raw = raw_root_of_invocation(inv)
    if raw_key(raw) == root_key(raw):
        return None
    return marker_dir(cfg) / oci.container_name(inv.container_id, raw_key(raw))


def legacy_path(cfg: Config, container_id: str) -> Path:
    """The marker an earlier torpor wrote for container_id, under any root."""
    return marker_dir(cfg) / oci.validate_container_id(container_id)


def roots_of(marker: Path) -> list[str] | None:
    """The roots a marker was written under (either format); None if it is missing,
    [UNREADABLE] for one that cannot be read or is no regular file (a link is not followed, a
    FIFO not waited on: only this code writes markers, remove it)."""
    try:   # never through a link, never blocking on a FIFO: a regular file or UNREADABLE
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return [UNREADABLE]
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return [UNREADABLE]
        doc = loads_json(os.read(fd, MAX_MARKER))
    except (OSError, ValueError):
        return [UNREADABLE]
    finally:
        os.close(fd)
    if not isinstance(doc, dict):
        return [UNREADABLE]
    roots = doc.get("roots", [doc["root"]] if "root" in doc else None)
    if not isinstance(roots, list) or not roots or not all(isinstance(r, str) for r in roots):
        return [UNREADABLE]
    return roots


def root_of(marker: Path) -> str | None:
    """The one root a marker of an earlier torpor names: None if it is missing, "" for the
    default root, UNREADABLE if it cannot be read."""
    roots = roots_of(marker)
    return None if roots is None else roots[0] if len(roots) == 1 else UNREADABLE


class _Locked:
    """The marker directory, flocked: a marker's roots are read, changed and written back by
    one torpor-runtime at a time (two of them only meet on a key collision)."""

    def __init__(self, cfg: Config, create: bool):
        self.dir = open_trusted_dir(marker_dir(cfg), "marker directory", create=create)

    def __enter__(self) -> _Locked:
        try:
            fcntl.flock(self.dir.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.dir.fd)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.dir.fd)   # lets go of the lock


def _store(target: Path, roots: list[str]) -> None:
    if roots:
        atomic_write(target, json.dumps({"roots": roots}).encode() + b"\n")
    else:
        target.unlink(missing_ok=True)


def _names(roots: list[str] | None, root: str) -> bool:
    """Does a marker's list of roots (as read) name root (normalized)?"""
    return any(normalize_root(r) == root for r in roots or [] if r != UNREADABLE)


def _without(target: Path, root: str) -> bool:
    """root (and any unreadable content) out of the marker target; True if it was there."""
    roots = roots_of(target)
    if roots is None or not (_names(roots, root) or UNREADABLE in roots):
        return False
    _store(target, [r for r in roots if r != UNREADABLE and normalize_root(r) != root])
    return True


def write(cfg: Config, inv: Invocation) -> bool:
    """Mark inv's container (under its root) as torpor's; False (logged) where it cannot be
    written. An earlier torpor's marker of the same (root, id) (by the id alone, or by the
    root as given) goes: this one replaces it."""
    root = root_of_invocation(inv)
    try:
        target = path(cfg, inv.container_id, root)
        old, raw = legacy_path(cfg, inv.container_id), raw_path(cfg, inv)
        with _Locked(cfg, create=True):
            roots = [r for r in roots_of(target) or [] if r != UNREADABLE]
            _store(target, roots if _names(roots, root) else [*roots, root])
            if _names(roots_of(old), root):   # an earlier torpor's marker of this (root, id)
                old.unlink(missing_ok=True)
            if raw is not None and _names(roots_of(raw), root):
                _without(raw, root)
        return True
    except (TorporError, OSError) as e:
        log.warning("%s %s: no marker for the native front (%s): later calls for it go "
                    "straight to the runtime", inv.command, inv.container_id, e)
        return False


def present(cfg: Config, inv: Invocation) -> bool:
    """Is there a marker for inv's container under inv's root (or one that cannot be read and
    may be)?"""
    root = root_of_invocation(inv)
    try:
        mine = [path(cfg, inv.container_id, root), raw_path(cfg, inv)]
        legacy = root_of(legacy_path(cfg, inv.container_id))
    except TorporError:
        return False
    for p in filter(None, mine):
        roots = roots_of(p)
        if _names(roots, root) or UNREADABLE in (roots or []):
            return True
    return legacy is not None and (legacy == UNREADABLE or normalize_root(legacy) == root)


def remove(cfg: Config, inv: Invocation) -> bool:
    """Forget inv's container under inv's root (after the real runtime deleted it, or when a
    create finds a leftover of an earlier container of that id and root it does not take
    over): its root leaves the marker, which goes with its last root; an earlier torpor's
    marker naming that root (by the id alone, or by the root as given) goes too. A marker
    that cannot be read is removed; the markers of other roots stay. True if a root was
    taken away."""
    root = root_of_invocation(inv)
    try:
        target = path(cfg, inv.container_id, root)
        old, raw = legacy_path(cfg, inv.container_id), raw_path(cfg, inv)
    except TorporError:
        return False
    done = False
    try:
        with _Locked(cfg, create=False):
            for p in filter(None, (target, raw)):
                done = _without(p, root) or done
            legacy = root_of(old)
            if legacy is not None and (legacy == UNREADABLE or normalize_root(legacy) == root):
                old.unlink()
                done = True
    except FileNotFoundError:   # no marker directory, or a marker gone meanwhile
        pass
    except (TorporError, OSError) as e:
        log.warning("%s %s: cannot remove its marker %s: %s", inv.command, inv.container_id,
                    target, e)
    return done


def other_roots(cfg: Config, inv: Invocation) -> list[str]:
    """The roots other than inv's that still mark a container of inv's id (any marker of that
    id, any format; one that cannot be read counts as another root's). What an earlier torpor
    keyed by the id alone (the agent socket directory <run_dir>/agents/<id>, torpord's record
    <id>) may be theirs while any is."""
    root = root_of_invocation(inv)
    try:
        cid = oci.validate_container_id(inv.container_id)
    except TorporError:
        return []
    others: list[str] = []
    try:
        names = os.listdir(marker_dir(cfg))
    except OSError:
        return []
    for name in names:
        if name == cid or name.startswith(cid + SEP):
            others += [r for r in roots_of(marker_dir(cfg) / name) or []
                       if r == UNREADABLE or normalize_root(r) != root]
    return others


def marked_ids(cfg: Config) -> set[str]:
    """The ids of the containers torpor-runtime took over here (a marker under any root);
    none where the marker directory is missing or unreadable."""
    try:
        names = os.listdir(marker_dir(cfg))
    except OSError:
        return set()
    ids = set()
    for n in names:
        try:
            ids.add(oci.split_name(n)[0])
        except TorporError:   # no marker's name: nothing of ours
            continue
    return ids


# how engines name a container's cgroup: <prefix><id>[.scope] (systemd) or <id> (cgroupfs:
# containerd's /<namespace>/<id>, podman's /libpod_parent/libpod-<id>)
_CGROUP_PREFIXES = ("libpod-", "cri-containerd-", "crio-", "docker-")


def cgroup_names(text: str) -> set[str]:
    """What may be a container id in a /proc/PID/cgroup: every component of every path,
    without ".scope", and without an engine's prefix where it has one (_CGROUP_PREFIXES)."""
    out: set[str] = set()
    for line in text.splitlines():
        for part in line.split(":", 2)[-1].split("/"):
            part = part.removesuffix(".scope")
            out.add(part)
            out.update(part[len(p):] for p in _CGROUP_PREFIXES if part.startswith(p))
    out.discard("")
    return out


def container_of(cfg: Config, pids: list[int], proc: Path = Path("/proc")
                 ) -> tuple[int, str] | None:
    """(pid, container id) of the first of pids that runs in a container torpor-runtime took
    over here (its cgroup names a marked id): the engine checkpoints that container, its GPU
    state through torpord. None where none does (or nothing can be read). A process in our own
    PID namespace is in no container (a container has its own; one run with the host's is
    not told apart): a systemd unit or a batch step whose cgroup happens to name a short
    container id (a ctr id "train", "user") is never taken for one."""
    ids = marked_ids(cfg)
    if not ids:
        return None
    ours = _pid_namespace(proc / "self")
    for pid in pids:
        if ours is not None and _pid_namespace(proc / str(pid)) == ours:
            continue
        try:
            text = (proc / str(pid) / "cgroup").read_text(errors="replace")
        except OSError:
            continue
        hit = sorted(ids & cgroup_names(text))
        if hit:
            return pid, hit[0]
    return None


def _pid_namespace(proc_pid: Path) -> tuple[int, int] | None:
    """The PID namespace of the process at /proc/<pid> (its nsfs device and inode), or None
    where it cannot be read (gone, or not ours to look at)."""
    try:
        st = os.stat(proc_pid / "ns" / "pid")
    except OSError:
        return None
    return st.st_dev, st.st_ino
