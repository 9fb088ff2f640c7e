"""torpor.registry without a registry: references and auth files, the image a checkpoint builds
into (layout, annotations, chunk artifact), the checks on manifests and layers read back, and
push/pull against an in-memory registry (resume, verification, chunks from the store)."""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
import json
import os
import tarfile
from pathlib import Path

import pytest

from torpor import manifest
from torpor.errors import CorruptCheckpointError, UsageError
from torpor.registry import auth, build, layer, oci, transfer
from torpor.registry.client import Client, RegistryError
from torpor.store import Store, images
from tests.unit.test_manifest import _images, _manifest

UUID = "GPU-00001234-0000-4000-8000-000000000000"


def _sealed(tmp_path: Path, big: int = 0) -> Path:
    d = _images(tmp_path)
    if big:
        (d / "pages-2.img").write_bytes(os.urandom(big))
    m = _manifest(manifest.file_table(d, checksums=True))
    m["gpus"] = [{"uuid": UUID, "name": "Fake GPU", "memory_total": 1 << 30, "index": 0}]
    manifest.write(d, m)
    return d


# --- references and credentials ---------------------------------------------------------------

@pytest.mark.parametrize("text, host, repo, tag, digest", [
    ("localhost:5000/a/b:v1", "localhost:5000", "a/b", "v1", None),
    ("reg.example.com/x", "reg.example.com", "x", None, None),
    ("localhost/a@sha256:" + "a" * 64, "localhost", "a", None, "sha256:" + "a" * 64),
    ("ubuntu:22.04", auth.DOCKER_HUB, "library/ubuntu", "22.04", None),
])
def test_references_parse_as_the_engines_read_them(text, host, repo, tag, digest):
    r = auth.parse_reference(text)
    assert (r.host, r.repository, r.tag, r.digest) == (host, repo, tag, digest)


@pytest.mark.parametrize("bad", ["", "https://h/x", "h:5000/UPPER", "h:5000/a/../b", "h:5000/a:",
                                 "h:5000/a@sha256:zz", "h:5000/a b"])
def test_bad_references_are_one_usage_error(bad):
    with pytest.raises(UsageError):
        auth.parse_reference(bad)


def _auth(path: Path, entries: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"auths": {k: {"auth": base64.b64encode(v.encode()).decode()}
                                          for k, v in entries.items()}}))
    return path


def test_credentials_follow_the_containers_auth_file_order(tmp_path):
    ref = auth.parse_reference("reg:5000/team/app:v1")
    home = tmp_path / "home"
    env = {"HOME": str(home), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    assert auth.credentials(ref, env=env) is None
    _auth(home / ".docker" / "config.json", {"https://reg:5000": "docker:pw"})
    assert auth.credentials(ref, env=env) == ("docker", "pw")
    _auth(tmp_path / "run" / "containers" / "auth.json", {"reg:5000": "podman:pw",
                                                          "reg:5000/team": "team:pw"})
    assert auth.credentials(ref, env=env) == ("team", "pw")        # the most specific key
    env["REGISTRY_AUTH_FILE"] = str(_auth(tmp_path / "explicit.json", {"reg:5000": "env:pw"}))
    assert auth.credentials(ref, env=env) == ("env", "pw")
    given = _auth(tmp_path / "given.json", {"reg:5000": "flag:pw"})
    assert auth.credentials(ref, given, env=env) == ("flag", "pw")
    (tmp_path / "bad.json").write_text('{"auths": {"reg:5000": {"auth": "bm9jb2xvbg=="}}}')
    with pytest.raises(UsageError, match="user:password"):
        auth.credentials(ref, tmp_path / "bad.json", env=env)


# --- build ------------------------------------------------------------------------------------

def _layout(path: Path) -> tuple[dict, dict, Path]:
    blobs = path / "blobs" / "sha256"
    index = json.loads((path / "index.json").read_text())
    image = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_text())
    return index, image, blobs


