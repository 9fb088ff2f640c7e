"""torpor-runtime's fetch of a checkpoint image's chunks at restore (registry/chunks.py): the
node's credential and TLS lookup (auth.node_auth_files, auth.node_tls_context), the refusals
before anything is fetched, and the fetch itself against an in-memory registry: every chunk
verified, the store left whole."""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from torpor.config import Config
from torpor.errors import CorruptCheckpointError, ExitCode, UsageError
from torpor.layout import CHUNKS
from torpor.registry import auth, chunks, oci, transfer
from torpor.registry.client import Client, DeadlineError
from torpor.store import Store, chunk
from tests import hostile
from tests.unit.test_registry_images import FakeRegistry, _auth, _pushed_packed


# --- credentials: the order torpor-runtime reads them in ---------------------------------------

def test_the_runtime_reads_its_config_file_then_the_containers_files_then_the_kubelets(
        tmp_path, monkeypatch):
    home, run = tmp_path / "home", tmp_path / "run"
    kubelet = tmp_path / "kubelet" / "config.json"
    monkeypatch.setattr(auth, "KUBELET_AUTH_FILE", kubelet)
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": str(run),
           "REGISTRY_AUTH_FILE": str(tmp_path / "env.json")}
    configured = tmp_path / "etc" / "torpor-auth.json"
    assert auth.node_auth_files(str(configured), env) == [
        configured, tmp_path / "env.json", run / "containers" / "auth.json",
        home / ".config" / "containers" / "auth.json", home / ".docker" / "config.json", kubelet]
    no_xdg = auth.node_auth_files("", {"HOME": str(home)})      # root under containerd
    assert no_xdg[0] == Path(f"/run/containers/{os.getuid()}/auth.json")
    assert no_xdg[-1] == kubelet and len(no_xdg) == 4

    ref = auth.parse_reference("reg:5000/team/app:v1")

    def creds(configured: str = "") -> tuple[str, str] | None:
        return auth.credentials(ref, files=auth.node_auth_files(configured, env))
    assert creds() is None
    _auth(kubelet, {"reg:5000": "kubelet:pw"})
    assert creds() == ("kubelet", "pw")                          # last resort: the kubelet's
    _auth(home / ".docker" / "config.json", {"https://reg:5000": "docker:pw"})
    assert creds() == ("docker", "pw")
    _auth(home / ".config" / "containers" / "auth.json", {"reg:5000": "config:pw"})
    assert creds() == ("config", "pw")
    _auth(run / "containers" / "auth.json", {"reg:5000": "podman:pw"})
    assert creds() == ("podman", "pw")
    _auth(tmp_path / "env.json", {"reg:5000": "env:pw", "other:5000": "x:y"})
    assert creds() == ("env", "pw")
    _auth(configured, {"reg:5000/team": "node:pw"})
    assert creds(str(configured)) == ("node", "pw")              # torpor's own file first
    _auth(configured, {"other:5000": "x:y"})                     # no entry: the next file's
    assert creds(str(configured)) == ("env", "pw")


def test_a_damaged_auth_file_is_one_clear_line(tmp_path):
    ref = auth.parse_reference("reg:5000/a:v1")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot read auth file .*bad.json"):
        auth.credentials(ref, files=auth.node_auth_files(str(tmp_path / "bad.json"), {}))


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_an_auth_file_that_is_no_small_regular_file_is_refused_not_waited_on(tmp_path, kind):
    """A FIFO at a default auth file location (~/.docker/config.json) blocked the pull's open
    for good; /dev/zero or a huge file was read up to the cap and then misparsed."""
    ref = auth.parse_reference("reg:5000/a:v1")
    path = tmp_path / "auth.json"
    hostile.plant(path, kind, auth.MAX_AUTH_FILE)
    with pytest.raises(UsageError, match="cannot read auth file .*(not a regular|larger)"):
        auth.credentials(ref, files=[path])


# --- TLS: containerd's hosts directory -----------------------------------------------------------

@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    for name in ("ca", "other", "client"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                        str(d / f"{name}.key"), "-out", str(d / f"{name}.crt"), "-days", "1",
                        "-subj", f"/CN=torpor {name}"], check=True, capture_output=True)
    return d


def _subjects(ctx) -> set[str]:
    return {dict(x[0] for x in c["subject"]).get("commonName", "") for c in ctx.get_ca_certs()}


