"""What torpord's handlers make of a request's PIDs and paths, with the checks that refuse bad
input (UsageError, NotFoundError): the PIDs an operation holds, the agents' socket directory,
the GPU data directory or packed checkpoint, the caller that owns an operation, the
fingerprint mode, and the GPU inventory when there is one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable

from .. import agent, gpus, procs
from ..errors import NoDriverError, UsageError
from ..files import require_trusted_location
from ..flows.policy import FingerprintMode
from ..store import images as store_images
from .containers import Containers

log = logging.getLogger("torpor.sidecar")


def resolve_pids(containers: Containers, pids: Iterable[int], container_id: str,
                 descendants: bool) -> list[int]:
    """The PIDs given, or the registered container's, with their process trees (descendants);
    each must be running."""
    pids = [int(p) for p in pids]
    if pids and container_id:
        raise UsageError("give PIDs or a container id, not both")
    if container_id:
        pids = [int(p) for p in containers.get(container_id).get("pids", [])]
        if not pids:
            raise UsageError(f"container '{container_id}' was registered without PIDs")
    if not pids:
        raise UsageError("no PIDs given")
    out: list[int] = []
    for pid in pids:
        procs.require(pid)
        for p in (procs.tree(pid) if descendants else [pid]):
            if p not in out:
                out.append(p)
    return out


def gpu_info(pids: Iterable[int]) -> gpus.Inventory | None:
    """NVML's inventory when there are PIDs to look up and NVML answers, else None."""
    if not list(pids):
        return None
    try:
        return gpus.discover()
    except NoDriverError as e:
        log.debug("no GPU inventory: %s", e)
        return None


def agent_dir(run_dir: Path, *names: str) -> Path:
    """The agents' socket directory: the first container's given (its name at torpor,
    <id>@<root key> or an earlier torpor's <id>: UsageError for anything else, so that no
    request names a directory outside <run_dir>/agents), else the bare one."""
    name = next((n for n in names if n), "")
    return agent.container_dir(run_dir, name) if name else agent.default_dir()


def data_dir(path: str) -> Path | None:
    """gpu_data_dir (or gpu_data_packed): None when not given, else an absolute path."""
    if not path:
        return None
    if not os.path.isabs(path):
        raise UsageError(f"gpu_data_dir must be an absolute path, not {path!r}")
    return Path(path)


def packed_dir(path: str) -> Path | None:
    """gpu_data_packed: None when not given, else a trusted packed checkpoint (its snapshot
    names the chunks torpord streams to the agents)."""
    packed = data_dir(path)
    if packed is not None:
        require_trusted_location(packed, "checkpoint")
        if not store_images.is_packed(packed):
            raise UsageError(f"gpu_data_packed {packed} is not a packed checkpoint")
    return packed


def owner(pid: int) -> tuple[int, int | None] | None:
    """owner_pid: None when not given, else (pid, its start time): the caller whose death
    rolls the operation back."""
    if not pid:
        return None
    start = procs.start_time(pid)
    if start is None:
        raise UsageError(f"owner PID {pid} is not running")
    return pid, start


# LockAndCheckpointRequest.fingerprints: FINGERPRINTS_NONE, _INDEX, _SKIP
_FINGERPRINT_MODES = (FingerprintMode.NONE, FingerprintMode.INDEX, FingerprintMode.SKIP)


def fingerprint_mode(n: int) -> FingerprintMode:
    """The request's fingerprints value as the engine's mode."""
    if not 0 <= n < len(_FINGERPRINT_MODES):
        raise UsageError(f"unknown fingerprints mode {n}")
    return _FINGERPRINT_MODES[n]
