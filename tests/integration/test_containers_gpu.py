"""GPU containers through torpor-runtime, with real podman, containerd, runc and CRIU and a fake
GPU (tests/fakes): the fake CUDA program runs inside the container; torpord (a real one, on
its own socket) locks, checkpoints and restores it through the fake driver by host PID.

Each test checks what the operator relies on: the checkpoint carries torpor.json inside the
exported archive / checkpoint image, the restored program continues (same process: its tick
goes on, the fake driver saw restore+unlock on the new host PID), the bundle is rewritten for
another GPU, and every failure leaves the container running or says why it stopped it.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from integration.containers import ContainerError, Containerd, Podman
from tests.fakes.fakegpu import CHECKPOINTED, RUNNING, FakeGpu, pid_of
from tests.integration.conftest import agent_dir, needs_criu, wait_for
from tests.integration.torpord import (  # noqa: F401  (fixtures)
    Daemon, base, gpu, daemon)
from torpor.agent import AgentClient
from torpor.archive import _open_stream

pytestmark = [needs_criu, pytest.mark.criu]
GIB = 1 << 30
TORPOR_RUNTIME = shutil.which("torpor-runtime") or "/usr/local/bin/torpor-runtime"


def _needs(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {' '.join(missing)} (./install.sh)")


class Shim:
    """torpor-runtime as the engines call it, behind a wrapper that sets torpor's environment
    (podman and conmon pass the runtime no variables of ours). extra: more variables, e.g.
    TORPOR_DEVICE_MAP or TORPOR_OCI_RUNTIME."""

    def __init__(self, base: Path, daemon: Daemon, gpu: FakeGpu):
        if not os.access(TORPOR_RUNTIME, os.X_OK):
            pytest.skip("torpor-runtime is not installed (./install.sh)")
        self.path = base / "torpor-runtime-test"
        self.env = {k: v for k, v in daemon.env.items()
                    if k.startswith(("TORPOR_", "FAKE_CUDA")) or k == "LD_LIBRARY_PATH"}
        self.write()

    def write(self, **extra: str) -> None:
        lines = ["#!/bin/sh"] + [f"export {k}='{v}'" for k, v in {**self.env, **extra}.items()]
        lines.append(f'exec {TORPOR_RUNTIME} "$@"')
        self.path.write_text("\n".join(lines) + "\n")
        self.path.chmod(0o700)

    def log(self, daemon: Daemon) -> str:
        p = daemon.cfg.state_dir / "runtime.log"
        return p.read_text() if p.exists() else ""


@pytest.fixture
def shim(base, daemon, gpu):
    return Shim(base, daemon, gpu)


@pytest.fixture
def name(request) -> str:
    test = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name.removeprefix("test_"))
    return f"tg{os.getpid()}-{test}"[:60].strip("-")


def fake_nodes(base: Path) -> dict[int, Path]:
    """Character nodes 195:N (as the NVIDIA driver makes them) outside /dev, for --device."""
    out = {}
    for minor in (0, 1, 255):
        p = base / "dev" / (f"nvidia{minor}" if minor != 255 else "nvidiactl")
        p.parent.mkdir(exist_ok=True)
        if not p.exists():
            os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
        out[minor] = p
    return out


class Workload:
    """The fake CUDA program in a container: its status file, key and host PID."""

    def __init__(self, gpu: FakeGpu, scope: str, gpu_index: int = 0, mem: int = 2 * GIB):
        self.gpu = gpu
        self.scope = scope
        self.status = gpu.state_dir / f"{scope}.status.json"
        self.argv, self.env, self.mounts = gpu.container_workload(scope, gpu_index, mem,
                                                                  self.status)

    def doc(self) -> dict:
        try:
            return json.loads(self.status.read_text())
        except (OSError, ValueError):
            return {}

    def tick(self) -> int:
        return int(self.doc().get("tick", -1))

    @property
    def key(self) -> str:
        return f"{self.scope}.{self.doc()['pid']}"

    def entry(self) -> dict:
        return self.gpu.proc_entry(self.key) or {}

    def host_pid(self) -> int | None:
        return pid_of(self.key)

    def wait_ticking(self, above: int = -1, timeout: float = 20) -> int:
        wait_for(lambda: self.tick() > above, timeout, f"tick > {above} ({self.doc()})")
        assert "error" not in self.doc(), self.doc()
        return self.tick()


def _manifest_in_tar(archive: Path) -> dict:
    """torpor.json as podman exported it (any compression), where podman's import puts it."""
    with _open_stream(archive) as stream, tarfile.open(fileobj=stream, mode="r|*") as tf:
        found = {m.name: tf.extractfile(m).read() for m in tf if m.name.endswith("torpor.json")}
    assert list(found) == ["checkpoint/torpor.json"], list(found)
    return json.loads(found["checkpoint/torpor.json"])