def test_tls_follows_containerds_hosts_toml_for_the_host(tmp_path, certs):
    hosts = tmp_path / "certs.d"
    d = hosts / "reg:5000"
    d.mkdir(parents=True)
    shutil.copy(certs / "other.crt", d / "extra.crt")            # a *.crt beside it counts too
    shutil.copy(certs / "client.crt", d / "client.pem")
    shutil.copy(certs / "client.key", d / "client.key")
    (d / "hosts.toml").write_text(
        'server = "https://reg:5000"\n'
        '[host."https://mirror:6000"]\n  ca = "/nonexistent/mirror.crt"\n'
        f'[host."https://reg:5000"]\n  ca = ["{certs / "ca.crt"}"]\n'
        '  client = [["client.pem", "client.key"]]\n')
    ctx = auth.node_tls_context("reg:5000", hosts)
    assert {"torpor ca", "torpor other"} <= _subjects(ctx)
    assert ctx.verify_mode.name == "CERT_REQUIRED"
    (d / "hosts.toml").write_text('server = "https://reg:5000"\nca = "ca.crt"\n')
    shutil.copy(certs / "ca.crt", d / "ca.crt")                  # relative: to the hosts dir
    assert "torpor ca" in _subjects(auth.node_tls_context("reg:5000", hosts))
    (d / "hosts.toml").write_text('[host."https://reg:5000"]\n  skip_verify = true\n')
    assert auth.node_tls_context("reg:5000", hosts).verify_mode.name == "CERT_NONE"
    (d / "hosts.toml").write_text('[host."https://reg:5000"]\n  ca = "missing.crt"\n')
    with pytest.raises(UsageError, match="missing.crt"):
        auth.node_tls_context("reg:5000", hosts)
    (d / "hosts.toml").write_text('[host."https://reg:5000"\n')
    with pytest.raises(UsageError, match="hosts.toml"):
        auth.node_tls_context("reg:5000", hosts)
    # a host without a directory there: the containers certs.d, the system's CAs
    assert "torpor ca" not in _subjects(auth.node_tls_context("elsewhere:5000", hosts))


# --- the fetch -----------------------------------------------------------------------------------

def _node_b(tmp_path: Path) -> tuple[FakeRegistry, Path, Store]:
    """A pushed packed checkpoint, and node B's view of a restore from its image: the layer's
    files (the checkpoint directory, no torpor-chunks/) and an empty store."""
    reg, _store = _pushed_packed(tmp_path)
    pulled = transfer.pull(FakeRegistry(blobs=reg.blobs, manifests=reg.manifests),
                           tmp_path / "p", Store(tmp_path / "scratch"))
    top = Path(pulled.checkpoint)
    shutil.rmtree(top / CHUNKS)
    return reg, top, Store(tmp_path / "store-b")


def _store_is_whole(store: Store) -> set[str]:
    names = set()
    for f in (store.backend.root / "chunks").glob("*/*"):
        chunk.decode(chunk.read_blob_file(f, "t"), f.name, "t")
        names.add(f.name)
    return names


def _cfg(tmp_path: Path, **kw) -> Config:
    return dataclasses.replace(Config(), registry_hosts_dir=tmp_path / "none", **kw)


def test_a_restore_without_an_image_reference_is_refused_naming_torpor_image_pull(tmp_path):
    _reg, top, store = _node_b(tmp_path)
    for given, cfg in [({}, _cfg(tmp_path)),
                       ({"checkpointImage": ""}, _cfg(tmp_path)),
                       ({"checkpointImage": "/var/lib/kubelet/checkpoints/c.tar"}, _cfg(tmp_path)),
                       ({"checkpointImage": "sha256:" + "a" * 64}, _cfg(tmp_path)),
                       ({"checkpointImage": "http://x/y"}, _cfg(tmp_path)),
                       ({"checkpointImage": "reg:5000/a/b:v1"},
                        _cfg(tmp_path, restore_fetch_timeout_s=0.0))]:
        with pytest.raises(CorruptCheckpointError, match="nor store.*torpor image pull") as e:
            chunks.for_restore(cfg, top, store, given)
        assert e.value.exit_code == ExitCode.CORRUPT
    with pytest.raises(UsageError, match="registry_auth_file .*missing.json.* does not exist"):
        chunks.for_restore(_cfg(tmp_path, registry_auth_file=str(tmp_path / "missing.json")),
                           top, store, {"checkpointImage": "reg:5000/a/b:v1"})
    assert not _store_is_whole(store) and not (top / CHUNKS).exists()
    (top / CHUNKS).mkdir()                 # a checkpoint that brings chunks must bring them all
    with pytest.raises(CorruptCheckpointError, match="torpor-chunks/ lacks them"):
        chunks.for_restore(_cfg(tmp_path), top, store, {"checkpointImage": "reg:5000/a/b:v1"})


