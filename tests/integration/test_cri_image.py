"""Restore from a checkpoint *image* through containerd 2.x's CRI, the image moved through a real
registry: CheckpointContainer of a fake-GPU container on node A (the kubelet's archive) ->
`torpor image build` from that archive -> `torpor image push` to Debian's docker-registry (TLS
with a CA made here, htpasswd auth: tests/integration/registry_server.py) -> on node B, a
second containerd 2 (its own root, state, socket, and certs.d/<registry>/hosts.toml naming the
CA), the kubelet's PullImage with the pull secret's credentials, then CreateContainer with
image = the checkpoint image's reference and StartContainer: the program continues.

containerd 2.1 knows a checkpoint image by the annotation org.criu.checkpoint.container.name on
the image's manifest (internal/cri/server/container_checkpoint_linux.go,
checkIfCheckpointOCIImage), only once the image is on the node (it resolves it locally: the
kubelet's PullImage comes first), and restores from the layer's files (config.dump, spec.dump,
status.dump, checkpoint/ at its root, as the kubelet's archive has them).

Skipped without containerd 2 or docker-registry.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import socket
import subprocess
import threading
import sys
import tarfile
from pathlib import Path

import pytest

from integration import cri as crimod
from tests.fakes.fakegpu import RUNNING
from tests.integration.conftest import needs_criu
from tests.integration.registry_server import PASSWORD, USER, Registry
from tests.integration.registry_server import missing as registry_missing
from tests.integration.test_cri import (  # noqa: F401  (fixtures)
    Node, _gpu_checkpoint, _gpu_workload, handler, node, registry)
from tests.integration.torpord import base, daemon, gpu  # noqa: F401  (fixtures)
from tests.integration.test_registry import netns  # noqa: F401  (fixture)
from torpor import config
from torpor.store import chunk

SKIP = crimod.missing() or registry_missing()
pytestmark = [needs_criu, pytest.mark.criu,
              pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]


@pytest.fixture
def docker_registry(base):
    r = Registry(base / "docker-registry").start()
    yield r
    r.kill()


def _torpor(env: dict[str, str], *args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "torpor.cli.main", "--json", *args], env=env,
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"torpor {' '.join(args)} exited {r.returncode}: {r.stderr}"
    return json.loads(r.stdout)


def _second_node(base: Path, handler, registry, docker_registry: Registry,
                 netns: str | None = None):
    """Node B: a second containerd 2 (own root, state, socket), the same handler and fake GPU
    host; base images from the plain-HTTP layout registry, the docker-registry over TLS with
    its CA in certs.d/<host>/hosts.toml (containerd's per-registry TLS settings). netns: its
    network namespace (the daemon, its shims and its host-network pods there)."""
    cdi = base / "cdi-b"
    cdi.mkdir()
    d = crimod.Containerd2(base / "c2b", str(handler.path), cdi_dirs=[cdi],
                           registries=[f"localhost:{registry.port}"], netns=netns)
    hosts = d.base / "certs.d" / docker_registry.host / "hosts.toml"
    hosts.parent.mkdir(parents=True)
    ca = docker_registry.certs / "ca.crt"
    hosts.write_text(f'server = "https://{docker_registry.host}"\n'
                     f'[host."https://{docker_registry.host}"]\n'
                     '  capabilities = ["pull", "resolve"]\n'
                     f'  ca = "{ca}"\n')
    cri = crimod.Cri(d.socket)
    try:
        yield Node(d, cri, registry.ref("torpor-busybox", "1"), base / "b", cdi)
    finally:
        try:
            cri.remove_all()
        finally:
            cri.close()
            d.stop()


@pytest.fixture
def node_b(base, handler, registry, docker_registry):
    yield from _second_node(base, handler, registry, docker_registry)


def _setns(path: str) -> None:
    """This thread into the network namespace at path (setns(2) moves only the caller)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, 0x40000000) != 0:                   # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


class _Forward:
    """127.0.0.1:port inside network namespace ns forwarded to 127.0.0.1:port here: node B
    reaches the base images' layout registry at the address the checkpoint names (containerd
    pulls the base image again at a restore)."""

    def __init__(self, ns: str, port: int) -> None:
        self.port, made = port, {}

        def listen() -> None:
            _setns(f"/run/netns/{ns}")
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen(16)
            made["sock"] = s                                     # stays in ns once made
        t = threading.Thread(target=listen)
        t.start()
        t.join()
        self.sock = made["sock"]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
                up = socket.create_connection(("127.0.0.1", self.port))
            except OSError:
                return
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        finally:
            try:
                b.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


