"""The fake CUDA driver and NVML (tests/fakes/) behave like the real ones, as torpor sees them:
torpor.driver.Driver drives a live fake CUDA program through the whole checkpoint state
machine, and pynvml reads the fake GPUs."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))                # tests.fakes.* (tests/conftest.py does this too)
try:
    import torpor  # noqa: F401  (the installed one, as ./test.sh runs it)
except ImportError:
    sys.path.insert(0, str(ROOT / "shim"))       # the source tree, e.g. the dev venv

from tests.fakes.fakegpu import CHECKPOINTED, LOCKED, RUNNING, FakeGpu  # noqa: E402
from torpor.driver import Driver, DriverError, ProcessState  # noqa: E402

H200 = "NVIDIA H200"
GPU0 = "GPU-0a1b2c3d-0000-4000-8000-000000000000"
GPU1 = "GPU-0a1b2c3d-1111-4000-8000-111111111111"
SMALL = "GPU-0a1b2c3d-2222-4000-8000-222222222222"
GIB = 1 << 30


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    g = FakeGpu(tmp_path / "gpu", [(GPU0, H200, 141 * GIB), (GPU1, H200, 141 * GIB),
                                   (SMALL, "NVIDIA H100 80GB HBM3", 1 * GIB)])
    for key, value in g.env().items():
        monkeypatch.setenv(key, value)
    with g:
        yield g


@pytest.fixture
def driver(gpu):
    return Driver.load(gpu.libcuda)


@pytest.fixture
def prog(gpu):
    p = gpu.spawn(gpu_index=0, mem=3 * GIB)
    p.wait_tick(0)
    yield p
    p.kill()


def stalled(prog, settle=0.2, watch=0.4) -> bool:
    """True when the program's tick stops advancing."""
    time.sleep(settle)              # a tick already past cuCtxSynchronize may still land
    before = prog.tick()
    time.sleep(watch)
    return prog.tick() == before


# -- the driver library ---------------------------------------------------------------------------

def test_load_reports_version_and_needs_a_state_dir(gpu, monkeypatch):
    d = Driver.load(gpu.libcuda)
    assert d.cuda_version == 13000
    assert d.error_name(401) == "CUDA_ERROR_ILLEGAL_STATE"
    assert d.error_name(909) == "CUDA_ERROR_TIMEOUT"
    assert d.error_text(1) == "invalid argument"
    assert d.error_name(12345) == "CUresult 12345"
    monkeypatch.delenv("FAKE_CUDA_STATE_DIR")
    from torpor.errors import NoDriverError
    with pytest.raises(NoDriverError, match="sees no GPU"):
        Driver.load(gpu.libcuda)


def test_full_state_machine_with_gpu_remap(gpu, driver, prog):
    pid = prog.pid
    st = gpu.state(pid)
    assert st["state"] == RUNNING and st["gpu"] == GPU0 and st["mem"] == 3 * GIB
    assert driver.get_state(pid) is ProcessState.RUNNING
    assert driver.restore_thread_id(pid) == pid

    driver.lock(pid, timeout_ms=5000)
    assert driver.get_state(pid) is ProcessState.LOCKED
    assert stalled(prog), "ticks went on while LOCKED"

    driver.checkpoint(pid)
    assert driver.get_state(pid) is ProcessState.CHECKPOINTED
    assert gpu.state(pid)["state"] == CHECKPOINTED
    assert stalled(prog, settle=0), "ticks went on while CHECKPOINTED"

    driver.restore(pid, {GPU0: GPU1})
    st = gpu.state(pid)
    assert st["state"] == LOCKED
    assert st["gpu"] == GPU1
    assert st["restored_pairs"] == [(GPU0, GPU1)]
    assert stalled(prog, settle=0), "ticks went on while LOCKED after restore"

    before = prog.tick()
    driver.unlock(pid)
    assert driver.get_state(pid) is ProcessState.RUNNING
    assert prog.wait_tick(before + 2) > before + 2

    assert [(c.call, c.pid, c.result) for c in gpu.calls() if c.call != "get_state"] == [
        ("restore_tid", pid, 0), ("lock", pid, 0), ("checkpoint", pid, 0),
        ("restore", pid, 0), ("unlock", pid, 0)]