# -- podman -----------------------------------------------------------------------------------

@pytest.fixture
def podman(shim, podman_image):
    _needs("podman")
    return Podman(str(shim.path))


@pytest.fixture
def running(podman, gpu, base, name) -> Workload:
    """The fake CUDA program ticking in a podman container with GPU 0 (/dev/nvidia0,
    /dev/nvidiactl, NVIDIA_VISIBLE_DEVICES); removed after the test."""
    w = _podman_workload(podman, gpu, base, name)
    try:
        w.wait_ticking()
        yield w
    finally:
        podman.rm(name)


DRIVER_PATH = {"org.torpor.agent": "off"}   # these tests check the driver's path: opt out of
                                            # the agent, preloaded into GPU containers by default


def _podman_workload(podman: Podman, gpu: FakeGpu, base: Path, name: str,
                     annotations: dict[str, str] | None = None) -> Workload:
    """The fake CUDA program started in a podman container with GPU 0, on the driver path
    (remove it after)."""
    nodes = fake_nodes(base)
    w = Workload(gpu, "w")
    podman.run(name, w.argv, mounts=w.mounts,
               env={**w.env, "NVIDIA_VISIBLE_DEVICES": gpu.uuid(0)},
               devices=[f"{nodes[0]}:/dev/nvidia0", f"{nodes[255]}:/dev/nvidiactl"],
               annotations={**DRIVER_PATH, **(annotations or {})})
    return w


def _export_and_remove(podman: Podman, name: str, w: Workload, base: Path) -> tuple[Path, int]:
    """checkpoint --export (uncompressed), then rm: (the archive, the tick at the checkpoint)."""
    archive = base / "ck.tar"
    podman.checkpoint(name, export=archive, compress="none")
    tick = w.tick()
    podman.rm(name)
    return archive, tick


def _assert_running_on(w: Workload, uuid: str) -> None:
    w.wait_ticking(w.tick())
    assert w.entry()["state"] == RUNNING and w.entry()["gpu"] == uuid


def test_podman_export_import_same_gpu(podman, gpu, daemon, name, base, running):
    w = running
    spec = json.loads((podman.bundle(name) / "config.json").read_text())
    assert [h["args"] for h in spec["hooks"]["createRuntime"]] == [
        ["torpor-hook", "createRuntime"]]
    wait_for(lambda: any(c.id.startswith(podman.inspect(name, "{{.Id}}"))
                         for c in daemon.client().list().containers), 10,
             "the hook registering the container")
    host_pid = w.host_pid()
    assert host_pid and host_pid == podman.pid(name)
    ps = subprocess.run([sys.executable, "-m", "torpor.cli.main", "--json", "ps"],
                        env=daemon.env, capture_output=True, text=True, timeout=60)
    rows = {r["pid"]: r for r in json.loads(ps.stdout)["processes"]}
    assert rows[host_pid]["container"] == podman.inspect(name, "{{.Id}}"), ps.stderr
    assert rows[host_pid]["state"] == "RUNNING"
    archive = base / "ck.tar.zst"
    podman.checkpoint(name, export=archive)                 # podman's default: zstd
    assert podman.state(name) == "exited"
    assert w.entry()["state"] == CHECKPOINTED
    m = _manifest_in_tar(archive)
    assert m["container"]["minors"] == [0] and m["container"]["visible"] == [gpu.uuid(0)]
    assert [g["uuid"] for g in m["gpus"]] == [gpu.uuid(0)]
    assert [(p["cuda"], p["gpu_memory"], p["gpu_memory_by_gpu"]) for p in m["processes"]] \
        == [(True, 2 * GIB, {gpu.uuid(0): 2 * GIB})]          # through torpord's CudaProcess
    assert m["files"]["pstree.img"]["sha256"]
    tick = w.tick()
    podman.rm(name)
    podman.restore(import_=archive)
    assert podman.state(name) == "running"
    new_pid = podman.pid(name)
    assert new_pid != host_pid and w.host_pid() == new_pid
    w.wait_ticking(tick)
    _assert_running_on(w, gpu.uuid(0))
    calls = [(c.call, c.pid) for c in gpu.calls() if c.call in ("restore", "unlock")]
    assert calls == [("restore", new_pid), ("unlock", new_pid)]


