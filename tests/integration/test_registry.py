"""Checkpoint images through a real registry: Debian's docker-registry on localhost with TLS (a
CA made here) and htpasswd auth, as a user runs it. A checkpoint is built into an image, pushed,
pulled on a "second node" (its own state dir and image store) and restored there; a second
checkpoint of a barely changed program pushes little; a tampered or truncated blob is refused
before anything restores; a registry killed mid-push leaves a push that resumes (the blobs it
finished are not sent again; resuming within a blob is tested in tests/unit/test_registry_images.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.fakes.fakegpu import RUNNING
from tests.integration.conftest import (Torpor, alive, checkpointed_and_reaped, needs_criu,
                                        read_count, wait_for)
from tests.integration.registry_server import Registry, missing
from tests.integration.test_store_cli import STABLE_PROGRAM

pytestmark = [needs_criu, pytest.mark.skipif(missing() is not None, reason=missing() or "")]


@pytest.fixture
def registry(tmp_path):
    r = Registry(tmp_path / "registry").start()
    yield r
    r.kill()


@pytest.fixture
def node_a(torpor, tmp_path):
    torpor.env["TORPOR_STORE_DIR"] = str(tmp_path / "store-a")
    return torpor


@pytest.fixture
def node_b(torpor, tmp_path):
    """A second node: its own state, run dir and image store (the same fake GPU host)."""
    env = {**torpor.env, "TORPOR_STATE_DIR": str(tmp_path / "b-state"),
           "TORPOR_RUN_DIR": str(tmp_path / "b-run"), "TORPOR_STORE_DIR": str(tmp_path / "store-b")}
    return Torpor(env)


def _stable_program(tmp_path: Path, reaper: list[int]) -> tuple[subprocess.Popen, Path]:
    status = tmp_path / "n.txt"
    prog = subprocess.Popen([sys.executable, "-c", STABLE_PROGRAM, str(status)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    reaper.append(prog.pid)
    wait_for(lambda: prog.poll() is not None or read_count(status), 30,
             "the program")
    assert prog.poll() is None
    return prog, status


_count = read_count


def _build_push(t: Torpor, registry: Registry, src: Path, layout: Path, ref: str) -> dict:
    t.json("image", "build", str(src), "-o", str(layout))
    return t.json("image", "push", str(layout), f"{registry.host}/{ref}", *registry.args())


def test_a_gpu_checkpoint_round_trips_through_the_registry(node_a, node_b, gpu, registry,
                                                            tmp_path, reaper):
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    reaper.append(prog.pid)
    prog.wait_tick(2)
    node_a.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"), "--store", "one")
    checkpointed_and_reaped(prog)
    built = node_a.json("image", "build", str(tmp_path / "ck"), "-o", str(tmp_path / "img"))
    ann = built["annotations"]
    assert ann["org.criu.checkpoint.container.name"] == "ck"
    assert ann["io.kubernetes.cri-o.annotations.checkpoint.name"] == "ck"
    assert json.loads(ann["io.torpor.checkpoint.gpus"])[0]["uuid"]
    assert built["chunks"] >= 1 and "io.torpor.chunks" in ann
    # no credentials: refused with one line, nothing sent
    denied = node_a.run("image", "push", str(tmp_path / "img"), f"{registry.host}/ck/gpu:v1",
                        "--cert-dir", str(registry.certs), "--authfile", "/dev/null")
    assert denied.returncode != 0 and len(denied.stderr.strip().splitlines()) == 1, denied.stderr
    pushed = node_a.json("image", "push", str(tmp_path / "img"), f"{registry.host}/ck/gpu:v1",
                         *registry.args())
    assert pushed["uploaded_blobs"] == pushed["blobs"] == built["chunks"] + 3  # +empty, config, layer
    pulled = node_b.json("image", "pull", f"{registry.host}/ck/gpu:v1", "-D",
                         str(tmp_path / "pulled"), *registry.args())
    assert pulled["chunks_fetched"] == built["chunks"] and pulled["chunks_from_store"] == 0
    assert pulled["checkpoint"] == str(tmp_path / "pulled" / "checkpoint")
    tick = prog.tick()
    r = node_b.json("restore", "-D", pulled["checkpoint"])
    assert r["cuda_pids"] == [prog.pid] and gpu.state(prog.pid)["state"] == RUNNING
    prog.wait_tick(tick + 3)
    # the node's store has them now: a second pull fetches no chunk
    again = node_b.json("image", "pull", f"{registry.host}/ck/gpu:v1", "-D",
                        str(tmp_path / "pulled2"), *registry.args())
    assert again["chunks_fetched"] == 0 and again["chunks_from_store"] == built["chunks"]


def test_a_node_whose_gpu_cannot_take_it_refuses_before_fetching_the_chunks(node_a, node_b, gpu,
                                                                            registry, tmp_path,
                                                                            reaper):
    prog = gpu.spawn(gpu_index=0, mem=8 << 30)
    reaper.append(prog.pid)
    prog.wait_tick(2)
    node_a.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"), "--store", "one")
    checkpointed_and_reaped(prog)
    _build_push(node_a, registry, tmp_path / "ck", tmp_path / "img", "fit/ck:v1")
    gpu.set_gpus([(gpu.uuid(0), "NVIDIA H200", 4 << 30)])     # node b: too little memory
    ref = f"{registry.host}/fit/ck:v1"
    out = node_b.run("image", "pull", ref, "-D", str(tmp_path / "p"), *registry.args())
    assert out.returncode == 7 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "no GPU here can take" in out.stderr and not (tmp_path / "p").exists()
    assert not list((tmp_path / "store-b").glob("chunks/*/*"))   # no chunk was fetched
    r = node_b.json("image", "pull", ref, "-D", str(tmp_path / "p"), "--no-preflight",
                    *registry.args())
    assert r["chunks_fetched"] == r["chunks"] >= 1


def test_a_second_checkpoint_pushes_only_what_changed(node_a, node_b, registry, tmp_path,
                                                      reaper):
    prog, status = _stable_program(tmp_path, reaper)
    node_a.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck1"), "--store", "one",
                "--leave-running")
    first = _build_push(node_a, registry, tmp_path / "ck1", tmp_path / "img1", "app/ck:one")
    n = _count(status)
    wait_for(lambda: _count(status) > n + 3, 10, "the program to go on")
    node_a.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck2"), "--store", "two")
    checkpointed_and_reaped(type("P", (), {"proc": prog})())
    second = _build_push(node_a, registry, tmp_path / "ck2", tmp_path / "img2", "app/ck:two")
    assert first["bytes_sent"] > 60 << 20, first
    assert second["skipped_blobs"] >= 16, second           # the 64 MiB, already there
    assert second["bytes_sent"] <= first["bytes_sent"] * 0.10, (first, second)
    # node b pulls one, then two: the second pull fetches only what its store lacks
    one = node_b.json("image", "pull", f"{registry.host}/app/ck:one", "-D", str(tmp_path / "p1"),
                      *registry.args())
    node_b.json("restore", "-D", one["checkpoint"])   # its chunks enter node b's store
    os.kill(prog.pid, 9)
    wait_for(lambda: not alive(prog.pid), 10, "the first restore to end")
    two = node_b.json("image", "pull", f"{registry.host}/app/ck:two", "-D", str(tmp_path / "p2"),
                      *registry.args())
    assert two["chunks_from_store"] >= 16 and two["bytes_received"] < one["bytes_received"] * 0.1
    before = _count(status)
    node_b.json("restore", "-D", two["checkpoint"])
    wait_for(lambda: _count(status) > before + 3, 10, "the restored program to go on")


def test_a_bare_checkpoint_travels_as_one_layer(node_a, node_b, registry, tmp_path, reaper):
    prog, status = _stable_program(tmp_path, reaper)
    node_a.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"))
    checkpointed_and_reaped(type("P", (), {"proc": prog})())
    built = node_a.json("image", "build", str(tmp_path / "ck"), "-o", str(tmp_path / "img"))
    assert built["chunks"] == 0 and built["layer_bytes"] > 64 << 20
    pushed = node_a.json("image", "push", str(tmp_path / "img"), f"{registry.host}/bare/ck:v1",
                         *registry.args())
    assert pushed["blobs"] == 2 and pushed["bytes_sent"] >= built["layer_bytes"]
    pulled = node_b.json("image", "pull", f"{registry.host}/bare/ck:v1", "-D", str(tmp_path / "p"),
                         "--oci-layout", str(tmp_path / "layout"), *registry.args())
    assert pulled["chunks"] == 0 and pulled["has_manifest"]
    assert sorted(p.name for p in Path(pulled["checkpoint"]).iterdir()) == \
        sorted(p.name for p in (tmp_path / "ck").iterdir())
    index = json.loads((tmp_path / "layout" / "index.json").read_text())
    assert index["manifests"][0]["digest"] == pushed["digest"] == built["digest"]
    n = _count(status)
    node_b.json("restore", "-D", pulled["checkpoint"])    # verifies torpor.json's checksums
    wait_for(lambda: _count(status) > n + 3, 10, "the restored program to go on")


def test_a_blob_whose_link_a_dying_registry_left_blank_is_pushed_again(node_a, node_b, registry,
                                                                       tmp_path, reaper):
    """docker-registry killed while it links a finished blob into the repository leaves the
    link file empty or half written, and answers every HEAD of that blob with 500 from then
    on (CI met it once after test_a_push_cut_off_by_a_dying_registry_resumes' kill). The next
    push uploads that blob again, which writes the link anew, and the image pulls whole."""
    prog, status = _stable_program(tmp_path, reaper)
    node_a.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"))
    checkpointed_and_reaped(type("P", (), {"proc": prog})())
    first = _build_push(node_a, registry, tmp_path / "ck", tmp_path / "img", "link/ck:v1")
    links = sorted(registry.storage.glob("docker/registry/v2/repositories/link/ck/_layers/"
                                         "sha256/*/link"))
    assert len(links) == first["blobs"] == 2
    links[0].write_text("")                    # as a kill between its open and its write
    links[1].write_text(links[1].read_text()[:20])   # a kill within its write
    second = node_a.json("image", "push", str(tmp_path / "img"), f"{registry.host}/link/ck:v1",
                         *registry.args())
    assert second["uploaded_blobs"] == 2 and second["skipped_blobs"] == 0, second
    third = node_a.json("image", "push", str(tmp_path / "img"), f"{registry.host}/link/ck:v1",
                        *registry.args())
    assert third["skipped_blobs"] == 2, third   # the registry knows them again
    pulled = node_b.json("image", "pull", f"{registry.host}/link/ck:v1", "-D", str(tmp_path / "p"),
                         *registry.args())
    n = _count(status)
    node_b.json("restore", "-D", pulled["checkpoint"])
    wait_for(lambda: _count(status) > n + 3, 10, "the restored program to go on")


def _tamper(path: Path, truncate: bool) -> None:
    data = bytearray(path.read_bytes())
    if truncate:
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("what", ["chunk", "layer", "truncated-chunk", "truncated-layer"])
def test_a_tampered_blob_is_refused_and_nothing_restores(node_a, node_b, gpu, registry, tmp_path,
                                                         reaper, what):
    prog = gpu.spawn(gpu_index=0, mem=16 << 20)
    reaper.append(prog.pid)
    prog.wait_tick(2)
    node_a.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"), "--store", "one")
    checkpointed_and_reaped(prog)
    _build_push(node_a, registry, tmp_path / "ck", tmp_path / "img", "bad/ck:v1")
    index = json.loads((tmp_path / "img" / "index.json").read_text())
    blobs = tmp_path / "img" / "blobs" / "sha256"
    image = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_text())
    if what.endswith("layer"):
        digest = image["layers"][0]["digest"]
    else:
        art = json.loads((blobs / image["annotations"]["io.torpor.chunks"][7:]).read_text())
        digest = max(art["layers"], key=lambda d: d["size"])["digest"]
    _tamper(registry.blob_file(digest), truncate=what.startswith("truncated"))
    out = node_b.run("image", "pull", f"{registry.host}/bad/ck:v1", "-D", str(tmp_path / "p"),
                     *registry.args())
    assert out.returncode == 9, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and digest in out.stderr, out.stderr
    assert not (tmp_path / "p").exists()                   # nothing half-pulled to restore from
    assert not alive(prog.pid)


class _CutProxy:
    """A TCP proxy to the registry that forwards at most `budget` bytes upstream, then holds
    (the test kills the registry while bytes are in flight); budget None: no limit."""

    def __init__(self, port: int, budget: int | None) -> None:
        self.upstream, self.budget, self.sent = port, budget, 0
        self.held = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:   # the registry is gone: so is this connection
                c.close()
                continue
            threading.Thread(target=self._pipe, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(65536):
                if up and self.budget is not None:
                    room = self.budget - self.sent
                    if room <= 0:
                        self.held.set()
                        threading.Event().wait(60)   # hold until the registry is gone
                        break
                    data = data[:room] if len(data) > room else data
                    self.sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.sock.close()


def test_a_push_cut_off_by_a_dying_registry_resumes(node_a, node_b, registry, tmp_path, reaper):
    prog, status = _stable_program(tmp_path, reaper)
    node_a.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"), "--store", "one")
    checkpointed_and_reaped(type("P", (), {"proc": prog})())
    built = node_a.json("image", "build", str(tmp_path / "ck"), "-o", str(tmp_path / "img"))
    assert built["chunks"] >= 16 and built["chunk_bytes"] > 60 << 20
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    proxy = _CutProxy(registry.port, budget=40 << 20)
    host = f"localhost:{proxy.port}"
    certs = tmp_path / "certs" / host
    certs.mkdir(parents=True)
    (certs / "ca.crt").write_bytes((registry.certs / "ca.crt").read_bytes())
    auth = tmp_path / "auth.json"
    auth.write_text(registry.authfile.read_text().replace(registry.host, host))
    args = ["--authfile", str(auth), "--cert-dir", str(certs)]
    push = node_a.start("-q", "image", "push", str(tmp_path / "img"), f"{host}/cut/ck:v1", *args)
    assert proxy.held.wait(60), "the push never sent 40 MiB"
    registry.kill()
    _out, err = push.communicate(timeout=60)
    assert push.returncode == 1 and "registry" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before   # the checkpoint intact
    registry.start()
    proxy.budget = None
    r = node_a.json("image", "push", str(tmp_path / "img"), f"{host}/cut/ck:v1", *args)
    # the blobs done before the cut are not sent again; the one cut mid-piece starts over
    # (docker-registry cannot resume an upload whose last PATCH broke off: BLOB_UPLOAD_INVALID)
    assert r["skipped_blobs"] >= 6, r
    assert r["bytes_sent"] < r["bytes_total"] - (24 << 20), r
    proxy.close()
    pulled = node_b.json("image", "pull", f"{registry.host}/cut/ck:v1", "-D", str(tmp_path / "p"),
                         *registry.args())
    node_b.json("restore", "-D", pulled["checkpoint"])
    n = _count(status)
    wait_for(lambda: _count(status) > n + 3, 10, "the restored program to go on")


def _checkpointctl() -> str | None:
    """checkpointctl where ./install.sh built it (packaging/checkpointctl/build.sh), or
    $TORPOR_CHECKPOINTCTL."""
    import shutil
    return os.environ.get("TORPOR_CHECKPOINTCTL") or shutil.which("checkpointctl")


def test_a_podman_checkpoint_image_round_trips_and_podman_restores_it(node_a, node_b, registry,
                                                                      podman_image, tmp_path):
    from integration.containers import Counter, Podman
    podman, counter, name = Podman("runc"), Counter(tmp_path / "data"), f"reg-{os.getpid()}"
    try:
        podman.run(name, counter.cmd, mounts=[counter.mount])
        token, _ = counter.wait_beyond(5)
        podman.checkpoint(name, export=tmp_path / "ckpt.tar.zst")
        at = counter.read()[1]
        built = node_a.json("image", "build", str(tmp_path / "ckpt.tar.zst"), "-o",
                            str(tmp_path / "img"))
        assert built["annotations"]["org.criu.checkpoint.container.name"] == name
        assert built["annotations"]["io.podman.annotations.checkpoint.name"] == name
        assert built["annotations"]["org.criu.checkpoint.engine.name"] == "podman"
        node_a.json("image", "push", str(tmp_path / "img"), f"{registry.host}/pod/ck:v1",
                    *registry.args())
        podman.rm(name)
        pulled = node_b.json("image", "pull", f"{registry.host}/pod/ck:v1", "-D",
                             str(tmp_path / "p"), "--archive", str(tmp_path / "pulled.tar"),
                             *registry.args())
        assert not pulled["has_manifest"]
        assert {"config.dump", "spec.dump", "checkpoint"} <= {p.name for p in (tmp_path / "p").iterdir()}
        tool = _checkpointctl()
        if tool:
            for cmd in ("show", "inspect"):
                out = subprocess.run([tool, cmd, str(tmp_path / "pulled.tar")], capture_output=True,
                                     text=True, timeout=60)
                assert out.returncode == 0 and name in out.stdout, (cmd, out.stdout, out.stderr)
        podman.restore(import_=tmp_path / "pulled.tar")
        assert podman.state(name) == "running"
        counter.wait_beyond(at + 3, token=token)
    finally:
        podman.rm(name)


class _InNetns(Torpor):
    """torpor run inside network namespace ns (ip netns exec): a second node's own network."""

    def __init__(self, env: dict[str, str], ns: str) -> None:
        super().__init__(env)
        self.ns = ns

    def run(self, *args: str, timeout: float = 120, check: bool = False):
        proc = subprocess.run(["ip", "netns", "exec", self.ns, sys.executable, "-m",
                               "torpor.cli.main", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise AssertionError(f"torpor {' '.join(args)} in {self.ns} exited "
                                 f"{proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc


@pytest.fixture
def netns():
    """A network namespace joined to this one by a veth pair: (its name, the address on this
    side, reachable from it). Link-local addresses, on this machine only."""
    ns, k = f"torpor-reg-{os.getpid()}", os.getpid() % 250 + 1
    here, there = f"169.254.{k}.1", f"169.254.{k}.2"
    cmds = [["ip", "netns", "add", ns],
            ["ip", "link", "add", f"trg{k}a", "type", "veth", "peer", "name", f"trg{k}b"],
            ["ip", "link", "set", f"trg{k}b", "netns", ns],
            ["ip", "addr", "add", f"{here}/30", "dev", f"trg{k}a"],
            ["ip", "link", "set", f"trg{k}a", "up"],
            ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{there}/30", "dev", f"trg{k}b"],
            ["ip", "netns", "exec", ns, "ip", "link", "set", f"trg{k}b", "up"],
            ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    try:
        for c in cmds:
            r = subprocess.run(c, capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot make a network namespace here: {' '.join(c)}: {r.stderr}")
        yield ns, here
    finally:
        subprocess.run(["ip", "link", "del", f"trg{k}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_second_node_in_its_own_network_namespace_pulls_and_restores(node_a, netns, tmp_path,
                                                                       reaper):
    ns, ip = netns
    registry = Registry(tmp_path / "registry", ip=ip).start()
    try:
        prog, status = _stable_program(tmp_path, reaper)
        node_a.json("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"), "--store", "one")
        checkpointed_and_reaped(type("P", (), {"proc": prog})())
        _build_push(node_a, registry, tmp_path / "ck", tmp_path / "img", "ns/ck:v1")
        node_b = _InNetns({**node_a.env, "TORPOR_STATE_DIR": str(tmp_path / "b-state"),
                           "TORPOR_RUN_DIR": str(tmp_path / "b-run"),
                           "TORPOR_STORE_DIR": str(tmp_path / "store-b")}, ns)
        pulled = node_b.json("image", "pull", f"{registry.host}/ns/ck:v1", "-D",
                             str(tmp_path / "p"), *registry.args())
        assert pulled["chunks_fetched"] == pulled["chunks"] >= 16
        n = _count(status)
        node_b.json("restore", "-D", pulled["checkpoint"])
        wait_for(lambda: _count(status) > n + 3, 10, "the restored program to go on")
        netns_of = os.readlink(f"/proc/{prog.pid}/ns/net")
        assert netns_of != os.readlink("/proc/self/ns/net")     # it lives on node b's network
    finally:
        registry.kill()
