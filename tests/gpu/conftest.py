"""GPU-host tests: a real driver with the checkpoint API, real NVML, real CRIU, PyTorch.

Skipped (with the reason) where any of those is missing. The GPU host has no package access:
see tests/gpu/README.md for how the runs there are set up.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integration.gpu import TorchStatus
from tests.integration.conftest import Torpor, alive, wait_for  # noqa: F401

HERE = Path(__file__).resolve().parent
TORCH_PROGRAM = HERE / "torch_program.py"


def _gpu_reason() -> str | None:
    try:
        from torpor.driver import Driver
        Driver.load(os.environ.get("TORPOR_LIBCUDA", "libcuda.so.1"))
    except Exception as e:  # TorporError or an import problem: no GPU here
        return f"no GPU with the driver checkpoint API: {e}"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "PyTorch is not installed"
    if os.geteuid() != 0:
        return "needs root"
    return None


GPU_SKIP = _gpu_reason()
pytestmark = pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")


@pytest.fixture(autouse=True)
def _tmp_path_removed(tmp_path: Path):
    """Each test's checkpoints go with it: they hold GBs (a 16 GiB program's images are 17 GB)
    and the GPU host's disk is 64 GB, so leftovers from earlier tests filled it under the later
    podman tests. Set up first, so torn down last: after the test's programs are gone."""
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture
def torpor(tmp_path: Path, torpor_env: dict[str, str]) -> Torpor:
    env = dict(os.environ, **torpor_env)
    env.pop("TORPOR_LIBCUDA")  # the real driver
    return Torpor(env)


class TorchProgram(TorchStatus):
    def __init__(self, tmp: Path, name: str, gib: float, seed: int = 1234, max_steps: int = 0):
        self.steps = tmp / f"{name}.steps"
        self.status_path = tmp / f"{name}.status.json"
        self.log = tmp / f"{name}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(TORCH_PROGRAM), "--gib", str(gib), "--seed", str(seed),
                 "--steps-file", str(self.steps), "--status", str(self.status_path),
                 "--max-steps", str(max_steps)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                cwd=tmp)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 300) -> None:
        def ready():
            if self.proc.poll() is not None and not alive(self.pid):
                raise AssertionError(f"torch program exited: {self.log.read_text()[-2000:]}")
            return self.status().get("ready")
        wait_for(ready, timeout, "torch program ready")

    def wait_step(self, above: int, timeout: float = 120, pid: int | None = None) -> int:
        def past():
            if not alive(pid or self.pid):
                raise AssertionError(f"torch program died: {self.log.read_text()[-2000:]}")
            return self.step() > above
        wait_for(past, timeout, f"step > {above}")
        return self.step()

    def wait_done(self, step: int, timeout: float = 300) -> None:
        """For a reference run with --max-steps: wait until it wrote step (it then exits)."""
        wait_for(lambda: self.status().get("done") or self.step() >= step, timeout,
                 f"reference run to reach step {step}")

    def kill(self) -> None:
        for pid in {self.pid, self.status().get("pid", self.pid)}:
            try:
                os.killpg(pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def programs(tmp_path: Path):
    started: list[TorchProgram] = []

    def start(name: str, gib: float, **kw) -> TorchProgram:
        p = TorchProgram(tmp_path, name, gib, **kw)
        started.append(p)
        return p
    yield start
    for p in started:
        p.kill()


def gpu_uuid() -> str:
    import pynvml
    pynvml.nvmlInit()
    try:
        u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
        return u.decode() if isinstance(u, bytes) else u
    finally:
        pynvml.nvmlShutdown()


def nvml_pids() -> set[int]:
    import pynvml
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    finally:
        pynvml.nvmlShutdown()


def sleep(s: float) -> None:
    time.sleep(s)