def test_a_bare_checkpoint_builds_into_the_standard_checkpoint_image(tmp_path):
    src = _sealed(tmp_path)
    r = build.build(src, tmp_path / "out", name="web")
    index, image, blobs = _layout(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "oci-layout").read_text())["imageLayoutVersion"] == "1.0.0"
    assert index["manifests"][0]["annotations"][oci.A_REF_NAME] == "latest"
    assert len(image["layers"]) == 1 and image["layers"][0]["mediaType"] == oci.LAYER_TYPE
    a = image["annotations"]
    assert a["org.criu.checkpoint.container.name"] == "web"
    assert a["io.kubernetes.cri-o.annotations.checkpoint.name"] == "web"
    assert a["io.podman.annotations.checkpoint.name"] == "web"
    assert a["org.criu.checkpoint.criu.version"] == "4.1.1"
    assert json.loads(a[oci.A_GPUS]) == [{"uuid": UUID, "name": "Fake GPU",
                                          "memory_total": 1 << 30}]
    assert a[oci.A_MANIFEST] == "sha256:" + hashlib.sha256((src / "torpor.json").read_bytes()).hexdigest()
    assert oci.A_CHUNKS not in a and r.chunks == 0
    with tarfile.open(blobs / image["layers"][0]["digest"][7:]) as tar:
        names = {m.name: m for m in tar}
    assert set(names) == {"checkpoint", "checkpoint/sub", "checkpoint/sub/x.img",
                          "checkpoint/pages-1.img", "checkpoint/inventory.img",
                          "checkpoint/pstree.img", "checkpoint/torpor.json"}
    assert {m.uid for m in names.values()} == {0} and {m.mtime for m in names.values()} == {0}
    for path in blobs.iterdir():   # every blob is what its name says
        assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name
    config = json.loads((blobs / image["config"]["digest"][7:]).read_text())
    assert config["rootfs"]["diff_ids"] == [image["layers"][0]["digest"]]
    assert oct((tmp_path / "out").stat().st_mode & 0o777) == "0o700"
    again = build.build(src, tmp_path / "out2", name="web")
    assert again.digest == r.digest                   # same checkpoint, same image


def test_a_packed_checkpoint_carries_its_chunks_beside_the_image(tmp_path):
    src = _sealed(tmp_path, big=9 << 20)
    store = Store(tmp_path / "store")
    doc, _ = images.pack(store, src, "one")
    r = build.build(src, tmp_path / "out")
    _index, image, blobs = _layout(tmp_path / "out")
    art = json.loads((blobs / image["annotations"][oci.A_CHUNKS][7:]).read_text())
    assert art["artifactType"] == oci.CHUNKS_ARTIFACT and art["config"]["mediaType"] == oci.EMPTY_TYPE
    names = {d["annotations"][oci.A_CHUNK] for d in art["layers"]}
    assert names == {c for f in doc["files"].values() for c, _n in f["chunks"] if c}
    assert r.chunks == len(names) >= 3
    with tarfile.open(blobs / image["layers"][0]["digest"][7:]) as tar:
        members = {m.name for m in tar}
    assert "checkpoint/torpor-store.json" in members
    assert not any("torpor-chunks" in m or "pages-" in m for m in members)


