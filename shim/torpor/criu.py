"""One door to CRIU: every CRIU call goes through run_criu().

Explicit argv, a cleaned environment, the command logged, CRIU's own log kept (dump.log in
the image directory, restore logs in the operation's work directory) and quoted only on
failure. CRIU's plugin directory is pointed at an empty one: CRIU >= 4 ships a cuda plugin
that would lock and checkpoint GPU state on its own, which is torpor's job here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from . import manifest, procs
from .config import Config
from .errors import CriuError, TorporError
from .files import private_dir, read_small_file, read_untrusted_tail

log = logging.getLogger(__name__)

MIN_VERSION = (4, 0)
SEARCH = ("/usr/local/sbin/criu", "/usr/sbin/criu", "/usr/local/bin/criu", "/usr/bin/criu")
# TORPOR_CRIU_PLUGIN=off: torpor's CRIU plugin (packaging/criu-plugin), loaded by every CRIU
# run, leaves torpor's own dumps and restores alone (they lock the GPU themselves)
CLEAN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C",
             "TORPOR_CRIU_PLUGIN": "off"}

DUMP_LOG = manifest.DUMP_LOG  # in the image directory, travels with the checkpoint
RESTORE_LOG = "restore.log"  # in the restore's work directory


@dataclasses.dataclass(frozen=True)
class Criu:
    path: str
    version: tuple[int, ...]

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


def _parse_version(text: str) -> tuple[int, ...]:
    m = re.search(r"Version:\s*([0-9][0-9.]*)", text)
    if not m:
        return ()
    return tuple(int(x) for x in m.group(1).strip(".").split("."))


@functools.lru_cache(maxsize=4)
def _probe(path: str) -> Criu:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True,
                             env=CLEAN_ENV, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CriuError(f"cannot run CRIU at {path}: {e}") from e
    version = _parse_version(out)
    if not version:
        raise CriuError(f"{path} does not look like CRIU ('--version' said: {out.strip()[:80]})")
    return Criu(path, version)


def find(cfg: Config) -> Criu:
    """The configured CRIU, else the first on the search path; CriuError if none is >= 4.0."""
    candidates = [cfg.criu] if cfg.criu else [p for p in SEARCH if os.access(p, os.X_OK)]
    if not cfg.criu and shutil.which("criu"):
        candidates.append(shutil.which("criu"))  # type: ignore[arg-type]
    if not candidates:
        raise CriuError("CRIU is not installed", hint="run ./install.sh")
    found = [_probe(c) for c in candidates]
    good = [c for c in found if c.version >= MIN_VERSION]
    if not good:
        raise CriuError(f"CRIU {found[0].version_text} at {found[0].path} is too old: "
                        f"torpor needs 4.0 or newer",
                        hint="3.x fails on current kernels; run ./install.sh to build 4.x")
    return good[0]


def _empty_plugin_dir(cfg: Config) -> Path:
    return private_dir(cfg.state_dir / "criu-plugins-none")


# A line of CRIU's log at -v4 (criu/include/log.h): "(00.123456) Error (criu/cr-dump.c:123):
# what", in a restored task "(00.123456)   1234: Error (...): what"; a warning "Warn  (...)"
_LEVEL_LINE = re.compile(r"(?:\(\s*[0-9.]+\)\s*)?(?:[0-9]+:\s*)?"
                         r"(Error|Warn)\s*\([^()]*\):\s*(.*)")
# errors CRIU logs and goes on after: never why it failed
_HARMLESS = ("rlimit: Can't setup RLIMIT_NOFILE for self",)
# its last word, which says only that it failed
_VERDICT = re.compile(r"(Dumping|Pre-dumping|Restoring) FAILED\.?")


def log_errors(log_path: Path, n: int = 3) -> str:
    """Why CRIU failed, from its log's tail, in one line: its first errors (the first says
    why, as CRIU's own log_first_err has it; the rest follow from it), leaving out those it
    goes on after (_HARMLESS) and its closing "Dumping FAILED."; where there are none, its
    warnings, then what was left out, then lines that mention an error, then its last lines."""
    try:
        tail = read_untrusted_tail(log_path.parent, log_path.name, 256 << 10)
        lines = tail.decode(errors="replace").splitlines()
    except (OSError, TorporError):   # a link or a FIFO in its place: not quoted
        return f"(no log at {log_path})"
    errors, warnings = [], []
    for ln in lines:
        m = _LEVEL_LINE.fullmatch(ln.strip())
        if m:
            (errors if m[1] == "Error" else warnings).append(m[2].strip())
    harmful = [e for e in errors if not e.startswith(_HARMLESS)]
    causes = [e for e in harmful if not _VERDICT.fullmatch(e)]
    mention = [ln.strip() for ln in lines if "error" in ln.lower()]
    picked = next((found[:n] for found in (causes, warnings, harmful, errors) if found), None) \
        or mention[-n:] or lines[-n:]
    return " | ".join(picked)


def _outliving_setup() -> None:
    """In CRIU's child, before exec: images private (umask 077); CRIU is left to finish on its
    own, in its own session, out of reach of the terminal's Ctrl-C and of torpor's death, and
    writes to a file, not to a pipe torpor's death would break. Killed half-way, CRIU harms
    the program either way: a dump's tracees may be inside its parasite (registers set up for
    a syscall that, resumed without its tracer, ends the program, seen with a SIGKILLed
    torpor), and a restore leaves its processes frozen in its restorer (blocked signals, a
    futex CRIU would have woken). Recovery (engine/recovery.py) waits for CRIU's outcome
    instead: a finished dump is sealed, a failed one rolled back; a finished restore is
    completed, a tree a CRIU killed anyway left is stopped."""
    os.umask(0o077)


def run_criu(criu: Criu, cfg: Config, action: str, args: list[str], log_path: Path,
             *, timeout: float | None = None) -> None:
    """Run `criu ACTION ARGS` with its log at log_path, outliving torpor (_outliving_setup);
    CriuError quoting the log on failure. A timeout kills CRIU: for calls that change no
    process (check, a probe), never a dump or a restore."""
    argv = [criu.path, action, *args, "--log-file", str(log_path), "-v4",
            "--libdir", str(_empty_plugin_dir(cfg))]
    log.info("running %s", " ".join(argv))
    start = time.monotonic()
    out_path = log_path.with_suffix(".out")   # CRIU's own words, read then removed
    try:
        fd = os.open(out_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        with open(fd, "w+b") as out:
            proc = subprocess.run(argv, env=CLEAN_ENV, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout,
                                  start_new_session=True, preexec_fn=_outliving_setup)
            out.seek(0)
            said = out.read(1 << 16)
    except subprocess.TimeoutExpired as e:
        raise CriuError(f"criu {action} did not finish in {timeout:.0f} s (log: {log_path})",
                        cut_short=True) from e
    finally:
        out_path.unlink(missing_ok=True)
    log.info("criu %s exited %d after %.2f s", action, proc.returncode, time.monotonic() - start)
    if proc.returncode < 0:   # its log ends wherever the signal found it: nothing to quote
        raise CriuError(f"criu {action} failed: CRIU was killed by signal {-proc.returncode} "
                        f"({_signal_name(-proc.returncode)}) (log: {log_path})", cut_short=True)
    if proc.returncode != 0:
        lines = said.decode(errors="replace").strip().splitlines()
        detail = log_errors(log_path) if log_path.exists() else (lines[-1] if lines else "")
        detail += "".join(f" [{hint}]" for said_by_criu, hint in _HINTS if said_by_criu in detail)
        raise CriuError(f"criu {action} failed: {detail} (log: {log_path})")


# What CRIU says, and what an operator does about it.
_HINTS = (
    ("Connected TCP socket", "torpor takes established TCP connections along with "
     "tcp_established = true in its config, or TORPOR_TCP_ESTABLISHED=1"),
    ("has bad size", "a file the program had open when it was checkpointed has changed size "
     "since: CRIU reopens it in place, so it must be as it was"),
)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "an unnamed signal"


def network_lock_args(tcp_established: bool) -> list[str]:
    """How CRIU locks the connections it takes along: its default, iptables, needs
    iptables-restore; a host with only nftables (no iptables installed) gets CRIU's nftables
    lock instead, or every dump with --tcp-established fails ("Failed to lock TCP
    connection"). A `network-lock` line in /etc/criu/default.conf still wins for the default."""
    if not tcp_established or shutil.which("iptables-restore", path=CLEAN_ENV["PATH"]):
        return []
    return ["--network-lock", "nftables"]


def dump(criu: Criu, cfg: Config, pid: int, images_dir: Path, *, leave_running: bool,
         shell_job: bool, tcp_established: bool = False, extra: list[str] | None = None) -> None:
    args = ["--tree", str(pid), "--images-dir", str(images_dir)]
    if leave_running:
        args.append("--leave-running")
    if shell_job:
        args.append("--shell-job")
    if tcp_established:
        args += ["--tcp-established", *network_lock_args(True)]
    run_criu(criu, cfg, "dump", args + list(extra or []), images_dir / DUMP_LOG)


def restore(criu: Criu, cfg: Config, images_dir: Path, work_dir: Path, *, shell_job: bool,
            tcp_established: bool = False, extra: list[str] | None = None) -> int:
    """Restore detached; returns the root PID CRIU reports."""
    pidfile = work_dir / "restore.pid"   # restore_finished() reads it too
    args = ["--images-dir", str(images_dir), "--work-dir", str(work_dir),
            "--restore-detached", "--pidfile", str(pidfile)]
    if shell_job:
        args.append("--shell-job")
    if tcp_established:
        args += ["--tcp-established", *network_lock_args(True)]
    run_criu(criu, cfg, "restore", args + list(extra or []), work_dir / RESTORE_LOG)
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError) as e:
        raise CriuError(f"criu restore gave no PID (pidfile {pidfile}): {e}") from e


