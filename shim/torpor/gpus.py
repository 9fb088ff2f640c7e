"""GPU discovery through NVML (pynvml): GPUs, which host PIDs use them, driver version."""

from __future__ import annotations

import dataclasses

from .errors import NoDriverError


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_total: int
    memory_free: int
    minor: int | None = None  # /dev/nvidia<minor>; None where NVML cannot tell


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu_uuid: str
    used_memory: int  # bytes; 0 where NVML cannot tell


@dataclasses.dataclass(frozen=True)
class Inventory:
    driver_version: str
    gpus: list[Gpu]
    processes: list[GpuProcess]

    def by_uuid(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def by_minor(self, minor: int) -> Gpu | None:
        return next((g for g in self.gpus if g.minor == minor), None)

    def gpus_of(self, pid: int) -> list[str]:
        return sorted({p.gpu_uuid for p in self.processes if p.pid == pid})

    def memory_of(self, pid: int) -> int:
        return sum(p.used_memory for p in self.processes if p.pid == pid)

    def free_memory(self) -> dict[str, int]:
        """Each GPU's free bytes, by UUID."""
        return {g.uuid: g.memory_free for g in self.gpus}

    def memory_by_gpu(self, pid: int) -> dict[str, int]:
        """What pid holds on each of its GPUs (a program on several rarely holds the same)."""
        out: dict[str, int] = {}
        for p in self.processes:
            if p.pid == pid:
                out[p.gpu_uuid] = out.get(p.gpu_uuid, 0) + p.used_memory
        return out


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def discover() -> Inventory:
    """Read every GPU and every compute process. NoDriverError when NVML is missing."""
    try:
        import pynvml
    except ImportError as e:  # pragma: no cover - a broken install
        raise NoDriverError("pynvml is not installed (package nvidia-ml-py)") from e
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise NoDriverError(f"NVML unavailable: {e}", hint="is the NVIDIA driver installed?") from e
    try:
        gpus, procs = [], []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(pynvml.nvmlDeviceGetUUID(h))
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                minor: int | None = int(pynvml.nvmlDeviceGetMinorNumber(h))
            except pynvml.NVMLError:
                minor = None
            gpus.append(Gpu(i, uuid, _text(pynvml.nvmlDeviceGetName(h)), int(mem.total),
                            int(mem.free), minor))
            try:
                running = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            except pynvml.NVMLError:
                running = []
            for p in running:
                used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0
                procs.append(GpuProcess(int(p.pid), uuid, int(used or 0)))
        return Inventory(_text(pynvml.nvmlSystemGetDriverVersion()), gpus, procs)
    except pynvml.NVMLError as e:
        raise NoDriverError(f"NVML query failed: {e}") from e
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
