"""Markers: the containers torpor-runtime took over, read by its native front (shim/front).

The front execs runc itself for every call that names a container without a marker; so each
container whose spec names GPUs (torpor.oci.detect) gets one when it is created or restored
here, before the real runtime runs, and loses it when the real runtime has deleted it:

    <run_dir>/containers/<container id>    0600, in a 0700 directory; JSON {"root": ...}

run_dir (/run/torpor) is a tmpfs like the runtimes' own state: markers go with a reboot as
the containers do. "root" is the runtime root (--root) as given: one container id may live
under two roots (containerd namespaces, podman and ctr side by side), and a delete under one
removes only a marker written under the same root. A marker that is stale (its container is
gone without a delete) only sends that id's calls through Python, which passes them on.
Writing or removing one never fails the command: the container must still start or go.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

from .. import oci
from ..config import Config
from ..errors import TorporError
from ..files import atomic_write, loads_json, private_dir
from .argv import Invocation

log = logging.getLogger("torpor.runtime")
DIR = "containers"
MAX_MARKER = 1 << 16


def marker_dir(cfg: Config) -> Path:
    return cfg.run_dir / DIR


def path(cfg: Config, container_id: str) -> Path:
    """The marker's name; UsageError for an id that cannot name a file."""
    return marker_dir(cfg) / oci.validate_container_id(container_id)


def _root(inv: Invocation) -> str:
    root = inv.global_opts.get("root")
    return root if isinstance(root, str) else ""


def write(cfg: Config, inv: Invocation) -> bool:
    """Mark inv's container as torpor's; False (logged) where it cannot be written."""
    try:
        target = path(cfg, inv.container_id)
        private_dir(target.parent, "marker directory")
        atomic_write(target, json.dumps({"root": _root(inv)}).encode() + b"\n")
        return True
    except (TorporError, OSError) as e:
        log.warning("%s %s: no marker for the native front (%s): later calls for it go "
                    "straight to the runtime", inv.command, inv.container_id, e)
        return False


def root_of(marker: Path) -> str | None:
    """The root a marker was written under; None if it is missing, "" for the default root,
    "?" for one that cannot be read, or is no regular file (a link is not followed, a FIFO
    not waited on: only this code writes markers, remove it)."""
    try:   # never through a link, never blocking on a FIFO: a regular file or "?"
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return "?"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "?"
        doc = loads_json(os.read(fd, MAX_MARKER))
    except (OSError, ValueError):
        return "?"
    finally:
        os.close(fd)
    root = doc.get("root") if isinstance(doc, dict) else None
    return root if isinstance(root, str) else "?"


def present(cfg: Config, inv: Invocation) -> bool:
    """Is there a marker (of any root, readable or not) for inv's container?"""
    try:
        return root_of(path(cfg, inv.container_id)) is not None
    except TorporError:
        return False


def remove(cfg: Config, inv: Invocation) -> bool:
    """Forget inv's container (after the real runtime deleted it, or when a create finds a
    leftover of an earlier container of that id and root it does not take over). A marker
    written under another root stays. True if one was removed."""
    try:
        target = path(cfg, inv.container_id)
    except TorporError:
        return False
    root = root_of(target)
    if root is None or root not in (_root(inv), "?"):
        return False
    try:
        target.unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("%s %s: cannot remove its marker %s: %s", inv.command, inv.container_id,
                    target, e)
        return False
