"""The kubelet's checkpoint/restore flow through containerd 2.x's CRI, with torpor as the runtime
handler: RunPodSandbox -> CreateContainer -> StartContainer -> CheckpointContainer (the
kubelet's archive) -> a new sandbox -> CreateContainer with the archive as the image ->
StartContainer, over containerd's CRI socket with a client generated from the CRI api.proto.

A private containerd 2 per test (integration/cri.py: the config ./install.sh installs, with the
test's paths; the torpor handler runs a wrapper around the installed torpor-runtime that sets
the test's torpord and fake GPU, and logs its argv); pods on the host network (no CNI); the
sandbox image built locally; the base image (a static busybox) pulled with PullImage from a
registry on 127.0.0.1 (containerd 2.1 pulls a checkpoint's base image again at restore).
Skipped where containerd 2 is not installed.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import stat
import sys
import tarfile
from pathlib import Path

import pytest

from integration import cri as crimod
from tests.fakes.fakegpu import RUNNING, FakeGpu
from tests.integration.conftest import agent_dir, needs_criu, wait_for
from tests.integration.torpord import (  # noqa: F401  (fixtures)
    Daemon, base, gpu, daemon)
from torpor import config

SKIP = crimod.missing()
pytestmark = [needs_criu, pytest.mark.criu,
              pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]

GIB = 1 << 30
# the torpor-runtime of the venv test.sh installed this tree into (the tests' Python's),
# else the one on PATH
_VENV_RUNTIME = Path(sys.executable).parent / "torpor-runtime"
TORPOR_RUNTIME = (str(_VENV_RUNTIME) if os.access(_VENV_RUNTIME, os.X_OK)
                  else shutil.which("torpor-runtime") or "/usr/local/bin/torpor-runtime")
COUNTER = ('t=$(head -c8 /dev/urandom | od -An -tx1 | tr -d " \\n"); n=0; '
           'while :; do n=$((n+1)); echo "$t $n" > /data/counter.tmp; '
           'mv /data/counter.tmp /data/counter; sleep 0.05; done')


@pytest.fixture(scope="module")
def registry():
    from integration.oci_registry import LayoutRegistry
    with LayoutRegistry({"torpor-busybox": crimod.BUSYBOX_TAR}) as reg:
        yield reg


class Handler:
    """The torpor handler's BinaryName: torpor-runtime behind a wrapper that sets the test's
    torpord and fake GPU (containerd passes the runtime none of ours) and logs each argv."""

    def __init__(self, base: Path, daemon: Daemon):
        if not os.access(TORPOR_RUNTIME, os.X_OK):
            pytest.skip("torpor-runtime is not installed (./install.sh)")
        self.path = base / "torpor-runtime-test"
        self.calls = base / "runtime-calls.log"
        self.env = {k: v for k, v in daemon.env.items()
                    if k.startswith(("TORPOR_", "FAKE_CUDA")) or k == "LD_LIBRARY_PATH"}
        self.write()

    def write(self, **extra: str) -> None:
        lines = ["#!/bin/sh"] + [f"export {k}='{v}'" for k, v in {**self.env, **extra}.items()]
        lines += [f'echo "$*" >> {self.calls}', f'exec {TORPOR_RUNTIME} "$@"']
        self.path.write_text("\n".join(lines) + "\n")
        self.path.chmod(0o700)

    def commands(self) -> list[str]:
        """The runtime commands containerd's shim ran through torpor-runtime, in order."""
        known = ("create", "start", "checkpoint", "restore", "delete", "kill", "state")
        out = []
        for line in self.calls.read_text().splitlines() if self.calls.exists() else []:
            words = [w for w in line.split() if not w.startswith("-")]
            out += [w for w in words if w in known][:1]
        return out


@pytest.fixture
def handler(base, daemon):
    return Handler(base, daemon)


@pytest.fixture
def node(base, handler, registry, gpu):
    """A node: containerd 2 with the handlers runc and torpor, CDI specs in base/cdi, the
    base image pulled through CRI; every pod removed at the end."""
    cdi = base / "cdi"
    cdi.mkdir()
    d = crimod.Containerd2(base / "c2", str(handler.path), cdi_dirs=[cdi],
                           registries=[f"localhost:{registry.port}"])
    cri = crimod.Cri(d.socket)
    try:
        image = registry.ref("torpor-busybox", "1")
        cri.pull(image)
        yield Node(d, cri, image, base, cdi)
    finally:
        try:
            cri.remove_all()
        finally:
            cri.close()
            d.stop()


