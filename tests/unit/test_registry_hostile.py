"""A hostile registry and hostile layers against torpor.registry: every answer is untrusted. A
registry that stalls or breaks off mid-answer, or names a token that would smuggle a header, is
one RegistryError line (exit 1), never a socket's exception; a pull that fails leaves nothing,
wherever -D pointed; a layer whose tar headers would have the reader buffer gigabytes is
refused before they are read."""

from __future__ import annotations

import gzip
import http.server
import socket
import ssl
import tarfile
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from torpor.errors import TorporError
from torpor.registry import auth
from torpor.registry import client as client_mod
from torpor.registry.client import Client, RegistryError
from tests.unit.test_registry_images import tls_cert  # noqa: F401  (a fixture)

Route = Callable[[http.server.BaseHTTPRequestHandler], None]


def _send(h: http.server.BaseHTTPRequestHandler, code: int, body: bytes = b"",
          headers: dict | None = None) -> None:
    h.send_response(code)
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(body)


@pytest.fixture
def hostile(tls_cert):  # noqa: F811
    """A TLS registry answering each path prefix with routes[prefix](handler); a Client of
    it by hostile.client()."""
    routes: dict[str, Route] = {}

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):
            for prefix, fn in routes.items():
                if self.path.startswith(prefix):
                    return fn(self)
            _send(self, 404, b"{}")

        do_HEAD = do_PATCH = do_PUT = do_POST = do_GET

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    srv.handle_error = lambda *a: None   # a client that hung up on a hostile answer: expected
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls_cert / "ca.crt", tls_cert / "key.pem")
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ref = auth.parse_reference(f"localhost:{srv.server_address[1]}/a/b:v1")

    class Hostile:
        host = ref.host

        @staticmethod
        def client(creds=None, deadline=None) -> Client:
            return Client(ref, auth.tls_context(ref.host, tls_cert), creds, deadline)
    Hostile.routes = routes
    yield Hostile
    srv.shutdown()
    srv.server_close()


MANIFEST = b'{"schemaVersion":2,"config":{' + b" " * 4000 + b"}}"


def _stall(h) -> None:
    h.send_response(200)
    h.send_header("Content-Length", str(len(MANIFEST)))
    h.end_headers()
    h.wfile.write(MANIFEST[:100])
    h.wfile.flush()
    time.sleep(1.5)


def _break_off(h) -> None:
    h.send_response(200)
    h.send_header("Content-Length", str(len(MANIFEST)))
    h.end_headers()
    h.wfile.write(MANIFEST[:100])
    h.wfile.flush()
    h.close_connection = True
    h.connection.shutdown(socket.SHUT_RDWR)


@pytest.mark.parametrize("route", [_stall, _break_off])
def test_a_manifest_that_stalls_or_breaks_off_midway_is_one_registry_error(hostile, route,
                                                                           monkeypatch):
    monkeypatch.setattr(client_mod, "TIMEOUT", 0.5)
    hostile.routes["/v2/a/b/manifests/"] = route
    c = hostile.client()
    with pytest.raises(RegistryError, match=r"manifest v1: the answer broke off after \d+ bytes"):
        c.get_manifest("v1")


def test_a_manifest_that_trickles_past_the_deadline_stops_at_it(hostile):
    def trickle(h) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(MANIFEST)))
        h.end_headers()
        for i in range(60):   # 3 s of it, a byte at a time
            h.wfile.write(MANIFEST[i:i + 1])
            h.wfile.flush()
            time.sleep(0.05)
    hostile.routes["/v2/a/b/manifests/"] = trickle
    c = hostile.client(deadline=time.monotonic() + 1.0)
    t0 = time.monotonic()
    with pytest.raises(client_mod.DeadlineError, match="not done in time"):
        c.get_manifest("v1")
    assert time.monotonic() - t0 < 2.5


def _trickle(body: bytes, each_s: float) -> Route:
    """An answer of body that comes a byte every each_s seconds (every socket wait short)."""
    def route(h) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        try:
            for i in range(len(body)):
                h.wfile.write(body[i:i + 1])
                h.wfile.flush()
                time.sleep(each_s)
        except OSError:   # the client cut it off
            pass
    return route