def test_podman_agent_preloaded_by_default_and_answers_after_restore(podman, gpu, daemon,
                                                                    name, base):
    """No annotation: the agent is preloaded (config `agent`, on by default; the image's libc,
    the host's /usr here, can load it), wraps the program's driver calls in the container and
    answers on the host, in a directory of the container's own; a podman checkpoint/restore
    brings its socket back."""
    w = Workload(gpu, "agent")
    nodes = fake_nodes(base)
    podman.run(name, w.argv, mounts=w.mounts,
               env={**w.env, "NVIDIA_VISIBLE_DEVICES": gpu.uuid(0)},
               devices=[f"{nodes[0]}:/dev/nvidia0", f"{nodes[255]}:/dev/nvidiactl"])
    try:
        w.wait_ticking()
        cid = podman.inspect(name, "{{.Id}}")
        spec = json.loads((podman.bundle(name) / "config.json").read_text())
        assert "org.torpor.agent-skipped" not in (spec.get("annotations") or {})
        agents = agent_dir(daemon.cfg.run_dir, cid)
        assert stat.S_IMODE(agents.stat().st_mode) == 0o700
        sock = agents / f"agent-{w.doc()['pid']}.sock"       # the PID inside the container
        wait_for(sock.exists, 10, "the agent's socket")
        with AgentClient(sock) as a:
            assert (a.status()["allocations"], a.status()["bytes"]) == (1, 2 * GIB)
        archive, tick = _export_and_remove(podman, name, w, base)
        podman.restore(import_=archive)
        w.wait_ticking(tick)
        agents = agent_dir(daemon.cfg.run_dir, podman.inspect(name, "{{.Id}}"))
        with AgentClient(agents / sock.name) as a:
            assert a.status()["allocations"] == 1
    finally:
        podman.rm(name)
    assert not agents.exists()                                # removed with the container


STATIC_PROGRAM = "#include <unistd.h>\nint main(void) { for (;;) pause(); }\n"