def test_a_damaged_chunk_is_refused_at_build_and_no_layout_is_left(tmp_path):
    src = _sealed(tmp_path, big=5 << 20)
    images.pack(Store(tmp_path / "store"), src, "one")
    victim = max((src / "torpor-chunks").iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    victim.unlink()   # a hard link into the store: damage a copy
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=victim.name):
        build.build(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _kubelet_archive(tmp_path: Path, damage: bool = False, drop: bool = False
                     ) -> tuple[Path, str]:
    """A packed checkpoint as the kubelet's archive carries it: config.dump and spec.dump at the
    root, the checkpoint under checkpoint/, its chunk links flat (torpor-chunks+<sha256>);
    damage: flip a byte of the largest chunk; drop: leave it out. (archive, that chunk)"""
    src = _sealed(tmp_path, big=9 << 20)
    doc, _ = images.pack(Store(tmp_path / "store"), src, "one")
    out = tmp_path / "checkpoint-pod_default-c-2026.tar"
    biggest = max((src / "torpor-chunks").iterdir(), key=lambda p: p.stat().st_size).name
    with tarfile.open(out, "w") as tar:
        for n in ("config.dump", "spec.dump"):
            info = tarfile.TarInfo(n)
            data = json.dumps({"name": "c"}).encode()
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for path in sorted(src.rglob("*")):
            if path.is_dir():
                continue
            rel = path.relative_to(src).as_posix().replace("torpor-chunks/", "torpor-chunks+")
            data = path.read_bytes()
            if path.name == biggest and drop:
                continue
            if path.name == biggest and damage:
                data = data[:-1] + bytes([data[-1] ^ 1])
            info = tarfile.TarInfo(f"checkpoint/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out, biggest


def test_an_archive_of_a_packed_checkpoint_carries_its_chunks_beside_the_image(tmp_path):
    archive, _ = _kubelet_archive(tmp_path)
    doc = images.packed_doc(tmp_path / "img")
    r = build.build(archive, tmp_path / "out", name="c")
    _index, image, blobs = _layout(tmp_path / "out")
    art = json.loads((blobs / image["annotations"][oci.A_CHUNKS][7:]).read_text())
    names = {d["annotations"][oci.A_CHUNK] for d in art["layers"]}
    assert names == {c for f in doc["files"].values() for c, _n in f["chunks"] if c}
    assert r.chunks == len(names) >= 3
    for d in art["layers"]:
        assert hashlib.sha256((blobs / d["digest"][7:]).read_bytes()).hexdigest() == d["digest"][7:]
    with tarfile.open(blobs / image["layers"][0]["digest"][7:]) as tar:
        members = {m.name for m in tar}
    assert {"config.dump", "spec.dump", "checkpoint/torpor-store.json",
            "checkpoint/torpor.json"} <= members
    assert not any("torpor-chunks" in m for m in members)


def test_an_archive_whose_chunk_link_is_damaged_or_missing_is_not_built(tmp_path):
    archive, victim = _kubelet_archive(tmp_path / "a", drop=True)
    with pytest.raises(UsageError, match=f"chunk {victim} is missing from its torpor-chunks"):
        build.build(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    archive, victim = _kubelet_archive(tmp_path / "b", damage=True)
    with pytest.raises(CorruptCheckpointError, match=victim):
        build.build(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_link_in_a_checkpoint_is_not_built_into_an_image(tmp_path):
    src = _sealed(tmp_path)
    (src / "sub" / "x.img").unlink()
    (src / "sub" / "x.img").symlink_to("/etc/shadow")
    with pytest.raises(UsageError, match="plain files only"):
        build.build(src, tmp_path / "out")


# --- what is read back ------------------------------------------------------------------------

@pytest.mark.parametrize("doc", [
    {"schemaVersion": 1},
    {"schemaVersion": 2, "config": {"mediaType": "x", "digest": "md5:abc", "size": 1}, "layers": []},
    {"schemaVersion": 2, "config": {"mediaType": "x", "digest": "sha256:" + "0" * 64, "size": -1},
     "layers": []},
    {"schemaVersion": 2, "config": {"mediaType": "x", "digest": "sha256:" + "0" * 64, "size": 1},
     "layers": "no"},
    {"schemaVersion": 2, "mediaType": oci.INDEX_TYPE},
])
def test_malformed_manifests_are_corrupt(doc):
    with pytest.raises(CorruptCheckpointError):
        oci.Manifest.parse(json.dumps(doc).encode(), "test")
    with pytest.raises(CorruptCheckpointError, match="bytes"):
        oci.Manifest.parse(b" " * (oci.MAX_MANIFEST_BYTES + 1), "test")


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"x", **kw) -> tuple:
    ti = tarfile.TarInfo(name)
    ti.type, ti.size = kind, len(data) if kind == tarfile.REGTYPE else 0
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti, data if kind == tarfile.REGTYPE else None


@pytest.mark.parametrize("members, why", [
    ([_member("../evil")], "unsafe path"),
    ([_member("/etc/evil")], "unsafe path"),
    ([_member("checkpoint/a/../../evil")], "unsafe path"),
    ([_member("link", tarfile.SYMTYPE, linkname="/etc/shadow")], "not a plain file"),
    ([_member("hard", tarfile.LNKTYPE, linkname="checkpoint/x")], "not a plain file"),
    ([_member("dev", tarfile.CHRTYPE)], "not a plain file"),
    ([_member("fifo", tarfile.FIFOTYPE)], "not a plain file"),
    ([_member("a"), _member("a")], "twice"),
    ([_member("a"), _member("a/b")], "file and a directory"),
    ([_member("big", data=b"y" * 5000)], "more than"),
])
def test_an_untrusted_layer_is_never_unpacked_blindly(tmp_path, members, why):
    dest = tmp_path / "d"
    dest.mkdir(mode=0o700)
    with pytest.raises(CorruptCheckpointError, match=why):
        layer.unpack(_tar(*members), dest, "test", cap=4096)
    assert not (tmp_path / "evil").exists() and not Path("/etc/evil").exists()


def test_a_layer_unpacks_private(tmp_path):
    dest = tmp_path / "d"
    dest.mkdir(mode=0o700)
    files = layer.unpack(_tar(_member("./c/x.img", data=b"abc", mode=0o4777)), dest, "t", 10)
    assert files == ["c/x.img"] and (dest / "c" / "x.img").read_bytes() == b"abc"
    assert oct((dest / "c" / "x.img").stat().st_mode & 0o7777) == "0o600"
    assert oct((dest / "c").stat().st_mode & 0o777) == "0o700"


# --- push and pull against an in-memory registry ----------------------------------------------

class _Resp:
    def __init__(self, status: int, body: bytes = b"") -> None:
        self.status, self._body = status, io.BytesIO(body)

    def read(self, n: int = -1) -> bytes:
        return self._body.read(n)

    read1 = read   # http.client's: what has come, up to n


class FakeRegistry(Client):
    """The distribution API in memory; fail_patch_after: raise on that many-th PATCH (a cut)."""

    def __init__(self, ref: str = "reg:5000/a/b:v1", blobs: dict | None = None,
                 manifests: dict | None = None) -> None:
        super().__init__(auth.parse_reference(ref), None, None)  # type: ignore[arg-type]
        self.blobs: dict[str, bytes] = {} if blobs is None else blobs
        self.manifests: dict[str, bytes] = {} if manifests is None else manifests
        self.uploads: dict[str, bytearray] = {}
        self.fail_patch_after: int | None = None
        self.patches = 0
        self._ids = itertools.count()

    def ping(self) -> None:
        pass

    def clone(self) -> "FakeRegistry":
        return self   # one registry in memory, whatever the connections

    def has_blob(self, digest: str) -> bool:
        return digest in self.blobs

    def start_upload(self) -> str:
        loc = f"/up/{next(self._ids)}"
        self.uploads[loc] = bytearray()
        return loc

    def upload_offset(self, location: str) -> int | None:
        return len(self.uploads[location]) if location in self.uploads else None

    def patch(self, location: str, data: bytes, start: int) -> str:
        self.patches += 1
        if self.fail_patch_after is not None and self.patches > self.fail_patch_after:
            raise RegistryError("registry reg:5000: upload: connection reset")
        assert start == len(self.uploads[location])
        self.uploads[location] += data
        self.sent += len(data)
        return location

    def finish_upload(self, location: str, digest: str) -> None:
        data = bytes(self.uploads.pop(location))
        assert oci.digest_of(data) == digest
        self.blobs[digest] = data

    def put_manifest(self, ref: str, data: bytes) -> None:
        self.manifests[ref] = data
        self.manifests[oci.digest_of(data)] = data

    def get_manifest(self, ref: str) -> bytes:
        return self.manifests[ref]

    def request(self, method, path, body=None, headers=None, what="", ok=(200,), retry_auth=True):
        digest = path.rsplit("/", 1)[1]
        return _Resp(200, self.blobs[digest]) if digest in self.blobs else _Resp(404)


def test_a_push_cut_off_mid_blob_resumes_at_the_acknowledged_offset(tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "PIECE", 1 << 20)
    src = _sealed(tmp_path, big=5 << 20)
    r = build.build(src, tmp_path / "out")
    reg = FakeRegistry()
    reg.fail_patch_after = 3
    with pytest.raises(RegistryError):
        transfer.push(tmp_path / "out", reg, tmp_path / "state", workers=1)
    reg.fail_patch_after, reg.sent = None, 0
    res = transfer.push(tmp_path / "out", reg, tmp_path / "state", workers=1)
    assert res.resumed_blobs == 1 and res.digest == r.digest and res.skipped_blobs == 1  # config
    assert res.bytes_sent == r.layer_bytes - (2 << 20)           # two pieces not sent again
    assert reg.manifests["v1"] == (tmp_path / "out/blobs/sha256" / r.digest[7:]).read_bytes()
    assert not list((tmp_path / "state" / "registry-uploads").iterdir())
    again = transfer.push(tmp_path / "out", reg, tmp_path / "state")
    assert again.uploaded_blobs == 0 and again.skipped_blobs == again.blobs


def test_a_resume_where_the_registry_stands_elsewhere_starts_the_blob_over(tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "PIECE", 1 << 20)
    r = build.build(_sealed(tmp_path, big=3 << 20), tmp_path / "out")
    reg = FakeRegistry()
    reg.fail_patch_after = 2
    with pytest.raises(RegistryError):
        transfer.push(tmp_path / "out", reg, tmp_path / "state", workers=1)
    (loc,) = reg.uploads
    reg.uploads[loc] += b"half a piece the registry kept"   # a PATCH cut midway
    reg.fail_patch_after, reg.sent = None, 0
    res = transfer.push(tmp_path / "out", reg, tmp_path / "state", workers=1)
    assert res.resumed_blobs == 0 and res.uploaded_blobs == 1 and res.bytes_sent == r.layer_bytes


def _pushed_packed(tmp_path: Path) -> tuple[FakeRegistry, Store]:
    src = _sealed(tmp_path, big=9 << 20)
    store = Store(tmp_path / "store")
    images.pack(store, src, "one")
    build.build(src, tmp_path / "out")
    reg = FakeRegistry()
    transfer.push(tmp_path / "out", reg, tmp_path / "state")
    return reg, store


def test_a_pull_verifies_every_chunk_and_takes_what_the_store_has(tmp_path):
    reg, store = _pushed_packed(tmp_path)
    other = Store(tmp_path / "store-b")
    r = transfer.pull(FakeRegistry(blobs=reg.blobs, manifests=reg.manifests), tmp_path / "p",
                      other)
    assert r.chunks >= 3 and r.chunks_fetched == r.chunks and r.chunks_from_store == 0
    assert images.verify(Path(r.checkpoint)) == r.chunks
    for c in (Path(r.checkpoint) / "torpor-chunks").iterdir():    # into node b's store, linked
        assert other.backend.has_blob(c.name) and c.stat().st_nlink == 2
    assert manifest.read(Path(r.checkpoint))["gpus"][0]["uuid"] == UUID
    local = transfer.pull(FakeRegistry(blobs=reg.blobs, manifests=reg.manifests), tmp_path / "q",
                          store, layout_out=tmp_path / "layout")
    assert local.chunks_from_store == local.chunks and local.chunks_fetched == 0
    assert (tmp_path / "layout" / "index.json").exists()


def test_a_pull_fetches_again_a_chunk_the_store_holds_damaged(tmp_path):
    """The store's chunk is looked at before it is taken (backend.has_blob): a truncated one
    counts as missing, is fetched, and the verified blob replaces it."""
    reg, store = _pushed_packed(tmp_path)
    victim = max(store.backend.blobs(), key=lambda b: b.size).name
    path = store.backend.blob_path(victim)
    path.write_bytes(path.read_bytes()[:100])
    r = transfer.pull(FakeRegistry(blobs=reg.blobs, manifests=reg.manifests), tmp_path / "p",
                      store)
    assert r.chunks_fetched == 1 and r.chunks_from_store == r.chunks - 1
    assert images.verify(Path(r.checkpoint)) == r.chunks
    assert store.verify(dry_run=True).damaged == []


@pytest.mark.parametrize("how", ["flip", "truncate", "swap"])
def test_a_tampered_chunk_is_refused_and_nothing_is_left(tmp_path, how):
    reg, _store = _pushed_packed(tmp_path)
    image = oci.Manifest.parse(reg.manifests["v1"], "t")
    art = oci.Manifest.parse(reg.manifests[image.annotation(oci.A_CHUNKS)], "t")
    d = max(art.layers, key=lambda x: x.size)
    data = bytearray(reg.blobs[d.digest])
    if how == "flip":
        data[-1] ^= 1
    elif how == "truncate":
        data = data[:100]
    else:   # another chunk's blob under this digest: its own digest is fine, its name is not
        data = bytearray(reg.blobs[min(art.layers, key=lambda x: x.size).digest])
    reg.blobs[d.digest] = bytes(data)
    with pytest.raises(CorruptCheckpointError, match=d.digest):
        transfer.pull(reg, tmp_path / "p", Store(tmp_path / "store-b"))
    assert not (tmp_path / "p").exists()


def test_a_manifest_that_does_not_match_the_digest_asked_for_is_refused(tmp_path):
    reg, _ = _pushed_packed(tmp_path)
    want = oci.digest_of(reg.manifests["v1"])
    reg.manifests[want] = reg.manifests["v1"].replace(b'"schemaVersion":2', b'"schemaVersion": 2')
    reg.ref = auth.parse_reference(f"reg:5000/a/b@{want}")
    with pytest.raises(CorruptCheckpointError, match="tampered"):
        transfer.pull(reg, tmp_path / "p", Store(tmp_path / "store-b"))


def test_a_layer_that_brings_its_own_chunk_folder_is_refused(tmp_path):
    reg, _ = _pushed_packed(tmp_path)
    image = oci.Manifest.parse(reg.manifests["v1"], "t")
    layer_d = image.layers[0]
    buf = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(reg.blobs[layer_d.digest])) as src, \
            tarfile.open(fileobj=buf, mode="w") as out:
        for m in src:
            out.addfile(m, src.extractfile(m) if m.isfile() else None)
        planted = tarfile.TarInfo("checkpoint/torpor-chunks/" + "0" * 64)
        planted.size = 3
        out.addfile(planted, io.BytesIO(b"bad"))
    new_layer = oci.Descriptor.of(oci.LAYER_TYPE, buf.getvalue())
    reg.blobs[new_layer.digest] = buf.getvalue()
    forged = oci.Manifest(image.config, (new_layer,), image.annotations).dump()
    reg.manifests["v1"] = forged
    with pytest.raises(CorruptCheckpointError, match="torpor-chunks"):
        transfer.pull(reg, tmp_path / "p", Store(tmp_path / "store-b"))
    assert not (tmp_path / "p").exists()


# --- the HTTP client against a small TLS server ---------------------------------------------

import http.server  # noqa: E402
import ssl  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(d / "key.pem"), "-out", str(d / "ca.crt"), "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    return d


def _server(tls_cert: Path, scheme: str):
    seen: list[tuple[str, str, str | None]] = []

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _handle(self) -> None:
            got = self.headers.get("Authorization")
            seen.append((self.command, self.path, got))
            basic = "Basic " + base64.b64encode(b"u:p").decode()
            if self.path.startswith("/token"):
                return self._send(200, b'{"token": "T0K"}' if got == basic else b"", None) \
                    if got == basic else self._send(401)
            want = basic if scheme == "basic" else "Bearer T0K"
            if got != want:
                port = self.server.server_address[1]
                challenge = ('Basic realm="r"' if scheme == "basic" else
                             f'Bearer realm="https://localhost:{port}/token",service="reg"')
                return self._send(401, b"{}", {"WWW-Authenticate": challenge})
            if self.command == "HEAD":
                self.close_connection = True   # drops a kept-alive connection, unannounced
                return self._send(404)
            self._send(200, b"{}")

        do_GET = do_HEAD = do_PUT = _handle

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls_cert / "ca.crt", tls_cert / "key.pem")
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen


@pytest.mark.parametrize("scheme", ["basic", "bearer"])
def test_the_client_authenticates_as_the_registry_asks_and_survives_a_dropped_connection(
        tls_cert, scheme):
    srv, seen = _server(tls_cert, scheme)
    try:
        ref = auth.parse_reference(f"localhost:{srv.server_address[1]}/a/b:v1")
        c = Client(ref, auth.tls_context(ref.host, tls_cert), ("u", "p"))
        c.ping()
        assert c.has_blob("sha256:" + "0" * 64) is False       # the server drops the connection
        assert c.has_blob("sha256:" + "0" * 64) is False       # ... and the client reconnects
        c.close()
        if scheme == "bearer":
            assert any(p.startswith("/token?") and "scope=repository%3Aa%2Fb%3Apull%2Cpush" in p
                       for _m, p, _a in seen), seen
        no_creds = Client(ref, auth.tls_context(ref.host, tls_cert), None)
        with pytest.raises(RegistryError, match="authentication required"):
            no_creds.ping()
        untrusted = Client(ref, ssl.create_default_context(), ("u", "p"))
        with pytest.raises(RegistryError, match="not trusted"):
            untrusted.ping()
    finally:
        srv.shutdown()


def test_a_layer_larger_than_the_disk_is_refused_before_it_is_fetched(tmp_path):
    reg, _ = _pushed_packed(tmp_path)
    image = oci.Manifest.parse(reg.manifests["v1"], "t")
    huge = oci.Descriptor(image.layers[0].media_type, image.layers[0].digest, 1 << 49)
    reg.manifests["v1"] = oci.Manifest(image.config, (huge,), image.annotations).dump()
    fetched = []
    reg.get_blob = lambda d, out: fetched.append(d)   # type: ignore[method-assign]
    with pytest.raises(UsageError, match="free"):
        transfer.pull(reg, tmp_path / "p", Store(tmp_path / "store-b"))
    assert [d.digest for d in fetched] == [image.config.digest] and not (tmp_path / "p").exists()