class Node:
    def __init__(self, daemon: crimod.Containerd2, cri: crimod.Cri, image: str, base: Path,
                 cdi: Path):
        self.daemon, self.cri, self.image, self.base, self.cdi = daemon, cri, image, base, cdi
        self.checkpoints = base / "kubelet" / "checkpoints"   # the kubelet's checkpoint dir
        self.checkpoints.mkdir(parents=True)

    def run(self, pod_name: str, handler: str, spec: crimod.ContainerSpec,
            image: str | None = None, annotations: dict[str, str] | None = None
            ) -> tuple[crimod.Pod, str]:
        pod = self.cri.run_pod(pod_name, handler, annotations=annotations)
        cid = self.cri.create(pod, spec, image)
        self.cri.start(cid)
        assert self.cri.state(cid) == "CONTAINER_RUNNING"
        return pod, cid


class Counter:
    """The busybox counter: '<token> <n>' in <dir>/counter every 50 ms; the token lives only
    in the shell's memory, so a restart shows as a new one."""

    def __init__(self, directory: Path):
        self.dir = directory
        directory.mkdir()

    def spec(self, image: str) -> crimod.ContainerSpec:
        return crimod.ContainerSpec("counter", image, ["/bin/sh", "-c", COUNTER],
                                    mounts=[(str(self.dir), "/data", False)])

    def read(self) -> tuple[str, int] | None:
        try:
            tok, n = (self.dir / "counter").read_text().split()
            return tok, int(n)
        except (OSError, ValueError):
            return None

    def beyond(self, n: int, timeout: float = 20) -> tuple[str, int]:
        return wait_for(lambda: (v := self.read()) and v[1] > n and v, timeout,
                        f"counter beyond {n} ({self.read()})")


def _members(archive: Path) -> list[str]:
    with tarfile.open(archive) as tf:
        return tf.getnames()


@pytest.mark.parametrize("runtime_handler", ["runc", "torpor"])
def test_cri_checkpoint_then_restore_from_the_archive_continues(node, handler, runtime_handler):
    """A CPU container: CheckpointContainer writes the kubelet's archive and leaves it running;
    a new pod's CreateContainer from the archive brings the same process back at the
    checkpoint (same token, the count from where it was, not from 1)."""
    c = Counter(node.base / "data")
    spec = c.spec(node.image)
    pod, cid = node.run("counter", runtime_handler, spec)
    tok, _ = c.beyond(5)
    archive = crimod.kubelet_archive(node.checkpoints, pod, "counter")
    assert re.fullmatch(r"checkpoint-counter_default-counter-[0-9T:.\-]+Z\.tar", archive.name)
    before = c.read()[1]
    node.cri.checkpoint(cid, archive)
    after = c.read()[1]
    assert node.cri.state(cid) == "CONTAINER_RUNNING"      # the kubelet's checkpoint: it runs on
    names = _members(archive)
    assert {"config.dump", "spec.dump", "status.dump", "rootfs-diff.tar"} <= set(names)
    assert "checkpoint/pstree.img" in names
    assert stat.S_IMODE(archive.stat().st_mode) & 0o077 == 0
    last = c.beyond(after + 20)[1]                          # it ran on well past the checkpoint
    node.cri.remove_pod(pod.id)
    assert c.read()[1] >= last

    pod2, cid2 = node.run("counter-restored", runtime_handler, spec, image=str(archive))
    first = wait_for(lambda: (v := c.read()) and v[1] < last and v, 20,
                     "the restored counter's first write")
    assert first[0] == tok                                  # same process memory
    assert before < first[1] <= after + 2                   # from the checkpoint on
    c.beyond(first[1] + 5)
    status = node.cri.status(cid2).status
    assert status.annotations.get("restored") == "true"
    assert node.cri.state(cid2) == "CONTAINER_RUNNING"
    calls = handler.commands()
    if runtime_handler == "torpor":
        assert "checkpoint" in calls and "restore" in calls, calls
    else:
        assert calls == [], calls


# -- fake GPU: devices as the NVIDIA device plugin gives them with CDI ---------------------------

