"""Debian's docker-registry, run as a user would: on localhost, TLS with a CA made here by
openssl, htpasswd (bcrypt) auth, filesystem storage. For tests/integration/test_registry.py."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARY = os.environ.get("TORPOR_DOCKER_REGISTRY", "/usr/bin/docker-registry")
USER, PASSWORD = "torpor", "s3cret-pass"
# Made ahead for a host without openssl and htpasswd (the GPU host: packaging/containerd/
# gpu-host-bundle.sh): ca.crt, server.crt and server.key for localhost/127.0.0.1, htpasswd.
PREMADE = ("ca.crt", "server.crt", "server.key", "htpasswd")


def _premade() -> Path | None:
    d = os.environ.get("TORPOR_REGISTRY_TLS")
    return Path(d) if d and all((Path(d) / f).is_file() for f in PREMADE) else None


def missing() -> str | None:
    tools = (BINARY,) if _premade() else (BINARY, shutil.which("openssl"), shutil.which("htpasswd"))
    for tool in tools:
        if not tool or not os.access(tool, os.X_OK):
            return "needs docker-registry, openssl and htpasswd (apache2-utils): ./install.sh"
    return None


def _free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


class Registry:
    def __init__(self, root: Path, ip: str = "127.0.0.1") -> None:
        """ip: the address it listens on (127.0.0.1, named localhost; or a veth's, reached from
        another network namespace)."""
        self.root, self.ip = root, ip
        root.mkdir(parents=True, exist_ok=True)
        self.port = _free_port(ip)
        self.host = f"localhost:{self.port}" if ip == "127.0.0.1" else f"{ip}:{self.port}"
        self.storage = root / "storage"
        self.certs = root / "certs.d" / self.host    # what --cert-dir is given
        self.certs.mkdir(parents=True)
        premade = _premade() if ip == "127.0.0.1" else None
        if premade:
            for f in PREMADE:
                shutil.copy(premade / f, root / f)
            (root / "server.key").chmod(0o600)
        else:
            self._make_tls_and_htpasswd(root, ip)
        shutil.copy(root / "ca.crt", self.certs / "ca.crt")
        self.authfile = root / "auth.json"
        token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
        self.authfile.write_text(json.dumps({"auths": {self.host: {"auth": token}}}))
        self.config = root / "config.yml"
        self.config.write_text(f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {self.storage}
  delete:
    enabled: true
http:
  addr: {ip}:{self.port}
  secret: torpor-test-secret-kept-across-restarts
  tls:
    certificate: {root}/server.crt
    key: {root}/server.key
auth:
  htpasswd:
    realm: torpor-test
    path: {root}/htpasswd
""")
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def _make_tls_and_htpasswd(root: Path, ip: str) -> None:
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
                 "ca.crt", "-days", "2", "-subj", "/CN=torpor test CA", cwd=root)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
                 "server.csr", "-subj", "/CN=localhost", cwd=root)
        (root / "san.cnf").write_text(f"subjectAltName=DNS:localhost,IP:127.0.0.1,IP:{ip}\n")
        _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.cnf",
                 cwd=root)
        htpasswd = subprocess.run(["htpasswd", "-Bbn", USER, PASSWORD], check=True,
                                  capture_output=True, text=True).stdout
        (root / "htpasswd").write_text(htpasswd)

    def start(self) -> "Registry":
        self.log = open(self.root / "registry.log", "ab")
        self.proc = subprocess.Popen([BINARY, "serve", str(self.config)], stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {(self.root / 'registry.log').read_text()}")
            try:
                socket.create_connection((self.ip, self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("docker-registry did not listen within 30 s")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def blob_files(self) -> list[Path]:
        return sorted((self.storage / "docker/registry/v2/blobs/sha256").glob("*/*/data"))

    def blob_file(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def args(self) -> list[str]:
        """torpor image push/pull options for this registry."""
        return ["--authfile", str(self.authfile), "--cert-dir", str(self.certs)]
