"""podman GPU containers through torpor-runtime on a real GPU: PyTorch continues bit-exact.

Unchanged podman commands (`container checkpoint --export`, `container restore --import`) with
the runtime set to torpor-runtime (TORPOR_TEST_RUNTIME, default /usr/local/bin/torpor-runtime);
each container's steps are compared with an uninterrupted reference run of the same seed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from integration.containers import ContainerError, Podman
from integration.gpu import TorchContainer, gpu_mounts, nvidia_devices
from tests.gpu.compare_steps import compare
from tests.gpu.conftest import GPU_SKIP, gpu_uuid
from torpor import driver

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")]
RUNTIME = os.environ.get("TORPOR_TEST_RUNTIME", "/usr/local/bin/torpor-runtime")


@pytest.fixture(scope="module")
def podman() -> Podman:
    if shutil.which("podman") is None or not os.access(RUNTIME, os.X_OK):
        pytest.skip(f"needs podman and {RUNTIME}")
    p = Podman(RUNTIME, timeout=900)
    p.ensure_image()
    return p


@pytest.fixture
def containers(podman, tmp_path):
    made: list[str] = []

    def make(name: str, gib: float, **kw) -> TorchContainer:
        made.append(name)
        podman.rm(name)
        return TorchContainer(podman, name, tmp_path, gib, **kw)
    yield make
    for n in made:
        podman.rm(n)


def _bit_exact(ref: TorchContainer, tc: TorchContainer, last: int) -> None:
    ref.wait(lambda: ref.status().get("done") or ref.step() >= last, 600, f"reference step {last}")
    tc.wait_step(last, timeout=600)
    n, mismatch = compare(str(ref.steps), str(tc.steps))
    assert mismatch is None, f"diverged at {mismatch}"
    assert n >= last, f"only {n} common steps"


def _started(containers, name: str, gib: float, last: int, at_step: int,
             **kw) -> tuple[TorchContainer, TorchContainer]:
    """A reference container (stops at step `last`) and `name`, both trained past `at_step`."""
    ref = containers("ref", gib, max_steps=last + 1)
    tc = containers(name, gib, **kw)
    ref.start()
    tc.start()
    tc.wait_ready()
    tc.wait_step(at_step)
    return ref, tc


def _cuda_state(pid: int) -> str:
    return driver.Driver.load(os.environ.get("TORPOR_LIBCUDA", "libcuda.so.1")).get_state(pid).name


def test_podman_export_import_continues_bit_exact(podman, containers, tmp_path):
    ref, tc = _started(containers, "gpu1", 2.0, last=59, at_step=10)
    old_pid = podman.pid(tc.name)
    archive = tmp_path / "gpu1.tar"
    podman.checkpoint(tc.name, export=archive, compress="none")
    assert podman.state(tc.name) == "exited"
    with tarfile.open(archive) as tf:
        m = json.loads(tf.extractfile("checkpoint/torpor.json").read())
    # the agent, preloaded by default into GPU containers, moved the tensors (issue 20)
    assert sum(a.get("bytes", 0) for a in (m.get("agent") or {}).values()) >= 1 << 30, \
        m.get("agent")
    at = tc.step()
    podman.rm(tc.name)
    podman.restore(import_=archive)
    new_pid = podman.pid(tc.name)
    assert new_pid != old_pid and _cuda_state(new_pid) == "RUNNING"
    tc.wait_step(at + 10)
    _bit_exact(ref, tc, 59)


def test_podman_leave_running_pauses_for_the_copy_and_its_export_restores_bit_exact(
        podman, containers, tmp_path):
    """Issue 20 item 3 for containers: `--leave-running` pauses the program only for the copy
    to host memory and the dump; the write-out runs while it trains on, and the export is a
    whole checkpoint: restored after the original is gone, it continues bit-exact."""
    ref, tc = _started(containers, "gpu-lr", 4.0, last=79, at_step=10)
    archive = tmp_path / "gpu-lr.tar"
    podman.checkpoint(tc.name, export=archive, leave_running=True, compress="none")
    assert podman.state(tc.name) == "running"
    at = tc.step()
    tc.wait_step(at + 5)                                 # trains on after the checkpoint
    with tarfile.open(archive) as tf:
        m = json.loads(tf.extractfile("checkpoint/torpor.json").read())
    pause = m["pause"]
    moved = sum(a.get("bytes", 0) for a in (m.get("agent") or {}).values())
    print(f"leave-running: {moved / 2**30:.2f} GiB moved, paused {pause['paused_s']:.2f} s, "
          f"durable {pause['durable_s']:.2f} s, timings {m.get('timings')}")
    assert pause["staged"] is True and moved >= 3 << 30, (pause, m.get("agent"))
    assert pause["paused_s"] < pause["durable_s"], pause
    podman.rm(tc.name)
    podman.restore(import_=archive)
    assert _cuda_state(podman.pid(tc.name)) == "RUNNING"
    tc.wait_step(at + 10)
    _bit_exact(ref, tc, 79)


def test_podman_restore_with_device_map_onto_same_gpu_uuid(podman, containers, tmp_path):
    u = gpu_uuid()
    ref, tc = _started(containers, "gpu2", 1.0, last=39, at_step=5,
                       annotations={"org.torpor.device-map": f"{u}={u}"})
    archive = tmp_path / "gpu2.tar.zst"
    podman.checkpoint(tc.name, export=archive)            # podman's default: zstd
    at = tc.step()
    podman.rm(tc.name)
    podman.restore(import_=archive)
    tc.wait_step(at + 10)
    log = open("/var/lib/torpor/runtime.log").read() if os.path.exists(
        "/var/lib/torpor/runtime.log") else ""
    cid = podman.inspect(tc.name, "{{.Id}}")
    assert any(f"restore {cid}: pre-flight" in line and f"{{'{u}': '{u}'}} (explicit)" in line
               for line in log.splitlines()), log[-2000:]
    _bit_exact(ref, tc, 39)


def test_podman_dump_on_full_disk_leaves_container_running(podman, containers, tmp_path):
    ref, tc = _started(containers, "gpu3", 1.0, last=39, at_step=5)
    images = podman.bundle(tc.name) / "checkpoint"
    images.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(images)], check=True)
    try:
        with pytest.raises(ContainerError) as err:
            podman.checkpoint(tc.name, export=tmp_path / "gpu3.tar")
    finally:
        subprocess.run(["umount", "-l", str(images)])
    assert "rolled back" in err.value.stderr, err.value.stderr
    assert podman.state(tc.name) == "running"
    assert _cuda_state(podman.pid(tc.name)) == "RUNNING"
    at = tc.step()
    tc.wait_step(at + 10)
    _bit_exact(ref, tc, 39)


INFER_SERVER = Path(__file__).resolve().parent / "infer_server.py"
_CLIENT = """
import json, sys, urllib.request
port, path, body = int(sys.argv[1]), sys.argv[2], sys.argv[3]
req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body.encode() or None,
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    print(r.read().decode())
"""


def _ask(pid: int, path: str, body: dict | None = None, port: int = 8080) -> dict:
    """An HTTP request from a real client in the container's network namespace (the
    container has --network none: its loopback is its own)."""
    def enter() -> None:
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        os.setns(fd, os.CLONE_NEWNET)
        os.close(fd)
        # podman's --network none without a network stack leaves lo down: up, as a CNI would
        import fcntl
        import socket
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            ifr = fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0))     # SIOCGIFFLAGS
            flags = struct.unpack("16sH14x", ifr)[1]
            fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))   # IFF_UP
    out = subprocess.run([sys.executable, "-c", _CLIENT, str(port), path,
                          json.dumps(body) if body is not None else ""],
                         capture_output=True, text=True, timeout=120, preexec_fn=enter)
    assert out.returncode == 0, f"client failed: {out.stderr[-1500:]}"
    return json.loads(out.stdout)


def test_podman_http_inference_server_gives_the_same_answer_after_export_and_import(
        podman, tmp_path):
    """A GPU inference server (a TCP listener, weights and KV cache on the GPU) in a podman
    container, checkpointed with --export and restored with --import through torpor-runtime,
    answers a fixed prompt exactly as before, and its count of requests served goes on."""
    name, status = "infer-srv", tmp_path / "infer-srv.status.json"
    podman.rm(name)
    argv = [sys.executable, str(INFER_SERVER), "--gib", "1", "--status", str(status)]
    log = tmp_path / "infer-srv.log"
    shell = " ".join(f"'{a}'" for a in argv) + f" >>'{log}' 2>&1"
    env = {"USER": "root", "HOME": str(tmp_path)}
    try:
        podman.run(name, ["/bin/sh", "-c", f"exec {shell}"], env=env, devices=nvidia_devices(),
                   mounts=gpu_mounts(tmp_path, INFER_SERVER.parent))
        deadline = time.monotonic() + 300
        while not status.exists():
            assert time.monotonic() < deadline and podman.state(name) == "running", \
                f"server not ready: {log.read_text(errors='replace')[-2000:] if log.exists() else ''}"
            time.sleep(0.2)
        pid = podman.pid(name)
        prompt = {"prompt": "Checkpoint me, then bring me back.", "max_new_tokens": 32}
        before = _ask(pid, "/generate", prompt)
        assert _ask(pid, "/generate", prompt)["tokens"] == before["tokens"]   # deterministic
        assert _ask(pid, "/health")["served"] == 2

        archive = tmp_path / "infer-srv.tar"
        podman.checkpoint(name, export=archive, compress="none")
        assert podman.state(name) == "exited"
        podman.rm(name)
        podman.restore(import_=archive)
        new_pid = podman.pid(name)
        assert new_pid != pid
        assert _cuda_state(new_pid) == "RUNNING"
        after = _ask(new_pid, "/generate", prompt)
        assert after["tokens"] == before["tokens"], (before, after)
        assert after["served"] == 3, "the server's own memory did not come back"
    finally:
        podman.rm(name)