def _cdi_spec(node: Node, gpu: FakeGpu) -> None:
    """nvidia.com/gpu=0 and =1 (device nodes 195:N outside /dev, NVIDIA_VISIBLE_DEVICES the
    GPU's UUID) and /dev/nvidiactl for every GPU device, in the node's CDI directory."""
    from tests.integration.test_containers_gpu import fake_nodes
    nodes = fake_nodes(node.base)

    def dev(minor: int, path: str) -> dict:
        return {"path": path, "hostPath": str(nodes[minor]), "type": "c", "major": 195,
                "minor": minor, "permissions": "rw"}

    spec = {"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": str(i), "containerEdits": {
                "deviceNodes": [dev(i, f"/dev/nvidia{i}")],
                "env": [f"NVIDIA_VISIBLE_DEVICES={gpu.uuid(i)}"]}} for i in (0, 1)],
            "containerEdits": {"deviceNodes": [dev(255, "/dev/nvidiactl")]}}
    (node.cdi / "nvidia.json").write_text(json.dumps(spec))


def _gpu_workload(node: Node, gpu: FakeGpu, gpu_index: int = 0):
    """The fake CUDA program (host /usr read-only in the busybox image) and its container spec
    asking for nvidia.com/gpu=<gpu_index> through CDI."""
    from tests.integration.test_containers_gpu import Workload
    _cdi_spec(node, gpu)
    w = Workload(gpu, f"cri{os.getpid()}")   # its own: other test runs on this host
    return w, _gpu_spec(node, w, gpu_index)


def _gpu_spec(node: Node, w, gpu_index: int) -> crimod.ContainerSpec:
    return crimod.ContainerSpec("cuda", node.image, w.argv, env=w.env,
                                mounts=[("/usr", "/usr", True), *w.mounts],
                                cdi_devices=[f"nvidia.com/gpu={gpu_index}"])


def _manifest(archive: Path) -> dict:
    with tarfile.open(archive) as tf:
        return json.loads(tf.extractfile("checkpoint/torpor.json").read())


def _gpu_checkpoint(node: Node, gpu: FakeGpu, w, spec, annotations: dict[str, str] | None = None
                    ) -> tuple[Path, int, int]:
    """Run the program in a pod through the torpor handler, CheckpointContainer it (it runs
    on), remove the pod: (the archive, the host PID it had, the tick at removal)."""
    pod, cid = node.run("cuda", "torpor", spec, annotations=annotations)
    w.wait_ticking()
    host_pid = w.host_pid()
    assert host_pid and host_pid == node.cri.pid(cid)
    archive = crimod.kubelet_archive(node.checkpoints, pod, "cuda")
    node.cri.checkpoint(cid, archive)
    assert node.cri.state(cid) == "CONTAINER_RUNNING"
    w.wait_ticking(w.tick())
    assert w.entry()["state"] == RUNNING                     # unlocked again after the dump
    tick = w.tick()
    node.cri.remove_pod(pod.id)
    return archive, host_pid, tick


def test_cri_gpu_container_checkpoint_and_restore_through_torpor(node, handler, gpu, daemon):
    """A fake GPU container with nvidia.com/gpu=0 from CDI: CheckpointContainer runs torpor's
    GPU phases (lock, checkpoint, dump, restore and unlock to run on) and the kubelet's
    archive carries torpor.json; CreateContainer from the archive in a new pod restores the
    program with its GPU state (the driver saw restore and unlock on the new host PID)."""
    w, spec = _gpu_workload(node, gpu)
    archive, host_pid, tick = _gpu_checkpoint(node, gpu, w, spec)
    m = _manifest(archive)
    assert m["container"]["minors"] == [0] and m["container"]["visible"] == [gpu.uuid(0)]
    assert [g["uuid"] for g in m["gpus"]] == [gpu.uuid(0)]
    assert [(p["cuda"], p["gpu_memory"]) for p in m["processes"]] == [(True, 2 * GIB)]
    calls = [(c.call, c.pid) for c in gpu.calls()]
    assert [c for c, p in calls if p == host_pid and c in ("lock", "checkpoint", "restore",
                                                           "unlock")] == \
        ["lock", "checkpoint", "restore", "unlock"]

    pod2, cid2 = node.run("cuda-restored", "torpor", spec, image=str(archive))
    new_pid = node.cri.pid(cid2)
    assert new_pid != host_pid and w.host_pid() == new_pid
    w.wait_ticking(tick)
    e = w.entry()
    assert e["state"] == RUNNING and e["gpu"] == gpu.uuid(0)
    assert [(c.call, c.pid) for c in gpu.calls() if c.pid == new_pid
            and c.call in ("restore", "unlock")] == [("restore", new_pid), ("unlock", new_pid)]
    assert handler.commands().count("restore") == 1
    assert node.cri.status(cid2).status.annotations.get("restored") == "true"


