"""Linux process facts read from /proc: existence, trees, names, sessions."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

from .errors import NotFoundError, UsageError
from .files import printable

PROC = Path("/proc")
# PID_MAX_LIMIT, the most /proc/sys/kernel/pid_max may be (4 Mi on 64-bit): every PID is below it
PID_LIMIT = 1 << 22


def is_pid(n: object) -> bool:
    """Whether n could be a Linux PID (1 to PID_LIMIT - 1); a PID read from a checkpoint is
    held to it before anything uses it."""
    return isinstance(n, int) and not isinstance(n, bool) and 0 < n < PID_LIMIT


def alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def pid_taken(pid: int, zombie_grace_s: float = 3.0) -> bool:
    """True while any process, zombies included, holds pid. A zombie (a dumped program
    whose parent has not reaped it yet) gets zombie_grace_s to be reaped first."""
    deadline = time.monotonic() + zombie_grace_s
    while (PROC / str(pid)).exists():
        if alive(pid) or time.monotonic() > deadline:
            return True
        time.sleep(0.02)
    return False


PF_KTHREAD = 0x00200000   # /proc/PID/stat flags: a kernel thread (linux/sched.h)


def _kernel_thread(pid: int) -> bool:
    try:
        return int(_stat_fields(pid)[6]) & PF_KTHREAD != 0
    except (OSError, IndexError, ValueError):
        return False


def _holds_self(pid: int) -> bool:
    """Whether pid is this process or one of its ancestors: its tree would hold the torpor
    that checkpoints it (and CRIU, and the dump would stop them both)."""
    cur, seen = os.getpid(), 0
    while cur > 1 and seen < 4096:
        if cur == pid:
            return True
        try:
            cur = int(_stat_fields(cur)[1])
        except (OSError, IndexError, ValueError):
            return False
        seen += 1
    return False


def require(pid: int) -> int:
    if pid <= 1:
        raise UsageError(f"refusing PID {pid}: not a program torpor can checkpoint")
    if not alive(pid):
        raise NotFoundError(f"no process with PID {pid}")
    if _kernel_thread(pid):   # CRIU would try, after torpor walked its "tree" (kthreadd: all)
        raise UsageError(f"refusing PID {pid}: a kernel thread, not a program torpor can "
                         "checkpoint")
    return pid


def parse_pid(text: str) -> int:
    """A PID given on the command line: decimal ASCII digits (a leading '-' is read, then
    refused), not whatever int() takes: ' 5 ', '1_0' and Arabic-Indic digits named other
    processes. Neither this process nor an ancestor (the shell it was started from)."""
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 20:
        raise UsageError(f"not a PID: '{printable(text, 40)}'")
    pid = require(int(text))
    if _holds_self(pid):
        raise UsageError(f"refusing PID {pid}: its process tree holds this torpor (PID "
                         f"{os.getpid()}); run torpor from outside the tree")
    return pid


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except FileNotFoundError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return out


def tree(pid: int) -> list[int]:
    """pid and all its descendants, parents first."""
    result, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        if p in result:
            continue
        result.append(p)
        todo += children(p)
    return result


def comm(pid: int) -> str:
    """pid's command name; "?" when it cannot be read (gone, or hidden from us)."""
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def cmdline(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except FileNotFoundError:
        return ""
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def _stat_fields(pid: int) -> list[str]:
    stat = (PROC / str(pid) / "stat").read_text()
    return stat.rsplit(")", 1)[1].split()


def session_id(pid: int) -> int:
    return int(_stat_fields(pid)[3])


def tty_nr(pid: int) -> int:
    return int(_stat_fields(pid)[4])


def stopped(pid: int) -> bool:
    """Whether pid is stopped by a signal (state T; not a tracee's t)."""
    try:
        return _stat_fields(pid)[0] == "T"
    except (OSError, IndexError):
        return False


def needs_shell_job(pid: int) -> bool:
    """CRIU's --shell-job: the tree's session or terminal lies outside the tree."""
    return session_id(pid) != pid or tty_nr(pid) != 0


def start_time(pid: int) -> int | None:
    """When pid started (clock ticks since boot): tells a process from a later one that
    reuses its PID. None when there is no such process."""
    try:
        return int(_stat_fields(pid)[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def started_at(pid: int) -> float | None:
    """When pid started, in seconds since the epoch (time.time()'s clock); None when there is
    no such process."""
    ticks = start_time(pid)
    if ticks is None:
        return None
    try:
        with open("/proc/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def find_argv(*words: str) -> list[int]:
    """The live processes of our own user (root's for a root torpor) whose command line holds
    every one of words, each as a whole argument. Anyone can start a process with any command
    line: one of another user's is never taken for ours (a CRIU recovery would wait for)."""
    found = []
    me = os.geteuid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if all(w.encode() in argv for w in words) and _uids(int(name)) == (me, me):
                found.append(int(name))
        except OSError:
            continue
    return found


def _uids(pid: int) -> tuple[int, int]:
    """pid's real and effective uid (a user's process may not fake either)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Uid:"):
                real, effective = line.split()[1:3]
                return int(real), int(effective)
    raise OSError(f"no Uid line for {pid}")


def traced(pid: int) -> bool:
    """Whether a tracer (CRIU dumping it, a debugger) holds pid."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1]) != 0
    except (OSError, ValueError, IndexError):
        pass
    return False


def rss_bytes(pid: int) -> int:
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def mem_available() -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), or None."""
    try:
        for line in (PROC / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def owner_uid(pid: int) -> int:
    return os.stat(PROC / str(pid)).st_uid


def nspid(pid: int) -> int | None:
    """pid as its own, innermost pid namespace numbers it (the last field of NSpid: in
    /proc/<pid>/status): getpid() inside a container, pid itself for a host process. None
    when there is no such process."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None
    return pid  # a kernel without NSpid (< 4.1) has no pid namespaces to speak of


def raise_fd_limit() -> str | None:
    """The soft limit on descriptors up to the hard one, for this process alone (its children
    inherit it; the programs torpor starts with `torpor run` are not its children then). torpord
    splices two a connection; a --leave-running checkpoint holds up to 200 a program of its
    GPU memory through the dump (held memory, the default), more than a shell's 1024 for a
    job of several ranks. None, or why it could not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= soft:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ValueError, OSError) as e:
        return f"cannot raise the descriptor limit from {soft}: {e}"
    return None