def test_wrong_states_are_illegal(gpu, driver, prog):
    pid = prog.pid
    for call in (driver.checkpoint, driver.unlock, driver.restore):
        with pytest.raises(DriverError) as e:
            call(pid)
        assert e.value.result_name == "CUDA_ERROR_ILLEGAL_STATE"
        assert "CUDA_ERROR_ILLEGAL_STATE" in str(e.value)
    driver.lock(pid, 1000)
    with pytest.raises(DriverError, match="CUDA_ERROR_ILLEGAL_STATE"):
        driver.lock(pid, 1000)
    with pytest.raises(DriverError, match="CUDA_ERROR_ILLEGAL_STATE"):
        driver.restore(pid)
    driver.checkpoint(pid)
    with pytest.raises(DriverError, match="CUDA_ERROR_ILLEGAL_STATE"):
        driver.unlock(pid)
    assert driver.get_state(pid) is ProcessState.CHECKPOINTED   # nothing moved
    driver.restore(pid)                                           # no pairs: same GPU
    assert gpu.state(pid)["gpu"] == GPU0 and gpu.state(pid)["restored_pairs"] == []
    driver.unlock(pid)
    assert driver.get_state(pid) is ProcessState.RUNNING


def test_unknown_or_dead_pid_is_invalid_value(gpu, driver, prog):
    with pytest.raises(DriverError) as e:
        driver.get_state(os.getpid())           # alive, but no CUDA context
    assert e.value.result_name == "CUDA_ERROR_INVALID_VALUE"
    assert driver.try_state(os.getpid()) is None
    pid = prog.pid
    prog.kill()
    assert gpu.state(pid) is not None           # the file stays; the process does not
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        driver.lock(pid, 100)


def test_restore_validates_gpu_pairs(gpu, driver, prog):
    pid = prog.pid
    driver.lock(pid, 1000)
    driver.checkpoint(pid)
    unknown = "GPU-ffffffff-ffff-4fff-8fff-ffffffffffff"
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_DEVICE"):
        driver.restore(pid, {GPU0: unknown})
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        driver.restore(pid, {GPU1: GPU0})       # misses the checkpointed GPU0
    with pytest.raises(DriverError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        driver.restore(pid, {GPU0: SMALL})      # 3 GiB does not fit in 1 GiB
    assert gpu.state(pid)["state"] == CHECKPOINTED and gpu.state(pid)["gpu"] == GPU0
    driver.restore(pid, {GPU0: GPU0})
    assert gpu.state(pid)["restored_pairs"] == [(GPU0, GPU0)]


def test_injected_failure_changes_nothing(gpu, driver, prog):
    pid = prog.pid
    gpu.fail("checkpoint", "CUDA_ERROR_UNKNOWN")
    driver.lock(pid, 1000)
    with pytest.raises(DriverError) as e:
        driver.checkpoint(pid)
    assert e.value.result == 999 and e.value.result_name == "CUDA_ERROR_UNKNOWN"
    assert driver.get_state(pid) is ProcessState.LOCKED
    assert gpu.calls()[-2] == ("checkpoint", pid, 999)

    gpu.fail("unlock", 304, pid=pid + 1)        # another pid: does not apply
    driver.unlock(pid)
    gpu.fail("get_state", 2, pid=pid)
    with pytest.raises(DriverError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        driver.get_state(pid)
    gpu.clear_faults()
    assert driver.get_state(pid) is ProcessState.RUNNING


def test_hung_lock_times_out_within_its_timeout(gpu, driver, prog):
    pid = prog.pid
    gpu.hang_lock()
    t0 = time.monotonic()
    with pytest.raises(DriverError) as e:
        driver.lock(pid, timeout_ms=300)
    took = time.monotonic() - t0
    assert e.value.result_name == "CUDA_ERROR_TIMEOUT"
    assert 0.25 <= took < 2.0, took
    assert driver.get_state(pid) is ProcessState.RUNNING
    gpu.clear_faults()
    driver.lock(pid, timeout_ms=300)
    assert driver.get_state(pid) is ProcessState.LOCKED
    driver.unlock(pid)


def test_delay_slows_the_call(gpu, driver, prog):
    gpu.delay("get_state", 300)
    t0 = time.monotonic()
    assert driver.get_state(prog.pid) is ProcessState.RUNNING
    assert time.monotonic() - t0 >= 0.3


def test_fakegpu_rejects_bad_input(gpu, tmp_path):
    with pytest.raises(ValueError):
        gpu.fail("freeze", 1)
    with pytest.raises(ValueError):
        FakeGpu(tmp_path / "bad", [("GPU-not-a-uuid", H200, GIB)])


# -- NVML through pynvml ----------------------------------------------------------------------------

@pytest.fixture
def nvml(gpu):
    gpu.activate()                               # env is restored by monkeypatch in `gpu`
    import pynvml
    pynvml.nvmlInit()
    yield pynvml
    pynvml.nvmlShutdown()
    gpu.deactivate()                             # later tests may want the real NVML


def _pids(nvml, index):
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    return {p.pid: p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)}


def test_nvml_lists_the_fake_gpus(gpu, nvml):
    assert nvml.nvmlDeviceGetCount() == 3
    assert nvml.nvmlSystemGetDriverVersion() == "999.0-fake"
    assert nvml.nvmlSystemGetCudaDriverVersion() == 13000
    for i, (uuid, name, total) in enumerate(gpu.gpus):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        assert nvml.nvmlDeviceGetUUID(h) == uuid
        assert nvml.nvmlDeviceGetName(h) == name
        assert nvml.nvmlDeviceGetIndex(h) == i
        assert nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(uuid)) == i
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        assert (mem.total, mem.used, mem.free) == (total, 0, total)
        mem2 = nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2)
        assert (mem2.total, mem2.used) == (total, 0)
        assert nvml.nvmlDeviceGetPciInfo(h).busId
        assert nvml.nvmlDeviceGetComputeRunningProcesses(h) == []
    with pytest.raises(nvml.NVMLError_NotFound):
        nvml.nvmlDeviceGetHandleByUUID("GPU-ffffffff-ffff-4fff-8fff-ffffffffffff")


