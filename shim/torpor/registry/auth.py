"""Where a registry's credentials and TLS settings come from: the containers conventions, as
podman, skopeo, buildah and CRI-O read them (containers-auth.json(5), containers-certs.d(5)).

References: HOST[:PORT]/REPOSITORY[:TAG][@sha256:DIGEST]; a first component without '.' or ':'
(and not "localhost") is a Docker Hub repository, as the engines read it.

Credentials, the first file that has an entry for the registry: --authfile, $REGISTRY_AUTH_FILE,
${XDG_RUNTIME_DIR}/containers/auth.json (/run/containers/<uid>/auth.json without it),
$XDG_CONFIG_HOME/containers/auth.json (~/.config/...), ~/.docker/config.json. Entries are keyed
by HOST[:PORT][/NAMESPACE...]; the most specific key matching the repository wins; "auth" is
base64 of user:password. Credential helpers (credHelpers, credsStore) are not run.

TLS: the system's CAs, plus every *.crt in --cert-dir or /etc/containers/certs.d/HOST:PORT/
(then /etc/docker/certs.d/HOST:PORT/); a client.cert with its client.key is presented.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import re
import ssl
from pathlib import Path

from ..errors import UsageError
from ..files import loads_json

DOCKER_HUB = "registry-1.docker.io"
_REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HOST = re.compile(r"[A-Za-z0-9.-]+(?::[0-9]{1,5})?|\[[0-9a-fA-F:]+\](?::[0-9]{1,5})?")
MAX_AUTH_FILE = 1 << 20


@dataclasses.dataclass(frozen=True)
class Reference:
    host: str          # HOST[:PORT], as the registry is reached
    repository: str
    tag: str | None
    digest: str | None

    @property
    def ref(self) -> str:
        """What a manifest is fetched or pushed by: the digest, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return (f"{self.host}/{self.repository}" + (f":{self.tag}" if self.tag else "")
                + (f"@{self.digest}" if self.digest else ""))


def parse_reference(text: str) -> Reference:
    bad = UsageError(f"bad image reference {text[:200]!r}: expected HOST[:PORT]/REPOSITORY[:TAG]"
                     "[@sha256:DIGEST]")
    if not isinstance(text, str) or len(text) > 4096 or text.startswith(("http:", "https:")):
        raise bad
    rest, _, digest = text.partition("@")
    first, slash, tail = rest.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        host, path = first, tail
    else:
        host, path = DOCKER_HUB, rest if "/" in rest.split(":")[0] else f"library/{rest}"
    repo, colon, tag = path.rpartition(":") if ":" in path else (path, "", "")
    if not _HOST.fullmatch(host) or not _REPO.fullmatch(repo) or (colon and not _TAG.fullmatch(tag)) \
            or ("@" in text and not _DIGEST.fullmatch(digest)):
        raise bad
    return Reference(host, repo, tag or None, digest or None)


def auth_files(authfile: Path | None = None, env: dict[str, str] | None = None) -> list[Path]:
    env = dict(os.environ) if env is None else env
    home = Path(env.get("HOME") or os.path.expanduser("~"))
    runtime = env.get("XDG_RUNTIME_DIR") or f"/run/containers/{os.getuid()}"
    runtime_file = Path(runtime, "containers", "auth.json") if env.get("XDG_RUNTIME_DIR") \
        else Path(runtime, "auth.json")
    config = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
    out = [authfile] if authfile else []
    if env.get("REGISTRY_AUTH_FILE"):
        out.append(Path(env["REGISTRY_AUTH_FILE"]))
    return out + [runtime_file, config / "containers" / "auth.json", home / ".docker" / "config.json"]


def _normalize(key: str) -> str:
    key = key.removeprefix("https://").removeprefix("http://")
    return key.removesuffix("/v1/").removesuffix("/v2/").rstrip("/")


def credentials(ref: Reference, authfile: Path | None = None,
                env: dict[str, str] | None = None) -> tuple[str, str] | None:
    """(user, password) for ref's repository from the first auth file that has an entry."""
    if authfile is not None and not authfile.is_file():
        raise UsageError(f"auth file {authfile} does not exist")
    host = "docker.io" if ref.host == DOCKER_HUB else ref.host
    parts = ref.repository.split("/")
    keys = [f"{host}/{'/'.join(parts[:i])}" for i in range(len(parts), 0, -1)] + [host]
    if host == "docker.io":
        keys.append("index.docker.io")
    for path in auth_files(authfile, env):
        try:
            with open(path, "rb") as f:
                doc = loads_json(f.read(MAX_AUTH_FILE))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read auth file {path}: {e}") from None
        auths = doc.get("auths") if isinstance(doc, dict) else None
        if not isinstance(auths, dict):
            continue
        entries = {_normalize(k): v for k, v in auths.items() if isinstance(v, dict)}
        for key in keys:
            entry = entries.get(key)
            if entry and isinstance(entry.get("auth"), str):
                try:
                    user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
                except (ValueError, UnicodeDecodeError):
                    sep = ""
                if not sep:
                    raise UsageError(f"auth file {path}: the entry for {key} is not "
                                     "base64 of user:password")
                return user, password
    return None


def tls_context(host: str, cert_dir: Path | None = None, verify: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    dirs = [cert_dir] if cert_dir else [Path("/etc/containers/certs.d") / host,
                                        Path("/etc/docker/certs.d") / host]
    for d in dirs:
        if not d.is_dir():
            continue
        for crt in sorted(d.glob("*.crt")):
            try:
                ctx.load_verify_locations(cafile=str(crt))
            except (OSError, ssl.SSLError) as e:
                raise UsageError(f"cannot load CA certificate {crt}: {e}") from None
        for cert in sorted(d.glob("*.cert")):
            key = cert.with_suffix(".key")
            try:
                ctx.load_cert_chain(str(cert), str(key))
            except (OSError, ssl.SSLError) as e:
                raise UsageError(f"cannot load client certificate {cert} ({key}): {e}") from None
        break
    return ctx
