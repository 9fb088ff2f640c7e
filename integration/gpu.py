"""A PyTorch program in a podman GPU container, for the GPU-host tests and benchmarks.

    tc = TorchContainer(podman, "g1", workdir, gib=4, seed=1234)
    tc.start(); tc.wait_step(10)
    podman.checkpoint("g1", export=...); podman.rm("g1"); podman.restore(import_=...)
    tc.wait_step(tc.step() + 10)                     # same steps file: it continues

The container sees the host's /usr (driver libraries, Python), /etc/ld.so.cache, the driver's
/usr/local/nvidia where it is a separate mount (bound explicitly: CRIU cannot dump it as a
submount of a recursive /usr bind), the Python environment torch lives in, the program's
folder and `workdir` (steps and status files), and the NVIDIA device nodes the host has.
Program output goes to a file in workdir (container stdio on a host file cannot be dumped,
so the program's own stdio is podman's).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Mapping

from .containers import Podman

ROOT = Path(__file__).resolve().parents[1]
TORCH_PROGRAM = ROOT / "tests" / "gpu" / "torch_program.py"
DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def nvidia_devices(indices: tuple[int, ...] = (0,)) -> list[str]:
    """podman --device arguments for GPUs `indices` and the driver's control nodes."""
    wanted = [f"/dev/nvidia{i}" for i in indices] + list(DEVICES)
    return [d for d in wanted if os.path.exists(d)]


def _mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f}


def gpu_mounts(*extra: Path) -> list[tuple[str, str, bool]]:
    """(host, container, read-only) binds: the same path inside."""
    points = _mount_points()
    out = [("/etc/ld.so.cache", "/etc/ld.so.cache", True)]
    for p in ("/usr/local/nvidia",):
        if p in points:
            out.append((p, p, True))
    prefix = Path(sys.prefix).resolve()
    if not str(prefix).startswith("/usr"):
        top = Path("/", *prefix.parts[1:2])   # e.g. /opt: the venv and what it links to
        out.append((str(top), str(top), True))
    for p in extra:
        out.append((str(p), str(p), False))
    return out


class TorchStatus:
    """What torch_program.py reports in its --status file (status_path), for a program run on
    the host (tests/gpu/conftest.py) or in a container alike."""

    status_path: Path

    def status(self) -> dict:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def step(self) -> int:
        return int(self.status().get("step", -1))


class ContainedTorch(TorchStatus):
    """torch_program.py in a container (podman's or a CRI pod's): its steps, status and log
    files in ``workdir`` (a restored container goes on writing the same ones), its command
    line, and waiting on it. A subclass says how its engine starts it and what state it is in
    (``state()``, ``running()``)."""

    def __init__(self, name: str, workdir: Path, gib: float, seed: int, max_steps: int,
                 program: Path = TORCH_PROGRAM, extra: tuple[str, ...] = ()):
        self.name, self.workdir, self.program = name, Path(workdir), Path(program)
        self.gib, self.seed, self.max_steps = gib, seed, max_steps
        self.extra = tuple(extra)   # more of the program's arguments (e.g. --cache-gib)
        self.steps = self.workdir / f"{name}.steps"
        self.status_path = self.workdir / f"{name}.status.json"
        self.log = self.workdir / f"{name}.log"

    def command(self, env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
        """The container's argv (a shell that execs the program, its output into the log) and
        environment (``env`` added)."""
        argv = [sys.executable, str(self.program), "--gib", str(self.gib), "--seed",
                str(self.seed), "--steps-file", str(self.steps), "--status",
                str(self.status_path), "--max-steps", str(self.max_steps), *self.extra]
        shell = " ".join(f"'{a}'" for a in argv) + f" >>'{self.log}' 2>&1"
        # The image has no /etc/passwd: torch asks getpass for a cache directory name.
        return ["/bin/sh", "-c", f"exec {shell}"], {
            "USER": "root", "HOME": str(self.workdir),
            "TORCHINDUCTOR_CACHE_DIR": str(self.workdir / "inductor"), **(env or {})}

    def state(self) -> str:
        raise NotImplementedError

    def running(self, state: str) -> bool:
        raise NotImplementedError

    def _tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def wait(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        next_check = time.monotonic() + 2
        while time.monotonic() < deadline:
            if pred():
                return
            if time.monotonic() > next_check:   # a container that exited will not get there
                next_check = time.monotonic() + 2
                if not self.running(self.state()):
                    break
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: timed out waiting for {what}; "
                             f"state {self.state()}; log: {self._tail()}")

    def wait_ready(self, timeout: float = 300) -> None:
        self.wait(lambda: self.status().get("ready"), timeout, "ready")

    def wait_step(self, above: int, timeout: float = 300) -> int:
        self.wait(lambda: self.step() > above, timeout, f"step > {above}")
        return self.step()


class TorchContainer(ContainedTorch):
    """tests/gpu/torch_program.py in a podman container named `name`."""

    def __init__(self, podman: Podman, name: str, workdir: Path, gib: float, seed: int = 1234,
                 max_steps: int = 0, annotations: dict[str, str] | None = None,
                 env: dict[str, str] | None = None, extra: tuple[str, ...] = ()):
        super().__init__(name, workdir, gib, seed, max_steps, extra=extra)
        self.podman = podman
        self.annotations = annotations or {}
        self.env = env or {}    # more of the program's environment

    def start(self) -> str:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv, env = self.command(self.env)
        return self.podman.run(self.name, argv, env=env, devices=nvidia_devices(),
                               mounts=gpu_mounts(self.workdir, self.program.parent),
                               annotations=self.annotations)

    def state(self) -> str:
        return self.podman.state(self.name)

    def running(self, state: str) -> bool:
        return state in ("running", "paused")