@pytest.fixture
def node_b_netns(base, handler, registry, netns):
    """Node B in a network namespace of its own (veth to this one, test_registry.py's), and
    a docker-registry (TLS, htpasswd) listening on this side's veth address: (node, registry,
    namespace)."""
    ns, here = netns
    r = Registry(base / "docker-registry-ns", ip=here).start()
    fwd = _Forward(ns, registry.port)
    try:
        for n in _second_node(base, handler, registry, r, netns=ns):
            yield n, r, ns
    finally:
        fwd.close()
        r.kill()


def test_cri_restores_a_gpu_checkpoint_image_pulled_from_a_registry(node, node_b, handler, gpu,
                                                                    daemon, docker_registry):
    """A fake-GPU container checkpointed through CRI on node A, its archive built into a
    checkpoint image and pushed; node B pulls it as the kubelet does (PullImage with the pull
    secret's credentials; without them the registry refuses) and CreateContainer with the
    image reference restores it: the program continues on node B with its GPU state."""
    w, spec = _gpu_workload(node, gpu)
    archive, host_pid, tick = _gpu_checkpoint(node, gpu, w, spec)
    layout = node.base / "image"
    built = _torpor(daemon.env, "image", "build", str(archive), "-o", str(layout),
                    "--name", "cuda")
    assert built["annotations"]["org.criu.checkpoint.container.name"] == "cuda"
    ref = f"{docker_registry.host}/ckpt/cuda:v1"
    pushed = _torpor(daemon.env, "image", "push", str(layout), ref, *docker_registry.args())
    assert pushed["digest"] == built["digest"]

    cri = node_b.cri
    with pytest.raises(crimod.CriError) as err:            # no pull secret: refused
        cri.pull(ref)
    assert "no basic auth credentials" in err.value.details, err.value
    image_ref = cri.pull(ref, auth=(USER, PASSWORD))
    assert image_ref.startswith("sha256:")
    # node B's device plugin: the same CDI spec (the same fake GPU host)
    node_b.cdi.joinpath("nvidia.json").write_text((node.cdi / "nvidia.json").read_text())

    pod, cid = node_b.run("cuda-from-image", "torpor", spec, image=ref)
    new_pid = node_b.cri.pid(cid)
    assert new_pid != host_pid and w.host_pid() == new_pid
    w.wait_ticking(tick)
    e = w.entry()
    assert e["state"] == RUNNING and e["gpu"] == gpu.uuid(0)
    assert [(c.call, c.pid) for c in gpu.calls() if c.pid == new_pid
            and c.call in ("restore", "unlock")] == [("restore", new_pid), ("unlock", new_pid)]
    ann = node_b.cri.status(cid).status.annotations
    assert ann.get("restored") == "true", ann
    assert handler.commands().count("restore") == 1


def _use_store(daemon, handler, store: Path) -> None:
    """The node's one store, as its config would give torpord and torpor-runtime."""
    daemon.stop()
    daemon.env["TORPOR_STORE_DIR"] = str(store)
    daemon.cfg = config.load(env=daemon.env)
    daemon.start()
    handler.write(TORPOR_STORE_DIR=str(store))


def _layer_names(layout: Path, digest: str) -> list[str]:
    blobs = layout / "blobs" / "sha256"
    image = json.loads((blobs / digest[7:]).read_text())
    with tarfile.open(blobs / image["layers"][0]["digest"][7:]) as tf:
        return tf.getnames()


def _artifact(layout: Path, digest: str) -> list[tuple[str, str]]:
    """The chunk artifact of the image digest in layout: (chunk name, blob digest) each."""
    blobs = layout / "blobs" / "sha256"
    image = json.loads((blobs / digest[7:]).read_text())
    art = json.loads((blobs / image["annotations"]["io.torpor.chunks"][7:]).read_text())
    return [(d["annotations"]["io.torpor.chunk"], d["digest"]) for d in art["layers"]]


def _store_chunks(store: Path) -> set[str]:
    """The chunks in a store, each read back whole and checked against its name (a half or
    damaged chunk fails here), and no temporary file of a writer left."""
    names = set()
    for f in (store / "chunks").glob("*/*"):
        chunk.decode(chunk.read_blob_file(f, str(store)), f.name, str(store))
        names.add(f.name)
    tmp = store / "tmp"
    assert not (tmp.exists() and any(tmp.iterdir())), list(tmp.iterdir())
    return names


