#!/usr/bin/env python3
"""An adversarial sweep of torpor's command lines with bad input (not part of the suite).

    python tests/adhoc_clifuzz/clifuzz.py [-k SUBSTRING] [--json OUT] [--keep]

Runs `torpor` (every subcommand), `torpor-hook` and `torpord` as subprocesses, each case under
a timeout, on a fake GPU host (tests/fakes; `make -C tests/fakes` first) with a private state,
run, store and suspend directory. For each case it records the exit code and stderr, and flags:

  TRACEBACK   a Python traceback on stderr (or "Exception ignored")
  INTERNAL    "internal error" (a bug caught by main())
  HANG        the command ran past its timeout
  SIGNAL      the command died of a signal
  CODE        an exit code that errors.ExitCode does not list, or not the one expected
  LINES       stderr was not one line on a failure (argparse's usage report is allowed)
  SILENT      a failure with nothing on stderr
  TARGET      the target program was killed or stopped (only where it should have kept running)
  MODE        a file or directory torpor created in the sandbox readable by others
  LEFTOVER    a failed command left new files in the sandbox (outside state/ and the store)

Needs root (it runs some cases as nobody through setpriv, and mounts a 1 MiB tmpfs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.fakes.fakegpu import FakeGpu  # noqa: E402

BIN = Path(sys.executable).parent
CODES = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 130}
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
LONG = "x" * 100_000
ODD = os.fsdecode(b"\xff\xfe-not-utf8")          # surrogateescape, as argv gives it
PIDS = {"0": "0", "1": "1", "-1": "-1", "2**70": str(2**70), "word": "abc", "empty": "",
        "dash": "-", "space": " 5 ", "underscore": "1_0", "arabic3": "\u0663",
        "newline": "12\n", "long": "9" * 5000, "kthreadd": "2"}


@dataclasses.dataclass
class Case:
    name: str
    argv: list[str]                  # first item: torpor | torpor-hook | torpord | ...
    expect: set[int] | None = None   # exit codes that are right; None: any documented one
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)
    stdin: str = "devnull"           # devnull | closed | text:<...>
    stdout: str = "pipe"             # pipe | closed | broken
    stderr: str = "pipe"             # pipe | closed | broken
    cwd_gone: bool = False           # run from a directory removed before it starts
    during: Callable[["Sandbox", object], None] | None = None   # in a thread, as it runs
    nobody: bool = False
    timeout: float = 40.0
    target: str | None = None        # sleep | cuda | zombie | exiting: substituted for $PID
    target_must_live: bool = False
    setup: Callable[["Sandbox"], None] | None = None


@dataclasses.dataclass
class Result:
    case: str
    argv: list[str]
    rc: int | None
    stderr: str
    stdout_len: int
    flags: list[str]
    seconds: float


class Sandbox:
    def __init__(self, base: Path):
        self.base = base
        self.gpu = FakeGpu(base / "fakegpu")
        for d in ("state", "run", "store", "susp", "w"):
            (base / d).mkdir(mode=0o700, exist_ok=True)
        os.chmod(base, 0o755)
        self.env = {**os.environ, **self.gpu.env(),
                    "TORPOR_STATE_DIR": str(base / "state"), "TORPOR_RUN_DIR": str(base / "run"),
                    "TORPOR_CONFIG": str(base / "no-config.toml"),
                    "TORPOR_STORE_DIR": str(base / "store"), "TORPOR_SUSPEND_DIR": str(base / "susp"),
                    "TORPOR_SUSPEND_TMPFS": "false", "TORPOR_AGENT_DIR": str(base / "agents"),
                    "PYTHONDONTWRITEBYTECODE": "1",
                    # the torpor under test, also for the cases run through /bin/sh
                    "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        self.w = base / "w"

    def fresh(self) -> Path:
        """An empty work directory for one case."""
        shutil.rmtree(self.w, ignore_errors=True)
        self.w.mkdir(mode=0o755)
        return self.w

    def spawn_target(self, kind: str):
        if kind == "cuda":
            return self.gpu.spawn(mem=64 << 20)
        if kind.startswith("cuda-slow-"):
            prog = self.gpu.spawn(mem=64 << 20)
            self.gpu.delay(kind[len("cuda-slow-"):], 2000, prog.pid)
            return prog
        if kind == "sleep":
            return subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        if kind == "zombie":
            p = subprocess.Popen(["true"])
            time.sleep(0.3)          # exited, not reaped: a zombie until the case is done
            return p
        if kind == "exiting":
            return subprocess.Popen(["sleep", "0.4"], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        raise ValueError(kind)


def _snapshot(base: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(base):
        if "/fakegpu" in dirpath[len(str(base)):][:9]:
            continue
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            try:
                out[p] = os.lstat(p).st_mode
            except OSError:
                pass
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def run_case(sb: Sandbox, case: Case) -> Result:
    w = sb.fresh()
    if case.setup:
        case.setup(sb)
    target = sb.spawn_target(case.target) if case.target else None
    pid = str(target.pid) if target else ""
    argv = [a.replace("$W", str(w)).replace("$PID", pid).replace("$BASE", str(sb.base))
            .replace("$SEALED", str(sb.sealed)) for a in case.argv]
    exe = shutil.which(argv[0], path=str(BIN)) or argv[0]
    cmd = [exe, *argv[1:]]
    if case.nobody:
        cmd = NOBODY + cmd
    env = dict(sb.env)
    for k, v in case.env.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v.replace("$W", str(w)).replace("$BASE", str(sb.base))
    before = _snapshot(sb.base)
    flags: list[str] = []
    t0 = time.monotonic()
    stdin = subprocess.DEVNULL
    if case.stdin.startswith("text:"):
        stdin = subprocess.PIPE
    kw: dict = {}
    if "closed" in (case.stdin, case.stdout, case.stderr):
        closed = [n for n, c in ((0, case.stdin), (1, case.stdout), (2, case.stderr))
                  if c == "closed"]
        # close the descriptor in the child only: a shell's n>&- does the same
        wrap = " ".join(f"{n}>&-" if n else "<&-" for n in closed)
        cmd = ["/bin/sh", "-c", f'exec "$@" {wrap}', "sh", *cmd]
    cwd = w
    if case.cwd_gone:
        cwd = w / "gone"
        cwd.mkdir()
        cmd = ["/bin/sh", "-c", 'rmdir "$PWD" && exec "$@"', "sh", *cmd]
    if case.stdout == "broken":
        r, wfd = os.pipe()
        os.close(r)                    # every write to stdout: EPIPE (SIGPIPE is Python's own)
        kw["stdout"] = wfd
    else:
        kw["stdout"] = subprocess.PIPE
    kw["stderr"] = subprocess.PIPE
    if case.stderr == "broken":
        r, efd = os.pipe()
        os.close(r)
        kw["stderr"] = efd
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=stdin, cwd=cwd,
                                start_new_session=True, **kw)
        for name in ("stdout", "stderr"):
            if getattr(case, name) == "broken":
                os.close(kw[name])
        if case.during is not None:
            import threading
            threading.Thread(target=case.during, args=(sb, target), daemon=True).start()
        try:
            out, err = proc.communicate(
                case.stdin[5:].encode(errors="surrogateescape") if case.stdin.startswith("text:") else None,
                timeout=case.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            rc = None
            flags.append("HANG")
    finally:
        seconds = time.monotonic() - t0
    err_text = (err or b"").decode(errors="replace")
    out = out or b""
    if rc is not None and rc < 0:
        flags.append("SIGNAL")
    if "Traceback (most recent call last)" in err_text or "Exception ignored" in err_text:
        flags.append("TRACEBACK")
    if "internal error" in err_text:
        flags.append("INTERNAL")
    if rc is not None and rc >= 0 and (rc not in CODES or (case.expect and rc not in case.expect)):
        flags.append("CODE")
    lines = [line for line in err_text.splitlines() if line.strip()]
    usage = bool(lines) and lines[0].startswith("usage:")
    if rc not in (0, None) and not lines and case.stderr == "pipe":
        flags.append("SILENT")
    if rc not in (0, None) and len(lines) > 1 and not usage and argv[0] == "torpor":
        # progress lines before the error are fine; the error itself must be one line
        errs = [line for line in lines if "error" in line]
        if len(errs) != 1 or errs[-1] != lines[-1]:
            flags.append("LINES")
    if target is not None:
        st = _state(target.pid)
        if case.target_must_live and st in ("gone", "Z", "T", "t"):
            flags.append(f"TARGET({st})")
        try:
            if case.target.startswith("cuda"):
                target.kill()
            else:
                os.kill(target.pid, signal.SIGKILL)
                target.wait(5)
        except Exception:
            pass
    sb.gpu.clear_faults()
    after = _snapshot(sb.base)
    new = {p: m for p, m in after.items() if p not in before}
    loose = [p for p, m in new.items() if not stat.S_ISLNK(m) and not stat.S_ISSOCK(m)
             and m & 0o077 and not p.startswith(str(sb.base / "fakegpu"))]
    if loose:
        flags.append("MODE:" + ",".join(f"{p[len(str(sb.base)):]}={oct(new[p] & 0o777)}"
                                         for p in loose[:4]))
    left = [p for p in new if p.startswith(str(w) + "/") and not os.path.isdir(p)]
    if rc not in (0, None) and left:
        flags.append("LEFTOVER:" + ",".join(p[len(str(w)):] for p in left[:4]))
    return Result(case.name, argv, rc, err_text[-3000:], len(out), flags, round(seconds, 2))


# -- the cases ------------------------------------------------------------------------------

def _mkfifo(p: Path) -> None:
    os.mkfifo(p, 0o600)


def _loop(p: Path) -> None:
    os.symlink(p.name + "b", p)
    os.symlink(p.name, str(p) + "b")


def _full_fs(sb: Sandbox) -> None:
    full = sb.w / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(full)],
                   check=True)
    with open(full / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def path_kinds(sb_w: str) -> dict[str, tuple[str, Callable[[Sandbox], None] | None]]:
    """Name -> (path text with $W, set-up)."""
    def under_w(fn, name):
        return lambda sb: fn(sb.w / name)
    return {
        "missing": ("$W/missing/deeper", None),
        "empty": ("", None),
        "dash": ("-", None),
        "newline": ("$W/a\nb", None),
        "nonutf8": ("$W/" + ODD, None),
        "long100k": ("$W/" + LONG, None),
        "dir": ("$W/adir", lambda sb: (sb.w / "adir").mkdir()),
        "file": ("$W/afile", lambda sb: (sb.w / "afile").write_text("hello\n")),
        "fifo": ("$W/fifo", under_w(_mkfifo, "fifo")),
        "devzero": ("/dev/zero", None),
        "devnull": ("/dev/null", None),
        "loop": ("$W/loop", under_w(_loop, "loop")),
        "dotdot": ("$W/../w/x/../y", None),
        "proc": ("/proc/self/mem", None),
        "fulltmpfs": ("$W/full/ck", _full_fs),
        "under-file": ("$W/afile/sub", lambda sb: (sb.w / "afile").write_text("x")),
    }


def torpor_cases(sb: Sandbox) -> list[Case]:
    c: list[Case] = []
    subs = {
        "doctor": [], "ps": [], "ls": [], "gc": [], "rm": ["NAME"],
        "checkpoint": ["$PID", "-D", "$W/ck"], "restore": ["-D", "$W/ck"],
        "suspend": ["$PID"], "resume": ["$PID"], "inspect": ["$W/ck"],
        "demo": ["--cpu", "--mib", "1"], "run": ["--", "true"],
        "image build": ["$W/ck", "-o", "$W/layout"],
        "image push": ["$W/layout", "localhost:1/r:t"],
        "image pull": ["localhost:1/r:t", "-D", "$W/pulled"],
    }
    for sub, rest in subs.items():
        words = sub.split()
        c.append(Case(f"{sub}: no args", ["torpor", *words], expect={0, 1, 2, 3}))
        if sub == "run":
            c[-1].expect = {2}
        c.append(Case(f"{sub}: unknown flag", ["torpor", *words, *rest, "--frobnicate"],
                      expect={0} if sub == "run" else {2},
                      target="sleep" if "$PID" in rest else None))
        c.append(Case(f"{sub}: extra arg", ["torpor", *words, *rest, "extra"],
                      expect={2} if sub not in ("rm", "run") else None,
                      target="sleep" if "$PID" in rest else None, target_must_live=True))
        c.append(Case(f"{sub}: --json -q", ["torpor", "--json", "-q", *words, *rest],
                      target="sleep" if "$PID" in rest else None))
        c.append(Case(f"{sub}: stdin closed", ["torpor", *words, *rest], stdin="closed",
                      target="sleep" if "$PID" in rest else None))
        c.append(Case(f"{sub}: stdout closed", ["torpor", *words, *rest], stdout="closed",
                      target="sleep" if "$PID" in rest else None))
        c.append(Case(f"{sub}: stdout broken", ["torpor", *words, *rest], stdout="broken",
                      target="sleep" if "$PID" in rest else None))
        c.append(Case(f"{sub}: --json stdout broken", ["torpor", "--json", *words, *rest],
                      stdout="broken", target="sleep" if "$PID" in rest else None))
        c.append(Case(f"{sub}: stderr broken", ["torpor", *words, *rest], stderr="broken",
                      target="sleep" if "$PID" in rest else None))
        c.append(Case(f"{sub}: stderr closed", ["torpor", *words, *rest], stderr="closed",
                      target="sleep" if "$PID" in rest else None))
        c.append(Case(f"{sub}: cwd removed", ["torpor", *words,
                                              *[a.replace("$W/", "") for a in rest]],
                      cwd_gone=True, target="sleep" if "$PID" in rest else None))
        c.append(Case(f"{sub}: relative paths", ["torpor", *words,
                                                 *[a.replace("$W/", "") for a in rest]],
                      target="sleep" if "$PID" in rest else None))
        c.append(Case(f"{sub}: non-utf8 extra", ["torpor", *words, *rest, ODD],
                      target="sleep" if "$PID" in rest else None))
        c.append(Case(f"{sub}: 100k extra", ["torpor", *words, *rest, LONG],
                      target="sleep" if "$PID" in rest else None))

    # PIDs
    for cmd in (["checkpoint", "$X", "-D", "$W/ck", "--leave-running"], ["suspend", "$X"],
                ["resume", "$X"]):
        for label, text in PIDS.items():
            c.append(Case(f"{cmd[0]}: pid {label}",
                          ["torpor", *[a.replace("$X", text) for a in cmd]],
                          expect={2, 3}))
        for kind in ("sleep", "zombie", "exiting", "cuda"):
            if kind == "cuda" and cmd[0] == "resume":
                exp = {2, 3}
            elif kind == "cuda":
                exp = {0}
            elif kind == "sleep" and cmd[0] == "checkpoint":
                exp = {0}
            elif kind == "exiting":
                exp = {0, 2, 3, 8}
            else:
                exp = {2, 3, 4, 8}
            c.append(Case(f"{cmd[0]}: pid of {kind}",
                          ["torpor", *[a.replace("$X", "$PID") for a in cmd]],
                          target=kind, expect=exp, target_must_live=kind in ("sleep", "cuda")))
    c.append(Case("checkpoint: pid of torpor's own parent shell", ["/bin/sh", "-c",
                  'exec torpor checkpoint $$ -D "$0/ck" --leave-running', "$W"],
                  expect={2, 5, 7, 8}))
    def dies_in(call):
        def during(sb, target):
            time.sleep(0.6)
            target.kill()
        return during
    for call in ("lock", "checkpoint"):
        for extra in ([], ["--leave-running"]):
            c.append(Case(f"checkpoint {' '.join(extra)}: program dies in {call}",
                          ["torpor", "checkpoint", "$PID", "-D", "$W/ck", *extra],
                          target="cuda-slow-" + call, during=dies_in(call),
                          expect={3, 8}, timeout=60))
        c.append(Case(f"suspend: program dies in {call}", ["torpor", "suspend", "$PID"],
                      target="cuda-slow-" + call, during=dies_in(call), expect={3, 8},
                      timeout=60))
    c.append(Case("checkpoint -D tmpfs too small for the dump (program must live)",
                  ["torpor", "checkpoint", "$PID", "-D", "$W/small/ck"], target="sleep",
                  target_must_live=True, expect={8},
                  setup=lambda sb: ((sb.w / "small").mkdir(), subprocess.run(
                      ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                       str(sb.w / "small")], check=True))))
    c.append(Case("checkpoint: no --leave-running of sleep (it ends)",
                  ["torpor", "checkpoint", "$PID", "-D", "$W/ck"], target="sleep", expect={0}))

    # paths, each where a path goes
    slots = {
        "checkpoint -D": (["checkpoint", "$PID", "--leave-running", "-D"], [], "sleep"),
        "restore -D": (["restore", "-D"], [], None),
        "inspect": (["inspect"], [], None),
        "inspect --verify": (["inspect", "--verify"], [], None),
        "image build src": (["image", "build", "-o", "$W/layout"], [], None),
        "image build -o": (["image", "build", "$SEALED", "-o"], [], None),
        "image push layout": (["image", "push", "localhost:1/r:t"], [], None),
        "image pull -D": (["image", "pull", "localhost:1/r:t", "-D"], [], None),
        "demo --keep": (["demo", "--cpu", "--mib", "1", "--keep"], [], None),
        "run --agent-dir": (["run", "--agent-dir"], ["--", "true"], None),
        "--config": (["--config"], ["ls"], None),
    }
    for slot, (pre, post, tgt) in slots.items():
        for kind, (text, setup) in path_kinds("$W").items():
            if slot == "image push layout":
                argv = ["torpor", "image", "push", text, "localhost:1/r:t"]
            elif slot == "image build src":
                argv = ["torpor", "image", "build", text, "-o", "$W/layout"]
            else:
                argv = ["torpor", *pre, text, *post]
            c.append(Case(f"{slot}: {kind}", argv, setup=setup, target=tgt,
                          target_must_live=tgt is not None, timeout=60))
        c.append(Case(f"{slot}: unreadable as nobody",
                      ["torpor", *pre, "$W/locked/x", *post] if slot not in
                      ("image push layout", "image build src") else
                      ["torpor", "image", "push" if "push" in slot else "build", "$W/locked/x",
                       *(["localhost:1/r:t"] if "push" in slot else ["-o", "$W/out"])],
                      nobody=True, setup=lambda sb: (sb.w / "locked").mkdir(mode=0o000),
                      env={"TORPOR_STATE_DIR": "$W/nstate", "TORPOR_STORE_DIR": "$W/nstore",
                           "TORPOR_AGENT_DIR": "$W/nagents"}, target=tgt))

    # names
    for label, name in {"dotdot": "..", "slash": "a/b", "colon": "a:b", "upper": "UPPER",
                        "empty": "", "dash": "-", "newline": "a\nb", "nonutf8": ODD,
                        "long": LONG, "dot": ".", "leading-dash": "-x", "space": "a b"}.items():
        c.append(Case(f"checkpoint --store name {label}",
                      ["torpor", "checkpoint", "$PID", "-D", "$W/ck", "--leave-running",
                       "--store", name], target="sleep", target_must_live=True))
        c.append(Case(f"rm name {label}", ["torpor", "rm", name], expect={2, 3}))
        c.append(Case(f"image build --name {label}",
                      ["torpor", "image", "build", "$SEALED", "-o", "$W/l", "--name", name]))
        c.append(Case(f"image build --tag {label}",
                      ["torpor", "image", "build", "$SEALED", "-o", "$W/l", "--tag", name]))
        c.append(Case(f"image push ref {label}",
                      ["torpor", "image", "push", "$BASE/layout", name], expect={1, 2, 3}))
        c.append(Case(f"image pull ref {label}",
                      ["torpor", "image", "pull", name, "-D", "$W/p"], expect={1, 2, 3}))
        c.append(Case(f"restore --device-map {label}",
                      ["torpor", "restore", "-D", "$SEALED", "--device-map", name]))
        c.append(Case(f"run -- {label}", ["torpor", "run", "--", name], expect={2, 3}))
    for jobs in ("0", "-1", "65", "x", str(2**70)):
        c.append(Case(f"image pull --jobs {jobs}",
                      ["torpor", "image", "pull", "localhost:1/r:t", "-D", "$W/p", "--jobs", jobs],
                      expect={2}))
    for mib in ("0", "-1", "x", str(2**70), "1e3"):
        c.append(Case(f"demo --mib {mib}", ["torpor", "demo", "--cpu", "--mib", mib],
                      expect={1, 2}, timeout=60))

    # config files and environment
    configs = {
        "invalid toml": b"this is [not toml",
        "wrong type": b"lock_timeout_s = \"ten\"\n",
        "wrong type path": b"state_dir = 5\n",
        "unknown key": b"frob = 1\n",
        "huge": b"# " + b"x" * (2 << 20) + b"\n",
        "nonutf8": b"criu = \"\xff\"\n",
        "nan": b"lock_timeout_s = nan\n",
        "inf agent": b"agent_timeout_s = inf\n",
        "huge int": b"agent_files = 99999999999999999999999\n",
        "negative uid": b"socket_owner_uid = -1\n",
        "uid 2**40": b"socket_owner_uid = 1099511627776\n",
        "float uid": b"socket_owner_uid = 1.5\n",
        "empty state_dir": b"state_dir = \"\"\n",
        "relative state_dir": b"state_dir = \"rel\"\n",
        "state_dir file": b"state_dir = \"/etc/passwd\"\n",
        "store_dir dev": b"store_dir = \"/dev/null\"\n",
        "nested table": b"[state_dir]\na = 1\n",
        "deep arrays": b"criu = " + b"[" * 5000 + b"]" * 5000 + b"\n",
        "NUL in string": b"criu = \"a\\u0000b\"\n",
        "empty libcuda": b"libcuda = \"\"\n",
        "oci_runtime nonsense": b"oci_runtime = \"/nonexistent/runc\"\n",
        "device_map garbage": b"device_map = \"===,,,\"\n",
        "date value": b"criu = 1979-05-27\n",
    }
    for label, data in configs.items():
        def write(sb, data=data):
            (sb.w / "c.toml").write_bytes(data)
        c.append(Case(f"config file {label}", ["torpor", "ls"], setup=write,
                      env={"TORPOR_CONFIG": "$W/c.toml"}, expect={0, 2}))
        c.append(Case(f"--config {label} (ps)", ["torpor", "--config", "$W/c.toml", "ps"],
                      setup=write, expect={0, 2}))
        c.append(Case(f"torpor-hook config {label}", ["torpor-hook", "createRuntime"],
                      setup=write, env={"TORPOR_CONFIG": "$W/c.toml"}, expect={0},
                      stdin='text:{"id": "c1", "bundle": "/nonexistent", "pid": 1}'))
        c.append(Case(f"torpord config {label}",
                      ["torpord", "--foreground", "--config", "$W/c.toml", "--op-timeout", "-1"],
                      setup=write, expect={2}, timeout=20))
    for label, (text, setup) in path_kinds("$W").items():
        if label in ("empty",):
            continue
        c.append(Case(f"TORPOR_CONFIG {label}", ["torpor", "ls"], setup=setup,
                      env={"TORPOR_CONFIG": text}, expect={0, 2}))
    garbage = {"empty": "", "nonutf8": ODD, "nan": "nan", "inf": "inf", "neg": "-1",
               "1e309": "1e309", "long": LONG, "newline": "a\nb", "rel": "rel/dir",
               "devnull": "/dev/null", "word": "maybe"}
    envs = ["TORPOR_STATE_DIR", "TORPOR_RUN_DIR", "TORPOR_LIBCUDA", "TORPOR_CRIU",
            "TORPOR_LOCK_TIMEOUT", "TORPOR_OCI_RUNTIME", "TORPOR_DEVICE_MAP", "TORPOR_SUSPEND_DIR",
            "TORPOR_SUSPEND_TMPFS", "TORPOR_STORE_DIR", "TORPOR_STORE_STREAM",
            "TORPOR_TCP_ESTABLISHED", "TORPOR_REGISTRY_AUTH_FILE", "TORPOR_REGISTRY_HOSTS_DIR",
            "TORPOR_RESTORE_FETCH_TIMEOUT", "TORPOR_AGENT_DIR", "REGISTRY_AUTH_FILE",
            "TORPOR_GPU_MAP", "TORPOR_DEBUG", "HOME", "XDG_RUNTIME_DIR", "DOCKER_CONFIG",
            "TMPDIR", "PATH"]
    registry = {"TORPOR_REGISTRY_AUTH_FILE", "TORPOR_REGISTRY_HOSTS_DIR", "REGISTRY_AUTH_FILE",
                "HOME", "XDG_RUNTIME_DIR", "DOCKER_CONFIG"}
    for var in envs:
        for label, val in garbage.items():
            cmds = [["ls"], ["checkpoint", "$PID", "-D", "$W/ck", "--leave-running"]]
            if var in registry:
                cmds = [["image", "pull", "localhost:1/r:t", "-D", "$W/p"],
                        ["image", "push", "$BASE/layout", "localhost:1/r:t"]]
            elif var in ("TORPOR_AGENT_DIR", "TMPDIR"):
                cmds.append(["run", "--", "true"])
            elif var in ("TORPOR_LIBCUDA", "TORPOR_DEVICE_MAP", "TORPOR_GPU_MAP"):
                cmds += [["ps"], ["restore", "-D", "$SEALED"]]
            for cmd in cmds:
                c.append(Case(f"env {var}={label}: {cmd[0]}", ["torpor", *cmd],
                              env={var: val}, target="sleep" if "$PID" in cmd else None,
                              target_must_live="$PID" in cmd, timeout=60))
    # torpor-hook
    hook_stdin = {
        "empty": "", "not json": "{{{", "list": "[]", "number": "5", "null": "null",
        "no id": '{"bundle": "/"}', "bundle file": '{"id": "x", "bundle": "/etc/passwd"}',
        "pid huge": '{"id": "x", "bundle": "$BASE", "pid": 1180591620717411303424}',
        "pid string": '{"id": "x", "bundle": "/", "pid": "abc"}',
        "annotations list": '{"id": "x", "bundle": "/", "annotations": [1]}',
        "deep": "[" * 100000 + "]" * 100000,
        "stopped": '{"id": "x", "status": "stopped"}',
        "nonutf8": "\udcff",
        "huge": '{"id": "' + "x" * 1_000_000 + '"}',
        "bundle fifo": '{"id": "x", "bundle": "$W"}',
    }
    for label, text in hook_stdin.items():
        for stage in ("createRuntime", "poststop", None):
            def mk_fifo_bundle(sb):
                os.mkfifo(sb.w / "config.json")
            c.append(Case(f"torpor-hook {stage} stdin {label}",
                          ["torpor-hook", *([stage] if stage else [])],
                          stdin="text:" + text.replace("$BASE", str(sb.base)).replace(
                              "$W", str(sb.w)),
                          expect={0}, timeout=30,
                          setup=mk_fifo_bundle if label == "bundle fifo" else None))
    for args in (["bogus"], ["", ""], ["-"], ["--help"], [ODD], [LONG], ["createRuntime", "x"]):
        c.append(Case(f"torpor-hook args {args[0][:10]!r}", ["torpor-hook", *args],
                      stdin='text:{"id": "x"}', expect={0, 2}))
    c.append(Case("torpor-hook stdin closed", ["torpor-hook", "createRuntime"], stdin="closed",
                  expect={0}))
    c.append(Case("torpor-hook stdin fifo never written", ["/bin/sh", "-c",
                  'mkfifo "$0/f"; exec torpor-hook createRuntime < "$0/f"', "$W"],
                  expect={0}, timeout=60))
    c.append(Case("torpor-hook state dir unwritable", ["torpor-hook", "poststop"],
                  stdin='text:{"id": "x"}', env={"TORPOR_STATE_DIR": "/proc/nope"}, expect={0}))
    c.append(Case("torpor-hook state dir /dev/null", ["torpor-hook", "poststop"],
                  stdin='text:{"id": "x"}', env={"TORPOR_STATE_DIR": "/dev/null"}, expect={0}))
    # torpord (never left running: each case is refused, or --op-timeout keeps it from serving)
    for args, exp in (([], {2}),   # not --foreground: it would daemonize; -h-like refusals only
                      (["--op-timeout", "0"], {2}), (["--op-timeout", "nan"], {2}),
                      (["--op-timeout", "inf"], {2}), (["--op-timeout", "-inf"], {2}),
                      (["--op-timeout", "x"], {2}), (["--log-level", "LOUD"], {2}),
                      (["--socket", ""], {2}), (["--socket", "$W/" + "s" * 200], {2}),
                      (["--socket", LONG], {2}), (["--config", ""], {2}),
                      (["--config", "/dev/zero"], {2}), (["--config", "$W/missing"], {2}),
                      (["--config", "$W/" + ODD], {2}), (["--frob"], {2}), (["extra"], {2})):
        if not args:
            continue
        c.append(Case(f"torpord {' '.join(a[:20] for a in args)}",
                      ["torpord", "--foreground", *args], expect=exp, timeout=20))
    c.append(Case("torpord as nobody", ["torpord", "--foreground", "--socket", "$W/s.sock"],
                  nobody=True, expect={2}, timeout=20))
    return c


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", default="", help="only cases whose name contains this")
    ap.add_argument("--json", type=Path, help="all results as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the sandbox")
    ap.add_argument("--all", action="store_true", help="print every case, not only flagged ones")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("clifuzz: needs root", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="clifuzz-"))
    sb = Sandbox(base)
    (base / "sealed").mkdir(mode=0o700)
    from tests.unit.test_manifest import _sealed as sealed
    sb.sealed = sealed(base / "sealed")
    subprocess.run([str(BIN / "torpor"), "-q", "image", "build", str(sb.sealed), "-o",
                    str(base / "layout")], env=sb.env, check=True, stdout=subprocess.DEVNULL)
    results: list[Result] = []
    cases = [c for c in torpor_cases(sb) if args.k in c.name]
    try:
        for i, case in enumerate(cases):
            r = run_case(sb, case)
            for m in _mounts_under(sb.w):
                subprocess.run(["umount", "-l", m], check=False)
            results.append(r)
            if r.flags or args.all:
                last = r.stderr.strip().splitlines()[-3:]
                print(f"[{i + 1}/{len(cases)}] {case.name}: rc={r.rc} {' '.join(r.flags)} "
                      f"({r.seconds}s)\n    " + "\n    ".join(x[:300] for x in last), flush=True)
    finally:
        for m in _mounts_under(base):
            subprocess.run(["umount", "-l", m], check=False)
        sb.gpu.close()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    flagged = [r for r in results if r.flags]
    print(f"\n{len(results)} cases, {len(flagged)} flagged")
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    return 1 if flagged else 0


def _mounts_under(d: Path) -> list[str]:
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        mnt = line.split()[1].encode().decode("unicode_escape")
        if mnt.startswith(str(d)):
            out.append(mnt)
    return sorted(out, reverse=True)


if __name__ == "__main__":
    sys.exit(main())
