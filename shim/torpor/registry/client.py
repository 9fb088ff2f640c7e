"""A small client for the registry HTTP API (the OCI distribution spec), on http.client.

One persistent HTTPS connection per registry; Basic auth, or a Bearer token fetched from the
realm the registry names (with the same credentials), as docker-registry and the public
registries ask. Counts the bytes it sends and receives (push/pull report them). Every failure
is one RegistryError line naming the registry and what it answered; nothing read from the
registry is trusted (bodies are read up to a cap, redirects only to https).

A deadline (time.monotonic() value), where given, bounds every request and every read: a
registry too slow for it (torpor-runtime fetching inside the kubelet's StartContainer) is a
DeadlineError, never a wait past it. Without one (torpor image pull and push), a body that
comes slower than MIN_RATE bytes a second over RATE_WINDOW_S is cut off (SlowError), and so
is a request whose sending and answer's headers take longer than TIMEOUT plus its body at
MIN_RATE (_exchange): each socket wait is bounded by TIMEOUT, but a registry sending a byte
of a body or of its headers every TIMEOUT - 1 seconds would otherwise hold a pull or a push
for good. (A TLS send of an upload's piece is one write under one TIMEOUT already.)
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import re
import socket
import ssl
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, Callable, Iterable, TypeVar

from ..errors import CorruptCheckpointError, TorporError
from ..files import loads_json, printable
from . import oci
from .auth import Reference

log = logging.getLogger(__name__)
TIMEOUT = 60.0
MIN_RATE = 16 << 10      # bytes a second a body must keep up over each RATE_WINDOW_S
RATE_WINDOW_S = 60.0     # (curl's --speed-limit/--speed-time, at a rate any real link beats)
MAX_ERROR_BODY = 4096
MAX_TOKEN = 1 << 20
READ = 1 << 20
_TOKEN = re.compile(r"[\x21-\x7e]{1,65536}")   # a bearer token: visible ASCII, one word
ACCEPT = ", ".join([oci.MANIFEST_TYPE, oci.DOCKER_MANIFEST_TYPE])


SERVER_ERRORS = (500, 502, 503, 504)


class RegistryError(TorporError):
    """The registry could not be reached, refused us, or answered something unexpected."""


class DeadlineError(RegistryError):
    """The client's deadline passed before the registry had answered."""


class SlowError(RegistryError):
    """A body came slower than MIN_RATE over RATE_WINDOW_S: cut off."""


class _Pace:
    """How fast one body comes: check(got) raises SlowError once a whole RATE_WINDOW_S has
    passed with fewer than MIN_RATE bytes a second in it (windows restart where one ended)."""

    def __init__(self, client: "Client", what: str) -> None:
        self.client, self.what = client, what
        self.start, self.at = time.monotonic(), 0

    def check(self, got: int) -> None:
        now = time.monotonic()
        if now - self.start < RATE_WINDOW_S:
            return
        rate = (got - self.at) / (now - self.start)
        if rate < MIN_RATE:
            self.client.close()
            raise SlowError(f"registry {self.client.ref.host}: {self.what}: "
                            f"{got - self.at} bytes in the last {now - self.start:.0f} s, "
                            f"under {MIN_RATE >> 10} KiB/s: the registry or the link stalls; "
                            "cut off (try again)")
        self.start, self.at = now, got


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), dict(re.findall(r'(\w+)="([^"]*)"', rest))