def test_podman_image_whose_libc_cannot_load_the_agent_starts_without_it(podman, gpu, daemon,
                                                                         shim, name, base):
    """An image whose libc.so.6 defines no version past GLIBC_2.12 (older than the agent
    needs; a synthetic ELF bound over the host's in the image's /usr) running a static
    program: created without the agent, a warning in runtime.log, the reason in the spec's
    annotation org.torpor.agent-skipped and so in torpord's record of the container."""
    from tests.fakes.fake_elf import fake_libc
    if not Path("/usr/lib/x86_64-linux-gnu/libc.so.6").exists() or shutil.which("gcc") is None:
        pytest.skip("needs x86_64 Debian's libc path and gcc")
    src, prog = base / "static.c", base / "static-prog"
    src.write_text(STATIC_PROGRAM)
    r = subprocess.run(["gcc", "-static", "-o", str(prog), str(src)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"no static libc to build with: {r.stderr[-300:]}")
    old_libc = fake_libc(base / "old" / "libc.so.6", newest="2.12")
    nodes = fake_nodes(base)
    podman.run(name, [str(prog)], env={"NVIDIA_VISIBLE_DEVICES": gpu.uuid(0)},
               mounts=[(str(old_libc), "/usr/lib/x86_64-linux-gnu/libc.so.6", True),
                       (str(prog), str(prog), True)],
               devices=[f"{nodes[0]}:/dev/nvidia0", f"{nodes[255]}:/dev/nvidiactl"])
    try:
        assert podman.state(name) == "running"
        cid = podman.inspect(name, "{{.Id}}")
        spec = json.loads((podman.bundle(name) / "config.json").read_text())
        reason = spec["annotations"]["org.torpor.agent-skipped"]
        assert "GLIBC_2.17" in reason, reason
        assert not any("libtorpor-agent" in e for e in spec["process"]["env"])
        assert f"create {cid}: agent not preloaded" in shim.log(daemon)
        # registered as <id>@<key of podman's runtime root> (torpor-hook, oci.name_in_state)
        wait_for(lambda: any(c.id.partition("@")[0] == cid
                             and c.annotations.get("org.torpor.agent-skipped") == reason
                             for c in daemon.client().list().containers), 10,
                 "torpord's record with the reason")
    finally:
        podman.rm(name)


def test_podman_restore_onto_other_gpu_rewrites_bundle(podman, gpu, daemon, shim, name, base,
                                                       running):
    w = running
    archive, tick = _export_and_remove(podman, name, w, base)
    shim.write(TORPOR_DEVICE_MAP=f"{gpu.uuid(0)}={gpu.uuid(1)}")
    podman.restore(import_=archive)
    w.wait_ticking(tick)
    _assert_running_on(w, gpu.uuid(1))
    assert w.entry()["restored_pairs"] == [(gpu.uuid(0), gpu.uuid(1))]
    spec = json.loads((podman.bundle(name) / "config.json").read_text())
    assert [d["path"] for d in spec["linux"]["devices"] if "nvidia" in d["path"]] == [
        "/dev/nvidia1", "/dev/nvidiactl"]
    assert f"NVIDIA_VISIBLE_DEVICES={gpu.uuid(1)}" in spec["process"]["env"]
    rules = {(r.get("major"), r.get("minor")) for r in spec["linux"]["resources"]["devices"]
             if r.get("allow")}
    assert (195, 1) in rules and (195, 0) not in rules
    node = Path(f"/proc/{podman.pid(name)}/root/dev/nvidia1")
    assert stat.S_ISCHR(node.stat().st_mode) and node.stat().st_rdev == os.makedev(195, 1)


def _exported(podman: Podman, name: str, w: Workload, base: Path) -> tuple[Path, int, list[str]]:
    """Once it ticks, _export_and_remove, and the archive's member names."""
    w.wait_ticking()
    archive, tick = _export_and_remove(podman, name, w, base)
    with tarfile.open(archive) as tf:
        return archive, tick, tf.getnames()


def test_podman_export_import_through_the_image_store(podman, gpu, daemon, shim, name, base):
    """org.torpor.store=on: the export carries the manifest, the snapshot and the store's
    chunks instead of the image files; the import on a host whose store lacks them (removed
    here) brings them in, each verified, and the container comes back on its GPU."""
    store = base / "store"
    shim.write(TORPOR_STORE_DIR=str(store))
    w = _podman_workload(podman, gpu, base, name, {"org.torpor.store": "on"})
    try:
        archive, tick, names = _exported(podman, name, w, base)
        chunks = [n for n in names if n.startswith("checkpoint/torpor-chunks+")]   # flat.py
        assert "checkpoint/torpor-store.json" in names and "checkpoint/torpor.json" in names
        assert chunks and not [n for n in names if n.startswith("checkpoint/pages-")], names
        blobs = sorted(p.name for p in (store / "chunks").glob("*/*"))
        assert blobs == sorted(n.rsplit("+", 1)[1] for n in chunks)
        shutil.rmtree(store)                              # another host: an empty store
        podman.restore(import_=archive)
        assert podman.state(name) == "running"
        w.wait_ticking(tick)
        _assert_running_on(w, gpu.uuid(0))
        assert sorted(p.name for p in (store / "chunks").glob("*/*")) == blobs
        assert "unpacked through" in shim.log(daemon)
    finally:
        podman.rm(name)


def test_podman_store_that_cannot_be_written_leaves_the_checkpoint_whole(podman, gpu, daemon,
                                                                          shim, name, base):
    blocker = base / "not-a-dir"
    blocker.write_text("a file where the store should be")
    shim.write(TORPOR_STORE_DIR=str(blocker / "store"))
    w = _podman_workload(podman, gpu, base, name, {"org.torpor.store": "on"})
    try:
        archive, tick, names = _exported(podman, name, w, base)
        assert "checkpoint/torpor-store.json" not in names
        assert [n for n in names if n.startswith("checkpoint/pages-")], names
        assert "not packed into the store" in shim.log(daemon)
        podman.restore(import_=archive)
        w.wait_ticking(tick)
        _assert_running_on(w, gpu.uuid(0))
    finally:
        podman.rm(name)


def test_podman_leave_running(podman, gpu, daemon, name, base, running):
    podman.checkpoint(name, leave_running=True, export=base / "ck.tar", compress="none")
    assert podman.state(name) == "running"
    _assert_running_on(running, gpu.uuid(0))
    assert _manifest_in_tar(base / "ck.tar")["leave_running"] is True


def test_podman_dump_on_full_disk_rolls_back_and_container_runs(podman, gpu, daemon, name,
                                                                 base, running):
    images = podman.bundle(name) / "checkpoint"   # where podman has runc dump
    images.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(images)], check=True)
    try:
        with pytest.raises(ContainerError) as err:
            podman.checkpoint(name, export=base / "ck.tar")
    finally:
        subprocess.run(["umount", str(images)])
    assert "rolled back" in err.value.stderr, err.value.stderr
    assert podman.state(name) == "running"
    _assert_running_on(running, gpu.uuid(0))
    assert daemon.client().list().operations == ()
    assert [c.call for c in gpu.calls() if c.call != "get_state"] == [
        "lock", "checkpoint", "restore", "unlock"]


