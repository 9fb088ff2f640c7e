"""A PyTorch program in a pod through containerd 2's CRI, with the host's GPUs as the NVIDIA
device plugin gives them through CDI: for tests/gpu/test_cri_gpu.py and bench/cri_path.py.

    with LayoutRegistry({"torpor-busybox": cri.BUSYBOX_TAR}) as base_images:
        node = GpuNode(base, runtime, base_images)             # a private containerd 2
        tp = CriTorch(node, "t1", workdir, gib=4, seed=1234)
        tp.run("torpor"); tp.wait_ready(); tp.wait_step(10)
        archive = node.checkpoint(tp)                           # CheckpointContainer; runs on
        tp.remove(); tp.run("torpor", image=str(archive))       # a new pod, from the archive
        tp.wait_step(at + 10); node.close()

The node's CDI spec (``nvidia.com/gpu=<index>``) carries each GPU's device node and the driver's
control nodes (``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``), with
``NVIDIA_VISIBLE_DEVICES`` the GPU's UUID, as the device plugin's CDI spec does; the container
asks for ``nvidia.com/gpu=0``. The image is the locally built static busybox (pulled with
PullImage from a stdlib registry: containerd 2.1 pulls a checkpoint's base image again at
restore); the host's /usr, /etc/ld.so.cache and the Python environment torch lives in are
bound read-only. CRI binds are recursive (``rbind``: the CRI has no other kind), and CRIU
cannot dump a submount it was not told about (the GPU host's /usr/local/nvidia): so a tree
with submounts is bound as the pieces beside them plus each submount on its own
(:func:`cover`), every one a mount in the spec, which runc hands CRIU as external.

``program``: torch_program.py, or tests/gpu/cpu_program.py (same command line and files, no
GPU) with ``gpu=False``: the same flow on a machine without a GPU, for rehearsals.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Mapping

from . import cri
from .gpu import TORCH_PROGRAM, ContainedTorch

__all__ = ["cover", "gpu_binds", "write_cdi_spec", "GpuNode", "CriTorch", "CPU_PROGRAM"]

CPU_PROGRAM = TORCH_PROGRAM.parent / "cpu_program.py"
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def _mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4].replace("\\040", " ") for line in f}


def cover(path: str, points: set[str] | None = None) -> list[str]:
    """Host paths whose recursive binds together show ``path``'s tree and bring along no
    mount that is not one of them: ``[path]`` when nothing is mounted below it; else its
    entries one by one (those holding a mount point covered the same way; symbolic links
    left out: a bind follows them) and each mount point itself."""
    points = _mount_points() if points is None else points
    top = path.rstrip("/") or "/"
    below = [p for p in points if p.startswith(top + "/")]
    if not below:
        return [top]
    out = []
    with os.scandir(top) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if e.is_symlink():
            continue
        full = os.path.join(top, e.name)
        if e.is_dir(follow_symlinks=False):
            out += cover(full, points)
        elif e.is_file(follow_symlinks=False) or full in points:
            out.append(full)
    return out


def gpu_binds(*rw: Path) -> list[tuple[str, str, bool]]:
    """(host, container, read-only) binds for a torch program: /usr, /etc/ld.so.cache, the
    top directory of the Python environment (e.g. /opt) when it is outside /usr, each
    covered around its submounts; then ``rw``, read-write."""
    points = _mount_points()
    ro = cover("/usr", points)
    prefix = Path(sys.prefix).resolve()
    if not str(prefix).startswith("/usr"):
        ro += cover(str(Path("/", *prefix.parts[1:2])), points)
    out = [(p, p, True) for p in ro] + [("/etc/ld.so.cache", "/etc/ld.so.cache", True)]
    return out + [(str(p), str(p), False) for p in rw]


def _node(path: str, host: Path) -> dict:
    st = os.stat(host)
    assert stat.S_ISCHR(st.st_mode), f"{host} is not a character device"
    return {"path": path, "hostPath": str(host), "type": "c", "major": os.major(st.st_rdev),
            "minor": os.minor(st.st_rdev), "permissions": "rw"}


def gpu_uuids() -> list[tuple[int, str]]:
    """(minor number, UUID) of each GPU, from NVML (torpor's own inventory)."""
    from torpor import gpus
    return [(g.minor if g.minor is not None else g.index, g.uuid) for g in gpus.discover().gpus]


def write_cdi_spec(directory: Path, gpus: list[tuple[int, str]] | None = None,
                   dev: Path = Path("/dev")) -> Path:
    """The device plugin's CDI spec for this host's GPUs (``gpus``: (minor, UUID) each,
    default :func:`gpu_uuids`; device nodes under ``dev``): nvidia.com/gpu=<index>."""
    gpus = gpu_uuids() if gpus is None else gpus
    devices = [{"name": str(i), "containerEdits": {
        "deviceNodes": [_node(f"/dev/nvidia{minor}", dev / f"nvidia{minor}")],
        "env": [f"NVIDIA_VISIBLE_DEVICES={uuid}"]}} for i, (minor, uuid) in enumerate(gpus)]
    control = [_node(p, dev / Path(p).name) for p in CONTROL_NODES
               if (dev / Path(p).name).exists()]
    spec = {"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu", "devices": devices,
            "containerEdits": {"deviceNodes": control}}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nvidia.json"
    path.write_text(json.dumps(spec, indent=1))
    return path


class GpuNode:
    """A node: a private containerd 2 under ``base`` (handlers runc and torpor, BinaryName
    ``runtime``), its CDI spec (``gpu``), the base image pulled from ``base_images``."""

    def __init__(self, base: Path, runtime: str, base_images, *, gpu: bool = True):
        self.base = Path(base)
        self.cdi = self.base / "cdi"
        if gpu:
            write_cdi_spec(self.cdi)
        else:
            self.cdi.mkdir(parents=True, exist_ok=True)
        self.daemon = cri.Containerd2(self.base / "c2", runtime, cdi_dirs=[self.cdi],
                                      registries=[f"localhost:{base_images.port}"])
        self.cri = cri.Cri(self.daemon.socket, timeout=900)
        try:
            self.image = base_images.ref("torpor-busybox", "1")
            self.cri.pull(self.image)
        except BaseException:
            self.close()
            raise
        self.checkpoints = self.base / "kubelet" / "checkpoints"   # the kubelet's directory
        self.checkpoints.mkdir(parents=True, exist_ok=True, mode=0o700)

    def trust(self, host: str, ca: Path) -> None:
        """certs.d/<host>/hosts.toml: pull from ``host`` over TLS with ``ca``."""
        hosts = self.daemon.base / "certs.d" / host / "hosts.toml"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text(f'server = "https://{host}"\n[host."https://{host}"]\n'
                         f'  capabilities = ["pull", "resolve"]\n  ca = "{ca}"\n')

    def checkpoint(self, tp: "CriTorch", timeout: int = 900) -> Path:
        """CheckpointContainer of ``tp`` into the kubelet's archive path (it runs on)."""
        archive = cri.kubelet_archive(self.checkpoints, tp.pod, tp.name)
        self.cri.checkpoint(tp.cid, archive, timeout=timeout)
        return archive

    def close(self) -> None:
        try:
            self.cri.remove_all()
        finally:
            self.cri.close()
            self.daemon.stop()


class CriTorch(ContainedTorch):
    """``program`` (torch_program.py) in a pod of its own on ``node``: steps, status and log
    in ``workdir``, so a restored container goes on writing the same files."""

    def __init__(self, node: GpuNode, name: str, workdir: Path, gib: float, seed: int = 1234,
                 max_steps: int = 0, annotations: Mapping[str, str] | None = None,
                 program: Path = TORCH_PROGRAM, gpu: bool = True):
        super().__init__(name, workdir, gib, seed, max_steps, program)
        self.node, self.annotations, self.gpu = node, dict(annotations or {}), gpu
        self.pod: cri.Pod | None = None
        self.cid = ""
        self.runs = 0

    def spec(self) -> cri.ContainerSpec:
        argv, env = self.command()
        return cri.ContainerSpec(self.name, self.node.image, argv, env=env,
                                 mounts=gpu_binds(self.workdir, self.program.parent),
                                 cdi_devices=["nvidia.com/gpu=0"] if self.gpu else [],
                                 annotations=self.annotations)

    def run(self, handler: str = "torpor", image: str | None = None) -> str:
        """RunPodSandbox, CreateContainer (from ``image``: an archive or checkpoint image),
        StartContainer; returns the container's ID."""
        self.create(handler, image)
        self.node.cri.start(self.cid)
        return self.cid

    def create(self, handler: str = "torpor", image: str | None = None) -> str:
        """RunPodSandbox and CreateContainer only (StartContainer is the caller's)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.runs += 1
        self.pod = self.node.cri.run_pod(f"{self.name}-{self.runs}", handler,
                                         annotations=self.annotations)
        self.cid = self.node.cri.create(self.pod, self.spec(), image)
        return self.cid

    def remove(self) -> None:
        if self.pod is not None:
            self.node.cri.remove_pod(self.pod.id)
            self.pod = None

    def state(self) -> str:
        try:
            return self.node.cri.state(self.cid)
        except cri.CriError as e:
            return f"unknown ({e})"

    def running(self, state: str) -> bool:
        return state == "CONTAINER_RUNNING"
