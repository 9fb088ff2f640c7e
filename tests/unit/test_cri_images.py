"""The CRI node's local images (packaging/containerd/oci_image.py) and the read-only registry
the CRI tests pull base images from (integration/oci_registry.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from integration.oci_registry import LayoutRegistry

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("oci_image",
                                               ROOT / "packaging" / "containerd" / "oci_image.py")
oci_image = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oci_image)


@pytest.fixture
def busybox(tmp_path: Path) -> Path:
    """A stand-in for a static busybox: answers --list with three applets."""
    p = tmp_path / "busybox"
    p.write_text("#!/bin/sh\nprintf 'sh\\nls\\nbusybox\\n'\n")
    p.chmod(0o755)
    return p


def _layout(data: bytes) -> tuple[dict, dict[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        files = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}
    return json.loads(files["index.json"]), files


def _blob(files: dict[str, bytes], digest: str) -> bytes:
    data = files["blobs/sha256/" + digest.removeprefix("sha256:")]
    assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
    return data


def test_busybox_image_is_a_valid_reproducible_layout(tmp_path, busybox):
    out = tmp_path / "bb.tar"
    assert oci_image.main(["busybox", str(busybox), str(out)]) == 0
    first = out.read_bytes()
    oci_image.main(["busybox", str(busybox), str(out)])
    assert out.read_bytes() == first                         # reproducible
    index, files = _layout(first)
    [desc] = index["manifests"]
    assert desc["annotations"]["io.containerd.image.name"] == "localhost/torpor-busybox:1"
    manifest = json.loads(_blob(files, desc["digest"]))
    config = json.loads(_blob(files, manifest["config"]["digest"]))
    layer = _blob(files, manifest["layers"][0]["digest"])
    assert config["rootfs"]["diff_ids"] == [manifest["layers"][0]["digest"]]  # uncompressed
    assert config["config"]["Entrypoint"] == ["/bin/sh"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as t:
        m = {x.name: x for x in t.getmembers()}
    assert m["bin/busybox"].isfile() and m["bin/busybox"].mode == 0o755
    assert {n: m[n].linkname for n in ("bin/sh", "bin/ls", "lib", "lib64")} == {
        "bin/sh": "busybox", "bin/ls": "busybox", "lib": "usr/lib", "lib64": "usr/lib64"}
    assert "bin/busybox" in m and not m["bin/busybox"].issym()
    assert m["tmp"].mode == 0o1777 and m["usr"].isdir()
    assert {x.mtime for x in m.values()} == {0} and {x.uid for x in m.values()} == {0}


def test_pause_image_holds_only_the_program(tmp_path):
    prog = tmp_path / "pause"
    prog.write_bytes(b"\x7fELF not really")
    out = tmp_path / "p.tar"
    oci_image.main(["pause", str(prog), str(out), "--name", "localhost/p:2"])
    index, files = _layout(out.read_bytes())
    manifest = json.loads(_blob(files, index["manifests"][0]["digest"]))
    with tarfile.open(fileobj=io.BytesIO(_blob(files, manifest["layers"][0]["digest"]))) as t:
        assert [(x.name, t.extractfile(x).read()) for x in t.getmembers()] == [
            ("pause", b"\x7fELF not really")]
    assert index["manifests"][0]["annotations"]["io.containerd.image.name"] == "localhost/p:2"


def test_registry_serves_the_layout_read_only(tmp_path, busybox):
    out = tmp_path / "bb.tar"
    oci_image.main(["busybox", str(busybox), str(out)])
    index, files = _layout(out.read_bytes())
    digest = index["manifests"][0]["digest"]
    with LayoutRegistry({"torpor-busybox": out}) as reg:
        url = f"http://127.0.0.1:{reg.port}/v2"
        assert reg.ref("torpor-busybox", "1") == f"localhost:{reg.port}/torpor-busybox:1"
        with urllib.request.urlopen(f"{url}/torpor-busybox/manifests/1") as r:
            assert r.headers["Docker-Content-Digest"] == digest
            assert "sha256:" + hashlib.sha256(r.read()).hexdigest() == digest
        req = urllib.request.Request(f"{url}/torpor-busybox/manifests/{digest}", method="HEAD")
        with urllib.request.urlopen(req) as r:
            assert r.read() == b"" and int(r.headers["Content-Length"]) > 0
        manifest = json.loads(files["blobs/sha256/" + digest.split(":")[1]])
        layer = manifest["layers"][0]["digest"]
        with urllib.request.urlopen(f"{url}/torpor-busybox/blobs/{layer}") as r:
            assert "sha256:" + hashlib.sha256(r.read()).hexdigest() == layer
        for bad in ("other/manifests/1", "torpor-busybox/manifests/2",
                    "torpor-busybox/blobs/sha256:" + "0" * 64, "torpor-busybox/../x"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"{url}/{bad}")
            assert e.value.code == 404
        for method in ("PUT", "POST", "DELETE"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(
                    f"{url}/torpor-busybox/manifests/1", data=b"{}", method=method))
            assert e.value.code == 501                    # nothing can be pushed