def _blob(n: int):
    import hashlib

    from torpor.registry import oci
    data = bytes(range(256)) * (n // 256)
    return data, oci.Descriptor(oci.LAYER_TYPE, "sha256:" + hashlib.sha256(data).hexdigest(),
                                len(data))


@pytest.mark.parametrize("what", ["manifest", "blob"])
def test_a_body_that_trickles_is_cut_off_without_a_deadline(hostile, monkeypatch, what):
    """torpor image pull has no deadline, and each byte came well inside TIMEOUT: before the
    minimum rate, a byte every 59 s held it for good."""
    import io
    monkeypatch.setattr(client_mod, "RATE_WINDOW_S", 0.5)
    monkeypatch.setattr(client_mod, "MIN_RATE", 1000)
    data, d = _blob(4096)
    hostile.routes["/v2/a/b/manifests/"] = _trickle(MANIFEST, 0.02)
    hostile.routes["/v2/a/b/blobs/"] = _trickle(data, 0.02)
    c = hostile.client()
    t0 = time.monotonic()
    with pytest.raises(client_mod.SlowError, match=r"under 0 KiB/s: the registry or the link "
                                                   r"stalls; cut off"):
        c.get_manifest("v1") if what == "manifest" else c.get_blob(d, io.BytesIO())
    assert time.monotonic() - t0 < 2.0


def test_a_body_that_keeps_the_rate_is_not_cut_off(hostile, monkeypatch):
    """Windows restart: a slow but steady body (over the rate in each window) arrives whole,
    however many windows it takes."""
    import io
    monkeypatch.setattr(client_mod, "RATE_WINDOW_S", 0.2)
    monkeypatch.setattr(client_mod, "MIN_RATE", 100)
    data, d = _blob(1024)

    def steady(h) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        for i in range(0, len(data), 64):   # 64 bytes each 0.05 s: ~1280 B/s, 0.8 s in all
            h.wfile.write(data[i:i + 64])
            h.wfile.flush()
            time.sleep(0.05)
    hostile.routes["/v2/a/b/blobs/"] = steady
    out = io.BytesIO()
    hostile.client().get_blob(d, out)
    assert out.getvalue() == data


@pytest.mark.parametrize("deadline", [None, 3600.0])
def test_small_answers_leave_the_connection_for_the_next_request(hostile, deadline):
    """_body reads with read1, which leaves a response with a Content-Length open at its
    last byte (http.client): every small answer (a manifest, an upload's 202) then cost a
    new TLS connection for the request after it. A chunked answer ends itself."""
    seen: set = set()

    def manifest(h) -> None:
        seen.add(h.client_address)
        _send(h, 200, MANIFEST)

    def chunked(h) -> None:
        seen.add(h.client_address)
        h.send_response(200)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for i in range(0, len(MANIFEST), 1000):
            part = MANIFEST[i:i + 1000]
            h.wfile.write(b"%x\r\n" % len(part) + part + b"\r\n")
        h.wfile.write(b"0\r\n\r\n")
    hostile.routes["/v2/a/b/manifests/chunked"] = chunked
    hostile.routes["/v2/a/b/manifests/"] = manifest
    c = hostile.client(deadline=None if deadline is None else time.monotonic() + deadline)
    assert [c.get_manifest(r) for r in ("v1", "chunked", "v1", "v1")] == [MANIFEST] * 4
    assert len(seen) == 1


def test_headers_that_trickle_are_cut_off_without_a_deadline(hostile, monkeypatch):
    """Each header byte inside TIMEOUT, none of the body check's business: the watchdog of the
    request and its answer's headers cuts them off."""
    monkeypatch.setattr(client_mod, "TIMEOUT", 0.5)

    def trickle(h) -> None:
        try:
            h.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            for _ in range(60):   # 3 s of it
                h.wfile.write(b"a")
                h.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass
    hostile.routes["/v2/a/b/manifests/"] = trickle
    t0 = time.monotonic()
    with pytest.raises(client_mod.SlowError, match=r"manifest v1: no answer within 0 s .* "
                                                   r"stalls; cut off"):
        hostile.client().get_manifest("v1")
    assert time.monotonic() - t0 < 2.0


def test_an_upload_the_registry_reads_slowly_is_cut_off(hostile, monkeypatch):
    """A push's PATCH that the registry reads a little each wait, more than the socket
    buffers hold: cut off, not held for the whole body. (A TLS send of the piece is one write
    under one TIMEOUT; the request's watchdog bounds it too: either way one RegistryError.)"""
    monkeypatch.setattr(client_mod, "TIMEOUT", 1.0)
    monkeypatch.setattr(client_mod, "MIN_RATE", 128 << 20)
    body = b"x" * (32 << 20)

    def slow_reader(h) -> None:
        try:
            left = int(h.headers["Content-Length"])
            while left:   # 1 MiB each 0.1 s (no send waits long): over 3 s for the body
                left -= len(h.rfile.read(min(left, 1 << 20)))
                time.sleep(0.1)
            _send(h, 202, b"", {"Location": "/v2/a/b/blobs/uploads/u"})
        except OSError:
            pass
    hostile.routes["/v2/a/b/blobs/uploads/"] = slow_reader
    t0 = time.monotonic()
    with pytest.raises(RegistryError, match="upload: "):
        hostile.client().patch("/v2/a/b/blobs/uploads/u", body, 0)
    assert time.monotonic() - t0 < 2.5


@pytest.mark.parametrize("token", ["abc\r\nX-Injected: 1", "two words", "é"])
def test_a_token_that_would_smuggle_a_header_is_refused_in_one_line(hostile, token):
    import json

    def registry(h) -> None:
        if h.headers.get("Authorization", "").startswith("Bearer"):
            return _send(h, 200, b"{}")
        _send(h, 401, b"{}", {"WWW-Authenticate":
                              f'Bearer realm="https://{hostile.host}/token",service="r"'})
    hostile.routes["/token"] = lambda h: _send(h, 200, json.dumps({"token": token}).encode())
    hostile.routes["/v2/"] = registry
    with pytest.raises(RegistryError, match="not one printable word"):
        hostile.client(("u", "p")).ping()


def test_a_pull_into_a_link_that_fails_leaves_nothing_where_the_link_points(tmp_path):
    from torpor.errors import PreflightError
    from torpor.registry import transfer
    from torpor.store import Store
    from tests.unit.test_registry_images import FakeRegistry, _pushed_packed
    reg, _ = _pushed_packed(tmp_path)
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)

    def refuse(m):
        raise PreflightError("no GPU here can take it")
    with pytest.raises(PreflightError):
        transfer.pull(FakeRegistry(blobs=reg.blobs, manifests=reg.manifests), tmp_path / "link",
                      Store(tmp_path / "store-b"), preflight=refuse)
    assert not target.exists() or not any(target.iterdir())
    ok = transfer.pull(FakeRegistry(blobs=reg.blobs, manifests=reg.manifests), tmp_path / "link",
                       Store(tmp_path / "store-b"), preflight=None)
    assert ok.directory == str(target) and (target / "checkpoint" / "torpor.json").is_file()