def test_cri_restores_a_packed_checkpoint_image_fetching_the_chunks_its_store_lacks(
        node, node_b_netns, handler, gpu, daemon):
    """org.torpor.store=on: the kubelet's archive carries the chunk links (torpor-chunks+<sha>);
    `torpor image build` puts them in the chunk artifact and the layer keeps only references
    (torpor-store.json). On node B, whose store is empty, with no `torpor image pull`:
    StartContainer from the image reference has torpor-runtime fetch the chunks from the
    artifact beside the image (the repository from containerd's checkpointImage annotation,
    node B's credentials from torpor's registry_auth_file, TLS from node B's containerd
    hosts.toml), each verified, and the program continues. Before that, wrong credentials, a
    tampered or truncated chunk, an unreachable registry and a fetch that cannot finish in its
    time are each refused at StartContainer with one line naming `torpor image pull`: nothing
    restored, nothing running, every chunk in node B's store whole and verified. Node B has
    its own network namespace: the program continues there."""
    node_b, docker_registry, ns = node_b_netns
    _use_store(daemon, handler, node.base / "store-a")
    w, spec = _gpu_workload(node, gpu)
    archive, host_pid, tick = _gpu_checkpoint(node, gpu, w, spec,
                                              annotations={"org.torpor.store": "on"})
    with tarfile.open(archive) as tf:
        links = [n for n in tf.getnames() if n.startswith("checkpoint/torpor-chunks+")]
    assert links
    layout = node.base / "image"
    built = _torpor(daemon.env, "image", "build", str(archive), "-o", str(layout),
                    "--name", "cuda")
    assert built["chunks"] == len(links) and "io.torpor.chunks" in built["annotations"]
    names = _layer_names(layout, built["digest"])
    assert "checkpoint/torpor-store.json" in names and "config.dump" in names
    assert not [n for n in names if "torpor-chunks" in n], names      # references only
    ref = f"{docker_registry.host}/ckpt/cuda-store:v1"
    _torpor(daemon.env, "image", "push", str(layout), ref, *docker_registry.args())
    art = _artifact(layout, built["digest"])

    store_b = node.base / "store-b"                                     # node B's, empty
    _use_store(daemon, handler, store_b)
    node_b.cdi.joinpath("nvidia.json").write_text((node.cdi / "nvidia.json").read_text())
    node_b.cri.pull(ref, auth=(USER, PASSWORD))                         # the kubelet's pull
    node_env = {"TORPOR_STORE_DIR": str(store_b),
                "TORPOR_REGISTRY_HOSTS_DIR": str(node_b.daemon.base / "certs.d"),
                "TORPOR_REGISTRY_AUTH_FILE": str(docker_registry.authfile)}
    restores = len([c for c in gpu.calls() if c.call == "restore"])

    def refused(name: str, why: str, **env: str) -> None:
        handler.write(**{**node_env, **env})
        pod = node_b.cri.run_pod(name, "torpor")
        cid = node_b.cri.create(pod, spec, image=ref)
        with pytest.raises(crimod.CriError) as err:
            node_b.cri.start(cid)
        assert why in err.value.details and "torpor image pull" in err.value.details, \
            err.value.details
        assert node_b.cri.state(cid) != "CONTAINER_RUNNING"
        assert len([c for c in gpu.calls() if c.call == "restore"]) == restores
        node_b.cri.remove_pod(pod.id)
        _store_chunks(store_b)

    bad = docker_registry.root / "wrong-auth.json"
    bad.write_text(json.dumps({"auths": {docker_registry.host: {
        "auth": base64.b64encode(f"{USER}:not-the-password".encode()).decode()}}}))
    refused("wrong-credentials", "authentication refused: check registry_auth_file",
            TORPOR_REGISTRY_AUTH_FILE=str(bad))
    assert not _store_chunks(store_b)
    refused("no-tls-settings", "TLS certificate not trusted (unable to get local issuer",
            TORPOR_REGISTRY_HOSTS_DIR=str(node.base / "no-hosts-dir"))
    refused("no-time", "did not end within restore_fetch_timeout_s",
            TORPOR_RESTORE_FETCH_TIMEOUT="0.001")
    assert not _store_chunks(store_b)

    victim, digest = art[0]
    blob = docker_registry.blob_file(digest)
    good = blob.read_bytes()
    for how, damaged, why in [("flipped", good[:-1] + bytes([good[-1] ^ 1]),
                               f"{digest} does not match its digest"),
                              ("truncated", good[: len(good) // 2],
                               f"{digest} has {len(good) // 2} bytes")]:
        blob.write_bytes(damaged)
        refused(f"chunk-{how}", why)
        assert victim not in _store_chunks(store_b)
    blob.write_bytes(good)
    docker_registry.kill()
    refused("registry-down", "Connection refused")
    docker_registry.start()

    handler.write(**node_env)
    pod, cid = node_b.run("cuda-from-image", "torpor", spec, image=ref)
    new_pid = node_b.cri.pid(cid)
    assert new_pid != host_pid and w.host_pid() == new_pid
    w.wait_ticking(tick)
    e = w.entry()
    assert e["state"] == RUNNING and e["gpu"] == gpu.uuid(0)
    assert node_b.cri.status(cid).status.annotations.get("restored") == "true"
    assert {n for n, _d in art} <= _store_chunks(store_b)               # fetched, verified
    assert os.stat(f"/proc/{new_pid}/ns/net").st_ino == os.stat(f"/run/netns/{ns}").st_ino