def test_podman_lock_failure_leaves_container_running(podman, gpu, daemon, name, base, running):
    gpu.fail("checkpoint", "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(ContainerError) as err:
        podman.checkpoint(name, export=base / "ck.tar")
    assert "CUDA_ERROR_OUT_OF_MEMORY" in err.value.stderr
    assert podman.state(name) == "running"
    _assert_running_on(running, gpu.uuid(0))


def test_podman_sigkill_of_torpor_runtime_mid_checkpoint_container_recovers(
        podman, gpu, daemon, name, base, running):
    """The shim dies while torpord checkpoints the GPU state (before the dump): torpord sees
    its caller gone and rolls back; the container keeps running."""
    gpu.delay("checkpoint", 1500)
    ck = subprocess.Popen([*podman.base, "container", "checkpoint", "--export",
                           str(base / "ck.tar"), name], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    try:
        shim_pid = wait_for(lambda: _pgrep("torpor-runtime(-py)? .*checkpoint --image-path"), 20,
                            "torpor-runtime checkpoint")
        wait_for(lambda: any(c.call == "lock" for c in gpu.calls()), 10, "the lock")
        os.kill(shim_pid, signal.SIGKILL)
        _, err = ck.communicate(timeout=60)
    finally:
        if ck.poll() is None:
            ck.kill()
    assert ck.returncode != 0
    wait_for(lambda: w_state(running) == RUNNING and not daemon.client().list().operations,
             15, "torpord rolling the operation back")
    assert podman.state(name) == "running"
    _assert_running_on(running, gpu.uuid(0))
    assert "died without ending it" in daemon.log_text()


def w_state(w: Workload) -> int | None:
    return w.entry().get("state")


def _pgrep(pattern: str) -> int | None:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def test_podman_gpu_restore_failure_stops_container_and_says_why(podman, gpu, daemon, name,
                                                                 base, running):
    archive, _ = _export_and_remove(podman, name, running, base)
    gpu.fail("restore", "CUDA_ERROR_UNKNOWN")
    with pytest.raises(ContainerError) as err:
        podman.restore(import_=archive)
    text = err.value.stderr + err.value.stdout
    assert "GPU restore of container" in text and "CUDA_ERROR_UNKNOWN" in text, text
    assert podman.state(name) != "running"


def test_podman_restore_refused_before_start_when_no_gpu_fits(podman, gpu, daemon, shim, name,
                                                              base, running):
    archive, _ = _export_and_remove(podman, name, running, base)
    shim.write(TORPOR_DEVICE_MAP=f"{gpu.uuid(0)}=GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(ContainerError) as err:
        podman.restore(import_=archive)
    assert "not on this host" in err.value.stderr + err.value.stdout
    assert not [c for c in gpu.calls() if c.call == "restore"]


def test_podman_corrupt_archive_refused(podman, gpu, daemon, name, base, running):
    archive, _ = _export_and_remove(podman, name, running, base)
    bad = base / "bad.tar"
    with tarfile.open(archive) as src, tarfile.open(bad, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member) if member.isfile() else None
            if member.name == "checkpoint/pstree.img":
                raw = bytearray(data.read())
                raw[-1] ^= 0xFF
                data = io.BytesIO(bytes(raw))
            dst.addfile(member, data)
    with pytest.raises(ContainerError) as err:
        podman.restore(import_=bad)
    assert "checksum mismatch" in err.value.stderr + err.value.stdout
    assert not [c for c in gpu.calls() if c.call == "restore"]


def test_podman_archive_without_its_manifest_still_gets_its_gpu_state_back(
        podman, gpu, daemon, name, base, running):
    """torpor.json removed from a driver-path export: nothing else of torpor's is in it, so it
    reads as another tool's checkpoint and runc restores it; torpor-runtime then has torpord
    give its process, still CHECKPOINTED in the driver, its GPU state back on the same GPU
    (runc alone left it frozen for good), and says so."""
    archive, tick = _export_and_remove(podman, name, running, base)
    bare = base / "bare.tar"
    with tarfile.open(archive) as src, tarfile.open(bare, "w") as dst:
        for member in src.getmembers():
            if member.name != "checkpoint/torpor.json":
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    podman.restore(import_=bare)
    assert podman.state(name) == "running"
    _assert_running_on(running, gpu.uuid(0))
    assert running.tick() > tick
    log = (daemon.cfg.state_dir / "runtime.log").read_text()
    assert "no manifest; GPU state of PIDs" in log, log[-2000:]


# -- containerd ----------------------------------------------------------------------------------

@pytest.fixture
def containerd(shim):
    _needs("containerd", "ctr")
    c = Containerd(str(shim.path))
    c.ensure_image()
    yield c
    c.stop()


def _containerd_workload(containerd: Containerd, gpu: FakeGpu, name: str,
                         scope: str) -> tuple[Workload, str]:
    """The fake CUDA program started in a containerd task with GPU 0, and the checkpoint image
    reference for it (remove both after)."""
    w = Workload(gpu, scope)
    containerd.run(name, w.argv, mounts=w.mounts,
                   env={**w.env, "NVIDIA_VISIBLE_DEVICES": gpu.uuid(0)}, annotations=DRIVER_PATH)
    return w, f"localhost/torpor-test-ck:{name.lower()}"


def test_containerd_checkpoint_restore_onto_other_gpu(containerd, gpu, daemon, shim, name):
    w, ref = _containerd_workload(containerd, gpu, name, "ctrd")
    try:
        w.wait_ticking()
        host_pid = containerd.pid(name)
        assert w.host_pid() == host_pid
        containerd.checkpoint(name, ref, leave_running=True)
        assert containerd.state(name) == "running"
        w.wait_ticking(w.tick())
        assert w.entry()["state"] == RUNNING
        tick = w.tick()
        containerd.rm(name)
        shim.write(TORPOR_DEVICE_MAP=f"{gpu.uuid(0)}={gpu.uuid(1)}")
        containerd.restore(ref, name)
        assert containerd.state(name) == "running"
        w.wait_ticking(tick)
        assert w.host_pid() == containerd.pid(name) != host_pid
        e = w.entry()
        assert e["state"] == RUNNING and e["gpu"] == gpu.uuid(1)
        spec = json.loads((containerd.bundle(name) / "config.json").read_text())
        assert f"NVIDIA_VISIBLE_DEVICES={gpu.uuid(1)}" in spec["process"]["env"]
    finally:
        containerd.rm(name)
        containerd.rm_image(ref)


def test_containerd_checkpoint_restore_through_the_image_store(containerd, gpu, daemon, shim,
                                                               name, base):
    """Config store_containers (TORPOR_STORE_DIR's store): containerd's checkpoint image is made
    from the packed directory, and its restore gets the files back through the store."""
    store = base / "store"
    config = base / "store-config.toml"
    config.write_text("store_containers = true\n")
    shim.write(TORPOR_STORE_DIR=str(store), TORPOR_CONFIG=str(config))
    w, ref = _containerd_workload(containerd, gpu, name, "ctrs")
    try:
        w.wait_ticking()
        containerd.checkpoint(name, ref, leave_running=True)
        assert list((store / "snapshots").glob("*.json")), shim.log(daemon)
        w.wait_ticking(w.tick())
        tick = w.tick()
        containerd.rm(name)
        shutil.rmtree(store)                              # the restore brings the chunks back
        containerd.restore(ref, name)
        assert containerd.state(name) == "running"
        w.wait_ticking(tick)
        assert w.entry()["state"] == RUNNING
        assert list((store / "chunks").glob("*/*")) and "unpacked through" in shim.log(daemon)
    finally:
        containerd.rm(name)
        containerd.rm_image(ref)


def test_containerd_runtime_killed_while_the_task_is_thawed_leaves_it_usable(
        containerd, gpu, daemon, name):
    """ctr pauses the task around its checkpoint; torpor-runtime thaws it for the GPU step.
    SIGKILLed then (torpord checkpointing the GPU state), it leaves the task running: ctr's
    resume after the failed checkpoint succeeds (lifecycle.resume), not "container not
    paused", which left containerd's shim calling the task paused while runc would neither
    pause nor resume it. torpord rolls the GPU state back; the task pauses and resumes."""
    w, _ = _containerd_workload(containerd, gpu, name, "ctrk")
    try:
        w.wait_ticking()
        gpu.delay("checkpoint", 3000)
        ck = subprocess.Popen([containerd.ctr, "--address", str(containerd.address),
                               "--namespace", containerd.namespace, "containers", "checkpoint",
                               "--task", "--rw", name, f"localhost/torpor-test-ck:{name}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: any(c.call == "lock" for c in gpu.calls()), 20, "the lock")
            shim_pid = _pgrep(f"torpor-runtime(-py)? .*checkpoint .*{name}")
            assert shim_pid, "torpor-runtime checkpoint"
            os.kill(shim_pid, signal.SIGKILL)
            out, err = ck.communicate(timeout=60)
        finally:
            if ck.poll() is None:
                ck.kill()
        assert ck.returncode != 0 and "error resuming task" not in out + err, out + err
        assert containerd.state(name) == "running"
        gpu.clear_faults()
        wait_for(lambda: w_state(w) == RUNNING and not daemon.client().list().operations, 20,
                 "torpord rolling the operation back")
        w.wait_ticking(w.tick())
        containerd._c("tasks", "pause", name)
        assert containerd.state(name) == "paused"
        containerd._c("tasks", "resume", name)
        assert containerd.state(name) == "running"
        w.wait_ticking(w.tick())
    finally:
        containerd.rm(name)