@pytest.mark.parametrize("where", ["fetch", "unpack"])
def test_a_full_disk_while_pulling_is_one_line_not_a_tampered_blob(tmp_path, monkeypatch, where):
    """A full disk while the layer is written (fetched, or unpacked) was blamed on the
    registry (\"cut off\", exit 9) or escaped as an OSError (\"internal error\")."""
    import errno
    import os

    from torpor.errors import UsageError
    from torpor.registry import layer, transfer
    from torpor.store import Store
    from tests.unit.test_registry_images import FakeRegistry, _pushed_packed

    reg, _ = _pushed_packed(tmp_path)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if where == "fetch":
        class Full:
            def __init__(self, f):
                self.f = f

            def write(self, data):
                raise full

            def __enter__(self):
                return self

            def __exit__(self, *a):
                self.f.close()
        real_open = open
        monkeypatch.setattr(transfer, "open", lambda p, m="r": Full(real_open(p, m))
                            if m == "xb" else real_open(p, m), raising=False)
    else:
        def no_room(*a):
            raise full
        monkeypatch.setattr(layer, "_write_member", no_room)
    with pytest.raises(UsageError, match="no space left") as e:
        transfer.pull(FakeRegistry(blobs=reg.blobs, manifests=reg.manifests), tmp_path / "p",
                      Store(tmp_path / "store-b"))
    assert e.value.exit_code == 2 and not (tmp_path / "p").exists()


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME])
def test_a_tar_extended_header_of_gigabytes_is_refused_before_it_is_read(tmp_path, kind):
    """tarfile reads a pax or GNU long-name header whole into memory: 4.5 MB of gzip declaring
    1 GB of long name made torpor take 2 GB. Refused from the header's size, in a pulled layer
    and in a checkpoint archive alike (only 1 KiB of it is here: the size alone is refused)."""
    from torpor import archive
    from torpor.errors import CorruptCheckpointError
    from torpor.registry import layer

    head = tarfile.TarInfo("././@LongLink")
    head.type, head.size = kind, 8 << 30
    data = head.tobuf(tarfile.GNU_FORMAT) + b"a" * 1024
    path = tmp_path / "bomb.tar.gz"
    with gzip.open(path, "wb") as g:
        g.write(data)
    dest = tmp_path / "d"
    dest.mkdir(mode=0o700)
    with open(path, "rb") as f, pytest.raises(CorruptCheckpointError, match="extended header"):
        layer.unpack(f, dest, "layer", 1 << 20)
    with pytest.raises(CorruptCheckpointError, match="extended header"):
        archive.verify_archive(path)


