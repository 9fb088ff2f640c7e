"""The fake CUDA driver and NVML (tests/fakes/) behave like the real ones, as torpor sees them:
torpor.driver.Driver drives a live fake CUDA program through the whole checkpoint state
machine, and pynvml reads the fake GPUs. Also for a "scoped" program in its own pid namespace,
as in a container: the host side uses host pids, the program's entry is <scope>.<nspid>.
The driver calls a program and torpor's agent make (device memory that holds data, the VMM
API, streams, events, pinned memory, fail-after faults) through tests/fakes/agent_probe.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
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

from tests.fakes.fakegpu import (  # noqa: E402
    CHECKPOINTED, LOCKED, PROGRAM, RUNNING, SYSTEM_PYTHON, FakeGpu, check_scope, key_of, nspid_of,
    pid_of, scoped_key)
from tests.fakes.probe_client import ProbeProcess  # noqa: E402
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
    monkeypatch.delenv("TORPOR_FAKE_CUDA_STATE_DIR", raising=False)   # its copy too
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
    monkeypatch.delenv("TORPOR_FAKE_CUDA_STATE_DIR", raising=False)   # its copy too
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


# -- scoped programs: in their own pid namespace, as in a container -------------------------------

needs_pidns = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                 reason="needs root and unshare (util-linux)")


def _criu() -> str | None:
    for path in ("/usr/local/sbin/criu", shutil.which("criu") or ""):
        if path and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture
def boxed(gpu):
    """A fake CUDA program as pid 1 of its own pid namespace (own /proc) with FAKE_CUDA_SCOPE."""
    p = gpu.spawn(gpu_index=0, mem=3 * GIB, scope="box-a", pid_namespace=True)
    p.wait_tick(0)
    yield p
    p.kill()


@needs_pidns
def test_scoped_key_is_scope_and_innermost_pid(gpu, boxed):
    host = boxed.pid
    assert boxed.status()["pid"] == 1                       # getpid() inside its namespace
    assert host not in (1, boxed.proc.pid)                  # the host pid: unshare's child
    assert nspid_of(host) == 1
    assert boxed.key == key_of(host) == scoped_key("box-a", 1) == "box-a.1"
    assert set(gpu.processes()) == {"box-a.1"}              # no entry under either pid
    assert gpu.state(host) == gpu.proc_entry("box-a.1")
    assert gpu.state(host)["state"] == RUNNING and gpu.state(host)["mem"] == 3 * GIB
    assert pid_of("box-a.1") == host
    assert pid_of("box-b.1") is None and pid_of("box-a.2") is None


@needs_pidns
def test_scoped_full_state_machine_by_host_pid(gpu, driver, boxed):
    pid = boxed.pid
    assert driver.get_state(pid) is ProcessState.RUNNING
    assert driver.restore_thread_id(pid) == pid
    driver.lock(pid, timeout_ms=5000)
    assert gpu.proc_entry("box-a.1")["state"] == LOCKED
    assert stalled(boxed), "ticks went on while LOCKED"
    driver.checkpoint(pid)
    assert driver.get_state(pid) is ProcessState.CHECKPOINTED
    driver.restore(pid, {GPU0: GPU1})
    st = gpu.proc_entry("box-a.1")
    assert st["state"] == LOCKED and st["gpu"] == GPU1 and st["restored_pairs"] == [(GPU0, GPU1)]
    assert stalled(boxed, settle=0), "ticks went on while LOCKED after restore"
    before = boxed.tick()
    driver.unlock(pid)
    assert boxed.wait_tick(before + 2) > before + 2
    assert set(gpu.processes()) == {"box-a.1"}
    assert {c.pid for c in gpu.calls()} == {pid}            # calls.log has the host pid
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        driver.get_state(1)                                  # its inner pid means nothing here


@needs_pidns
def test_nvml_lists_scoped_program_under_host_pid(gpu, nvml, driver, boxed):
    pid = boxed.pid
    h0, h1 = nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlDeviceGetHandleByIndex(1)
    assert _pids(nvml, 0) == {pid: 3 * GIB} and _pids(nvml, 1) == {}
    assert nvml.nvmlDeviceGetMemoryInfo(h0).used == 3 * GIB
    driver.lock(pid, 1000)
    driver.checkpoint(pid)
    assert _pids(nvml, 0) == {} and nvml.nvmlDeviceGetMemoryInfo(h0).used == 0
    driver.restore(pid, {GPU0: GPU1})
    assert _pids(nvml, 0) == {} and _pids(nvml, 1) == {pid: 3 * GIB}
    driver.unlock(pid)
    boxed.kill()
    assert gpu.proc_entry("box-a.1") is not None            # the file stays; the process does not
    assert _pids(nvml, 1) == {} and nvml.nvmlDeviceGetMemoryInfo(h1).used == 0
    assert pid_of("box-a.1") is None
    with pytest.raises(DriverError, match="CUDA_ERROR_INVALID_VALUE"):
        driver.lock(pid, 100)


@needs_pidns
def test_scoped_and_unscoped_programs_side_by_side(gpu, driver, nvml):
    with gpu.spawn(scope="box-a", pid_namespace=True, mem=GIB) as a, \
            gpu.spawn(scope="box-b", pid_namespace=True, mem=2 * GIB) as b, \
            gpu.spawn(mem=4 * GIB) as plain:
        assert a.status()["pid"] == b.status()["pid"] == 1   # same inner pid, other scopes
        assert set(gpu.processes()) == {"box-a.1", "box-b.1", plain.pid}
        assert plain.key == str(plain.pid) and gpu.state(plain.pid)["mem"] == 4 * GIB
        assert _pids(nvml, 0) == {a.pid: GIB, b.pid: 2 * GIB, plain.pid: 4 * GIB}

        gpu.fail("lock", "CUDA_ERROR_UNKNOWN", pid=b.pid)    # faults go by the host pid
        driver.lock(a.pid, 1000)
        with pytest.raises(DriverError, match="CUDA_ERROR_UNKNOWN"):
            driver.lock(b.pid, 1000)
        driver.lock(plain.pid, 1000)
        assert [gpu.proc_entry(k)["state"] for k in ("box-a.1", "box-b.1", str(plain.pid))] \
            == [LOCKED, RUNNING, LOCKED]
        assert stalled(a) and not stalled(b, settle=0)
        gpu.clear_faults()
        for prog in (a, plain):
            driver.checkpoint(prog.pid)
            driver.restore(prog.pid)
            driver.unlock(prog.pid)
        assert driver.get_state(a.pid) is driver.get_state(plain.pid) is ProcessState.RUNNING
        assert [c.pid for c in gpu.calls() if c.call == "lock"] == [a.pid, b.pid, plain.pid]


@needs_pidns
def test_restore_counts_scoped_memory(gpu, driver):
    """Memory accounting (restore's room check) sees a scoped program through its host pid."""
    with gpu.spawn(gpu_index=2, scope="box-a", pid_namespace=True, mem=GIB // 2) as boxed, \
            gpu.spawn(gpu_index=0, mem=GIB // 2 + 1) as plain:
        driver.lock(plain.pid, 1000)
        driver.checkpoint(plain.pid)
        with pytest.raises(DriverError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            driver.restore(plain.pid, {GPU0: SMALL})        # SMALL has 1 GiB, half of it used
        boxed.kill()
        driver.restore(plain.pid, {GPU0: SMALL})            # its memory went with it
        assert gpu.state(plain.pid)["gpu"] == SMALL


def test_scope_without_a_pid_namespace_and_invalid_scopes(gpu, driver):
    with gpu.spawn(scope="solo.x-1_") as solo, \
            gpu.spawn(env={"FAKE_CUDA_SCOPE": ".hidden"}) as bad:
        assert solo.key == f"solo.x-1_.{solo.pid}"           # nspid = pid in the root namespace
        assert bad.key == str(bad.pid)                       # an invalid scope is ignored
        assert set(gpu.processes()) == {solo.key, bad.pid}
        driver.lock(solo.pid, 1000)
        assert gpu.state(solo.pid)["state"] == LOCKED
        driver.unlock(solo.pid)
    for scope in ("", ".x", "a/b", "a b", "x" * 129, "é"):
        with pytest.raises(ValueError):
            check_scope(scope)
    with pytest.raises(ValueError):
        gpu.spawn(scope="a/b")
    assert gpu.proc_entry("../gpus") is None and gpu.proc_entry(".x.1") is None


def test_container_workload(gpu, tmp_path):
    status = tmp_path / "out" / "ctr.status.json"
    argv, env, mounts = gpu.container_workload("ctr-1", gpu_index=1, mem=GIB, status_file=status)
    assert argv[:3] == [SYSTEM_PYTHON, "-I", str(PROGRAM)]
    assert argv[argv.index("--gpu") + 1] == "1" and argv[argv.index("--mem") + 1] == str(GIB)
    assert argv[argv.index("--status") + 1] == str(status)
    assert argv[argv.index("--lib") + 1] == gpu.libcuda
    assert env == {"FAKE_CUDA_SCOPE": "ctr-1", "FAKE_CUDA_STATE_DIR": str(gpu.state_dir),
                   "TORPOR_LIBCUDA": gpu.libcuda, "LD_LIBRARY_PATH": str(gpu.build_dir)}
    assert mounts == [(str(gpu.state_dir), str(gpu.state_dir), False),
                      (str(gpu.build_dir), str(gpu.build_dir), True),
                      (str(PROGRAM), str(PROGRAM), True),
                      (str(status.parent), str(status.parent), False)]
    assert status.parent.is_dir()
    _, _, inside = gpu.container_workload("ctr-1")           # status in the state dir: no 4th
    assert len(inside) == 3
    with pytest.raises(ValueError):
        gpu.container_workload("no/slash")


@needs_pidns
@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"needs {SYSTEM_PYTHON}")
def test_container_workload_runs_with_only_its_env(gpu, driver, tmp_path):
    """argv + env alone (system python, no venv, nothing inherited) make a working scoped program
    (a pid namespace and /proc of its own standing in for the container)."""
    status = tmp_path / "out" / "ctr.status.json"
    argv, env, _ = gpu.container_workload("ctr-1", gpu_index=1, mem=GIB, status_file=status)
    log = open(tmp_path / "ctr.log", "wb")
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--",
                             *argv], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not status.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert status.exists(), (tmp_path / "ctr.log").read_text()
        key = scoped_key("ctr-1", 1)
        host = pid_of(key)
        assert host and host != proc.pid and key_of(host) == key
        assert gpu.proc_entry(key)["gpu"] == GPU1
        driver.lock(host, 1000)
        assert gpu.proc_entry(key)["state"] == LOCKED
        driver.unlock(host)
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


@needs_pidns
@pytest.mark.skipif(os.geteuid() != 0 or _criu() is None, reason="needs root and CRIU")
def test_scoped_key_survives_criu_restore(gpu, driver, nvml, tmp_path):
    """A CRIU restore of the pid namespace gives the program another host pid (in a new
    namespace); its inner pid, environment and so its key stay: the host goes on with the new
    pid."""
    prog = gpu.spawn(scope="box-c", pid_namespace=True, mount_proc=False, mem=2 * GIB)
    old, restored = prog.pid, None
    try:
        driver.lock(old, 1000)
        driver.checkpoint(old)
        images = tmp_path / "img"
        images.mkdir()
        r = subprocess.run([_criu(), "dump", "-t", str(old), "-D", str(images), "-o", "dump.log"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (images / "dump.log").read_text()[-3000:]
        prog.proc.wait(10)                                   # unshare ends with its child
        r = subprocess.run([_criu(), "restore", "-d", "-D", str(images), "-o", "restore.log",
                            "--pidfile", str(tmp_path / "pid")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (images / "restore.log").read_text()[-3000:]
        restored = int((tmp_path / "pid").read_text())
        assert restored != old          # (its pid namespace is new; the inode number may recur)
        assert nspid_of(restored) == 1 and key_of(restored) == "box-c.1"
        assert pid_of("box-c.1") == restored
        assert driver.get_state(restored) is ProcessState.CHECKPOINTED
        driver.restore(restored, {GPU0: GPU1})
        assert gpu.proc_entry("box-c.1")["gpu"] == GPU1
        assert _pids(nvml, 1) == {restored: 2 * GIB}, (gpu.state_dir / "proc" / "box-c.1").read_text()
        before = prog.tick()
        driver.unlock(restored)
        assert prog.wait_tick(before + 2) > before + 2     # the restored one ticks on
        assert [(c.call, c.pid) for c in gpu.calls() if c.call != "get_state"] == [
            ("lock", old), ("checkpoint", old), ("restore", restored), ("unlock", restored)]
    finally:
        prog.kill()
        if restored:
            try:
                os.kill(restored, 9)
            except ProcessLookupError:
                pass


# -- the calls of a program and of torpor's agent: data, VMM, streams, faults ---------------------

MIB = 1 << 20
INVALID_VALUE, OUT_OF_MEMORY, NOT_SUPPORTED, NOT_FOUND, INVALID_HANDLE = 1, 2, 801, 500, 400


class Probe(ProbeProcess):
    """agent_probe.py over the fake driver, without the agent."""

    def __init__(self, gpu: FakeGpu):
        super().__init__(gpu.libcuda, {**os.environ, **gpu.env()})

    def result(self, cid: str, timeout: float = 30.0) -> dict:
        return super().result(cid, timeout)


@pytest.fixture
def program(gpu):
    """A CUDA program on GPU0 (141 GiB), its context made."""
    p = Probe(gpu)
    assert p.rc("init") == 0
    yield p
    p.close()


def mem(gpu, p) -> int:
    return gpu.state(p.pid)["mem"]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_device_memory_keeps_what_is_written(gpu, program):
    p, n = program, 5 * MIB + 3
    a = p.call(f"alloc {n} dlsym")["ptr"]
    b = p.call(f"alloc {MIB} dlsym")["ptr"]
    assert p.call(f"check {a} {n} -1")["ok"]                   # new memory reads zeros
    assert p.rc(f"fill {a} {n} 7") == p.rc(f"fill {b} {MIB} 8") == 0
    assert p.call(f"check {a} {n} 7")["ok"] and p.call(f"check {b} {MIB} 8")["ok"]
    doc = p.call(f"check {a} {MIB} 8")
    assert (doc["rc"], doc["ok"], doc["bad"]) == (0, False, 0)
    assert p.rc(f"fill {a + MIB} 100 9") == 0                  # only those bytes change
    doc = p.call(f"check {a} {n} 7")
    assert doc["ok"] is False and MIB <= doc["bad"] < MIB + 100
    assert p.call(f"check {a + MIB} 100 9")["ok"] and p.call(f"check {b} {MIB} 8")["ok"]

    # the range must lie in one live allocation: the driver's CUDA_ERROR_INVALID_VALUE
    assert p.rc(f"htod {a} {n + 1} dlsym") == INVALID_VALUE
    assert p.rc(f"fill {a + n - 3} 3 1") == 0 and p.rc(f"fill {a + n - 3} 4 1") == INVALID_VALUE
    assert p.rc(f"dtoh {a - 1} 2 dlsym") == INVALID_VALUE
    doc = p.call(f"range {a + 12345}")
    assert [doc[k] for k in ("rc", "base", "size", "attr_base", "attr_size")] == [0, a, n, a, n]
    assert p.rc(f"free {b} dlsym") == 0
    assert p.rc(f"check {b} 16 8") == INVALID_VALUE            # freed
    doc = p.call(f"range {b}")
    assert (doc["rc"], doc["failed"]) == (NOT_FOUND, "cuMemGetAddressRange")
    assert mem(gpu, p) == n


def test_huge_allocations_cost_only_what_is_written(gpu, program):
    p = program
    big = p.call(f"alloc {100 * GIB} dlsym")
    assert big["rc"] == 0 and mem(gpu, p) == 100 * GIB
    at = big["ptr"] + 99 * GIB
    assert p.rc(f"fill {at} {MIB} 5") == 0 and p.call(f"check {at} {MIB} 5")["ok"]
    assert rss(p.pid) < 512 * MIB
    assert p.rc(f"alloc {41 * GIB + 1} dlsym") == OUT_OF_MEMORY  # 141 GiB on GPU0
    assert mem(gpu, p) == 100 * GIB
    assert p.rc(f"free {big['ptr']} dlsym") == 0 and mem(gpu, p) == 0


def test_vmm_unmap_and_remap_keep_the_data(gpu, program):
    p = program
    v = p.call(f"vmm {3 * MIB}")                               # rounded up to the granularity
    assert v["rc"] == 0 and v["size"] == 4 * MIB and mem(gpu, p) == 4 * MIB
    ptr, handle, size = v["ptr"], v["handle"], v["size"]
    assert ptr % (2 * MIB) == 0
    assert p.call(f"check {ptr} {size} -1")["ok"]              # a new handle starts zeroed
    assert p.rc(f"fill {ptr} {size} 11") == 0 and p.call(f"check {ptr} {size} 11")["ok"]
    assert p.call(f"range {ptr + 5}")["base"] == ptr and p.call(f"range {ptr}")["size"] == size

    # unmapped: the addresses stay reserved, hold nothing; the handle keeps memory and data
    assert p.rc(f"unmap {ptr} {size}") == 0
    assert p.rc(f"check {ptr} 16 11") == INVALID_VALUE and p.rc(f"range {ptr}") == NOT_FOUND
    assert mem(gpu, p) == 4 * MIB
    # mapped again at the same address: no access before cuMemSetAccess, then the same data
    assert p.rc(f"map {ptr} {size} {handle}") == 0
    assert p.rc(f"check {ptr} 16 11") == p.rc(f"fill {ptr} 16 11") == INVALID_VALUE
    assert p.rc(f"access {ptr} {size}") == 0
    assert p.call(f"check {ptr} {size} 11")["ok"]

    # another reservation: a second handle reads zeros; the first one mapped there too shows
    # (and shares) its data
    r = p.call(f"reserve {size}")["ptr"]
    h2 = p.call(f"create {size}")["handle"]
    assert mem(gpu, p) == 8 * MIB
    assert p.rc(f"map {r} {size} {h2}") == p.rc(f"access {r} {size}") == 0
    assert p.call(f"check {r} {size} -1")["ok"]
    assert p.rc(f"unmap {r} {size}") == p.rc(f"release {h2}") == 0
    assert mem(gpu, p) == 4 * MIB
    assert p.rc(f"map {r} {size} {handle}") == p.rc(f"access {r} {size}") == 0
    assert p.call(f"check {r} {size} 11")["ok"]
    assert p.rc(f"fill {r} 100 12") == 0 and p.call(f"check {ptr} 100 12")["ok"]
    assert p.rc(f"unmap {r} {size}") == p.rc(f"addrfree {r} {size}") == 0
    assert p.rc(f"vmmfree {ptr} {handle} {size}") == 0 and mem(gpu, p) == 0


def test_va_phase_places_reservations_where_a_test_says(gpu, program):
    """va_phase: the first reservation `offset` past a 1 GiB boundary, each later one right
    below the one before; a malformed offset is refused; without it, mmap() decides."""
    p = program
    gpu.va_phase(26 * MIB)
    first = p.call(f"reserve {12 * MIB}")["ptr"]
    assert first % GIB == 26 * MIB
    assert p.call(f"reserve {4 * MIB}")["ptr"] == first - 4 * MIB
    assert p.call(f"reserve {6 * MIB}")["ptr"] == first - 10 * MIB
    for bad in (MIB, GIB, -2 * MIB):                 # not granular, out of the span
        gpu.va_phase(bad)
        assert p.rc(f"reserve {2 * MIB}") == INVALID_VALUE
    gpu.va_phase(None)
    assert p.rc(f"reserve {2 * MIB}") == 0


def test_vmm_mappings_side_by_side_are_one_range_for_copies(gpu, program):
    p = program
    r = p.call(f"reserve {6 * MIB}")["ptr"]
    h = [p.call(f"create {2 * MIB}")["handle"] for _ in range(3)]
    for i in range(2):
        assert p.rc(f"map {r + 2 * i * MIB} {2 * MIB} {h[i]}") == 0
    assert p.rc(f"access {r} {4 * MIB}") == 0                  # both at once
    assert p.rc(f"fill {r + MIB} {2 * MIB} 3") == 0            # across the seam
    assert p.call(f"check {r + MIB} {2 * MIB} 3")["ok"]
    assert p.rc(f"fill {r + 3 * MIB} {2 * MIB} 3") == INVALID_VALUE   # into the unmapped third
    assert p.rc(f"map {r + 4 * MIB} {2 * MIB} {h[2]}") == 0
    assert p.rc(f"fill {r + 3 * MIB} {2 * MIB} 3") == INVALID_VALUE   # mapped, no access yet
    # whole mappings only: a part, or a range beyond them, is refused
    assert p.rc(f"unmap {r} {MIB}") == p.rc(f"access {r + 2 * MIB} {4 * MIB + 4096}") \
        == INVALID_VALUE
    assert p.rc(f"map {r + 2 * MIB} {2 * MIB} {h[2]}") == INVALID_VALUE  # already mapped
    assert p.rc(f"unmap {r} {6 * MIB}") == 0                   # three mappings at once
    assert [p.rc(f"release {x}") for x in h] == [0, 0, 0]
    assert p.rc(f"addrfree {r} {6 * MIB}") == 0 and mem(gpu, p) == 0


def test_vmm_memory_goes_when_released_and_unmapped(gpu, program):
    p = program
    total = p.call("meminfo")["total"]
    assert total == 141 * GIB and p.call("meminfo")["free"] == total
    h = p.call(f"create {2 * MIB}")["handle"]
    r = p.call(f"reserve {2 * MIB}")["ptr"]
    assert p.rc(f"map {r} {2 * MIB} {h}") == p.rc(f"access {r} {2 * MIB}") == 0
    assert mem(gpu, p) == 2 * MIB and p.call("meminfo")["free"] == total - 2 * MIB
    assert p.call(f"retain {r + 4096}")["handle"] == h         # any address of the mapping
    assert p.rc(f"release {h}") == p.rc(f"release {h}") == 0   # both references
    assert p.rc(f"release {h}") == INVALID_VALUE               # none left
    assert mem(gpu, p) == 2 * MIB                               # ... but still mapped
    assert p.call(f"check {r} 16 -1")["ok"]
    assert p.rc(f"addrfree {r} {2 * MIB}") == INVALID_VALUE    # a mapping is in there
    assert p.rc(f"unmap {r} {2 * MIB}") == 0
    assert mem(gpu, p) == 0 and p.call("meminfo")["free"] == total
    assert p.rc(f"map {r} {2 * MIB} {h}") == INVALID_VALUE      # the handle is gone
    assert p.rc(f"addrfree {r} {2 * MIB}") == 0
    assert p.rc(f"addrfree {r} {2 * MIB}") == INVALID_VALUE
    # the granularity: sizes and addresses are multiples of 2 MiB
    assert p.rc(f"create {MIB}") == p.rc(f"reserve {3 * MIB}") == INVALID_VALUE
    r = p.call(f"reserve {4 * MIB}")["ptr"]
    h = p.call(f"create {2 * MIB}")["handle"]
    assert p.rc(f"map {r + 4096} {2 * MIB} {h}") == INVALID_VALUE
    assert p.rc(f"map {r} {4 * MIB} {h}") == INVALID_VALUE      # larger than the handle
    assert p.rc(f"map {r + 2 * MIB} {4 * MIB} {h}") == INVALID_VALUE   # past the reservation
    assert p.rc(f"release {h}") == p.rc(f"addrfree {r} {4 * MIB}") == 0


def test_vmm_and_allocations_share_the_gpu_with_other_processes(gpu, program):
    p = program
    with gpu.spawn(gpu_index=0, mem=40 * GIB) as other:
        other.wait_tick(0)
        big = p.call(f"alloc {100 * GIB} dlsym")
        assert big["rc"] == 0 and p.call("meminfo")["free"] == GIB
        doc = p.call(f"vmm {2 * GIB}")
        assert (doc["rc"], doc["failed"]) == (OUT_OF_MEMORY, "cuMemCreate")
        assert mem(gpu, p) == 100 * GIB
        assert p.rc(f"free {big['ptr']} dlsym") == 0
        v = p.call(f"vmm {2 * GIB}")
        assert v["rc"] == 0 and mem(gpu, p) == 2 * GIB
        assert p.call("meminfo")["free"] == 99 * GIB
        assert p.rc(f"vmmfree {v['ptr']} {v['handle']} {v['size']}") == 0
    assert p.call("meminfo")["free"] == 141 * GIB               # the other one is gone


def test_streams_events_and_pinned_memory_move_the_data(gpu, program):
    p = program
    a = p.call(f"alloc {40 * MIB} dlsym")["ptr"]
    v = p.call(f"vmm {2 * MIB}")
    for door in ("dlsym", "proc", "proc_v2"):
        doc = p.call(f"@streamcopy {a + 1} {40 * MIB - 1} 21 {door}")
        assert (doc["rc"], doc["ok"]) == (0, True)
        assert p.call(f"check {a + 1} {40 * MIB - 1} 21 {door}")["ok"]
        assert p.call(f"@streamcopy {v['ptr']} {2 * MIB} 22 {door}")["ok"]
    assert p.call(f"@streamcopy {a} {40 * MIB + 1} 21")["failed"] == "cuMemcpyHtoDAsync"


_SEMANTICS = r"""
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1])
V, U, S, I, P = ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_int, ctypes.byref
out = {}
def cu(name, *args):
    return getattr(lib, name)(*args)
cur, dev, ctx, prim = V(), I(-1), V(), V()
assert cu("cuInit", 0) == 0
out["before"] = [cu("cuCtxGetCurrent", P(cur)), cur.value, cu("cuCtxGetDevice", P(dev))]
assert cu("cuDevicePrimaryCtxRetain", P(prim), 1) == 0
out["primary"] = [cu("cuCtxGetCurrent", P(cur)), cur.value]
assert cu("cuCtxCreate_v2", P(ctx), 0, 0) == 0
out["created"] = [cu("cuCtxGetCurrent", P(cur)), cur.value == ctx.value,
                  cu("cuCtxGetDevice", P(dev)), dev.value]
out["set"] = [cu("cuCtxSetCurrent", prim), cu("cuCtxGetDevice", P(dev)), dev.value,
              cu("cuCtxPopCurrent_v2", P(cur)), cur.value == prim.value,
              cu("cuCtxGetCurrent", P(cur)), cur.value, cu("cuCtxSetCurrent", None),
              cu("cuCtxPushCurrent_v2", ctx), cu("cuCtxPushCurrent_v2", prim),
              cu("cuCtxSetCurrent", None), cu("cuCtxGetCurrent", P(cur)), cur.value == ctx.value,
              cu("cuCtxSetCurrent", V(0x1234))]

buf = ctypes.create_string_buffer(8192)
addr = ctypes.addressof(buf)
out["register"] = [cu("cuMemHostRegister_v2", buf, S(8192), 0),
                   cu("cuMemHostRegister_v2", V(addr + 4096), S(8192), 0),
                   cu("cuMemHostUnregister", V(addr + 1)), cu("cuMemHostUnregister", buf),
                   cu("cuMemHostUnregister", buf), cu("cuMemHostRegister_v2", buf, S(8192), 16)]
host = V()
assert cu("cuMemHostAlloc", P(host), S(10000), 0) == 0
mtype = ctypes.c_uint()
out["hostalloc"] = [host.value % 4096, ctypes.string_at(host, 10000) == bytes(10000),
                    cu("cuMemHostRegister_v2", host, S(100), 0),
                    cu("cuPointerGetAttribute", P(mtype), 2, U(host.value)), mtype.value,
                    cu("cuMemFreeHost", host), cu("cuMemFreeHost", host),
                    cu("cuMemHostAlloc", P(host), S(100), 8)]

stream, event, dptr = V(), V(), U()
assert cu("cuMemAlloc_v2", P(dptr), S(4096)) == 0
out["stream"] = [cu("cuStreamCreate", P(stream), 2), cu("cuStreamCreate", P(stream), 1),
                 cu("cuStreamSynchronize", stream), cu("cuStreamQuery", stream),
                 cu("cuEventCreate", P(event), 0), cu("cuEventRecord", event, stream),
                 cu("cuEventQuery", event), cu("cuEventSynchronize", event),
                 cu("cuStreamDestroy_v2", stream), cu("cuStreamDestroy_v2", stream),
                 cu("cuStreamSynchronize", stream), cu("cuEventRecord", event, stream),
                 cu("cuMemcpyHtoDAsync_v2", dptr, buf, S(16), stream),
                 cu("cuMemcpyHtoDAsync_v2", dptr, buf, S(16), V(2)),
                 cu("cuEventDestroy_v2", event), cu("cuEventSynchronize", event),
                 [cu("cuStreamSynchronize", V(s)) for s in (None, 1, 2)]]
base, size = U(), S()
out["pointer"] = [cu("cuPointerGetAttribute", P(mtype), 2, dptr), mtype.value,
                  cu("cuPointerGetAttribute", P(base), 1, dptr),
                  cu("cuPointerGetAttribute", P(base), 11, U(dptr.value + 4096)),
                  cu("cuMemGetAddressRange_v2", None, P(size), U(dptr.value + 4095)), size.value]
print(json.dumps(out))
"""


def test_contexts_host_memory_streams_and_events_follow_the_driver(gpu):
    r = subprocess.run([sys.executable, "-c", _SEMANTICS, gpu.libcuda], capture_output=True,
                       text=True, env={**os.environ, **gpu.env()}, timeout=30)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["before"] == [0, None, 201]                      # no context: none current
    assert out["primary"] == [0, None]                          # retaining makes none current
    assert out["created"] == [0, True, 0, 0]                    # creating does
    assert out["set"] == [0, 0, 1, 0, True, 0, None, 0, 0, 0, 0, 0, True, 201]
    assert out["register"] == [0, 712, 713, 0, 713, INVALID_VALUE]
    assert out["hostalloc"] == [0, True, 712, 0, 1, 0, INVALID_VALUE, INVALID_VALUE]
    assert out["stream"] == [INVALID_VALUE, 0, 0, 0, 0, 0, 0, 0, 0, INVALID_HANDLE,
                             INVALID_HANDLE, INVALID_HANDLE, INVALID_HANDLE, 0, 0,
                             INVALID_HANDLE, [0, 0, 0]]
    assert out["pointer"] == [0, 2, NOT_SUPPORTED, INVALID_VALUE, 0, 4096]


def test_get_proc_address_gives_the_new_calls_by_their_base_names(program):
    p = program
    for base, exported in {
            "cuMemcpyDtoHAsync": "cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync": "cuMemcpyHtoDAsync_v2",
            "cuStreamCreate": "cuStreamCreate", "cuStreamDestroy": "cuStreamDestroy_v2",
            "cuStreamQuery": "cuStreamQuery", "cuEventCreate": "cuEventCreate",
            "cuEventRecord": "cuEventRecord", "cuEventQuery": "cuEventQuery",
            "cuEventSynchronize": "cuEventSynchronize", "cuEventDestroy": "cuEventDestroy_v2",
            "cuMemHostAlloc": "cuMemHostAlloc", "cuMemFreeHost": "cuMemFreeHost",
            "cuMemHostRegister": "cuMemHostRegister_v2",
            "cuMemHostUnregister": "cuMemHostUnregister", "cuCtxGetDevice": "cuCtxGetDevice",
            "cuCtxGetCurrent": "cuCtxGetCurrent", "cuCtxSetCurrent": "cuCtxSetCurrent",
            "cuMemGetInfo": "cuMemGetInfo_v2", "cuMemGetAddressRange": "cuMemGetAddressRange_v2",
            "cuPointerGetAttribute": "cuPointerGetAttribute",
            "cuMemGetAllocationGranularity": "cuMemGetAllocationGranularity",
            "cuMemAddressReserve": "cuMemAddressReserve", "cuMemAddressFree": "cuMemAddressFree",
            "cuMemCreate": "cuMemCreate", "cuMemRelease": "cuMemRelease", "cuMemMap": "cuMemMap",
            "cuMemUnmap": "cuMemUnmap", "cuMemSetAccess": "cuMemSetAccess",
            "cuMemGetAllocationPropertiesFromHandle": "cuMemGetAllocationPropertiesFromHandle",
            "cuMemRetainAllocationHandle": "cuMemRetainAllocationHandle"}.items():
        fn = p.call(f"addr {exported} dlsym")["fn"]
        assert fn is not None and p.call(f"addr {base} proc")["fn"] == fn, base
    v = p.call(f"vmm {2 * MIB} proc_v2")
    assert v["rc"] == 0 and p.rc(f"fill {v['ptr']} 64 1 proc") == 0
    assert p.rc(f"vmmfree {v['ptr']} {v['handle']} {v['size']} proc") == 0


def test_fail_files_fail_the_programs_calls_and_count_down(gpu, driver, program):
    p = program
    fail = gpu.state_dir / "fail"
    a = p.call("alloc 4096 dlsym")["ptr"]
    assert p.rc(f"fill {a} 16 3") == 0

    (fail / "cuMemcpyHtoD_v2").write_text("999 after=2\n")      # 2 go through, then all fail
    assert [p.rc(f"fill {a} 16 4") for _ in range(4)] == [0, 0, 999, 999]
    assert (fail / "cuMemcpyHtoD_v2").read_text() == "999 after=0\n"
    (fail / "cuMemcpyHtoD_v2").write_text(f"2 {p.pid} after=1 times=2\n")
    assert [p.rc(f"fill {a} 16 3") for _ in range(5)] == [0, 2, 2, 0, 0]
    assert (fail / "cuMemcpyHtoD_v2").read_text() == f"2 {p.pid} after=0 times=0\n"
    (fail / "cuMemcpyHtoD_v2").write_text(f"2 {p.pid + 1}\n")      # another pid's
    assert p.rc(f"fill {a} 16 3") == 0
    (fail / "cuMemcpyHtoD_v2").write_text(f"700 {p.pid}\n")        # ours, every call
    assert p.rc(f"fill {a} 16 5") == p.rc(f"fill {a} 16 5") == 700
    (fail / "cuMemcpyHtoD_v2").unlink()
    assert p.call(f"check {a} 16 3")["ok"]                      # a failed call did nothing

    (fail / "cuMemcpyDtoH_v2").write_text("999 times=1\n")
    assert [p.rc(f"check {a} 16 3") for _ in range(2)] == [999, 0]
    (fail / "cuMemCreate").write_text("2\n")
    doc = p.call(f"vmm {2 * MIB}")
    assert (doc["rc"], doc["failed"]) == (2, "cuMemCreate") and mem(gpu, p) == 4096
    (fail / "cuMemCreate").unlink()
    (fail / "cuMemSetAccess").write_text("999 after=1\n")
    v = p.call(f"vmm {2 * MIB}")
    assert v["rc"] == 0
    doc = p.call(f"vmm {2 * MIB}")                              # undone after the failure
    assert (doc["rc"], doc["failed"]) == (999, "cuMemSetAccess") and mem(gpu, p) == 4096 + 2 * MIB
    (fail / "cuMemSetAccess").unlink()
    (fail / "cuMemAlloc_v2").write_text("2 after=1\n")
    assert [p.rc(f"alloc 4096 {d}") for d in ("dlsym", "proc")] == [0, 2]
    (fail / "cuMemAlloc_v2").unlink()

    (fail / "get_state").write_text("999 after=1\n")           # the checkpoint API too
    assert driver.get_state(p.pid) is ProcessState.RUNNING
    with pytest.raises(DriverError, match="CUDA_ERROR_UNKNOWN"):
        driver.get_state(p.pid)


def test_the_programs_calls_block_while_locked_and_take_delays(gpu, driver, program):
    p = program
    a = p.call(f"alloc {8 * MIB} dlsym")["ptr"]
    v, w = p.call(f"vmm {4 * MIB}"), p.call(f"vmm {2 * MIB}")
    driver.lock(p.pid, 1000)
    driver.checkpoint(p.pid)
    held = [p.send(cmd) for cmd in (
        f"fill {a} 4096 1", f"check {v['ptr']} 4096 -1", "meminfo", f"range {a}",
        f"@streamcopy {a + 4 * MIB} {MIB} 2", f"vmm {2 * MIB}", f"unmap {w['ptr']} {w['size']}",
        "alloc 4096 proc", f"create {2 * MIB}", f"reserve {2 * MIB}")]
    time.sleep(0.5)
    assert not any(p.done(cid) for cid in held)
    driver.restore(p.pid)
    time.sleep(0.2)
    assert not any(p.done(cid) for cid in held)                # LOCKED holds them still
    t_unlock = time.monotonic()
    driver.unlock(p.pid)
    for cid in held:
        doc = p.result(cid)
        assert doc["rc"] == 0 and doc["t1"] >= t_unlock, doc
    assert p.call(f"check {a} 4096 1")["ok"]

    (gpu.state_dir / "delay" / "cuMemCreate").write_text("300\n")
    doc = p.call(f"vmm {2 * MIB}")
    assert doc["rc"] == 0 and doc["t1"] - doc["t0"] >= 0.3
