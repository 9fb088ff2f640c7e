"""Suspend and resume of bare process trees: their GPU state to host memory and back.

suspend:    [agent-prepare -> agent-detach ->] lock -> checkpoint, and the process stays, its
            GPU memory released
resume:     gpu-restore -> unlock [-> agent-resume]

A suspended program's agent data goes into a private directory under suspend_dir (/dev/shm:
host memory), removed at resume; with suspend_in_process the agent keeps it in the program's
own memory instead.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .. import agent_data, procs
from ..driver import ProcessState
from ..engine import Engine, HostMemory, targets_of
from ..errors import NotFoundError, UsageError
from . import policy
from .checkpoint import gpu_view, require_running


def suspend(engine: Engine, pid: int) -> dict[str, Any]:
    """Move the GPU state of pid's tree to host memory and release the GPU; it stays alive."""
    procs.require(pid)
    tree = procs.tree(pid)
    with engine.begin("suspend", tree) as op:
        states, inv = gpu_view(engine, tree)
        if not states:
            engine.driver  # a missing driver is the better message
            raise UsageError(f"process tree {pid} has no CUDA state: nothing to suspend")
        require_running(states)
        cuda_pids = sorted(states)
        gpu_memory = {p: inv.memory_of(p) for p in cuda_pids} if inv else {}
        # Its GPU memory goes to host memory (the program's, or /dev/shm): refused before
        # anything moves rather than leaving the kernel to kill the program half-way. The
        # engine checks, once it knows which agents answer: the driver moves all of a
        # program's GPU memory (NVML's figure); an agent knows, once it has scanned the GPU,
        # how much of it is zeros that stay behind (a JAX arena is mostly zeros).
        available = procs.mem_available()
        host = None if available is None else HostMemory(available, gpu_memory,
                                                         f"suspending {pid}")
        data = agent_data.InProcess() if engine.cfg.suspend_in_process \
            else agent_data.DataDir.scratch(engine.cfg, pid)
        moved = engine.lock_and_checkpoint(op, cuda_pids, data=data, scratch=True, host=host)
        try:
            for p in cuda_pids:
                record = {"root": pid, "since": time.time(),
                          "gpus": inv.gpus_of(p) if inv else [],
                          "gpu_memory": gpu_memory.get(p, 0)}
                if str(p) in op.entry.agents:   # where its agent's data is, for resume
                    record["agents"] = {str(p): op.entry.agents[str(p)]}
                    record["data_root"] = op.entry.data_root
                    record["agent"] = moved[p]
                engine.journal.mark_suspended(p, record)
        except BaseException as e:  # e.g. a full disk: suspended unrecorded is suspended lost
            for p in cuda_pids:
                engine.journal.clear_suspended(p)
            engine.fail(op, cuda_pids, e, during="suspend")
    return {"pids": cuda_pids, "gpu_memory_released": sum(gpu_memory.values()),
            "agent": {str(p): r for p, r in moved.items()},
            "timings": policy.timings(engine)}


def resume(engine: Engine, pid: int) -> dict[str, Any]:
    """Give a suspended tree its GPU state back and let it run."""
    procs.require(pid)
    states = engine.cuda_states(procs.tree(pid))
    if not states:
        engine.driver
        raise NotFoundError(f"process tree {pid} has no CUDA state")
    locked = sorted(p for p, s in states.items()
                    if s in (ProcessState.CHECKPOINTED, ProcessState.LOCKED))
    records = {p: r for p, r in engine.journal.suspended().items() if p in states}
    # A program whose agent moved its memory: also when a resume died after the driver's part
    agents = {p: t for p, r in records.items() for t in targets_of(r.get("agents", {})).values()
              if t.pid == p}
    todo = sorted(set(locked) | set(agents))
    if not todo:
        raise UsageError(f"process tree {pid} is not suspended (all RUNNING)")
    with engine.begin("resume", todo) as op:
        back = policy.restore_or_roll_back(engine, op, locked, agents=agents,
                                           retry=todo)
    for root in {r["data_root"] for p, r in records.items() if p in todo and r.get("data_root")}:
        agent_data.DataDir(Path(root)).remove(background=True)
    for p in todo:
        engine.journal.clear_suspended(p)
    return {"pids": todo, "agent": {str(p): r for p, r in back.items()},
            "timings": policy.timings(engine)}
