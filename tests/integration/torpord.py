"""A real torpord for integration tests: its own state and run dirs, a fake GPU's environment.

The fixtures the container, CRI and CRIU-plugin suites share (import them by name):
    base    a short private directory in /tmp (socket paths stay under 108 bytes), removed
            afterwards with whatever a daemon left mounted below it
    gpu     a fake GPU host in base
    daemon  torpord on base and gpu, stopped afterwards"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import torpor
from integration.cri import remove_tree

from tests.fakes.fakegpu import FakeGpu
from torpor import config
from torpor.sidecar.client import Client, ping

PKG = Path(torpor.__file__).resolve().parent


class Daemon:
    """torpord subprocesses on one state/run dir; start() may be called again after a kill."""

    def __init__(self, base: Path, gpu: FakeGpu, config_text: str = ""):
        self.base = base
        self.gpu = gpu
        (base / "config.toml").write_text(config_text)
        self.env = {**os.environ, **gpu.env(),
                    "TORPOR_STATE_DIR": str(base / "state"), "TORPOR_RUN_DIR": str(base / "run"),
                    "TORPOR_CONFIG": str(base / "config.toml"),
                    "PYTHONPATH": os.pathsep.join(
                        [str(PKG.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(
                            os.pathsep) if p])}
        self.cfg = config.load(env=self.env)
        self.log = base / "torpord.log"
        self.proc: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, op_timeout: float = 600) -> "Daemon":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torpor.sidecar.daemon", "--foreground",
                 "--log-level", "debug", "--op-timeout", str(op_timeout), *args],
                env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True)
        self.procs.append(self.proc)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if ping(self.cfg, timeout=1).status == "ok":
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"torpord exited {self.proc.returncode}:\n{self.log_text()}")
            time.sleep(0.05)
        raise AssertionError(f"torpord did not answer:\n{self.log_text()}")

    def client(self, **kw) -> Client:
        return Client(self.cfg, **kw)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=20)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="tt", dir="/tmp"))
    yield d
    if not os.environ.get("TORPOR_TEST_KEEP"):   # set: left for a look after a failure
        remove_tree(d)


@pytest.fixture
def gpu(base):
    with FakeGpu(base / "gpu") as g:
        yield g


@pytest.fixture
def daemon(base, gpu):
    d = Daemon(base, gpu).start()
    yield d
    d.stop()
