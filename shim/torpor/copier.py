"""torpor-copier (agent/copier/copier.c): the copy of a paused program's held GPU memory into its
data files, from a process of its own, beside the driver's checkpoint and CRIU's dump.

A leave-running checkpoint whose agent deferred its copy (agent/PROTOCOL.md, "The deferred
copy"; config leave_running_drain) has its data files sized but empty once the agent's
prepare returns: the agent wrote the plan of the copy into a memfd and released the memory,
which the descriptors `detach hold` gave torpor keep alive. The copier was started before
the pause (prestart, in a session of its own: as CRIU, a torpor killed during the pause does
not take it along; where systemd is the init and torpor runs as root, in a scope of its own
too, scoped(): a unit's stop or restart kills its whole cgroup, and torpord runs as one) and
made its GPU contexts while the program ran; ready() says it got there, and only then does
the prepare defer its copy (a copier that cannot, on a GPU without room for another context,
leaves the copy to the agent as without one). hand() gives it the plan, the data files and
those descriptors; it finishes the files before it lets the memory go. wait() is the last
step before the program's resume, which must not run while the copier reads the memory the
program would write. A recovery in another torpor only has the copier's
PID and start time from the journal: it waits for that process to be gone, then resumes the
program from the files, which the agent checks part by part by their GPU fingerprints.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import select
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import fdbag, procs
from .errors import NotFoundError, TorporError

BINARY = Path(__file__).resolve().parent / "_agent" / "torpor-copier"
REPLY_MAX = 64 << 10
READY_TIMEOUT_S = 30.0  # how long a copier may take to load the driver and make its contexts
# Free GPU memory a copier's context needs beside the running program: a context takes a few
# hundred MiB (its own, never the program's), made while the program runs and may still
# allocate; below this much free, a program near its GPU's end could meet an out-of-memory
# error torpor caused, so no copier is started there (the agent copies as without one).
CONTEXT_ROOM = 1 << 30
CONTEXT_SIZE = 512 << 20   # what one copier's context is taken to use, for the next one's check
FOREIGN_WAIT_S = 60.0   # how long a recovery waits for another torpor's copier, each time
SYSTEMD_DIR = Path("/run/systemd/system")   # present where systemd is the init (sd_booted)
SCOPE_FAILED = "systemd-run could not start it in a scope of its own"
SCOPE_RETRY_S = 600.0   # how long a systemd-run failure is remembered: then a scope is tried again
_scopes = itertools.count()
# a unit name of this process's own: a PID reused after a torpord restart (a PID namespace)
# could otherwise meet a scope that outlived the last one, still running its copier
_RUN = os.urandom(3).hex()
_scope_broken = ""   # why systemd-run failed in this process: not asked again (scope_broken)
_scope_broken_at = 0.0   # when (time.monotonic()): forgotten SCOPE_RETRY_S later


def scope_broken() -> str:
    """Why systemd-run could not give a copier its scope in this process in the last
    SCOPE_RETRY_S ("" if it did, or was never asked, or that was longer ago): the copiers
    since run in torpor's own cgroup. Forgotten after that, so that one passing failure (a
    D-Bus restart) does not turn scopes off for the months a torpord runs."""
    global _scope_broken
    if _scope_broken and time.monotonic() - _scope_broken_at >= SCOPE_RETRY_S:
        _scope_broken = ""
    return _scope_broken


def _remember_scope_failure(why: str) -> str:
    global _scope_broken, _scope_broken_at
    _scope_broken, _scope_broken_at = why, time.monotonic()
    return f"{SCOPE_FAILED} ({why})"


class StillCopying(TorporError):
    """Another torpor's copier still runs: what it holds is the only copy of the data, so it
    is never killed; the journal entry stays, and the next recovery looks again."""


def binary(path: str = "") -> Path:
    """The copier to run: path (config copier), else the one installed beside the agent."""
    exe = Path(path) if path else BINARY
    if not exe.is_file():
        raise NotFoundError(f"torpor-copier is missing ({exe})",
                            hint="reinstall torpor: the build compiles agent/ with make and gcc"
                            if not path else "set config copier to where it is")
    return exe


def new_plan() -> int:
    """An empty memfd for the agent's plan (a regular file to it), close-on-exec."""
    return os.memfd_create("torpor-copy-plan", os.MFD_CLOEXEC)