def test_cri_gpu_restore_onto_the_gpu_the_new_pod_was_given(node, handler, gpu, daemon):
    """The new pod is given another GPU (nvidia.com/gpu=1 from the device plugin, while GPU 0
    is still there): the checkpoint's GPU goes where the kubelet put the container, without
    any device map, and the program continues on GPU 1 (its driver state restored there,
    its container's devices and environment those of GPU 1)."""
    w, spec = _gpu_workload(node, gpu, 0)
    archive, host_pid, tick = _gpu_checkpoint(node, gpu, w, spec)
    pod2, cid2 = node.run("cuda-moved", "torpor", _gpu_spec(node, w, 1), image=str(archive))
    w.wait_ticking(tick)
    e = w.entry()
    assert e["state"] == RUNNING and e["gpu"] == gpu.uuid(1)
    assert e["restored_pairs"] == [(gpu.uuid(0), gpu.uuid(1))]
    info = json.loads(node.cri.status(cid2).info["info"])
    spec2 = info["runtimeSpec"]
    assert f"NVIDIA_VISIBLE_DEVICES={gpu.uuid(1)}" in spec2["process"]["env"]
    node_path = Path(f"/proc/{node.cri.pid(cid2)}/root/dev/nvidia1")
    assert stat.S_ISCHR(node_path.stat().st_mode)
    assert node_path.stat().st_rdev == os.makedev(195, 1)


def test_cri_restore_refused_before_anything_starts_when_the_given_gpu_does_not_fit(
        node, handler, gpu, daemon):
    """The new pod is given a GPU of another model: torpor refuses at StartContainer with its
    one line, through CRI as the error the kubelet shows; nothing was restored (no driver
    restore, the container is not running) and the archive is left whole for another try."""
    w, spec = _gpu_workload(node, gpu, 0)
    archive, host_pid, tick = _gpu_checkpoint(node, gpu, w, spec)
    size = archive.stat().st_size
    gpu.set_gpus([gpu.gpus[0], (gpu.uuid(1), "NVIDIA A100", gpu.gpus[1][2]), *gpu.gpus[2:]])
    pod2 = node.cri.run_pod("cuda-misfit", "torpor")
    cid2 = node.cri.create(pod2, _gpu_spec(node, w, 1), image=str(archive))
    with pytest.raises(crimod.CriError) as err:
        node.cri.start(cid2)
    assert "NVIDIA A100" in err.value.details and "NVIDIA H200" in err.value.details, err.value
    assert node.cri.state(cid2) != "CONTAINER_RUNNING"
    assert not [c for c in gpu.calls() if c.call == "restore" and c.pid != host_pid]
    assert archive.stat().st_size == size


def _agent_events(path: Path) -> list[str]:
    return [e.rsplit(" ", 1)[0] for e in path.read_text().splitlines()] if path.exists() else []


def _flat_members(archive: Path) -> list[str]:
    """The archive's checkpoint/ members, each a plain file directly in checkpoint/ (what
    containerd 2.1's writeCriuCheckpointData can copy: it os.Create's every entry)."""
    with tarfile.open(archive) as tf:
        inside = [m for m in tf.getmembers() if m.name.startswith("checkpoint/")]
    assert all(m.isfile() and "/" not in m.name[len("checkpoint/"):] for m in inside), \
        [m.name for m in inside if not m.isfile() or "/" in m.name[len("checkpoint/"):]]
    return [m.name[len("checkpoint/"):] for m in inside]


def _agent_socket(daemon: Daemon, cid: str, gpu: FakeGpu, scope: str) -> Path:
    """The socket of the container's program under its agent (agent-<PID in the pod>.sock in
    the directory torpor-runtime bound to /run/torpor/agents), once it serves."""
    def found() -> Path | None:
        for sock in agent_dir(daemon.cfg.run_dir, cid).glob("agent-*.sock"):
            if gpu.proc_entry(f"{scope}.{sock.stem.split('-')[1]}"):
                return sock
        return None
    return wait_for(found, 20, "the program under its agent")


