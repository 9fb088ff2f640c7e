"""A read-only OCI distribution endpoint on 127.0.0.1 serving the images of OCI image-layout
tars: what a node pulls base images from, for the CRI tests (the machines cannot reach a
registry). Stdlib only; plain HTTP (containerd talks plain HTTP to ``localhost:PORT``).

    with LayoutRegistry({"torpor-busybox": Path("busybox.tar")}) as reg:
        ref = reg.ref("torpor-busybox", "1")        # localhost:PORT/torpor-busybox:1

Serves ``GET``/``HEAD /v2/``, ``/v2/<name>/manifests/<tag or digest>`` and
``/v2/<name>/blobs/<digest>``; every tag of the layout's index (its
``org.opencontainers.image.ref.name``) is offered. Nothing can be pushed. Why it exists:
containerd 2.1's CRI restore (CreateContainer from a checkpoint archive) pulls the
checkpoint's base image by its repo digest even when the image is on the node, so the base
image must come from a registry and stay reachable.
"""

from __future__ import annotations

import json
import re
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Mapping

__all__ = ["LayoutRegistry"]

_PATH = re.compile(r"^/v2/(?P<name>[a-z0-9._/-]+)/(?P<kind>manifests|blobs)/"
                   r"(?P<ref>[A-Za-z0-9._:-]+)$")


class _Repo:
    def __init__(self, layout: Path):
        self.blobs: dict[str, bytes] = {}
        self.tags: dict[str, str] = {}
        self.types: dict[str, str] = {}
        with tarfile.open(layout) as t:
            for m in t.getmembers():
                if m.isfile() and m.name.startswith("blobs/sha256/"):
                    self.blobs["sha256:" + m.name.rsplit("/", 1)[1]] = t.extractfile(m).read()
            index = json.loads(t.extractfile("index.json").read())
        for desc in index["manifests"]:
            self.types[desc["digest"]] = desc["mediaType"]
            tag = desc.get("annotations", {}).get("org.opencontainers.image.ref.name")
            if tag:
                self.tags[tag] = desc["digest"]


class LayoutRegistry:
    """Serves ``repos`` (name -> OCI layout tar) until :meth:`close`."""

    def __init__(self, repos: Mapping[str, Path]):
        self.repos = {name: _Repo(Path(p)) for name, p in repos.items()}
        self.requests: list[str] = []
        handler = self._handler()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def ref(self, name: str, tag: str) -> str:
        return f"localhost:{self.port}/{name}:{tag}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        reg = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self) -> None:
                reg.requests.append(f"{self.command} {self.path}")
                if self.path in ("/v2/", "/v2"):
                    return self._send(200, b"{}", "application/json")
                m = _PATH.match(self.path)
                repo = reg.repos.get(m["name"]) if m else None
                if repo is None:
                    return self._send(404, b'{"errors":[{"code":"NAME_UNKNOWN"}]}',
                                      "application/json")
                ref = m["ref"]
                digest = repo.tags.get(ref, ref) if m["kind"] == "manifests" else ref
                data = repo.blobs.get(digest)
                if data is None:
                    return self._send(404, b'{"errors":[{"code":"UNKNOWN"}]}',
                                      "application/json")
                ctype = (repo.types.get(digest, "application/vnd.oci.image.manifest.v1+json")
                         if m["kind"] == "manifests" else "application/octet-stream")
                self._send(200, data, ctype, digest)

            def _send(self, code: int, data: bytes, ctype: str, digest: str = "") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Docker-Distribution-API-Version", "registry/2.0")
                if digest:
                    self.send_header("Docker-Content-Digest", digest)
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer()

            def do_HEAD(self) -> None:
                self._answer()

        return Handler

    def __enter__(self) -> "LayoutRegistry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