def test_nvml_running_processes_follow_checkpoint(gpu, nvml, driver, prog):
    pid = prog.pid
    assert _pids(nvml, 0) == {pid: 3 * GIB}
    assert _pids(nvml, 1) == {}
    h0 = nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMemoryInfo(h0).used == 3 * GIB

    driver.lock(pid, 1000)
    assert _pids(nvml, 0) == {pid: 3 * GIB}      # locked still holds its memory
    driver.checkpoint(pid)
    assert _pids(nvml, 0) == {}
    assert nvml.nvmlDeviceGetMemoryInfo(h0).used == 0

    driver.restore(pid, {GPU0: GPU1})
    assert _pids(nvml, 0) == {}
    assert _pids(nvml, 1) == {pid: 3 * GIB}
    driver.unlock(pid)
    prog.kill()
    assert _pids(nvml, 1) == {}                  # gone with the process


def test_nvml_without_state_dir_is_driver_not_loaded(gpu, monkeypatch):
    gpu.activate()
    import pynvml
    monkeypatch.delenv("FAKE_CUDA_STATE_DIR")
    try:
        with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
            pynvml.nvmlInit()
    finally:
        gpu.deactivate()


def test_deactivate_unloads_the_fake_nvml(gpu):
    import pynvml
    gpu.activate()
    pynvml.nvmlInit()
    assert pynvml.nvmlSystemGetDriverVersion() == "999.0-fake"
    pynvml.nvmlShutdown()
    gpu.deactivate()
    assert pynvml.nvmlLib is None
    maps = Path("/proc/self/maps").read_text()
    assert gpu.libnvml not in maps


def test_program_in_subprocess_env_finds_fake_nvml(gpu, tmp_path):
    """torpor runs as a subprocess with gpu.env(): pynvml must find the fake by LD_LIBRARY_PATH."""
    import subprocess
    code = ("import pynvml; pynvml.nvmlInit(); "
            "print(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(1)))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **gpu.env()},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == GPU1