def _agent_round_trip(node: Node, handler: Handler, gpu: FakeGpu, daemon: Daemon,
                      annotations: dict[str, str], nbytes: int) -> tuple[dict, list[str]]:
    """fake_agent.py (its "GPU memory" a pattern it checks) under the agent in a pod through
    the torpor handler: CheckpointContainer (it runs on, its agent resumed from the image
    directory), the pod removed, a new pod's CreateContainer from the archive and
    StartContainer: its agent resumes from the archive's data and its memory is intact. The
    archive's manifest and checkpoint/ members."""
    from tests.integration.test_agent_containers import agent_workload
    from torpor.agent import AgentClient
    from torpor.archive import verify_archive
    _cdi_spec(node, gpu)
    events = gpu.state_dir / "agent-events"
    argv, env, mounts = agent_workload(gpu, "agcri", nbytes, events)
    spec = crimod.ContainerSpec("cuda", node.image, argv, env=env,
                                mounts=[("/usr", "/usr", True), *mounts],
                                cdi_devices=["nvidia.com/gpu=0"])
    pod, cid = node.run("cuda-agent", "torpor", spec, annotations=annotations)
    sock = _agent_socket(daemon, cid, gpu, "agcri")
    old_pid = node.cri.pid(cid)
    archive = crimod.kubelet_archive(node.checkpoints, pod, "cuda")
    node.cri.checkpoint(cid, archive)
    assert node.cri.state(cid) == "CONTAINER_RUNNING"
    ev = _agent_events(events)
    # the leave-running staging's status (asked once containerd's pause is lifted), whether it
    # can hold its memory (a copier for it, engine.holding: not asked into the store), the
    # prepare's
    n = 3 if ev[:3] == ["agent status"] * 3 else 2
    assert ev[:n] == ["agent status"] * n and ev[n].startswith("agent prepare") and \
        "agent detach" in ev, ev
    assert n == (2 if annotations.get("org.torpor.store") else 3), (annotations, ev)
    assert ev[-2:] == ["agent status", "agent resume"], ev   # left running: resumed from the files
    with AgentClient(sock) as a:
        st = a.status()
    assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True)
    members = _flat_members(archive)
    m = _manifest(archive)
    assert m["agent"][str(old_pid)]["bytes"] == nbytes
    if "torpor-store.json" not in members:
        assert verify_archive(archive) == m     # torpor inspect --verify of the kubelet's archive
    events.unlink()
    node.cri.remove_pod(pod.id)

    pod2, cid2 = node.run("cuda-agent-restored", "torpor", spec, image=str(archive))
    assert node.cri.pid(cid2) != old_pid
    assert _agent_events(events)[0] == "agent status" and "agent resume" in _agent_events(events)
    with AgentClient(_agent_socket(daemon, cid2, gpu, "agcri")) as a:
        st = a.status()
    assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True)
    assert node.cri.status(cid2).status.annotations.get("restored") == "true"
    assert handler.commands().count("restore") == 1
    return m, members


def test_cri_checkpoint_and_restore_under_the_agent(node, handler, gpu, daemon):
    """org.torpor.agent=on: the agent's data files reach the kubelet's archive as flat files
    (torpor-gpu+<pid>+gpu-memory-<k>.bin; containerd 2.1 copies the runtime's image directory
    entry by entry as plain files, a subdirectory failed the checkpoint), listed under their
    tree paths in the file table; the restore puts them back and the program's memory comes
    back bit-exact through its agent."""
    m, members = _agent_round_trip(node, handler, gpu, daemon, {"org.torpor.agent": "on"},
                                   3 << 20)
    pid, entry = next(iter(m["agent"].items()))
    for k, size in enumerate(entry["files"]):
        assert f"torpor-gpu+{pid}+gpu-memory-{k}.bin" in members
        assert m["files"][f"torpor-gpu/{pid}/gpu-memory-{k}.bin"]["size"] == size