@dataclasses.dataclass
class Copier:
    pid: int
    start: int | None                        # its start time (procs.start_time), for recovery
    proc: subprocess.Popen[bytes] | None = None   # this torpor's child: its reply on stdout
    ctl: socket.socket | None = None         # ready(): where its go goes (hand)
    early: bytes = b""                       # what it wrote after its ready line
    scoped: bool = False                     # started by systemd-run --scope (scoped())

    def to_json(self) -> dict[str, int]:
        return {"copier": self.pid, "copier_start": self.start or 0}


def scoped(command: list[str]) -> list[str]:
    """command, run in a transient systemd scope of its own where systemd is the init and
    this is root: `systemd-run --scope` moves itself into the new scope and then execs command
    (same PID, parent and descriptors). Without it a torpord stopped or restarted by systemd
    (its unit's cgroup killed whole), or a torpor in a login session that is closed, would
    take the copier along while it holds the only copy of a program's GPU memory. Elsewhere
    (no systemd, not root) command as it is: its own session still keeps it from torpor's
    signals."""
    run = shutil.which("systemd-run")
    if os.geteuid() != 0 or not run or not SYSTEMD_DIR.is_dir() or scope_broken():
        return command
    unit = f"torpor-copier-{os.getpid()}-{_RUN}-{next(_scopes)}"
    return [run, "--scope", "--quiet", "--collect", f"--unit={unit}",
            "--description=torpor-copier: a checkpoint's GPU memory into its data files",
            "--", *command]


def _spawn(command: list[str], fds: Sequence[int]) -> subprocess.Popen[bytes]:
    # every GPU visible, whatever this torpor's shell hides: the program's may be any of them
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, pass_fds=fds, start_new_session=True, env=env)


def take_room(uuids: Sequence[str], free: Mapping[str, int], taken: dict[str, int]
              ) -> str | None:
    """Why a copier must not make a context on uuids (a program's GPUs), given NVML's free
    bytes of each GPU and what the copiers already let through take of it (GPUs NVML does not
    show are left to the copier's own context creation); None when each has CONTEXT_ROOM
    left, and then CONTEXT_SIZE is added to each one's taken: several programs on one GPU
    start one copier each."""
    for u in uuids:
        if u in free and free[u] - taken.get(u, 0) < CONTEXT_ROOM:
            others = (f" (about {taken[u] >> 20} MiB of it for other programs' copiers)"
                      if taken.get(u) else "")
            return (f"{u} has {free[u] >> 20} MiB free{others}, less than the "
                    f"{CONTEXT_ROOM >> 20} MiB a copier's context may take beside the program")
    for u in uuids:
        if u in free:
            taken[u] = taken.get(u, 0) + CONTEXT_SIZE
    return None


