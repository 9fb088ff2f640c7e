"""The GPU test programs, started with or without torpor's in-process agent, for
tests/gpu/test_agent_gpu.py and bench/agent_path.py (no pytest here).

    exe = build_cuda_streams(Path("/tmp/build"))           # nvcc; NoCompiler without one
    p = Program(workdir, "prog", command("torch", 2.0, extra=["--graphs"]), env=env, agent=True)
    p.wait_ready(); p.wait_step(10)

Five kinds, one steps-file and status format (compare_steps.py compares any two runs of the
same kind, command line and seed):
  torch  torch_program.py   (PyTorch training; --graphs, --cache-gib, PYTORCH_CUDA_ALLOC_CONF)
  infer  infer_program.py   (PyTorch inference: random-init decoder, weights + KV cache)
  cpu    cpu_program.py     (no GPU: host memory only, for the benchmarks' harness)
  cupy   cupy_program.py    (CuPy)
  cuda   cuda_streams.cu    (CUDA C runtime API, built with nvcc; --mib instead of --gib)

agent=True starts it as `torpor run -- COMMAND` (the agent preloaded; torpor execs the
command, so the pid is the program's); env must then carry TORPOR_AGENT_DIR and torpor's
PYTHONPATH, and no TORPOR_LIBCUDA pointing at a fake driver.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from integration.gpu import TorchStatus

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TORCH_PROGRAM = HERE / "torch_program.py"
CUPY_PROGRAM = HERE / "cupy_program.py"
JAX_PROGRAM = HERE / "jax_program.py"
INFER_PROGRAM = HERE / "infer_program.py"
CPU_PROGRAM = HERE / "cpu_program.py"
CUDA_SOURCE = HERE / "cuda_streams.cu"


class NoCompiler(Exception):
    pass


def nvcc() -> str | None:
    for c in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and os.access(c, os.X_OK):
            return c
    return None


def build_cuda_streams(out_dir: Path) -> Path:
    """cuda_streams.cu compiled (nvcc -O2) into out_dir, once per source version.
    NoCompiler without nvcc; CalledProcessError (with nvcc's output) when it fails."""
    compiler = nvcc()
    if compiler is None:
        raise NoCompiler("nvcc is not installed")
    digest = hashlib.sha256(CUDA_SOURCE.read_bytes()).hexdigest()[:12]
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / f"cuda_streams-{digest}"
    if not exe.exists():
        tmp = out_dir / f".{exe.name}.{os.getpid()}"
        subprocess.run([compiler, "-O2", "-o", str(tmp), str(CUDA_SOURCE)], check=True,
                       capture_output=True, text=True, timeout=600)
        os.replace(tmp, exe)
    return exe


def command(kind: str, gib: float, *, seed: int = 1234, max_steps: int = 0,
            sleep: float | None = None, extra: Sequence[str] = (),
            cuda_exe: Path | None = None) -> list[str]:
    """The program's argv, without --steps-file/--status (Program adds those)."""
    if kind == "torch":
        argv = [sys.executable, str(TORCH_PROGRAM), "--gib", f"{gib:g}"]
    elif kind in ("infer", "cpu"):
        script = INFER_PROGRAM if kind == "infer" else CPU_PROGRAM
        argv = [sys.executable, str(script), "--gib", f"{gib:g}"]
    elif kind == "cupy":
        argv = [sys.executable, str(CUPY_PROGRAM), "--gib", f"{gib:g}"]
    elif kind == "jax":   # XLA_FLAGS for bit-exact runs: jax_program.py's docstring
        argv = [sys.executable, str(JAX_PROGRAM), "--gib", f"{gib:g}"]
    elif kind == "cuda":
        if cuda_exe is None:
            raise ValueError("kind 'cuda' needs cuda_exe (build_cuda_streams)")
        argv = [str(cuda_exe), "--mib", f"{gib * 1024:g}"]
    else:
        raise ValueError(f"unknown program kind {kind!r}")
    argv += ["--seed", str(seed), "--max-steps", str(max_steps)]
    if sleep is not None:
        argv += ["--sleep", f"{sleep:g}"]
    return argv + list(extra)


def torpor_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "torpor.cli.main", *args]


def with_torpor_path(env: Mapping[str, str]) -> dict[str, str]:
    """env whose PYTHONPATH reaches this checkout's torpor (shim/) and tests (the root)."""
    out = dict(env)
    parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    for p in (str(ROOT), str(ROOT / "shim")):
        if p not in parts:
            parts.insert(0, p)
    out["PYTHONPATH"] = os.pathsep.join(parts)
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Program(TorchStatus):
    """One program run: its steps, status and log files in workdir, named after name (the
    status file's format is torch_program.py's, which the other programs follow)."""

    def __init__(self, workdir: Path, name: str, argv: Sequence[str], *,
                 env: Mapping[str, str] | None = None, agent: bool = False):
        self.name, self.agent = name, agent
        self.steps = Path(workdir) / f"{name}.steps"
        self.status_path = Path(workdir) / f"{name}.status.json"
        self.log = Path(workdir) / f"{name}.log"
        for f in (self.steps, self.status_path):
            f.unlink(missing_ok=True)
        full = list(argv) + ["--steps-file", str(self.steps), "--status", str(self.status_path)]
        if agent:
            full = torpor_argv("run", "--", *full)
        self.argv = full
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(full, env=dict(env) if env is not None else None,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True, cwd=workdir)
        self.pid = self.proc.pid

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def wait(self, pred: Callable[[], object], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            if not alive(self.pid) and not pred():
                raise AssertionError(f"{self.name} (PID {self.pid}) ended while waiting for "
                                     f"{what}: {self.tail()}")
            time.sleep(0.02)
        raise AssertionError(f"{self.name}: timed out after {timeout:.0f} s waiting for {what}; "
                             f"status {self.status()}; log: {self.tail()}")

    def wait_ready(self, timeout: float = 300) -> None:
        self.wait(lambda: self.status().get("ready"), timeout, "ready")

    def wait_step(self, above: int, timeout: float = 300) -> int:
        """Until the program wrote a step past `above`; returns its step."""
        self.wait(lambda: self.step() > above, timeout, f"step > {above}")
        return self.step()

    def wait_done(self, timeout: float = 600) -> dict:
        """For a run with --max-steps: until it says done."""
        self.wait(lambda: self.status().get("done"), timeout, "done")
        return self.status()

    def reap(self, timeout: float = 60) -> None:
        """After a checkpoint ended the program: reap it, so CRIU may restore its PID."""
        self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        for pid in {self.pid, int(self.status().get("pid", self.pid))}:
            try:
                os.killpg(pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                os.kill(pid, 9)   # a restored program may be in another process group
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