class Client:
    # what an operator does about refused credentials or an untrusted certificate (the CLI's
    # options; torpor-runtime names its config keys instead)
    auth_advice = ("log in with podman login (or give --authfile)",
                   "no credentials for it in the auth files (podman login, or --authfile)")
    tls_advice = "put its CA in /etc/containers/certs.d/{host}/ca.crt or give --cert-dir"

    def __init__(self, ref: Reference, ctx: ssl.SSLContext,
                 creds: tuple[str, str] | None, deadline: float | None = None) -> None:
        self.ref, self.ctx, self.creds, self.deadline = ref, ctx, creds, deadline
        self.sent = self.received = 0
        self._conn: http.client.HTTPSConnection | None = None
        self._last: http.client.HTTPResponse | None = None   # the connection's latest response
        self._auth: str | None = None
        self.base = f"/v2/{ref.repository}"

    def clone(self) -> "Client":
        """Another connection to the same registry, with the authorization found so far."""
        c = Client(self.ref, self.ctx, self.creds, self.deadline)
        c._auth = self._auth
        return c

    # --- plumbing ----------------------------------------------------------------------------

    def _fail(self, what: str, why: str) -> RegistryError:
        return RegistryError(f"registry {self.ref.host}: {what}: {printable(why, 300)}")

    def _timeout(self, what: str) -> float:
        """How long one socket operation may wait: TIMEOUT, or what is left of the deadline
        (DeadlineError once it has passed)."""
        if self.deadline is None:
            return TIMEOUT
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.close()
            raise DeadlineError(f"registry {self.ref.host}: {what}: not done in time")
        return min(TIMEOUT, left)

    def _connection(self, what: str = "") -> http.client.HTTPSConnection:
        timeout = self._timeout(what)
        if self._last is not None and not self._last.isclosed():
            self.close()   # a response not read to its end (an error's body): a new connection
        if self._conn is None:
            self._conn = http.client.HTTPSConnection(self.ref.host, timeout=timeout,
                                                     context=self.ctx)
        elif self._conn.sock is not None:
            self._conn.sock.settimeout(timeout)
        return self._conn

    def close(self) -> None:
        self._last = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _exchange(self, method: str, path: str, body: bytes | None, hdrs: dict[str, str],
                  what: str) -> http.client.HTTPResponse:
        """The request sent and its answer's status and headers read, within TIMEOUT plus the
        body at MIN_RATE (within the deadline, where one is): past that a watchdog shuts the
        socket and the request is a SlowError. Every single socket wait has its timeout, but
        a registry that trickles its headers a byte each wait would hold it for good."""
        budget = TIMEOUT + (len(body) if body else 0) / MIN_RATE
        if self.deadline is not None:
            budget = min(budget, max(0.0, self.deadline - time.monotonic()))
        conn, fired = self._connection(what), threading.Event()

        def cut() -> None:
            fired.set()
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)   # the blocked send or recv returns
                except OSError:
                    pass
        timer = threading.Timer(budget, cut)
        timer.daemon = True
        timer.start()
        try:
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            if not fired.is_set():
                return resp
        except (OSError, http.client.HTTPException):
            if not fired.is_set():
                raise
        finally:
            timer.cancel()
        # cut: whatever came (the shut socket ends headers as if they were whole) is not used
        self.close()
        self._timeout(what)   # DeadlineError where the deadline cut it short
        raise SlowError(f"registry {self.ref.host}: {what}: no answer within {budget:.0f} s "
                        f"(the request and the answer's headers, at {MIN_RATE >> 10} KiB/s "
                        "or more): the registry or the link stalls; cut off (try again)")

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None, what: str = "",
                ok: tuple[int, ...] = (200,), retry_auth: bool = True
                ) -> http.client.HTTPResponse:
        """One request; the response (status in ok, or 404 for HEAD/GET, else RegistryError),
        its body still to be read by the caller."""
        hdrs = dict(headers or {})
        if self._auth:
            hdrs["Authorization"] = self._auth
        if body is not None:
            hdrs.setdefault("Content-Length", str(len(body)))
        what = what or f"{method} {path}"
        reused = self._conn is not None
        try:
            try:
                resp = self._exchange(method, path, body, hdrs, what)
            except (ConnectionError, http.client.RemoteDisconnected):
                # a kept-alive connection the registry closed meanwhile: once more on a new
                # one, except for a PATCH (the registry may hold part of it: push resumes)
                self.close()
                if not reused or method == "PATCH":
                    raise
                resp = self._exchange(method, path, body, hdrs, what)
        except ssl.SSLCertVerificationError as e:
            self.close()
            raise self._fail(what, f"TLS certificate not trusted ({e.verify_message}): "
                             + self.tls_advice.format(host=self.ref.host)) from None
        except (OSError, http.client.HTTPException) as e:
            self.close()
            self._timeout(what)   # DeadlineError where the deadline cut it short
            raise self._fail(what, f"{type(e).__name__}: {e}") from None
        self._last = resp
        if body is not None:
            self.sent += len(body)
        if resp.status == 401 and retry_auth:
            challenge = resp.getheader("WWW-Authenticate", "")
            self._body(resp, MAX_ERROR_BODY, what)
            self._authenticate(challenge, what)
            return self.request(method, path, body, headers, what, ok, retry_auth=False)
        if resp.status in ok or (resp.status == 404 and method in ("HEAD", "GET")):
            return resp
        try:
            detail = self._body(resp, MAX_ERROR_BODY, what).decode("utf-8", "replace") \
                if method != "HEAD" else ""
        except RegistryError:   # the status says enough
            detail = ""
        if resp.status == 401:
            detail = self._auth_advice()
        raise self._fail(what, f"HTTP {resp.status} {resp.reason} {_error_text(detail)}".strip())

    def _auth_advice(self) -> str:
        return (f"authentication refused: {self.auth_advice[0]}" if self.creds
                else f"authentication required: {self.auth_advice[1]}")

    def _authenticate(self, challenge: str, what: str) -> None:
        scheme, params = _challenge(challenge)
        if scheme == "basic":
            if not self.creds:
                raise self._fail(what, self._auth_advice())
            self._auth = "Basic " + base64.b64encode(":".join(self.creds).encode()).decode()
            return
        if scheme != "bearer" or "realm" not in params:
            raise self._fail(what, f"unsupported authentication challenge {challenge[:100]!r}")
        realm = urllib.parse.urlsplit(params["realm"])
        if realm.scheme != "https" or not realm.netloc:
            raise self._fail(what, "the token realm is not an https URL: refused")
        query = {k: v for k, v in params.items() if k in ("service", "scope")}
        query.setdefault("scope", f"repository:{self.ref.repository}:pull,push")
        hdrs = {}
        if self.creds:
            hdrs["Authorization"] = "Basic " + base64.b64encode(
                ":".join(self.creds).encode()).decode()
        conn = http.client.HTTPSConnection(realm.netloc, timeout=self._timeout(what),
                                           context=self.ctx)
        try:
            conn.request("GET", f"{realm.path or '/'}?{urllib.parse.urlencode(query)}",
                         headers=hdrs)
            resp = conn.getresponse()
            data = resp.read(MAX_TOKEN)
        except (OSError, http.client.HTTPException) as e:
            raise self._fail(what, f"token service {realm.netloc}: {e}") from None
        finally:
            conn.close()
        if resp.status == 401:
            raise self._fail(what, "authentication refused by the token service: "
                             f"{self.auth_advice[0]}" if self.creds else self._auth_advice())
        if resp.status != 200:
            raise self._fail(what, f"token service refused: HTTP {resp.status}")
        try:
            doc = loads_json(data)
            token = doc.get("token") or doc.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise self._fail(what, "token service answered no token")
        if not _TOKEN.fullmatch(token):   # it goes into a header: no CR/LF, no spaces
            raise self._fail(what, "token service answered a token that is not one printable "
                             "word: refused")
        self._auth = f"Bearer {token}"

    def _path(self, location: str) -> str:
        """An upload Location (absolute or relative) as a path on this registry."""
        u = urllib.parse.urlsplit(location)
        if u.netloc and u.netloc != self.ref.host:
            raise self._fail("upload", f"upload location on another host {u.netloc!r}: refused")
        return urllib.parse.urlunsplit(("", "", u.path, u.query, ""))

    def _body(self, resp: http.client.HTTPResponse, cap: int, what: str) -> bytes:
        """resp's body, at most cap bytes of it. A body that stalls, breaks off or ends before
        its Content-Length is a RegistryError (DeadlineError where the deadline passed), never
        an exception of the socket's, nor a short body passed on as if it were whole."""
        parts, got, pace = [], 0, _Pace(self, what)
        try:
            while got < cap:
                if self.deadline is not None and self._conn and self._conn.sock:
                    # what has come, at most one wait of what is left: a trickle stops too
                    self._conn.sock.settimeout(self._timeout(what))
                data = resp.read1(min(READ, cap - got))   # what has come: paced below
                if not data:
                    break
                parts.append(data)
                got += len(data)
                pace.check(got)
            if resp.length == 0 and not resp.isclosed():
                # read1 leaves a response open at its last byte (http.client), and the next
                # request would need a new connection: read() ends it
                resp.read()
        except (OSError, http.client.HTTPException) as e:
            self.close()
            self._timeout(what)   # DeadlineError where the deadline cut it short
            raise self._fail(what, f"the answer broke off after {got} bytes "
                             f"({type(e).__name__}: {e})") from None
        finally:
            self.received += got
        if got < cap and resp.length:   # the connection closed before the announced end
            self.close()
            raise self._fail(what, f"the answer broke off after {got} bytes, "
                             f"{got + resp.length} announced")
        return b"".join(parts)

    # --- the API -----------------------------------------------------------------------------

    def ping(self) -> None:
        self._body(self.request("GET", "/v2/", what="ping"), MAX_ERROR_BODY, "ping")

    def has_blob(self, digest: str) -> bool:
        """Whether the repository has the blob; a server error counts as no. docker-registry
        killed while it wrote a blob's link into the repository answers 500 for that blob
        from then on (tests/integration/test_registry.py), and uploading the blob again
        writes the link anew; a registry that truly fails refuses that upload with its own
        error."""
        resp = self.request("HEAD", f"{self.base}/blobs/{digest}", what=f"blob {digest}",
                            ok=(200, *SERVER_ERRORS))
        resp.read()
        return resp.status == 200

    def start_upload(self) -> str:
        resp = self.request("POST", f"{self.base}/blobs/uploads/", b"", what="start upload",
                            ok=(202,))
        self._body(resp, MAX_ERROR_BODY, "start upload")
        return self._path(resp.getheader("Location") or "")

    def upload_offset(self, location: str) -> int | None:
        """Where an upload stands (the bytes the registry has), None when it is gone."""
        try:
            resp = self.request("GET", self._path(location), what="upload status", ok=(204,))
        except RegistryError:
            return None
        resp.read(MAX_ERROR_BODY)
        if resp.status != 204:
            return None
        m = re.fullmatch(r"(?:bytes=)?0-(\d+)", resp.getheader("Range") or "")
        return int(m.group(1)) + 1 if m else 0

    def patch(self, location: str, data: bytes, start: int) -> str:
        resp = self.request("PATCH", self._path(location), data, {
            "Content-Type": "application/octet-stream",
            "Content-Range": f"{start}-{start + len(data) - 1}"}, what="upload", ok=(202,))
        self._body(resp, MAX_ERROR_BODY, "upload")
        return self._path(resp.getheader("Location") or location)

    def finish_upload(self, location: str, digest: str) -> None:
        path = self._path(location)
        sep = "&" if "?" in path else "?"
        self._body(self.request("PUT", f"{path}{sep}digest={digest}", b"", what=f"blob {digest}",
                                ok=(201, 204)), MAX_ERROR_BODY, f"blob {digest}")

    def put_manifest(self, ref: str, data: bytes) -> None:
        self._body(self.request("PUT", f"{self.base}/manifests/{ref}", data,
                                {"Content-Type": oci.MANIFEST_TYPE}, what=f"manifest {ref}",
                                ok=(201, 200)), MAX_ERROR_BODY, f"manifest {ref}")

    def get_manifest(self, ref: str) -> bytes:
        resp = self.request("GET", f"{self.base}/manifests/{ref}", headers={"Accept": ACCEPT},
                            what=f"manifest {ref}")
        if resp.status == 404:
            self._body(resp, MAX_ERROR_BODY, f"manifest {ref}")
            raise RegistryError(f"registry {self.ref.host}: no image {self.ref.repository}:{ref}",
                                exit_code=3)
        data = self._body(resp, oci.MAX_MANIFEST_BYTES + 1, f"manifest {ref}")
        if len(data) > oci.MAX_MANIFEST_BYTES:
            self.close()
            raise CorruptCheckpointError(f"registry {self.ref.host}: manifest {ref} is larger "
                                         f"than {oci.MAX_MANIFEST_BYTES} bytes: refused")
        return data

    def get_blob(self, d: oci.Descriptor, out: BinaryIO) -> None:
        """Blob d written to out, refused (CorruptCheckpointError, exit 9) unless it is exactly
        d.size bytes whose sha256 is d.digest."""
        resp = self.request("GET", f"{self.base}/blobs/{d.digest}", what=f"blob {d.digest}",
                            ok=(200, 307))
        if resp.status == 307:   # a storage backend's redirect: follow it once, https only
            self._body(resp, MAX_ERROR_BODY, f"blob {d.digest}")
            raise self._fail(f"blob {d.digest}", "redirects are not followed (filesystem "
                             "storage serves blobs itself)")
        if resp.status == 404:
            self._body(resp, MAX_ERROR_BODY, f"blob {d.digest}")
            raise CorruptCheckpointError(f"registry {self.ref.host}: blob {d.digest} of the "
                                         "image is missing")
        h, got, pace = hashlib.sha256(), 0, _Pace(self, f"blob {d.digest}")
        try:
            while got <= d.size:
                try:
                    if got == d.size:
                        # read() ends the response at its last byte, read1() would leave it
                        # open (http.client), and the connection then takes no next request
                        data = resp.read(1)
                    else:   # what has come, at most one wait (of what is left): a trickle
                        if self.deadline is not None and self._conn and self._conn.sock:
                            self._conn.sock.settimeout(self._timeout(f"blob {d.digest}"))
                        data = resp.read1(min(READ, d.size + 1 - got))
                except (OSError, http.client.HTTPException) as e:
                    self.close()
                    self._timeout(f"blob {d.digest}")   # DeadlineError where it cut it short
                    raise CorruptCheckpointError(
                        f"registry {self.ref.host}: blob {d.digest} was cut off after {got} of "
                        f"{d.size} bytes ({e}): refused") from None
                if not data:
                    break
                h.update(data)
                got += len(data)
                out.write(data)   # a full disk here is ours, not the registry's: not caught
                pace.check(got)
        finally:
            self.received += got
        if got != d.size:
            self.close()
            raise CorruptCheckpointError(f"registry {self.ref.host}: blob {d.digest} has "
                                         f"{'more than ' if got > d.size else ''}{got} bytes, its "
                                         f"manifest says {d.size}: truncated or tampered, refused")
        if "sha256:" + h.hexdigest() != d.digest:
            raise CorruptCheckpointError(f"registry {self.ref.host}: blob {d.digest} does not "
                                         "match its digest: tampered or damaged, refused")


T = TypeVar("T")
R = TypeVar("R")


def each(client: Client, items: Iterable[T], fn: Callable[[Client, T], R], workers: int
         ) -> list[R]:
    """fn(c, item) for every item, over `workers` connections at once (each thread its own
    clone of client); the results in order. The first failure is raised once the calls under
    way have ended (the rest are not started); the clones' byte counts go to client."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(client, it) for it in items]
    local, clones, lock = threading.local(), [], threading.Lock()

    def run(it: T) -> R:
        c = getattr(local, "client", None)
        if c is None:
            c = local.client = client.clone()
            with lock:
                clones.append(c)
        return fn(c, it)
    try:
        with ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(run, it) for it in items]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    finally:
        for c in clones:
            if c is not client:
                client.sent += c.sent
                client.received += c.received
                c.close()


def _error_text(detail: str) -> str:
    """The registry's error JSON ({"errors": [{"code", "message"}]}) in a few words."""
    try:
        errs = json.loads(detail).get("errors") or []
        return "; ".join(f"{e.get('code', '')}: {e.get('message', '')}" for e in errs[:3])
    except (ValueError, AttributeError, TypeError):
        return detail[:200]