def dumping(images_dir: Path) -> list[int]:
    """The CRIU processes still dumping into images_dir (a checkpoint whose torpor died)."""
    return procs.find_argv("dump", "--images-dir", str(images_dir))


def dump_output(images_dir: Path) -> Path:
    """Where a dump's CRIU writes its standard output while it runs (removed after)."""
    return (images_dir / DUMP_LOG).with_suffix(".out")


def restore_finished(work_dir: Path) -> bool:
    """Whether the CRIU restore run in work_dir got to the end (it writes its pidfile once
    every process is restored)."""
    return (work_dir / "restore.pid").is_file()


def restoring(work_dir: Path) -> list[int]:
    """The CRIU processes still restoring in work_dir (a restore whose torpor died)."""
    return procs.find_argv("restore", "--work-dir", str(work_dir))


def check(criu: Criu) -> tuple[bool, str]:
    """`criu check`: (ok, what it said)."""
    proc = subprocess.run([criu.path, "check"], env=CLEAN_ENV, capture_output=True, text=True,
                          timeout=60)
    said = (proc.stdout + proc.stderr).strip()
    return proc.returncode == 0, said.splitlines()[-1] if said else ""


def pstree(images_dir: Path) -> list[dict]:
    """Entries of pstree.img (pid, ppid, pgid, sid, threads), read with CRIU's own pycriu."""
    try:
        from pycriu import images
    except ImportError as e:
        raise CriuError("pycriu is not installed (it comes with CRIU)",
                        hint="run ./install.sh") from e
    path = images_dir / "pstree.img"
    try:
        with open(path, "rb") as f:
            img = images.load(f)
    except FileNotFoundError:
        raise CriuError(f"{images_dir} holds no CRIU image (no pstree.img)") from None
    except Exception as e:  # pycriu raises its own and protobuf errors
        raise CriuError(f"cannot read {path}: {e}") from e
    return list(img["entries"])