def prestart(libcuda: str, devices: Sequence[str], exe: str = "", deadline_s: float = 0
             ) -> Copier:
    """A copier started before the pause, with nothing to copy yet: it loads the driver and
    makes a context on each of devices (NVML's UUIDs of the program's GPUs) while the program
    runs, then waits for hand(). ready() says whether it got there; discard() one that is not
    handed anything. exe: config copier (binary()). It holds no memory until hand(), so it may be killed until then."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        args = ["--libcuda", libcuda, "--ctl", str(theirs.fileno())]
        if devices:
            args += ["--devices", ",".join(devices)]
        if deadline_s > 0:   # no part written for that long after its go: it ends by itself
            args += ["--deadline", str(max(1, int(deadline_s)))]
        plain = [str(binary(exe)), *args]
        command = scoped(plain)
        proc = _spawn(command, [theirs.fileno()])
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    # scoped from the command, not binary() again: the binary may be gone by now, and an
    # error here would leave the copier started and its socket open
    return Copier(proc.pid, procs.start_time(proc.pid), proc, ours, scoped=command != plain)


def ready(c: Copier, timeout: float = READY_TIMEOUT_S) -> str | None:
    """None once c (prestart) says it is ready to copy; else why it is not (its own error, or
    nothing said in time), and c is discarded. Where systemd-run failed (ended with status 1,
    or still runs at the timeout), the reason starts with SCOPE_FAILED, and the copiers of the
    next SCOPE_RETRY_S start without a scope."""
    assert c.proc is not None and c.proc.stdout is not None
    fd, buf = c.proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    why = f"not ready after {timeout:g} s"
    poller = select.poll()   # not select(): a descriptor past 1024 is fine
    poller.register(fd, select.POLLIN)
    while b"\n" not in buf and len(buf) < REPLY_MAX:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(max(1, int(left * 1000))):
            if c.scoped and not buf and _comm(c.pid) == "systemd-run":
                # still systemd-run, not yet the copier it execs: it hangs (a D-Bus that does
                # not answer), as every scoped copier after it would: taken for its failure
                why = _remember_scope_failure("systemd-run --scope still running at the "
                                              "copier's ready timeout: it hangs")
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            why = "it ended with no reply"
            if c.scoped and not buf:   # systemd-run's own failure (its error is not kept)
                why = _scope_failed(c)
            break
        buf += chunk
    line, nl, c.early = buf.partition(b"\n")
    if nl:
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if isinstance(reply, dict) and reply.get("ready") is True:
            return None
        why = str(reply.get("error", "?"))[:300] if isinstance(reply, dict) else \
            "it said something else"
    discard(c)
    return why


def _scope_failed(c: Copier) -> str:
    """A scoped copier that ended before a word: systemd-run failed (no D-Bus, a systemd
    without transient scopes, a container that sees the host's /run): said, and this process
    starts its copiers without a scope for SCOPE_RETRY_S (scope_broken)."""
    assert c.proc is not None
    try:
        rc = c.proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "it ended its output with no reply"
    if rc != 1:    # systemd-run's failure is 1; the copier says its own failures (a JSON
        return f"it ended with status {rc} and no reply"   # line), 2 is its usage, 127 exec
    return _remember_scope_failure(f"systemd-run --scope ended with status {rc}")


def _comm(pid: int) -> str:
    """pid's command name (/proc/<pid>/comm), "" where it cannot be read."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def hand(c: Copier, plan: int, files: Sequence[int], held: Sequence[int]) -> None:
    """Give a ready copier its work: plan (new_plan(), written by the agent), files (the data
    files, read-write, sized by the agent), held (detach_hold's descriptors, in their order).
    OSError when it is gone (or past HOLD_DIRECT held, no bag of them can be made: fdbag.py).
    Every fd stays the caller's (the copier has its own copies)."""
    assert c.ctl is not None
    try:
        with fdbag.carried(held) as sent:
            socket.send_fds(c.ctl, [f"go {len(files)} {len(held)}".encode()],
                            [plan, *files, *sent])
    finally:
        c.ctl.close()
        c.ctl = None


def discard(c: Copier) -> None:
    """A prestarted copier never handed anything (or not ready): it holds nothing, so it goes."""
    if c.ctl is not None:
        c.ctl.close()
        c.ctl = None
    if c.proc is None or c.proc.stdout is None or c.proc.stdout.closed:
        return   # never ours, or reaped already
    if c.proc.poll() is None:
        c.proc.kill()
    c.proc.communicate()


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
    out = (c.early + out)[:REPLY_MAX]
    try:
        reply = json.loads(out or b"null")
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