def test_cri_checkpoint_packed_into_the_store_and_restored(node, handler, gpu, daemon):
    """org.torpor.store=on (and the agent): torpor-runtime packs the checkpoint into the node's
    store, its chunk links flat in the archive (torpor-chunks+<sha256>, still hard links into
    the store until containerd copies them); the restore brings them back, verifies every chunk
    and the program's memory is intact."""
    store = node.base / "store"
    daemon.stop()   # the node's one store, as its config would give torpord and the runtime
    daemon.env["TORPOR_STORE_DIR"] = str(store)
    daemon.cfg = config.load(env=daemon.env)
    daemon.start()
    handler.write(TORPOR_STORE_DIR=str(store))
    m, members = _agent_round_trip(node, handler, gpu, daemon,
                                   {"org.torpor.agent": "on", "org.torpor.store": "on"}, 5 << 20)
    assert list((store / "snapshots").glob("*.json"))        # torpor packed it
    assert "torpor-store.json" in members
    chunks = [n for n in members if n.startswith("torpor-chunks+")]
    assert chunks and all(re.fullmatch(r"torpor-chunks\+[0-9a-f]{64}", n) for n in chunks)
    assert not [n for n in members if n.startswith("torpor-gpu")]   # only in the chunks


def test_cri_restore_refuses_a_hostile_flat_name_before_anything_starts(node, handler, gpu,
                                                                        daemon):
    """The archive is untrusted: a flat name that would climb out of the checkpoint
    (torpor-gpu+...), added to an agent checkpoint's archive, is refused at StartContainer
    with torpor's one line, before CRIU or the driver restore anything."""
    from tests.integration.test_agent_containers import agent_workload
    _cdi_spec(node, gpu)
    argv, env, mounts = agent_workload(gpu, "aghost", 1 << 20, gpu.state_dir / "agent-events")
    spec = crimod.ContainerSpec("cuda", node.image, argv, env=env,
                                mounts=[("/usr", "/usr", True), *mounts],
                                cdi_devices=["nvidia.com/gpu=0"])
    pod, cid = node.run("cuda-agent", "torpor", spec, annotations={"org.torpor.agent": "on"})
    _agent_socket(daemon, cid, gpu, "aghost")
    archive = crimod.kubelet_archive(node.checkpoints, pod, "cuda")
    node.cri.checkpoint(cid, archive)
    node.cri.remove_pod(pod.id)
    bad = archive.with_name("hostile-" + archive.name)
    with tarfile.open(archive) as src, tarfile.open(bad, "w") as dst:
        for mem in src.getmembers():
            dst.addfile(mem, src.extractfile(mem) if mem.isfile() else None)
        info = tarfile.TarInfo("checkpoint/torpor-gpu+1+.hidden")
        info.size = 4
        dst.addfile(info, io.BytesIO(b"evil"))
    restores = len([c for c in gpu.calls() if c.call == "restore"])
    pod2 = node.cri.run_pod("cuda-hostile", "torpor")
    cid2 = node.cri.create(pod2, spec, image=str(bad))
    with pytest.raises(crimod.CriError) as err:
        node.cri.start(cid2)
    assert "not a valid flat name" in err.value.details, err.value
    assert node.cri.state(cid2) != "CONTAINER_RUNNING"
    assert len([c for c in gpu.calls() if c.call == "restore"]) == restores


def test_cri_restore_of_a_tampered_archive_is_refused_before_anything_starts(node, handler, gpu,
                                                                            daemon):
    """The archive is untrusted: one byte changed in a memory image, and StartContainer fails
    with torpor's checksum error before CRIU or the driver restore anything."""
    w, spec = _gpu_workload(node, gpu)
    archive, host_pid, tick = _gpu_checkpoint(node, gpu, w, spec)
    bad = archive.with_name("tampered-" + archive.name)
    with tarfile.open(archive) as src, tarfile.open(bad, "w") as dst:
        pages = sorted(m.name for m in src.getmembers() if m.name.startswith("checkpoint/pages-"))
        assert pages
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if m.name == pages[0]:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    pod2 = node.cri.run_pod("cuda-tampered", "torpor")
    cid2 = node.cri.create(pod2, spec, image=str(bad))
    with pytest.raises(crimod.CriError) as err:
        node.cri.start(cid2)
    assert "checksum mismatch" in err.value.details, err.value
    assert node.cri.state(cid2) != "CONTAINER_RUNNING"
    assert not [c for c in gpu.calls() if c.call == "restore" and c.pid != host_pid]
