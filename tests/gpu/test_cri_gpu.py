"""The kubelet's checkpoint/restore flow through containerd 2.x's CRI with a real GPU: PyTorch
continues bit-exact.

Over containerd's CRI socket, as the kubelet calls it (integration/cri.py; a private containerd 2
per node, the torpor runtime handler's BinaryName TORPOR_TEST_RUNTIME, default
/usr/local/bin/torpor-runtime): RunPodSandbox -> CreateContainer with ``nvidia.com/gpu=0``
from the node's CDI spec (the device plugin's: the GPU's device node, the driver's control
nodes, NVIDIA_VISIBLE_DEVICES) -> StartContainer -> train -> CheckpointContainer (the kubelet's
archive; the container trains on) -> the pod removed -> a new sandbox -> CreateContainer with
the archive as the image -> StartContainer: the restored program's steps agree with an
uninterrupted reference run of the same seed (tests/gpu/compare_steps.py). And the same from a
checkpoint image: built from the archive, pushed to Debian's docker-registry (TLS, htpasswd),
pulled by a second containerd 2 (its own root, state and socket) with the pull secret's
credentials, restored there. integration/cri_gpu.py has the node and the container.

Skipped without a GPU, PyTorch, containerd 2 (TORPOR_CONTAINERD2) or torpor-runtime; the
registry test also without docker-registry (TORPOR_DOCKER_REGISTRY) and its TLS tools.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from integration import cri
from integration.cri_gpu import CriTorch, GpuNode, gpu_uuids
from integration.oci_registry import LayoutRegistry
from tests.gpu.compare_steps import compare
from tests.gpu.conftest import GPU_SKIP
from tests.integration.registry_server import PASSWORD, USER, Registry
from tests.integration.registry_server import missing as registry_missing
from torpor import driver

RUNTIME = os.environ.get("TORPOR_TEST_RUNTIME", "/usr/local/bin/torpor-runtime")
CRI_SKIP = cri.missing() or (None if os.access(RUNTIME, os.X_OK) else f"needs {RUNTIME}")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or ""),
              pytest.mark.skipif(CRI_SKIP is not None, reason=CRI_SKIP or "")]


@pytest.fixture(scope="module")
def base_images():
    with LayoutRegistry({"torpor-busybox": cri.BUSYBOX_TAR}) as reg:
        yield reg


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="tcrig", dir="/var/tmp"))   # on disk: GBs of archives
    yield d
    cri.remove_tree(d)


@pytest.fixture
def nodes(base, base_images):
    made: list[GpuNode] = []

    def make(name: str) -> GpuNode:
        made.append(GpuNode(base / name, RUNTIME, base_images))
        return made[-1]
    yield make
    for n in reversed(made):
        n.close()


def _manifest(archive: Path) -> dict:
    with tarfile.open(archive) as tf:
        return json.loads(tf.extractfile("checkpoint/torpor.json").read())


def _cuda_state(pid: int) -> str:
    return driver.Driver.load(os.environ.get("TORPOR_LIBCUDA", "libcuda.so.1")).get_state(pid).name


def _bit_exact(ref: CriTorch, tc: CriTorch, last: int) -> None:
    ref.wait(lambda: ref.status().get("done") or ref.step() >= last, 600, f"reference step {last}")
    tc.wait_step(last, timeout=600)
    n, mismatch = compare(str(ref.steps), str(tc.steps))
    assert mismatch is None, f"diverged at {mismatch}"
    assert n >= last, f"only {n} common steps"


def _trained_and_checkpointed(node: GpuNode, work: Path, gib: float, last: int,
                              annotations: dict[str, str] | None = None
                              ) -> tuple[CriTorch, CriTorch, Path, int]:
    """A reference pod (stops at step `last`) and a training pod, both through the torpor
    handler; the training one CheckpointContainer'd past step 10, trains on, its pod removed.
    (reference, trained, archive, its host PID)."""
    ref = CriTorch(node, "ref", work, gib, max_steps=last + 1, annotations=annotations)
    tc = CriTorch(node, "train", work, gib, annotations=annotations)
    ref.run("torpor")
    tc.run("torpor")
    tc.wait_ready()
    tc.wait_step(10)
    old_pid = node.cri.pid(tc.cid)
    archive = node.checkpoint(tc)
    assert tc.state() == "CONTAINER_RUNNING"             # the kubelet's checkpoint: it runs on
    at = tc.step()
    tc.wait_step(at + 3)
    m = _manifest(archive)
    assert m["container"]["minors"] == [gpu_uuids()[0][0]], m["container"]   # nvidia.com/gpu=0
    assert any(p["cuda"] for p in m["processes"]), m["processes"]
    moved = sum(a.get("bytes", 0) for a in (m.get("agent") or {}).values())
    if (annotations or {}).get("org.torpor.agent") == "off":
        assert not moved, m.get("agent")
    gpu_bytes = (m.get("sizes") or {}).get("gpu_memory", 0)
    assert moved + gpu_bytes >= gib * (1 << 30) * 0.9, (m.get("sizes"), moved)
    tc.remove()
    return ref, tc, archive, old_pid


@pytest.mark.parametrize("agent", ["default", "off"])
def test_cri_gpu_checkpoint_and_restore_from_the_kubelets_archive_continues_bit_exact(nodes, base,
                                                                                     agent):
    """The agent preloaded as GPU containers get it by default, and org.torpor.agent=off (the
    driver's checkpoint API)."""
    node = nodes("a")
    ann = {"org.torpor.agent": "off"} if agent == "off" else None
    ref, tc, archive, old_pid = _trained_and_checkpointed(node, base / "work", 2.0, last=59,
                                                          annotations=ann)
    at = tc.step()
    tc.run("torpor", image=str(archive))                 # a new pod, from the archive
    new_pid = node.cri.pid(tc.cid)
    assert new_pid != old_pid and _cuda_state(new_pid) == "RUNNING"
    assert node.cri.status(tc.cid).status.annotations.get("restored") == "true"
    tc.wait_step(at + 10)
    _bit_exact(ref, tc, 59)


@pytest.mark.skipif(registry_missing() is not None, reason=registry_missing() or "")
def test_cri_gpu_restore_on_a_second_node_from_a_checkpoint_image_pulled_from_a_registry(
        nodes, base):
    """The kubelet's archive built into a checkpoint image (`torpor image build`), pushed to
    the registry; node B (a second containerd 2) pulls it with the pull secret's credentials
    (refused without) and CreateContainer from the image reference restores it bit-exact."""
    node = nodes("a")
    ref, tc, archive, old_pid = _trained_and_checkpointed(node, base / "work", 1.0, last=49)
    registry = Registry(base / "registry").start()
    try:
        env = dict(os.environ)
        layout = base / "image"
        built = _torpor(env, "image", "build", str(archive), "-o", str(layout), "--name", tc.name)
        assert built["annotations"]["org.criu.checkpoint.container.name"] == tc.name
        archive.unlink()
        image = f"{registry.host}/ckpt/{tc.name}:v1"
        pushed = _torpor(env, "image", "push", str(layout), image, *registry.args())
        assert pushed["digest"] == built["digest"]
        node_b = nodes("b")
        node_b.trust(registry.host, registry.certs / "ca.crt")
        with pytest.raises(cri.CriError):
            node_b.cri.pull(image)                       # no pull secret: refused
        node_b.cri.pull(image, auth=(USER, PASSWORD))
        at = tc.step()
        tc_b = CriTorch(node_b, tc.name, tc.workdir, tc.gib)   # the same files: it goes on
        tc_b.run("torpor", image=image)
        new_pid = node_b.cri.pid(tc_b.cid)
        assert new_pid != old_pid and _cuda_state(new_pid) == "RUNNING"
        assert node_b.cri.status(tc_b.cid).status.annotations.get("restored") == "true"
        tc_b.wait_step(at + 10)
        _bit_exact(ref, tc_b, 49)
    finally:
        registry.kill()


def _torpor(env: dict[str, str], *args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "torpor.cli.main", "--json", *args], env=env,
                       capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"torpor {' '.join(args)} exited {r.returncode}: {r.stderr}"
    return json.loads(r.stdout)
