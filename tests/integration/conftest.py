"""Integration tests: real CRIU, real processes, the torpor CLI as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fakes.fakegpu import FakeGpu


def _criu_ok() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for p in ("/usr/local/sbin/criu", shutil.which("criu") or ""):
        if p and os.access(p, os.X_OK):
            out = subprocess.run([p, "--version"], capture_output=True, text=True).stdout
            if "Version: 4" in out or "Version: 5" in out:
                return None
    return "needs CRIU >= 4 (./install.sh)"


CRIU_SKIP = _criu_ok()
needs_criu = pytest.mark.skipif(CRIU_SKIP is not None, reason=CRIU_SKIP or "")


class Torpor:
    """Runs `python -m torpor.cli.main` with an isolated state dir and a fake GPU host."""

    def __init__(self, env: dict[str, str]):
        self.env = env

    def run(self, *args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "torpor.cli.main", *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise AssertionError(f"torpor {' '.join(args)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc

    def json(self, *args: str, **kw) -> dict:
        proc = self.run("--json", *args, check=True, **kw)
        return json.loads(proc.stdout)

    def start(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "torpor.cli.main", *args], env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def podman_image():
    """The podman tests' image (integration.containers.IMAGE), imported once, and removed at
    the end of the session unless it was there before: the suite leaves no image behind."""
    if shutil.which("podman") is None:
        pytest.skip("needs podman")
    from integration.containers import IMAGE, Podman
    p = Podman()
    had = p.has_image()
    p.ensure_image()
    yield IMAGE
    if not had:
        p.rm_image()


@pytest.fixture
def gpu(tmp_path: Path):
    with FakeGpu(tmp_path / "fakegpu") as g:
        yield g


@pytest.fixture
def torpor(tmp_path: Path, gpu: FakeGpu, torpor_env: dict[str, str]) -> Torpor:
    env = {**os.environ, **torpor_env, **gpu.env()}
    return Torpor(env)


# A test program's counter, for programs written as COUNTER + """...""" that call tick(path, n):
# one fixed-width line rewritten in place through a descriptor the program keeps open. A file
# rewritten with open(path, "w") is empty between the truncate and the write: a checkpoint taken
# there keeps it empty, and CRIU refuses to restore an open file whose size has changed since
# ("has bad size"). Here the size never changes and a reader never sees the file empty.
COUNTER = """
import os as _os
_ticks = {}
def tick(path, n):
    if path not in _ticks:
        _ticks[path] = _os.open(path, _os.O_WRONLY | _os.O_CREAT | _os.O_CLOEXEC, 0o600)
    _os.pwrite(_ticks[path], b"%20d\\n" % n, 0)
"""


# The simplest such program: ticks the counter in sys.argv[1] every 20 ms.
TICKING = COUNTER + """
import sys, time
n = 0
while True:
    n += 1
    tick(sys.argv[1], n)
    time.sleep(0.02)
"""


def read_count(path: Path) -> int:
    """The counter a COUNTER program ticks: 0 before its first tick."""
    for _ in range(3):          # a read racing the in-place write may see it half-copied
        try:
            text = path.read_text()
        except FileNotFoundError:
            return 0
        try:
            return int(text) if text.strip() else 0
        except ValueError:
            time.sleep(0.005)
    raise AssertionError(f"{path} does not hold a counter: {text!r}")


def agent_dir(run_dir: Path, cid: str) -> Path:
    """The agent socket directory torpor-runtime made for the engine's container cid:
    <run_dir>/agents/<cid>@<key of the engine's --root> (runtime/lifecycle.py agent_name),
    made at its create or restore; a name that exists nowhere until it is."""
    found = sorted((run_dir / "agents").glob(f"{cid}@*"))
    assert len(found) <= 1, f"{cid} under {len(found)} runtime roots: {found}"
    return found[0] if found else run_dir / "agents" / f"{cid}@not-made-yet"


def wait_for(pred, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def reaper():
    """kill(pid) for every pid added, at teardown (restored processes are nobody's child)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def checkpointed_and_reaped(prog, timeout: float = 10.0) -> None:
    """After a dump (which ends the program), reap it so CRIU can restore its PID."""
    prog.proc.wait(timeout=timeout)