def test_nothing_is_fetched_when_the_store_has_every_chunk(tmp_path):
    reg, top, store = _node_b(tmp_path)
    chunks._fetch_from(FakeRegistry(blobs=reg.blobs, manifests=reg.manifests), top, store)
    shutil.rmtree(top / CHUNKS)
    assert chunks.for_restore(_cfg(tmp_path), top, store, {}) is None   # no registry asked


def test_the_missing_chunks_are_fetched_verified_and_linked(tmp_path):
    reg, top, store = _node_b(tmp_path)
    n, fetched = chunks._fetch_from(FakeRegistry(blobs=reg.blobs, manifests=reg.manifests),
                                    top, store)
    assert n == fetched >= 3 and len(_store_is_whole(store)) == n
    assert {p.name for p in (top / CHUNKS).iterdir()} == _store_is_whole(store)
    assert not chunks.missing(store, top)


def test_a_store_chunk_that_is_a_link_is_not_linked_through(tmp_path):
    """The store's chunks are hard-linked into torpor-chunks/: linkat followed a chunk that
    is a symbolic link and linked whatever it points at into the checkpoint directory. The
    fetch now takes such a chunk for damaged (backend.has_blob): fetched again, the verified
    blob renamed over the link; the linking on its own still refuses a link."""
    reg, top, store = _node_b(tmp_path)
    registry = FakeRegistry(blobs=reg.blobs, manifests=reg.manifests)
    chunks._fetch_from(registry, top, store)
    shutil.rmtree(top / CHUNKS)
    name = sorted(_store_is_whole(store))[0]
    blob = store.backend.blob_path(name)
    elsewhere = tmp_path / "elsewhere"
    blob.rename(elsewhere)
    blob.symlink_to(elsewhere)
    assert chunks._fetch_from(registry, top, store)[1] == 1
    assert os.stat(elsewhere).st_nlink == 1
    assert not blob.is_symlink() and os.path.samefile(top / CHUNKS / name, blob)
    blob.unlink()
    blob.symlink_to(elsewhere)
    with pytest.raises(CorruptCheckpointError, match=name):
        chunks._link_from_store(store, name, tmp_path / "linked")
    assert os.stat(elsewhere).st_nlink == 1
    assert not os.path.lexists(tmp_path / "linked")


@pytest.mark.parametrize("how", ["flip", "truncate", "swap"])
def test_a_tampered_chunk_is_refused_and_the_store_stays_whole(tmp_path, how):
    reg, top, store = _node_b(tmp_path)
    image = oci.Manifest.parse(reg.manifests["v1"], "t")
    art = oci.Manifest.parse(reg.manifests[image.annotation(oci.A_CHUNKS)], "t")
    d = max(art.layers, key=lambda x: x.size)
    data = bytearray(reg.blobs[d.digest])
    if how == "flip":
        data[-1] ^= 1
    elif how == "truncate":
        data = data[:100]
    else:
        data = bytearray(reg.blobs[min(art.layers, key=lambda x: x.size).digest])
    reg.blobs[d.digest] = bytes(data)
    with pytest.raises(CorruptCheckpointError, match=d.digest) as e:
        chunks._fetch_from(FakeRegistry(blobs=reg.blobs, manifests=reg.manifests), top, store)
    assert e.value.exit_code == ExitCode.CORRUPT
    assert d.annotation(oci.A_CHUNK) not in _store_is_whole(store)
    assert not (top / CHUNKS).exists()                    # no half-linked directory either
    assert not list((store.backend.root / "tmp").iterdir())


