"""The CUDA driver's checkpoint API (cuCheckpointProcess*, driver >= 570), through ctypes.

Six calls act on *another* process by PID: get-state, lock, checkpoint, restore, unlock and
get-restore-thread-id. A process moves RUNNING -> LOCKED -> CHECKPOINTED and back
(CHECKPOINTED -> LOCKED on restore, LOCKED -> RUNNING on unlock). A checkpointed process holds
no GPU handles, so CRIU can dump it.

The library is libcuda.so.1 unless the config names another (CI names a fake one built by the
test suite, tests/fakes/). Struct layouts follow cuda.h (CUDA 12.8+), "CUDA_CHECKPOINT".
"""

from __future__ import annotations

import ctypes
import enum
import re
import threading
import uuid as uuidlib
from typing import Mapping

from .errors import NoDriverError, TorporError

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_NOT_SUPPORTED = 801


class ProcessState(enum.Enum):
    """CUprocessState."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class DriverError(TorporError):
    """A checkpoint-API call failed; carries the CUresult and its name."""

    def __init__(self, call: str, pid: int, result: int, name: str, text: str):
        super().__init__(f"{call}(pid {pid}) failed: {name} ({text})")
        self.call, self.pid, self.result, self.result_name = call, pid, result, name


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]


class _CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", _CUuuid), ("newUuid", _CUuuid)]


class _RestoreArgs(ctypes.Structure):
    # char reserved[52 - sizeof(CUcheckpointGpuPair *)]
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
                ("reserved1", ctypes.c_uint64)]


class _UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


assert ctypes.sizeof(_LockArgs) == 64 and ctypes.sizeof(_RestoreArgs) == 64


# NVML's spelling of a GPU or a MIG instance (GPU-8c6d2f4e-1b3a-4c5d-9e7f-0a1b2c3d4e5f), and
# nothing else: the one rule for a GPU UUID, wherever one comes from (a manifest, the driver)
GPU_UUID = re.compile(r"(?:GPU|MIG)-([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                      r"[0-9a-fA-F]{4}-[0-9a-fA-F]{12})")
GPU_UUID_FORM = "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"


def is_gpu_uuid(text: object) -> bool:
    """Whether text is a GPU UUID as NVML spells it (GPU_UUID)."""
    return isinstance(text, str) and GPU_UUID.fullmatch(text) is not None


def uuid_bytes(gpu_uuid: str) -> bytes:
    """'GPU-8c6d…' (NVML's spelling, GPU_UUID) -> the 16 raw bytes of CUuuid."""
    m = GPU_UUID.fullmatch(gpu_uuid) if isinstance(gpu_uuid, str) else None
    if m is None:
        raise TorporError(f"not a GPU UUID: '{gpu_uuid}'")
    return uuidlib.UUID(m[1]).bytes


class Driver:
    """A loaded libcuda with the checkpoint API. Thread-safe; load once per process."""

    _CALLS = ("cuCheckpointProcessGetState", "cuCheckpointProcessLock",
              "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
              "cuCheckpointProcessUnlock", "cuCheckpointProcessGetRestoreThreadId")

    def __init__(self, lib: ctypes.CDLL, path: str):
        self._lib = lib
        self.path = path
        self._mutex = threading.Lock()
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        version = ctypes.c_int(0)
        rc = lib.cuDriverGetVersion(ctypes.byref(version))
        self.cuda_version = version.value if rc == CUDA_SUCCESS else 0  # e.g. 13000
        missing = [c for c in self._CALLS if not hasattr(lib, c)]
        if missing:
            raise NoDriverError(
                f"the NVIDIA driver at {path} has no checkpoint API (missing {missing[0]}; "
                f"CUDA {self.cuda_version // 1000}.{self.cuda_version % 1000 // 10})",
                hint="driver 570 or newer is needed")
        rc = lib.cuInit(0)
        if rc == CUDA_ERROR_NO_DEVICE:
            raise NoDriverError("the NVIDIA driver is loaded but sees no GPU")
        if rc != CUDA_SUCCESS:
            raise NoDriverError(f"cuInit failed: {self.error_name(rc)} ({self.error_text(rc)})")

    @classmethod
    def load(cls, path: str = "libcuda.so.1") -> "Driver":
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise NoDriverError(f"no NVIDIA driver: cannot load {path} ({e})",
                                hint="install the NVIDIA driver, or run without GPU work") from e
        return cls(lib, path)

    # -- errors ---------------------------------------------------------------------------
    def error_name(self, rc: int) -> str:
        s = ctypes.c_char_p()
        if self._lib.cuGetErrorName(rc, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode()
        return f"CUresult {rc}"

    def error_text(self, rc: int) -> str:
        s = ctypes.c_char_p()
        if self._lib.cuGetErrorString(rc, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode()
        return "unknown error"

    def _check(self, call: str, pid: int, rc: int) -> None:
        if rc != CUDA_SUCCESS:
            raise DriverError(call, pid, rc, self.error_name(rc), self.error_text(rc))

    # -- the six calls ----------------------------------------------------------------------
    def get_state(self, pid: int) -> ProcessState:
        state = ctypes.c_int(-1)
        rc = self._lib.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(state))
        self._check("cuCheckpointProcessGetState", pid, rc)
        return ProcessState(state.value)

    def try_state(self, pid: int) -> ProcessState | None:
        """The state, or None when pid is not a CUDA process (or is gone)."""
        try:
            return self.get_state(pid)
        except DriverError:
            return None

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = _LockArgs(timeoutMs=max(0, int(timeout_ms)))
        rc = self._lib.cuCheckpointProcessLock(ctypes.c_int(pid), ctypes.byref(args))
        self._check("cuCheckpointProcessLock", pid, rc)

    def checkpoint(self, pid: int) -> None:
        args = _CheckpointArgs()
        rc = self._lib.cuCheckpointProcessCheckpoint(ctypes.c_int(pid), ctypes.byref(args))
        self._check("cuCheckpointProcessCheckpoint", pid, rc)

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        """Restore GPU state; gpu_map {old UUID: new UUID} is passed to the driver as gpuPairs.

        The caller passes a pair for every GPU the process used (identity pairs included) or
        none at all, which restores onto the same UUIDs.
        """
        args = _RestoreArgs()
        pairs = list((gpu_map or {}).items())
        if pairs:
            arr = (_GpuPair * len(pairs))()
            for i, (old, new) in enumerate(pairs):
                arr[i].oldUuid.bytes[:] = list(uuid_bytes(old))
                arr[i].newUuid.bytes[:] = list(uuid_bytes(new))
            args.gpuPairs = ctypes.cast(arr, ctypes.POINTER(_GpuPair))
            args.gpuPairsCount = len(pairs)
        rc = self._lib.cuCheckpointProcessRestore(ctypes.c_int(pid), ctypes.byref(args))
        self._check("cuCheckpointProcessRestore", pid, rc)

    def unlock(self, pid: int) -> None:
        args = _UnlockArgs()
        rc = self._lib.cuCheckpointProcessUnlock(ctypes.c_int(pid), ctypes.byref(args))
        self._check("cuCheckpointProcessUnlock", pid, rc)

    def restore_thread_id(self, pid: int) -> int:
        tid = ctypes.c_int(0)
        rc = self._lib.cuCheckpointProcessGetRestoreThreadId(ctypes.c_int(pid), ctypes.byref(tid))
        self._check("cuCheckpointProcessGetRestoreThreadId", pid, rc)
        return tid.value