# stats-dump's fields (microseconds) as the pause reports them, in seconds
_DUMP_STATS_S = {"frozen_time": "frozen_s", "memdump_time": "memdump_s",
                 "memwrite_time": "memwrite_s"}


def dump_stats(images_dir: Path, since: float = 0.0) -> dict[str, float | int] | None:
    """What CRIU's dump says of itself (its stats-dump, read with pycriu): how long it kept
    the tree frozen, of which dumping and writing memory, and the pages it wrote. None where
    there is none, it was written before since (wall clock: an earlier dump's, in a work
    directory that outlives checkpoints) or it cannot be read (an older CRIU, a damaged
    file): it only informs."""
    try:
        from pycriu import images
        path = images_dir / "stats-dump"
        if os.lstat(path).st_mtime < since:
            return None
        # CRIU writes a few dozen bytes: a FIFO, a device or anything larger is not read
        entry = images.loads(read_small_file(path, 4096))["entries"][0]["dump"]
        out: dict[str, float | int] = {
            name: round(int(entry[key]) / 1e6, 4) for key, name in _DUMP_STATS_S.items()}
        out["pages_written"] = int(entry["pages_written"])
    except Exception:  # noqa: BLE001  (pycriu's own and protobuf errors, a missing field)
        return None
    if any(v < 0 for v in out.values()):
        return None
    return out
