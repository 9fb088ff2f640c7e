"""torpor-copier (agent/copier/copier.c): the copy of a paused program's held GPU memory into its
data files, from a process of its own, beside the driver's checkpoint and CRIU's dump.

A leave-running checkpoint whose agent deferred its copy (agent/PROTOCOL.md, "The deferred
copy"; config leave_running_drain) has its data files sized but empty once the agent's
prepare returns: the agent wrote the plan of the copy into a memfd and released the memory,
which the descriptors `detach hold` gave torpor keep alive. start() hands the plan, the data
files and those descriptors to the copier, in a session of its own (as CRIU: a torpor killed
during the pause does not take it along, and it finishes the files before it lets the memory
go); wait() is the last step before the program's resume, which must not run while the copier
reads the memory the program would write. A recovery in another torpor only has the copier's
PID and start time from the journal: it waits for that process to be gone, then resumes the
program from the files, which the agent checks part by part by their GPU fingerprints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from . import procs
from .errors import NotFoundError, TorporError

BINARY = Path(__file__).resolve().parent / "_agent" / "torpor-copier"
REPLY_MAX = 64 << 10
FOREIGN_WAIT_S = 60.0   # how long a recovery waits for another torpor's copier, each time


class StillCopying(TorporError):
    """Another torpor's copier still runs: what it holds is the only copy of the data, so it
    is never killed; the journal entry stays, and the next recovery looks again."""


def binary() -> Path:
    if not BINARY.is_file():
        raise NotFoundError(f"torpor-copier is missing ({BINARY})",
                            hint="reinstall torpor: the build compiles agent/ with make and gcc")
    return BINARY


def new_plan() -> int:
    """An empty memfd for the agent's plan (a regular file to it), close-on-exec."""
    return os.memfd_create("torpor-copy-plan", os.MFD_CLOEXEC)


@dataclasses.dataclass
class Copier:
    pid: int
    start: int | None                        # its start time (procs.start_time), for recovery
    proc: subprocess.Popen[bytes] | None = None   # this torpor's child: its reply on stdout

    def to_json(self) -> dict[str, int]:
        return {"copier": self.pid, "copier_start": self.start or 0}


def start(libcuda: str, plan: int, files: Sequence[int], held: Sequence[int]) -> Copier:
    """The copier running: plan (new_plan(), written by the agent), files (the data files,
    read-write, sized by the agent), held (detach_hold's descriptors, in their order). Every
    fd stays the caller's (the copier has its own copies)."""
    fds = [plan, *files, *held]
    proc = subprocess.Popen(
        [str(binary()), "--libcuda", libcuda, "--plan", str(plan),
         "--files", ",".join(map(str, files)), "--held", ",".join(map(str, held))],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        pass_fds=fds, start_new_session=True)
    return Copier(proc.pid, procs.start_time(proc.pid), proc)


def wait(c: Copier, timeout: float) -> dict[str, Any]:
    """Until the copier is gone: its reply ({"ok": true, "bytes", "parts", "seconds",
    "setup_seconds", "copy_seconds"}, or {"ok": false, "error"}). One of ours still copying
    after timeout seconds is killed (the resume cannot wait for ever: the program is paused,
    and this torpor holds the memory too), and that is its failure. Another torpor's copier
    (recovery: no proc) says nothing but that it ended: {"ok": None}, the agent's check of
    every part at the resume says the rest; one still running after FOREIGN_WAIT_S (or
    timeout, if shorter) raises StillCopying: it may hold the only copy, never killed."""
    if c.proc is None:
        return _wait_foreign(c, min(timeout, FOREIGN_WAIT_S))
    try:
        out, _ = c.proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        c.proc.kill()
        c.proc.communicate()
        return {"ok": False, "error": f"still copying after {timeout:g} s: killed"}
    try:
        reply = json.loads(out[:REPLY_MAX] or b"null")
    except ValueError:
        reply = None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        return {"ok": False, "error": f"it ended with status {c.proc.returncode} and no reply"}
    if not reply["ok"]:
        return {"ok": False, "error": str(reply.get("error", "?"))[:300]}
    return {k: v for k, v in reply.items() if isinstance(v, (bool, int, float))}


def _wait_foreign(c: Copier, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while _same(c):
        if time.monotonic() > deadline:
            raise StillCopying(f"torpor-copier (PID {c.pid}) is still copying a program's GPU "
                               "memory into its checkpoint, which an interrupted torpor left: "
                               "the program gets its memory back once it is done",
                               hint="run 'torpor ps' again in a while")
        time.sleep(0.05)
    return {"ok": None}


def _same(c: Copier) -> bool:
    """The copier's process still runs (not another one under its PID: its start time; one
    whose start could not be read when it started had ended by then)."""
    return bool(c.start) and procs.alive(c.pid) and procs.start_time(c.pid) == c.start
