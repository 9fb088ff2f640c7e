"""What torpord's handlers make of a request's PIDs and paths, with the checks that refuse bad
input (UsageError, NotFoundError): the PIDs an operation holds, the agents' socket directory,
the GPU data directory, and the GPU inventory when there is one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable

from .. import agent, gpus, procs
from ..errors import NoDriverError, UsageError
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


def agent_dir(run_dir: Path, *container_ids: str) -> Path:
    """The agents' socket directory: the first container's given, else the bare one."""
    cid = next((c for c in container_ids if c), "")
    return agent.container_dir(run_dir, cid) if cid else agent.default_dir()


def data_dir(path: str) -> Path | None:
    """gpu_data_dir (or gpu_data_packed): None when not given, else an absolute path."""
    if not path:
        return None
    if not os.path.isabs(path):
        raise UsageError(f"gpu_data_dir must be an absolute path, not {path!r}")
    return Path(path)