@pytest.mark.parametrize("status", [200, 500])
def test_a_small_answer_that_stalls_is_one_registry_error(hostile, monkeypatch, status):
    """The bodies read only to be done with them (ping, an upload's answer, an error's text)
    went through a bare resp.read(): a stall there escaped as TimeoutError."""
    monkeypatch.setattr(client_mod, "TIMEOUT", 0.5)

    def stall(h) -> None:
        h.send_response(status)
        h.send_header("Content-Length", "100")
        h.end_headers()
        h.wfile.write(b"{")
        h.wfile.flush()
        time.sleep(1.5)
    hostile.routes["/v2/"] = stall
    with pytest.raises(RegistryError, match="HTTP 500" if status == 500 else "broke off"):
        hostile.client().ping()


def test_a_layer_of_many_long_named_members_is_read_without_keeping_them(tmp_path):
    """tarfile keeps every member it read (tar.members), streaming too: 2.4 MB of gzip
    repeating one 3,750-character directory 100,000 times made a pull take 818 MB (8 GB at
    the layer's limit of a million members); an archive had no limit at all."""
    import tracemalloc

    from torpor import archive
    from torpor.registry import layer

    parts = ["d" * 250] * 15
    path = tmp_path / "many.tar.gz"
    with gzip.open(path, "wb") as g:
        for k in range(1, len(parts) + 1):
            ti = tarfile.TarInfo("/".join(parts[:k]))
            ti.type = tarfile.DIRTYPE
            g.write(ti.tobuf(tarfile.PAX_FORMAT))
        g.write(ti.tobuf(tarfile.PAX_FORMAT) * 4000 + b"\0" * 1024)
    dest = tmp_path / "d"
    dest.mkdir(mode=0o700)
    tracemalloc.start()
    try:
        with open(path, "rb") as f:
            assert layer.unpack(f, dest, "layer", 1 << 20) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak   # 38 MB when every member was kept
    kept = []
    archive._members(path, lambda tar, m: kept.append(len(tar.members)))
    assert len(kept) == 4015 and max(kept) <= 1


def test_a_pull_whose_outputs_are_taken_is_refused_before_anything_is_fetched(tmp_path):
    """--archive naming an existing file was refused only at the very end: every chunk
    fetched into the store, the --oci-layout written and left behind, -D removed."""
    from torpor.errors import UsageError
    from torpor.registry import transfer
    from torpor.store import Store
    from tests.unit.test_registry_images import FakeRegistry, _pushed_packed
    reg, _ = _pushed_packed(tmp_path)
    (tmp_path / "taken.tar").write_bytes(b"mine")
    fetched = []
    fake = FakeRegistry(blobs=reg.blobs, manifests=reg.manifests)
    fake.get_manifest = lambda ref: fetched.append(ref)   # type: ignore[method-assign]
    with pytest.raises(UsageError, match="exists already"):
        transfer.pull(fake, tmp_path / "p", Store(tmp_path / "store-b"),
                      layout_out=tmp_path / "layout", archive_out=tmp_path / "taken.tar")
    assert not fetched and (tmp_path / "taken.tar").read_bytes() == b"mine"
    assert not (tmp_path / "p").exists() and not (tmp_path / "layout").exists()


# --- a layout to push, from elsewhere ----------------------------------------------------------

def _layout(root: Path, annotations: dict) -> Path:
    """An OCI layout whose one image manifest carries annotations (no layer needed to read it)."""
    import hashlib
    import json as json_mod
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        h = hashlib.sha256(data).hexdigest()
        (blobs / h).write_bytes(data)
        return f"sha256:{h}"
    config = put(b"{}")
    man = json_mod.dumps({"schemaVersion": 2,
                          "mediaType": "application/vnd.oci.image.manifest.v1+json",
                          "config": {"mediaType": "application/vnd.oci.empty.v1+json",
                                     "digest": config, "size": 2},
                          "layers": [], "annotations": annotations}).encode()
    d = put(man)
    (root / "index.json").write_text(json_mod.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": d,
         "size": len(man)}]}))
    return root


@pytest.mark.parametrize("chunks", ["sha256:../../../etc/passwd", "sha256:" + "A" * 64, "x"])
def test_a_layouts_chunk_artifact_that_is_no_digest_names_no_file(tmp_path, chunks):
    from torpor.errors import CorruptCheckpointError
    from torpor.registry import transfer
    layout = _layout(tmp_path / "layout", {"io.torpor.chunks": chunks})
    with pytest.raises(CorruptCheckpointError, match="is no sha256 digest"):
        transfer._read_layout(layout)


def test_a_layouts_index_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    import os
    from torpor.errors import CorruptCheckpointError
    from torpor.registry import transfer
    layout = _layout(tmp_path / "layout", {})
    (layout / "index.json").unlink()
    os.mkfifo(layout / "index.json")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        transfer._read_layout(layout)
