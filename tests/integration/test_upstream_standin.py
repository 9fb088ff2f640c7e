"""bench/upstream/cuda-checkpoint.c, the stand-in for NVIDIA's cuda-checkpoint that the upstream
leg of the benchmarks gives CRIU's cuda plugin: the plugin's command line (-h mentions
--action, --get-state prints the state names it parses, --get-restore-tid a number), one
driver call per action, bad usage exit 2 with one line. Against the fake driver."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.fakes.fakegpu import FakeGpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("upstream")
    r = subprocess.run(["make", "-s", "-C", str(ROOT / "bench" / "upstream"), f"BUILD={build}",
                        f"CALL_LOG={build / 'calls.log'}"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.fail(f"the stand-in does not build:\n{r.stderr}")
    return build / "cuda-checkpoint"


@pytest.fixture
def gpu(tmp_path: Path):
    with FakeGpu(tmp_path / "fakegpu") as g:
        yield g


def cc(standin: Path, gpu: FakeGpu, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(standin), *args], env={**os.environ, **gpu.env()},
                          capture_output=True, text=True, timeout=60)


def test_help_names_the_action_flag_the_plugin_looks_for(standin: Path) -> None:
    r = subprocess.run([str(standin), "-h"], capture_output=True, text=True)
    assert r.returncode == 0 and "--action" in r.stdout and "stand-in" in r.stdout


def test_the_plugins_sequence_drives_the_driver_one_call_each(standin: Path, gpu: FakeGpu) -> None:
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    pid = str(prog.pid)

    def state() -> str:
        r = cc(standin, gpu, "--get-state", "--pid", pid)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert state() == "running"
    assert cc(standin, gpu, "--action", "lock", "--pid", pid, "--timeout", "5000").returncode == 0
    assert state() == "locked"
    assert cc(standin, gpu, "--action", "checkpoint", "--pid", pid).returncode == 0
    assert state() == "checkpointed"
    tid = cc(standin, gpu, "--get-restore-tid", "--pid", pid)
    assert tid.returncode == 0 and int(tid.stdout) > 0
    # restore onto the other GPU: the pair reaches the driver
    old, new = gpu.uuid(0), gpu.uuid(1)
    r = cc(standin, gpu, "--action", "restore", "--pid", pid, "--device-map", f"{old}={new}")
    assert r.returncode == 0, r.stderr
    assert gpu.state(prog.pid)["gpu"] == new
    assert cc(standin, gpu, "--action", "unlock", "--pid", pid).returncode == 0
    assert state() == "running"
    prog.wait_tick(prog.tick())
    names = [c.call for c in gpu.calls() if c.pid == prog.pid and c.name == "CUDA_SUCCESS"]
    assert names == ["get_state", "lock", "get_state", "checkpoint", "get_state", "restore_tid",
                     "restore", "unlock", "get_state"]


def test_a_driver_refusal_is_exit_1_with_the_drivers_error(standin: Path, gpu: FakeGpu) -> None:
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    r = cc(standin, gpu, "--action", "unlock", "--pid", str(prog.pid))   # not locked
    assert r.returncode == 1 and "CUDA_ERROR_ILLEGAL_STATE" in r.stderr
    assert r.stderr.count("\n") == 1


@pytest.mark.parametrize("args", [
    ["--action", "freeze", "--pid", "1"], ["--get-state"], ["--get-state", "--pid", "x"],
    ["--action", "lock", "--pid", "1", "--timeout", "-3"],
    ["--action", "restore", "--pid", "1", "--device-map", "GPU-1=GPU-2"],
    ["--get-state", "--pid", "1", "extra"]])
def test_bad_usage_is_exit_2_with_one_line(standin: Path, gpu: FakeGpu, args: list[str]) -> None:
    r = cc(standin, gpu, *args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


PLUGIN = Path(os.environ.get("TORPOR_CRIU_UPSTREAM_PLUGIN_DIR", "/usr/local/lib/torpor/criu-upstream"))


@pytest.mark.skipif(os.geteuid() != 0 or not (PLUGIN / "cuda_plugin.so").exists(),
                    reason="needs root and CRIU's cuda plugin (packaging/criu/install-criu.sh builds "
                           "it with CRIU)")
def test_criu_with_its_cuda_plugin_and_the_standin_checkpoints_and_restores(
        standin: Path, gpu: FakeGpu, tmp_path: Path) -> None:
    """The upstream leg as the benchmark runs it, on the fake driver: CRIU loads its cuda plugin
    from its own directory (--libdir), the plugin runs the stand-in from PATH, the program is
    locked and checkpointed by the dump and restored and unlocked by the restore. CRIU_FAULT=138
    (the plugin's FI_PLUGIN_CUDA_FORCE_ENABLE) stands in for /proc/driver/nvidia/gpus."""
    from tests.integration.conftest import wait_for
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    env = {**os.environ, **gpu.env(), "CRIU_FAULT": "138",
           "PATH": f"{standin.parent}:{os.environ['PATH']}"}
    images = tmp_path / "images"
    images.mkdir()
    calls_log = standin.parent / "calls.log"       # the stand-in logs there once it exists
    calls_log.write_text("")
    criu = ["/usr/local/sbin/criu", "-D", str(images), "-v4", "--libdir", str(PLUGIN),
            "--shell-job"]
    r = subprocess.run([criu[0], "dump", "-t", str(prog.pid), *criu[1:], "-o", "dump.log"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (images / "dump.log").read_text()[-2000:]
    prog.proc.wait(timeout=10)
    assert gpu.state(prog.pid)["state"] == 2          # CHECKPOINTED in the image
    dump_log = (images / "dump.log").read_text()
    assert "cuda_plugin: Checkpointing CUDA devices" in dump_log
    r = subprocess.run([criu[0], "restore", "-d", *criu[1:], "-o", "restore.log"], env=env,
                       capture_output=True, text=True, timeout=120)
    try:
        assert r.returncode == 0, (images / "restore.log").read_text()[-2000:]
        assert gpu.state(prog.pid)["state"] == 0
        calls = [c.call for c in gpu.calls() if c.pid == prog.pid and c.name == "CUDA_SUCCESS"]
        assert [c for c in calls if c in ("lock", "checkpoint", "restore", "unlock")] == \
            ["lock", "checkpoint", "restore", "unlock"]
        logged = [line.split() for line in calls_log.read_text().splitlines()]
        assert [w for w, pid, rc in logged if pid == str(prog.pid) and rc == "0"
                and w in ("lock", "checkpoint", "restore", "unlock")] == \
            ["lock", "checkpoint", "restore", "unlock"]
        at = prog.tick()
        wait_for(lambda: prog.tick() > at + 2, what="the restored program to tick")
    finally:
        calls_log.unlink(missing_ok=True)
        try:
            os.kill(prog.pid, 9)
        except ProcessLookupError:
            pass
