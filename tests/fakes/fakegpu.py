"""Test helper around the fake CUDA driver and fake NVML (tests/fakes/*.c).

Import it as `tests.fakes.fakegpu` (with the repository root on sys.path, as `python -m pytest`
from the root gives) or as `fakegpu` (with tests/fakes on sys.path). It needs only the stdlib.

    gpu = FakeGpu(tmp_path / "gpu")                 # builds the fakes once, writes the gpus file
    prog = gpu.spawn(gpu_index=0, mem=2 << 30)      # a fake CUDA program, registered and ticking
    env = {**os.environ, **gpu.env()}               # what to give torpor
    gpu.fail("checkpoint", "CUDA_ERROR_UNKNOWN")    # fault injection
    gpu.calls()                                     # [Call("lock", 1234, 0), ...]

State directory layout (shared by every process that loads the fakes; read at every call):
  gpus             <uuid>|<name>|<total bytes>, one GPU a line, index = line order
  proc/<pid>       state=0..3, gpu=<uuid>, mem=<bytes>, restored_pairs=<old>:<new>,...
  fail/<call>      "<CUresult> [pid]"      hang/lock "[pid]"      delay/<call> "<ms> [pid]"
  calls.log        "<call> <pid> <CUresult>" a line, one per checkpoint-API call
  cuda_version     13000 by default        driver_version "999.0-fake" by default
<call> is one of CALLS. A pid that is not a live CUDA process gets CUDA_ERROR_INVALID_VALUE.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import subprocess
import sys
import time
import uuid as uuidlib
from pathlib import Path
from typing import Iterable, Mapping, NamedTuple

FAKES_DIR = Path(__file__).resolve().parent
BUILD_DIR = FAKES_DIR / "build"
PROGRAM = FAKES_DIR / "fake_cuda_program.py"
LIBCUDA = "libcuda.so.1"
LIBNVML = "libnvidia-ml.so.1"

RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3
CALLS = ("get_state", "lock", "checkpoint", "restore", "unlock", "restore_tid")

CUDA_ERRORS = {  # the values of cuda.h
    "CUDA_SUCCESS": 0,
    "CUDA_ERROR_INVALID_VALUE": 1,
    "CUDA_ERROR_OUT_OF_MEMORY": 2,
    "CUDA_ERROR_NOT_INITIALIZED": 3,
    "CUDA_ERROR_DEINITIALIZED": 4,
    "CUDA_ERROR_NO_DEVICE": 100,
    "CUDA_ERROR_INVALID_DEVICE": 101,
    "CUDA_ERROR_INVALID_CONTEXT": 201,
    "CUDA_ERROR_OPERATING_SYSTEM": 304,
    "CUDA_ERROR_INVALID_HANDLE": 400,
    "CUDA_ERROR_ILLEGAL_STATE": 401,
    "CUDA_ERROR_NOT_FOUND": 500,
    "CUDA_ERROR_NOT_READY": 600,
    "CUDA_ERROR_ILLEGAL_ADDRESS": 700,
    "CUDA_ERROR_LAUNCH_FAILED": 719,
    "CUDA_ERROR_NOT_PERMITTED": 800,
    "CUDA_ERROR_NOT_SUPPORTED": 801,
    "CUDA_ERROR_TIMEOUT": 909,
    "CUDA_ERROR_UNKNOWN": 999,
}
CUDA_ERROR_NAMES = {v: k for k, v in CUDA_ERRORS.items()}

GIB = 1 << 30
DEFAULT_GPUS = (
    ("GPU-11111111-2222-3333-4444-555555555555", "NVIDIA H200", 141 * GIB),
    ("GPU-66666666-7777-8888-9999-aaaaaaaaaaaa", "NVIDIA H200", 141 * GIB),
)

_built: Path | None = None


def build() -> Path:
    """Runs make once per process (serialized across processes by a lock); returns the build
    dir holding libcuda.so.1 and libnvidia-ml.so.1."""
    global _built
    if _built is None:
        BUILD_DIR.mkdir(exist_ok=True)
        with open(BUILD_DIR / ".make.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            r = subprocess.run(["make", "-s", "-C", str(FAKES_DIR)], capture_output=True,
                               text=True)
        if r.returncode != 0:
            raise RuntimeError(f"building the fake GPU libraries failed:\n{r.stdout}{r.stderr}")
        _built = BUILD_DIR
    return _built


def cuda_result(result: int | str) -> int:
    """A CUresult from its number or its name ("CUDA_ERROR_UNKNOWN")."""
    return result if isinstance(result, int) else CUDA_ERRORS[result]


def _same_symbol(a: ctypes.CDLL, b: ctypes.CDLL, name: str) -> bool:
    try:
        fa, fb = getattr(a, name), getattr(b, name)
    except AttributeError:
        return False
    return ctypes.cast(fa, ctypes.c_void_p).value == ctypes.cast(fb, ctypes.c_void_p).value


class Call(NamedTuple):
    call: str       # one of CALLS
    pid: int
    result: int     # the CUresult returned

    @property
    def name(self) -> str:
        return CUDA_ERROR_NAMES.get(self.result, f"CUresult {self.result}")


class FakeProgram:
    """A running fake_cuda_program.py; `with` kills it."""

    def __init__(self, proc: subprocess.Popen, status_path: Path, log_path: Path):
        self.proc, self.pid = proc, proc.pid
        self.status_path, self.log_path = status_path, log_path

    def status(self) -> dict | None:
        try:
            return json.loads(self.status_path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def tick(self) -> int:
        st = self.status()
        return -1 if st is None else st.get("tick", -1)

    def wait_ready(self, timeout: float = 10.0) -> "FakeProgram":
        """Waits for the first status (the context and memory exist)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st is not None:
                if "error" in st:
                    raise RuntimeError(f"fake CUDA program failed: {st['error']}")
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake CUDA program exited {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')}")
            time.sleep(0.01)
        raise TimeoutError("fake CUDA program did not start")

    def wait_tick(self, above: int, timeout: float = 5.0) -> int:
        """Waits until tick > above; returns it (raises TimeoutError otherwise)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.tick()
            if t > above:
                return t
            time.sleep(0.01)
        raise TimeoutError(f"tick stayed at {self.tick()} (wanted > {above})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "FakeProgram":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


class FakeGpu:
    """A fake GPU host in state_dir: the gpus file, process files, faults, call log."""

    def __init__(self, state_dir: str | os.PathLike,
                 gpus: Iterable[tuple[str, str, int]] = DEFAULT_GPUS, *,
                 cuda_version: int = 13000, driver_version: str = "999.0-fake"):
        self.build_dir = build()
        self.libcuda = str(self.build_dir / LIBCUDA)
        self.libnvml = str(self.build_dir / LIBNVML)
        self.state_dir = Path(state_dir).resolve()
        for sub in ("proc", "fail", "hang", "delay"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        self.set_gpus(gpus)
        (self.state_dir / "cuda_version").write_text(f"{cuda_version}\n")
        (self.state_dir / "driver_version").write_text(f"{driver_version}\n")
        self._programs: list[FakeProgram] = []
        self._nvml_handle: ctypes.CDLL | None = None

    # -- the host ----------------------------------------------------------------------------
    def set_gpus(self, gpus: Iterable[tuple[str, str, int]]) -> None:
        """(Re)writes the gpus file, e.g. to play another host before a restore."""
        lines = []
        for gpu_uuid, name, total in gpus:
            uuidlib.UUID(gpu_uuid.removeprefix("GPU-"))  # ValueError unless a real UUID
            if "|" in gpu_uuid + name or "\n" in name:
                raise ValueError(f"bad fake GPU {gpu_uuid!r} {name!r}")
            lines.append(f"{gpu_uuid}|{name}|{int(total)}\n")
        self.gpus = [tuple(line.rstrip("\n").split("|")) for line in lines]
        self.gpus = [(u, n, int(t)) for u, n, t in self.gpus]
        self._write("gpus", "".join(lines))

    def uuid(self, index: int) -> str:
        return self.gpus[index][0]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables to give torpor (and programs): TORPOR_LIBCUDA, LD_LIBRARY_PATH
        (build dir first, so pynvml's CDLL("libnvidia-ml.so.1") finds the fake) and
        FAKE_CUDA_STATE_DIR. `base` (default os.environ) supplies the LD_LIBRARY_PATH tail."""
        base = os.environ if base is None else base
        ld = [str(self.build_dir)] + [p for p in base.get("LD_LIBRARY_PATH", "").split(":") if p]
        return {"TORPOR_LIBCUDA": self.libcuda, "LD_LIBRARY_PATH": ":".join(ld),
                "FAKE_CUDA_STATE_DIR": str(self.state_dir)}

    def activate(self) -> None:
        """Makes the fakes serve *this* Python process: sets FAKE_CUDA_STATE_DIR and
        TORPOR_LIBCUDA in os.environ and preloads the fake NVML, so a later
        CDLL("libnvidia-ml.so.1") (pynvml's) gets it by soname. LD_LIBRARY_PATH cannot do
        that in a running process. Tests should restore os.environ (monkeypatch.setenv)."""
        os.environ["FAKE_CUDA_STATE_DIR"] = str(self.state_dir)
        os.environ["TORPOR_LIBCUDA"] = self.libcuda
        if self._nvml_handle is None:
            self._nvml_handle = ctypes.CDLL(self.libnvml, mode=ctypes.RTLD_GLOBAL)

    def deactivate(self) -> None:
        """Undoes activate() as far as it can: drops pynvml's loaded library and function cache
        and dlcloses the fake NVML, so a later pynvml.nvmlInit() in this process loads the real
        libnvidia-ml.so.1 (if nothing else still holds the fake)."""
        import _ctypes
        fake = self._nvml_handle
        pynvml = sys.modules.get("pynvml")
        if pynvml is not None:
            lib = pynvml.nvmlLib
            pynvml.nvmlLib = None
            pynvml._nvmlGetFunctionPointer_cache.clear()
            if lib is not None and fake is not None and _same_symbol(lib, fake, "nvmlInit_v2"):
                _ctypes.dlclose(lib._handle)        # pynvml's reference to the fake
        if fake is not None:
            _ctypes.dlclose(fake._handle)
            self._nvml_handle = None

    # -- processes -------------------------------------------------------------------------------
    def state(self, pid: int) -> dict | None:
        """proc/<pid> parsed: {"state": int, "gpu": str, "mem": int,
        "restored_pairs": [(old, new), ...]}, or None when there is no such file."""
        try:
            text = (self.state_dir / "proc" / str(pid)).read_text()
        except FileNotFoundError:
            return None
        doc: dict = {}
        for line in text.splitlines():
            key, sep, val = line.partition("=")
            if sep:
                doc[key.strip()] = val.strip()
        for key in ("state", "mem"):
            if key in doc:
                doc[key] = int(doc[key])
        doc["restored_pairs"] = [tuple(p.split(":", 1))
                                 for p in doc.get("restored_pairs", "").split(",") if p]
        return doc

    def processes(self) -> dict[int, dict]:
        """Every proc file, live or not: {pid: state(pid)}."""
        out = {}
        for f in (self.state_dir / "proc").iterdir():
            if f.name.isdigit() and (st := self.state(int(f.name))) is not None:
                out[int(f.name)] = st
        return out

    def set_state(self, pid: int, state: int) -> None:
        """Forces a process's state (e.g. FAILED), bypassing the state machine."""
        path = self.state_dir / "proc" / str(pid)
        lines = [f"state={int(state)}" if ln.startswith("state=") else ln
                 for ln in path.read_text().splitlines()]
        self._write(f"proc/{pid}", "\n".join(lines) + "\n")

    def spawn(self, gpu_index: int = 0, mem: int = GIB, *, status: str | os.PathLike | None = None,
              env: Mapping[str, str] | None = None, wait: bool = True,
              max_ticks: int = 0) -> FakeProgram:
        """Starts fake_cuda_program.py in its own session, stdio on /dev/null and a log file
        (no pipes, so CRIU can dump it); waits for its first status unless wait=False.
        Programs still running are killed by close()."""
        n = len(self._programs)
        status_path = Path(status) if status else self.state_dir / f"program{n}.status.json"
        log_path = self.state_dir / f"program{n}.log"
        full_env = {**os.environ, **(env or {}), **self.env()}
        cmd = [sys.executable, str(PROGRAM), "--gpu", str(gpu_index), "--mem", str(mem),
               "--status", str(status_path), "--lib", self.libcuda]
        if max_ticks:
            cmd += ["--max-ticks", str(max_ticks)]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    env=full_env, start_new_session=True, close_fds=True)
        prog = FakeProgram(proc, status_path, log_path)
        self._programs.append(prog)
        if wait:
            try:
                prog.wait_ready()
            except Exception:
                prog.kill()
                raise
        return prog

    def close(self) -> None:
        """Kills the programs spawn() started; deactivate()s if activate()d."""
        for prog in self._programs:
            prog.kill()
        if self._nvml_handle is not None:
            self.deactivate()

    def __enter__(self) -> "FakeGpu":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- faults ----------------------------------------------------------------------------------
    def fail(self, call: str, result: int | str, pid: int | None = None) -> None:
        """`call` (one of CALLS) returns `result` (a CUresult or its name) without acting,
        for `pid` only if given, until clear_faults()."""
        self._check_call(call)
        self._write(f"fail/{call}", f"{cuda_result(result)}" + (f" {pid}" if pid else "") + "\n")

    def hang_lock(self, pid: int | None = None) -> None:
        """lock waits out its timeoutMs (0: 60 s) and returns CUDA_ERROR_TIMEOUT, state left
        RUNNING. unhang_lock() meanwhile lets a waiting lock go through."""
        self._write("hang/lock", f"{pid}\n" if pid else "\n")

    def unhang_lock(self) -> None:
        (self.state_dir / "hang" / "lock").unlink(missing_ok=True)

    def delay(self, call: str, ms: int, pid: int | None = None) -> None:
        """`call` sleeps `ms` before doing anything (to SIGKILL the caller mid-phase)."""
        self._check_call(call)
        self._write(f"delay/{call}", f"{int(ms)}" + (f" {pid}" if pid else "") + "\n")

    def clear_faults(self) -> None:
        for sub in ("fail", "hang", "delay"):
            for f in (self.state_dir / sub).iterdir():
                f.unlink(missing_ok=True)

    # -- the call log ----------------------------------------------------------------------------
    def calls(self) -> list[Call]:
        """calls.log parsed, oldest first."""
        try:
            text = (self.state_dir / "calls.log").read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 3:
                out.append(Call(parts[0], int(parts[1]), int(parts[2])))
        return out

    def clear_calls(self) -> None:
        (self.state_dir / "calls.log").unlink(missing_ok=True)

    # -- internals -------------------------------------------------------------------------------
    @staticmethod
    def _check_call(call: str) -> None:
        if call not in CALLS:
            raise ValueError(f"unknown checkpoint call {call!r}; one of {CALLS}")

    def _write(self, rel: str, text: str) -> None:
        path = self.state_dir / rel
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