def test_an_image_that_is_not_the_checkpoint_being_restored_is_refused(tmp_path):
    """A tag moved since containerd pulled the image: its manifest carries another
    torpor.json's sha256; nothing is fetched."""
    reg, top, store = _node_b(tmp_path)
    image = oci.Manifest.parse(reg.manifests["v1"], "t")
    ann = dict(image.annotations) | {oci.A_MANIFEST: "sha256:" + "0" * 64}
    reg.manifests["v1"] = oci.Manifest(image.config, image.layers,
                                       tuple(sorted(ann.items()))).dump()
    with pytest.raises(CorruptCheckpointError, match="tag moved"):
        chunks._fetch_from(FakeRegistry(blobs=reg.blobs, manifests=reg.manifests), top, store)
    assert not _store_is_whole(store)


def test_a_deadline_passed_is_refused_before_any_connection():
    c = Client(auth.parse_reference("192.0.2.1:5000/a:v1"), None,   # type: ignore[arg-type]
               None, deadline=time.monotonic() - 1)
    t = time.monotonic()
    with pytest.raises(DeadlineError, match="not done in time"):
        c.ping()
    assert time.monotonic() - t < 1 and c._conn is None


@pytest.mark.parametrize("how", ["silent", "trickle"])
def test_a_registry_too_slow_for_the_deadline_is_given_up_on_at_it(tmp_path, certs, how):
    """A registry that accepts and never answers, or answers a blob one byte at a time: the
    fetch stops at its deadline (not the 60 s socket timeout, not the whole blob's time)."""
    import ssl
    import threading
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs / "ca.crt", certs / "ca.key")
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        if how == "silent":
            stop.wait(30)
            conn.close()
            return
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            tls.recv(65536)
            tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
            while not stop.is_set():
                try:
                    tls.sendall(b"x")
                except OSError:
                    return
                time.sleep(0.02)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ref = auth.parse_reference(f"127.0.0.1:{listener.getsockname()[1]}/a:v1")
    c = Client(ref, ctx, None, deadline=time.monotonic() + 1.5)
    d = oci.Descriptor(oci.CHUNK_TYPE, "sha256:" + "0" * 64, 1000000)
    t0 = time.monotonic()
    try:
        with pytest.raises(DeadlineError, match="not done in time"):
            c.get_blob(d, io.BytesIO())
        assert time.monotonic() - t0 < 4
    finally:
        stop.set()
        c.close()
        listener.close()


@pytest.mark.parametrize("deadline", [None, 30.0])
def test_blobs_one_after_another_on_one_kept_alive_connection(certs, deadline):
    """A restore fetches many chunks over one connection. Read to its last byte under a
    deadline (read1), a blob's response must still end, or the next request on that
    connection fails (http.client's ResponseNotReady: seen in the CRI image test); an error
    body read only in part must not poison the connection either."""
    import hashlib
    import ssl
    import threading
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs / "ca.crt", certs / "ca.key")
    listener = socket.create_server(("127.0.0.1", 0))
    blobs = [os.urandom(70000), os.urandom(12345), b"z" * 5]
    digests = ["sha256:" + hashlib.sha256(b).hexdigest() for b in blobs]
    connections = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            connections.append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    def handle(conn) -> None:
        try:
            answer(conn)
        except OSError:   # the client closed a connection whose 404 body it did not want
            pass

    def answer(conn) -> None:
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    data = tls.recv(65536)
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                path = head.split(b" ")[1].decode()
                digest = path.rsplit("/", 1)[-1]
                if digest in digests:
                    body = blobs[digests.index(digest)]
                    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
                                + body)
                else:   # a 404 whose body is larger than the client reads of an error
                    body = b"x" * (1 << 20)
                    tls.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n"
                                % len(body) + body)
    threading.Thread(target=serve, daemon=True).start()
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ref = auth.parse_reference(f"127.0.0.1:{listener.getsockname()[1]}/a:v1")
    c = Client(ref, ctx, None, deadline=None if deadline is None else time.monotonic() + deadline)
    try:
        for _ in range(2):
            for b, d in zip(blobs, digests):
                out = io.BytesIO()
                c.get_blob(oci.Descriptor(oci.CHUNK_TYPE, d, len(b)), out)
                assert out.getvalue() == b
            with pytest.raises(CorruptCheckpointError, match="missing"):
                c.get_blob(oci.Descriptor(oci.CHUNK_TYPE, "sha256:" + "1" * 64, 3), io.BytesIO())
        assert len(connections) <= 3, "a new connection for every blob"
    finally:
        c.close()
        listener.close()
