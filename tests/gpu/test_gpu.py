"""The engine on a real H200: PyTorch programs checkpointed and restored, continuing bit-exact.

Each scenario runs a reference program (same seed, uninterrupted) beside the one torpor
interrupts, and compares their per-step loss and bulk-memory checksums line by line.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.gpu.compare_steps import compare
from tests.gpu.conftest import GPU_SKIP, gpu_uuid, nvml_pids, wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")]

GIB = 2.0


def _bit_exact(ref, prog, last: int) -> None:
    """Both runs reach step `last` (the reference then stops), and agree on every step."""
    ref.wait_done(last)
    prog.wait_step(last, timeout=300, pid=prog.status().get("pid", prog.pid))
    n, mismatch = compare(str(ref.steps), str(prog.steps))
    assert mismatch is None, f"diverged at {mismatch}"
    assert n >= last, f"only {n} common steps"


def test_checkpoint_restore_continues_bit_exact(torpor, programs, tmp_path):
    ref = programs("ref", GIB, max_steps=60)
    prog = programs("prog", GIB)
    prog.wait_ready()
    prog.wait_step(10)
    images = tmp_path / "ck"
    m = torpor.json("checkpoint", str(prog.pid), "-D", str(images), timeout=600)["manifest"]
    prog.proc.wait(timeout=30)
    (p,) = [p for p in m["processes"] if p["cuda"]]
    assert p["gpu_memory"] >= GIB * (1 << 30) and m["gpus"][0]["uuid"] == gpu_uuid()
    at = prog.step()
    r = torpor.json("restore", "-D", str(images), timeout=600)
    assert r["cuda_pids"] == [prog.pid]
    prog.wait_step(at + 20, pid=prog.pid)
    _bit_exact(ref, prog, 59)


def test_restore_with_device_map_onto_same_gpu_uuid(torpor, programs, tmp_path):
    ref = programs("ref", 1.0, max_steps=40)
    prog = programs("prog", 1.0)
    prog.wait_ready()
    prog.wait_step(5)
    torpor.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"), timeout=600)
    prog.proc.wait(timeout=30)
    u = gpu_uuid()
    r = torpor.json("restore", "-D", str(tmp_path / "ck"), "--device-map", f"{u}={u}", timeout=600)
    assert r["gpu_map"] == {u: u}  # passed to the driver as gpuPairs
    at = prog.step()
    prog.wait_step(at + 10, pid=prog.pid)
    _bit_exact(ref, prog, 39)


def test_suspend_releases_gpu_and_resume_continues(torpor, programs):
    ref = programs("ref", GIB, max_steps=50)
    prog = programs("prog", GIB)
    prog.wait_ready()
    prog.wait_step(5)
    r = torpor.json("suspend", str(prog.pid), timeout=600)
    assert r["gpu_memory_released"] >= GIB * (1 << 30)
    assert prog.pid not in nvml_pids()  # its GPU memory is gone from the GPU
    at = prog.step()
    time.sleep(1.0)
    assert prog.step() == at  # paused in its CUDA calls
    torpor.json("resume", str(prog.pid), timeout=600)
    prog.wait_step(at + 15)
    _bit_exact(ref, prog, 49)


@pytest.mark.parametrize("phase", ["checkpoint", "dump", "seal"])
def test_sigkill_of_torpor_mid_phase_recovers_program(torpor, programs, tmp_path, phase):
    """Killed before the dump: the program runs on. Killed mid-dump, CRIU outlives torpor
    (criu.run_criu) and its outcome decides: a finished dump (it ends the program) is sealed
    by the next torpor and the restore continues it, a failed one's program runs on. Killed
    in the seal: the next torpor seals the images and the restore continues the program."""
    ref = programs("ref", GIB, max_steps=50)
    prog = programs("prog", GIB)
    prog.wait_ready()
    prog.wait_step(5)
    journal = tmp_path / "state" / "journal"
    images = tmp_path / "ck"
    t = torpor.start("checkpoint", str(prog.pid), "-D", str(images))

    def in_phase():
        for f in journal.glob("*.json"):
            try:
                if f'"phase": "{phase}"' in f.read_text():
                    return True
            except OSError:
                pass
        return False
    wait_for(in_phase, 120, f"phase {phase}")
    time.sleep(0.2 if phase != "seal" else 0.0)
    t.kill()
    t.wait()
    ps = torpor.run("ps")
    assert ps.returncode == 0, ps.stderr
    sealed = "sealed the checkpoint" in ps.stderr or (images / "torpor.json").exists()
    if phase == "seal" or (phase == "dump" and sealed):
        assert sealed, ps.stderr
        prog.proc.wait(timeout=30)
        torpor.json("restore", "-D", str(images), timeout=600)
    else:
        assert "recovered" in ps.stderr, ps.stderr
    at = prog.step()
    prog.wait_step(at + 10, pid=prog.pid)
    _bit_exact(ref, prog, 49)


def test_dump_failure_on_full_disk_leaves_program_running(torpor, programs, tmp_path):
    ref = programs("ref", 1.0, max_steps=40)
    prog = programs("prog", 1.0)
    prog.wait_ready()
    prog.wait_step(5)
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)], check=True)
    try:
        proc = torpor.run("checkpoint", str(prog.pid), "-D", str(small / "ck"), timeout=600)
    finally:
        subprocess.run(["umount", "-l", str(small)])
    assert proc.returncode == 8 and "rolled back" in proc.stderr, proc.stderr
    at = prog.step()
    prog.wait_step(at + 10)
    _bit_exact(ref, prog, 39)


def test_demo_on_gpu(torpor):
    r = torpor.json("demo", "--mib", "1024", timeout=600)
    assert r["mode"] == "gpu" and r["checkpoint"]["gpu_memory"] >= 1 << 30


def test_sidecar_lock_checkpoint_and_rollback(torpor, programs, monkeypatch):
    """torpord over its real socket: a real program locked, checkpointed, rolled back."""
    from torpor import config
    from torpor.sidecar import client as sidecar_client
    from torpor.sidecar.client import Client, ensure_running

    monkeypatch.delenv("TORPOR_LIBCUDA", raising=False)
    cfg = config.load()
    ref = programs("ref", 1.0, max_steps=40)
    prog = programs("prog", 1.0)
    prog.wait_ready()
    prog.wait_step(5)
    ensure_running(cfg)
    try:
        with Client(cfg) as c:
            ck = c.lock_and_checkpoint(pids=[prog.pid])
            assert [p.pid for p in ck.cuda_processes] == [prog.pid]
            assert prog.pid not in nvml_pids()
            st = c.status(pids=[prog.pid]).processes[0]
            assert st.state == "CHECKPOINTED"
            c.rollback(ck.op_id)
            assert c.status(pids=[prog.pid]).processes[0].state == "RUNNING"
    finally:
        for daemon in sidecar_client._started:
            daemon.terminate()
            daemon.wait(timeout=30)
    at = prog.step()
    prog.wait_step(at + 10)
    _bit_exact(ref, prog, 39)
