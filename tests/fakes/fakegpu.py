"""Test helper around the fake CUDA driver and fake NVML (tests/fakes/*.c).

Import it as `tests.fakes.fakegpu` (with the repository root on sys.path, as `python -m pytest`
from the root gives) or as `fakegpu` (with tests/fakes on sys.path). It needs only the stdlib.

    gpu = FakeGpu(tmp_path / "gpu")                 # builds the fakes once, writes the gpus file
    prog = gpu.spawn(gpu_index=0, mem=2 << 30)      # a fake CUDA program, registered and ticking
    env = {**os.environ, **gpu.env()}               # what to give torpor
    gpu.fail("checkpoint", "CUDA_ERROR_UNKNOWN")    # fault injection
    gpu.calls()                                     # [Call("lock", 1234, 0), ...]
    gpu.state(prog.pid)                             # {"state": RUNNING, "gpu": ..., ...}

State directory layout (shared by every process that loads the fakes; read at every call):
  gpus             <uuid>|<name>|<total bytes>, one GPU a line, index = line order
  proc/<key>       state=0..3, gpu=<uuid>, mem=<bytes>, restored_pairs=<old>:<new>,...,
                   pidns=<its PID namespace inode>, host=<host pid>:<start time>,
                   image=<GPU at its last checkpoint>: a process with that key in another
                   PID namespace or as another host process (CRIU restored it) is
                   CHECKPOINTED on `image`, as the real driver's state travels in the image
  fail/<call>      "<CUresult> [pid]"      hang/lock "[pid]"      delay/<call> "<ms> [pid]"
  calls.log        "<call> <pid> <CUresult>" a line, one per checkpoint-API call
  cuda_version     13000 by default        driver_version "999.0-fake" by default
  va_phase         "<offset>": GPU memory at chosen addresses (va_phase()); without it, at
                   mmap()'s. $FAKE_CUDA_VA_PHASE (bytes) sets it for every FakeGpu: run a
                   suite with FAKE_CUDA_VA_PHASE=$((26 << 20)) and so on to find a test that
                   holds for the layout chance gave it only
<call> is one of CALLS. A pid that is not a live CUDA process gets CUDA_ERROR_INVALID_VALUE.
  delay/<cu name>  "<ms> [pid]" (pid: the program's getpid()) also delays the driver calls fake_libcuda.c adds for torpor's
                   agent (cuStreamSynchronize, cuMemFree_v2, cuMemAllocPitch_v2, cuLaunchKernel,
                   cuMemcpyHtoD_v2, cuMemcpyDtoH_v2), named by their exported name: write the
                   file directly (delay() takes CALLS only) to hold such a call in flight.
cuGetProcAddress(_v2) answers base names ("cuMemAlloc" -> cuMemAlloc_v2) from the fake's own
table, unaffected by an LD_PRELOADed library exporting the same names.
Every pid above (fault files, calls.log, what NVML lists) is the pid the caller's /proc shows:
the host pid, also for a program in a container.

Process keys (fake_common.h fk_key_of; key_of() here is the same rule):
  "<pid>"            a program started normally;
  "<scope>.<nspid>"  a program whose environment has FAKE_CUDA_SCOPE=<scope> (SCOPE_RE): nspid is
                     its pid in its own, innermost pid namespace (getpid() inside a container,
                     the last NSpid of /proc/<host pid>/status outside). The host pid of a
                     containerized program differs from getpid(), and a CRIU restore changes
                     it; the scoped key stays. Give each container its own scope.
The checkpoint calls take a host pid and act on key_of(pid); NVML lists a scoped entry under
the host pid of the live process with that key (pid_of(), a scan of /proc), or not at all.

Containers: container_workload(scope, ...) gives the argv (system /usr/bin/python3), env and bind
mounts that run fake_cuda_program.py inside one (same paths inside as outside); read its entry
with proc_entry(scoped_key(scope, nspid)) or state(host_pid). spawn(scope=..., pid_namespace=True)
does the same without a container runtime (unshare --pid --fork --mount-proc; needs root).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import signal
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
STATE_DIR_VAR = "FAKE_CUDA_STATE_DIR"   # the fakes' state directory (both libraries read it)
# its copy, which torpor's hooks pass on (TORPOR_*): for a torpord a hook starts (fake_common.h)
HOOK_STATE_DIR_VAR = "TORPOR_FAKE_CUDA_STATE_DIR"
SCOPE_VAR = "FAKE_CUDA_SCOPE"           # makes a program's key "<scope>.<nspid>"
VA_PHASE_VAR = "FAKE_CUDA_VA_PHASE"     # bytes: every FakeGpu's va_phase (a sweep over layouts)
SCOPE_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}\Z")   # = fk_scope_ok
SYSTEM_PYTHON = "/usr/bin/python3"      # what container_workload runs the program with
_KEY_RE = re.compile(r"(?:[1-9][0-9]*|[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}\.[1-9][0-9]*)\Z")

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


def check_scope(scope: str) -> str:
    """`scope` if it is a valid FAKE_CUDA_SCOPE (SCOPE_RE), else ValueError. The fakes ignore
    an invalid one (the process is then keyed by its pid)."""
    if not isinstance(scope, str) or not SCOPE_RE.match(scope):
        raise ValueError(f"bad fake CUDA scope {scope!r}: want {SCOPE_RE.pattern}")
    return scope


def scoped_key(scope: str, nspid: int) -> str:
    """The key of a program under FAKE_CUDA_SCOPE=scope whose own getpid() is nspid."""
    if int(nspid) <= 0:
        raise ValueError(f"bad pid {nspid!r}")
    return f"{check_scope(scope)}.{int(nspid)}"


def _scope_of(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(SCOPE_VAR.encode() + b"="):       # the first one, as getenv()
            value = item[len(SCOPE_VAR) + 1:].decode("ascii", "replace")
            return value if SCOPE_RE.match(value) else None
    return None


def nspid_of(pid: int) -> int | None:
    """The innermost pid of host process `pid` (last value of NSpid in /proc/<pid>/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def key_of(pid: int) -> str:
    """The fakes' key of process `pid` (a pid of this /proc), as fk_key_of computes it:
    "<scope>.<nspid>" under a valid FAKE_CUDA_SCOPE, else str(pid) (also when it is gone)."""
    scope = _scope_of(pid)
    if scope is None:
        return str(pid)
    return f"{scope}.{nspid_of(pid) or pid}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] not in "ZXx"
    except (OSError, ValueError, IndexError):
        return True


def pid_of(key: str) -> int | None:
    """The live process with that key, by its pid in this /proc (fk_host_pid): the pid
    itself for "<pid>", a scan of /proc for "<scope>.<nspid>"; None when there is none."""
    key = str(key)
    if not _KEY_RE.match(key):
        return None
    if key.isdigit():
        return int(key) if _alive(int(key)) else None
    nspid = int(key.rsplit(".", 1)[1])
    for entry in os.listdir("/proc"):
        if entry.isdigit() and nspid_of(int(entry)) == nspid and key_of(int(entry)) == key \
                and _alive(int(entry)):
            return int(entry)
    return None


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
    """A running fake_cuda_program.py; `with` kills it.

    pid is the program's pid on this host (what torpor and the checkpoint calls get); key its
    proc/ entry's name (key_of(pid)). Under spawn(pid_namespace=True) proc is the `unshare`
    around it and pid its child, known once it has started (wait_ready())."""

    def __init__(self, proc: subprocess.Popen, status_path: Path, log_path: Path, *,
                 pid_namespace: bool = False, outer_log_path: Path | None = None):
        self.proc = proc
        self.status_path, self.log_path = status_path, log_path
        self.outer_log_path = outer_log_path       # unshare's own output (pid_namespace)
        self.pid_namespace = pid_namespace
        self._pid: int | None = None if pid_namespace else proc.pid
        self._key: str | None = None

    @property
    def pid(self) -> int:
        if self._pid is None:
            self._pid = self._child()
            if self._pid is None:
                raise RuntimeError("the fake CUDA program has not started yet (wait_ready())")
        return self._pid

    @property
    def key(self) -> str:
        """Its state entry's key, as the fakes compute it (kept from while it lived)."""
        if self._key is None:
            key = key_of(self.pid)
            if not _alive(self.pid):
                return key
            self._key = key
        return self._key

    def _still_ours(self) -> bool:
        """Is pid still the program (unshare's child, or a live process with its scoped key)?"""
        try:
            status = Path(f"/proc/{self._pid}/status").read_text()
        except OSError:
            return False
        if self.proc.poll() is None and f"PPid:\t{self.proc.pid}\n" in status:
            return True
        return self._key is not None and not self._key.isdigit() and key_of(self._pid) == self._key

    def _child(self) -> int | None:
        """The child of `unshare` (the program, pid 1 of its namespace)."""
        up = self.proc.pid
        try:
            kids = Path(f"/proc/{up}/task/{up}/children").read_text().split()
            if kids:
                return int(kids[0])
        except OSError:
            pass
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and \
                        f"PPid:\t{up}\n" in Path(f"/proc/{entry}/status").read_text():
                    return int(entry)
            except OSError:
                continue
        return None

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
                if self._pid is None and self.pid_namespace:
                    self._pid = self._child()
                if self._pid is not None:
                    self.key                        # noqa: B018  (remembered while alive)
                    return self
            if self.proc.poll() is not None:
                logs = [p for p in (self.outer_log_path, self.log_path) if p and p.exists()]
                raise RuntimeError(f"fake CUDA program exited {self.proc.returncode}: " +
                                   "".join(p.read_text(errors="replace") for p in logs))
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
        """SIGKILLs the program and returns once it is gone (reaped, or a zombie elsewhere)."""
        if self.pid_namespace and self._pid is not None and self._still_ours():
            try:            # the namespace's init: its end ends the namespace, then unshare
                os.kill(self._pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                self.proc.wait(timeout=5)   # unshare reaps it and exits
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + 5
            while _alive(self._pid) and time.monotonic() < deadline:
                time.sleep(0.01)            # (not unshare's child any more: someone else's)
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
    """A fake GPU host in state_dir: the gpus file, process files, faults, call log.

    The host:       set_gpus(gpus), uuid(index), env(base=None), activate(), deactivate()
    Processes:      spawn(gpu_index, mem, *, status, env, wait, max_ticks, scope, pid_namespace,
                    mount_proc) -> FakeProgram;
                    container_workload(scope, gpu_index, mem, status_file, *, max_ticks)
                    -> (argv, env, mounts); close()
    Their entries:  state(pid | key), proc_entry(key), processes(), set_state(pid | key, state);
                    key_of(pid), scoped_key(scope, nspid), pid_of(key) (the module functions)
    Faults, calls:  fail(call, result, pid), hang_lock(pid), unhang_lock(), delay(call, ms, pid),
                    clear_faults(), calls(), clear_calls()
    """

    key_of = staticmethod(key_of)
    scoped_key = staticmethod(scoped_key)
    pid_of = staticmethod(pid_of)

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
        if os.environ.get(VA_PHASE_VAR):        # a sweep of the suite over layouts
            self.va_phase(int(os.environ[VA_PHASE_VAR], 0))
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
                STATE_DIR_VAR: str(self.state_dir), HOOK_STATE_DIR_VAR: str(self.state_dir)}

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
    def state(self, pid: int | str) -> dict | None:
        """The entry of process `pid` (a host pid: its key_of(pid)), or of the key `pid` when a
        str: {"state": int, "gpu": str, "mem": int, "restored_pairs": [(old, new), ...]}, or
        None when there is no such file. A gone scoped process's host pid no longer leads to
        its entry: use proc_entry(key) (FakeProgram.key keeps it)."""
        return self.proc_entry(pid if isinstance(pid, str) else key_of(pid))

    def proc_entry(self, key: str | int) -> dict | None:
        """proc/<key> parsed as state() returns it, or None (also for a malformed key)."""
        key = str(key)
        if not _KEY_RE.match(key):
            return None
        try:
            text = (self.state_dir / "proc" / key).read_text()
        except FileNotFoundError:
            return None
        doc: dict = {}
        for line in text.splitlines():
            name, sep, val = line.partition("=")
            if sep:
                doc[name.strip()] = val.strip()
        for name in ("state", "mem"):
            if name in doc:
                doc[name] = int(doc[name])
        doc["restored_pairs"] = [tuple(p.split(":", 1))
                                 for p in doc.get("restored_pairs", "").split(",") if p]
        return doc

    def processes(self) -> dict[int | str, dict]:
        """Every proc file, live or not: {pid: entry} for "<pid>" entries, {key: entry} (a str)
        for scoped ones."""
        out: dict[int | str, dict] = {}
        for f in (self.state_dir / "proc").iterdir():
            if _KEY_RE.match(f.name) and (st := self.proc_entry(f.name)) is not None:
                out[int(f.name) if f.name.isdigit() else f.name] = st
        return out

    def set_state(self, pid: int | str, state: int) -> None:
        """Forces a process's state (e.g. FAILED), bypassing the state machine; `pid` as for
        state()."""
        key = pid if isinstance(pid, str) else key_of(pid)
        if not _KEY_RE.match(key):
            raise ValueError(f"bad fake process key {key!r}")
        path = self.state_dir / "proc" / key
        lines = [f"state={int(state)}" if ln.startswith("state=") else ln
                 for ln in path.read_text().splitlines()]
        self._write(f"proc/{key}", "\n".join(lines) + "\n")

    def spawn(self, gpu_index: int = 0, mem: int = GIB, *, status: str | os.PathLike | None = None,
              env: Mapping[str, str] | None = None, wait: bool = True,
              max_ticks: int = 0, scope: str | None = None, pid_namespace: bool = False,
              mount_proc: bool = True) -> FakeProgram:
        """Starts fake_cuda_program.py in its own session, stdio on /dev/null and a log file
        (no pipes, so CRIU can dump it); waits for its first status unless wait=False.
        Programs still running are killed by close().

        scope: run it under FAKE_CUDA_SCOPE=scope (key "<scope>.<nspid>"); otherwise an
        inherited FAKE_CUDA_SCOPE is dropped (unless `env` sets one). pid_namespace: run it as
        pid 1 of a new pid namespace, as in a container, and its own session leader, under
        `unshare --pid --fork [--mount-proc] -- setsid` (root; unshare's own output goes to
        FakeProgram.outer_log_path); FakeProgram.pid is still its host pid. mount_proc=False
        keeps the host's /proc (and mount namespace) so that a plain `criu dump -t <pid>` can
        dump the namespace."""
        n = len(self._programs)
        status_path = Path(status) if status else self.state_dir / f"program{n}.status.json"
        log_path = self.state_dir / f"program{n}.log"
        inherited = {k: v for k, v in os.environ.items() if k != SCOPE_VAR}
        full_env = {**inherited, **(env or {}), **self.env()}
        if scope is not None:
            full_env[SCOPE_VAR] = check_scope(scope)
        cmd = [sys.executable, str(PROGRAM), "--gpu", str(gpu_index), "--mem", str(mem),
               "--status", str(status_path), "--lib", self.libcuda]
        if max_ticks:
            cmd += ["--max-ticks", str(max_ticks)]
        outer_log = None
        if pid_namespace:
            # The program logs to a file of its own: unshare may write to its stderr after a
            # CRIU dump ended the program, and CRIU restores only files of the size it dumped.
            # No --kill-child: a restored pdeath signal would kill a CRIU-restored program.
            outer_log = self.state_dir / f"program{n}.unshare.log"
            cmd = (["unshare", "--pid", "--fork"] + (["--mount-proc"] if mount_proc else [])
                   + ["--", "setsid", "/bin/sh", "-c", 'exec "$@" >>"$0" 2>&1', str(log_path)]
                   + cmd)
        with open(outer_log or log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    env=full_env, start_new_session=True, close_fds=True)
        prog = FakeProgram(proc, status_path, log_path, pid_namespace=pid_namespace,
                           outer_log_path=outer_log)
        self._programs.append(prog)
        if wait:
            try:
                prog.wait_ready()
            except Exception:
                prog.kill()
                raise
        return prog

    def container_workload(self, scope: str, gpu_index: int = 0, mem: int = GIB,
                           status_file: str | os.PathLike | None = None, *, max_ticks: int = 0,
                           ) -> tuple[list[str], dict[str, str], list[tuple[str, str, bool]]]:
        """What a container needs to run fake_cuda_program.py as a scoped CUDA program:
        (argv, env, mounts). argv runs the system /usr/bin/python3 (-I: no venv, no user site;
        the host /usr must be in the container). env: FAKE_CUDA_SCOPE=scope,
        FAKE_CUDA_STATE_DIR, TORPOR_LIBCUDA, LD_LIBRARY_PATH=<build dir>. mounts: (host path,
        container path, read_only) with the same path inside: the state dir (read-write), the
        build dir and the program (read-only), and status_file's directory (read-write) when
        it is outside the state dir (created if missing). The status file (default
        <state dir>/<scope>.status.json) gets {"pid": <its pid inside>, "tick": n}; its key
        is scoped_key(scope, pid), and pid_of(key) finds its host pid. close() does not stop
        containers."""
        check_scope(scope)
        status = Path(status_file) if status_file else self.state_dir / f"{scope}.status.json"
        status = Path(os.path.abspath(status))
        argv = [SYSTEM_PYTHON, "-I", str(PROGRAM), "--gpu", str(int(gpu_index)),
                "--mem", str(int(mem)), "--status", str(status), "--lib", self.libcuda]
        if max_ticks:
            argv += ["--max-ticks", str(int(max_ticks))]
        env = {SCOPE_VAR: scope, STATE_DIR_VAR: str(self.state_dir),
               "TORPOR_LIBCUDA": self.libcuda, "LD_LIBRARY_PATH": str(self.build_dir)}
        mounts = [(str(self.state_dir), str(self.state_dir), False),
                  (str(self.build_dir), str(self.build_dir), True),
                  (str(PROGRAM), str(PROGRAM), True)]
        if not status.parent.resolve().is_relative_to(self.state_dir):
            status.parent.mkdir(parents=True, exist_ok=True)     # a bind mount's source
            mounts.append((str(status.parent), str(status.parent), False))
        return argv, env, mounts

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

    def va_phase(self, offset: int | None) -> None:
        """Where GPU memory goes (fake_libcuda.c va_phase): a program's first reservation, a
        VMM-served cuMemAlloc's too, `offset` bytes past a 1 GiB boundary and each later one
        right below the one before; None: wherever mmap() puts it, which varies run to run.
        The agent cuts its chunks at 32 MiB windows of these addresses, so a test that depends
        on the cut takes it from here, not from chance. Read by each reservation as it is made."""
        if offset is None:
            (self.state_dir / "va_phase").unlink(missing_ok=True)
        else:
            self._write("va_phase", f"{int(offset)}\n")

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

    def copies(self, pid: int | str) -> dict[str, int]:
        """What process `pid` (a host pid, or a key when a str) moved between host and device
        memory since it started: {"dtoh", "htod", "memset"} bytes (copies/<key>, which every
        copy and memset of the fake rewrites); zeros before its first."""
        key = pid if isinstance(pid, str) else key_of(pid)
        try:
            text = (self.state_dir / "copies" / key).read_text()
        except FileNotFoundError:
            text = ""
        out = {"dtoh": 0, "htod": 0, "memset": 0}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in out:
                out[name] = int(value)
        return out

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
