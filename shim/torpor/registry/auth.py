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

torpor-runtime, fetching a checkpoint image's chunks at restore (chunks.py), runs under the
engine (containerd's shim, as root), which hands it no credentials: the kubelet's pull secret
reaches containerd's PullImage only. Its credentials (node_auth_files): the config's
registry_auth_file, then the files above as root sees them ($REGISTRY_AUTH_FILE,
${XDG_RUNTIME_DIR}/containers/auth.json or /run/containers/0/auth.json: root's `podman login`,
$XDG_CONFIG_HOME/containers/auth.json, ~/.docker/config.json), then the kubelet's node-wide
/var/lib/kubelet/config.json. Its TLS (node_tls_context): containerd's hosts directory for
the host (registry_hosts_dir/HOST:PORT: hosts.toml's ca, client and skip_verify for that
host, and *.crt, *.cert/*.key beside it, as containerd reads them), else the containers
certs.d above.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import re
import ssl
import urllib.parse
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ..errors import UsageError
from ..files import loads_json, read_small_file

DOCKER_HUB = "registry-1.docker.io"
_REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HOST = re.compile(r"[A-Za-z0-9.-]+(?::[0-9]{1,5})?|\[[0-9a-fA-F:]+\](?::[0-9]{1,5})?")
MAX_AUTH_FILE = 1 << 20
MAX_HOSTS_TOML = 1 << 20
KUBELET_AUTH_FILE = Path("/var/lib/kubelet/config.json")   # the kubelet's node-wide credentials


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


def node_auth_files(configured: str = "", env: dict[str, str] | None = None) -> list[Path]:
    """The auth files torpor-runtime reads, in order (module docstring): the config's
    registry_auth_file, the containers conventions as this user sees them, the kubelet's."""
    return ([Path(configured)] if configured else []) + auth_files(None, env) \
        + [KUBELET_AUTH_FILE]


def _normalize(key: str) -> str:
    key = key.removeprefix("https://").removeprefix("http://")
    return key.removesuffix("/v1/").removesuffix("/v2/").rstrip("/")


def credentials(ref: Reference, authfile: Path | None = None,
                env: dict[str, str] | None = None, files: list[Path] | None = None
                ) -> tuple[str, str] | None:
    """(user, password) for ref's repository from the first auth file that has an entry:
    of files (node_auth_files) where given, else of auth_files(authfile, env)."""
    if authfile is not None and not authfile.is_file():
        raise UsageError(f"auth file {authfile} does not exist")
    host = "docker.io" if ref.host == DOCKER_HUB else ref.host
    parts = ref.repository.split("/")
    keys = [f"{host}/{'/'.join(parts[:i])}" for i in range(len(parts), 0, -1)] + [host]
    if host == "docker.io":
        keys.append("index.docker.io")
    for path in auth_files(authfile, env) if files is None else files:
        try:
            doc = loads_json(read_small_file(path, MAX_AUTH_FILE))   # a FIFO: refused
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


def _strings(value: object, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise UsageError(f"{where}: expected a path or a list of paths")


def _hosts_entry(path: Path, host: str) -> dict:
    """The settings containerd's hosts.toml gives host (its [host."https://HOST"] table, else
    the top level when server is https://HOST); {} when it names none."""
    try:
        doc = tomllib.loads(read_small_file(path, MAX_HOSTS_TOML).decode())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:   # UnicodeDecodeError and TOMLDecodeError are ValueErrors
        raise UsageError(f"cannot read {path}: {e}") from None
    for url, entry in (doc.get("host") or {}).items():
        u = urllib.parse.urlsplit(url)
        if u.netloc == host and u.scheme == "https" and isinstance(entry, dict):
            return entry
    server = urllib.parse.urlsplit(str(doc.get("server", "")))
    return doc if server.netloc == host and server.scheme == "https" else {}


def node_tls_context(host: str, hosts_dir: Path) -> ssl.SSLContext:
    """The TLS settings containerd uses for host: hosts_dir/HOST (its config_path: hosts.toml's
    ca, client and skip_verify, plus *.crt and *.cert/*.key files there); without such a
    directory, the containers certs.d (tls_context)."""
    d = hosts_dir / host
    if not d.is_dir():
        return tls_context(host)
    entry = _hosts_entry(d / "hosts.toml", host)
    where = f"{d}/hosts.toml"
    if entry.get("skip_verify") is True:
        return tls_context(host, verify=False)
    ctx = tls_context(host, d)        # the *.crt, *.cert/*.key files beside hosts.toml
    for ca in _strings(entry.get("ca", []), f"{where}: ca"):
        try:
            ctx.load_verify_locations(cafile=str(d / ca))   # relative: to the hosts dir
        except (OSError, ssl.SSLError) as e:
            raise UsageError(f"{where}: cannot load CA certificate {ca}: {e}") from None
    client = entry.get("client", [])
    pairs = [client] if isinstance(client, str) else client if isinstance(client, list) else None
    if pairs is None:
        raise UsageError(f"{where}: client is not a path or a list")
    for pair in pairs:
        cert, key = (pair, None) if isinstance(pair, str) else \
            (tuple(_strings(pair, f"{where}: client")) + (None,))[:2]
        try:
            ctx.load_cert_chain(str(d / cert), str(d / key) if key else None)
        except (OSError, ssl.SSLError) as e:
            raise UsageError(f"{where}: cannot load client certificate {cert}: {e}") from None
    return ctx
