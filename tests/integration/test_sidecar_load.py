"""torpord under load (issue 18 item 3, the "Load" suite): each flood from processes of their
own uid while root calls torpord every 50 ms on a new connection, both through root's own door
(as root's clients do) and through the public socket and the proxy, every call answered within
a second; torpord's memory (VmRSS before, peak, after), threads (/proc/PID/task) and log bytes
against stated bounds. The floods, at the issue's CI figures by default:
- idle: IDLE connections held by the configured owner uid (the proxy splices PER_UID of them;
  every other one is refused, never queued);
- refused: connect-and-close from a uid that is not allowed (socket opened up to it);
- rpcs: RPCS concurrent Status calls from the owner over 16 connections (those past the shared
  gRPC server's bounds are refused: RESOURCE_EXHAUSTED or CANCELLED; nothing else may fail);
- all at once: rpcs, idle and refused together (the public route only reported: its backlog
  may overflow, which is why root has a door);
- emfile: torpord's descriptor limit lowered under it (prlimit) far below what the owner's
  connections hold: accept goes on, root is answered (within 2 s: gRPC's listener retries a
  failed accept a second later) and the owner's ordinary calls are served afterwards.
Also: root answered while the public socket takes no connection at all; the proxy's limits in
process (per-uid cap, root's place when full, idle timeout, room under a descriptor limit).

Counts by env var: TORPOR_LOAD_IDLE (default 10000), TORPOR_LOAD_RPCS (default 10000),
TORPOR_LOAD_SECONDS (how long idle connections are held and refused floods last, default 8).
Figures are printed (pytest -s) as one `load[...]` line per flood."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
try:
    import torpor  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "shim"))
    import torpor  # noqa: F401

PKG = Path(torpor.__file__).resolve().parent
if not (PKG / "_proto" / "torpor_pb2_grpc.py").exists():
    pytest.skip(f"installed torpor at {PKG} lacks torpor._proto", allow_module_level=True)

from tests.fakes.fakegpu import FakeGpu  # noqa: E402
from tests.integration.torpord import Daemon  # noqa: E402
from torpor.errors import SidecarError  # noqa: E402
from torpor.sidecar.client import Client  # noqa: E402
from torpor.sidecar.peercred import PER_UID, RESERVE_FDS, PeerCredProxy, bind_unix  # noqa: E402

NOBODY = 65534
OWNER = 65533
IDLE = int(os.environ.get("TORPOR_LOAD_IDLE", "10000"))
RPCS = int(os.environ.get("TORPOR_LOAD_RPCS", "10000"))
SECONDS = float(os.environ.get("TORPOR_LOAD_SECONDS", "8"))
ROOT_WITHIN_S = 1.0      # every root call, on a new connection, during every flood
MAX_THREADS = 64         # gRPC's pools (16 + 4 workers) and its own, the proxy's one
MAX_RSS_GROWTH = 96 << 20          # bytes of VmRSS a flood may leave behind
MAX_RSS_PEAK = 192 << 20           # and may add at its peak (sampled every call)
MAX_LOG_GROWTH = 64 << 10          # bytes torpord may log (at debug level) during a flood
CLIENTS = (Path(__file__).with_name("load_clients.py")).read_text()

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (other uids' clients)")


@pytest.fixture
def base():
    d = Path(tempfile.mkdtemp(prefix="tpl", dir="/tmp"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(base):
    _raise_nofile(max(IDLE, 1024) + 1024)
    gpu = FakeGpu(base / "gpu")
    with gpu:
        d = Daemon(base, gpu, f"socket_owner_uid = {OWNER}\n")
        try:
            yield d.start()
        finally:
            d.stop()


def _raise_nofile(want: int) -> None:
    """This process's descriptor limits (inherited by its clients) to at least want (root may
    raise the hard one, up to fs.nr_open)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want:
        hard = min(want, int(Path("/proc/sys/fs/nr_open").read_text()))
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _client(uid: int, *args: object) -> subprocess.Popen:
    """load_clients.py as uid (a fresh process: no gRPC state crosses a fork). It drops root
    itself: Popen(user=...) would fork() this process, not vfork() it, and fork() runs gRPC's
    pthread_atfork handlers here, which stop and restart this process's gRPC threads (the
    test process then hung about once in ten runs after the EMFILE flood)."""
    return subprocess.Popen([sys.executable, "-c", CLIENTS, str(uid), *map(str, args)],
                            cwd="/", stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen, timeout: float = 120) -> dict:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise AssertionError(f"a client ran past {timeout} s: {p.args[3:]}") from None
    lines = out.strip().splitlines()
    assert lines, f"client exited {p.returncode} without a result: {err[-2000:]}"
    return json.loads(lines[-1])


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _root_call(d: Daemon, public: bool = False) -> float:
    """Seconds root's Status RPC took on a new connection (raises when it failed): through
    root's own door, as root's clients call, or through the public socket and the proxy.
    In a thread of its own, watched: a client that hangs past its deadline fails the test
    instead of hanging it (seen once in ~10 runs; the likely cause, gRPC's fork handlers run
    by Popen(user=...), is gone: see _client)."""
    out: list = []

    def call() -> None:
        t0 = time.monotonic()
        try:
            with Client(d.cfg, d.cfg.socket_path if public else None, timeout=5) as c:
                c.status(pids=[os.getpid()])
            out.append(time.monotonic() - t0)
        except Exception as e:
            out.append(e)
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(15)
    if not out:
        raise TimeoutError(f"root's call {'through the public socket ' if public else ''}"
                           "hung past 15 s (its deadline is 5 s)")
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


def _before(d: Daemon) -> tuple[int, int, int]:
    """torpord's VmRSS, threads and log size now."""
    return _rss(d.proc.pid), _threads(d.proc.pid), d.log.stat().st_size


def _under(d: Daemon, name: str, kids: list[subprocess.Popen],
           before: tuple[int, int, int] | None = None) -> dict:
    """Call torpord as root every 50 ms until every kid has exited; the figures (from before,
    taken now when not given)."""
    pid = d.proc.pid
    rss0, threads0, log0 = before or _before(d)
    took, failed, threads, rss = [], [], threads0, rss0
    public, public_failed = [], []
    try:
        while any(k.poll() is None for k in kids):
            for times, fails, way in ((took, failed, False), (public, public_failed, True)):
                try:
                    times.append(_root_call(d, way))
                except Exception as e:     # UNAVAILABLE, DEADLINE_EXCEEDED: a failure as well
                    fails.append(repr(e)[:200])
            threads, rss = max(threads, _threads(pid)), max(rss, _rss(pid))
            time.sleep(0.05)
        results = [_result(k) for k in kids]
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
                k.wait()
    f = {"calls": len(took) + len(failed), "failed": failed, "max_s": max(took, default=0.0),
         "public_failed": public_failed, "public_max_s": max(public, default=0.0),
         "public_calls": len(public) + len(public_failed),
         "rss0": rss0, "rss_max": rss, "rss1": _rss(pid), "threads0": threads0,
         "threads_max": threads, "log_bytes": d.log.stat().st_size - log0, "results": results}
    print(f"\nload[{name}]: root {f['calls']} calls, {len(failed)} failed, slowest "
          f"{f['max_s']:.3f} s (through the public socket: {len(public_failed)} failed, slowest "
          f"{f['public_max_s']:.3f} s); VmRSS {rss0 >> 20} -> {f['rss1'] >> 20} MiB (peak "
          f"{rss >> 20}); threads {threads0} -> at most {threads}; log +{f['log_bytes']} B; "
          f"clients {results}")
    return f


def _assert_bounded(d: Daemon, f: dict, public: bool = True,
                    within: float = ROOT_WITHIN_S) -> None:
    """Root answered, each call within `within` (through the public socket too, given
    public), and torpord within its bounds, then and after."""
    assert not f["failed"], f"root's calls failed under the flood: {f['failed'][:5]}"
    assert f["calls"] >= 5, "root was not called during the flood"
    assert f["max_s"] <= within, f"a root call took {f['max_s']:.2f} s"
    if public:
        # root's clients take their door; its calls through the public socket, made to show
        # the proxy serves root under the flood, may lose one connection in fifty to a shed
        # (seen once: a 10,000-connection idle flood, 1 of ~140): more is a broken proxy
        assert len(f["public_failed"]) * 50 <= f["public_calls"], \
            f"through the public socket: {f['public_failed'][:5]} of {f['public_calls']} calls"
        assert f["public_max_s"] <= within, f"public: a call took {f['public_max_s']:.2f} s"
    assert f["threads_max"] <= MAX_THREADS, f"torpord ran {f['threads_max']} threads"
    assert f["rss1"] - f["rss0"] <= MAX_RSS_GROWTH, \
        f"torpord's VmRSS grew {f['rss0'] >> 20} -> {f['rss1'] >> 20} MiB"
    assert f["rss_max"] - f["rss0"] <= MAX_RSS_PEAK, f"VmRSS peaked at {f['rss_max'] >> 20} MiB"
    assert f["log_bytes"] <= MAX_LOG_GROWTH, f"torpord logged {f['log_bytes']} bytes"
    assert _root_call(d) < ROOT_WITHIN_S           # and serves on afterwards
    assert _root_call(d, public=True) < ROOT_WITHIN_S
    assert d.proc.poll() is None
    assert "loop failed" not in d.log_text()


@needs_root
def test_idle_connections_of_the_owner_are_capped_and_root_answered(daemon):
    f = _under(daemon, "idle", [_client(OWNER, "hold", daemon.cfg.socket_path, IDLE, SECONDS)])
    held = f["results"][0]
    assert held["opened"] + sum(held["errors"].values()) == IDLE
    # PER_UID spliced (the gRPC server's first bytes reached them), every other one refused
    assert held.get("served", 0) <= PER_UID and held.get("silent", 0) <= PER_UID
    assert held.get("closed", 0) >= held["opened"] - PER_UID
    assert f["threads_max"] < PER_UID, "a thread per connection"
    _assert_bounded(daemon, f)


@needs_root
def test_refused_flood_of_another_uid_leaves_root_answered(daemon):
    sock = daemon.cfg.socket_path
    os.chmod(sock, 0o666)            # opened up: nobody's connections reach the proxy
    f = _under(daemon, "refused", [_client(NOBODY, "flood", sock, SECONDS) for _ in range(2)])
    assert sum(r["connects"] for r in f["results"]) > 100
    _assert_bounded(daemon, f)
    assert "refused connection from pid" in daemon.log_text()


@needs_root
def test_concurrent_rpcs_of_the_owner_are_bounded_and_root_answered(daemon):
    f = _under(daemon, "rpcs", [_client(OWNER, "rpcs", daemon.cfg.socket_path, RPCS, 16)])
    codes = f["results"][0]["codes"]
    assert sum(codes.values()) == RPCS
    # refused past the bounds: RESOURCE_EXHAUSTED past maximum_concurrent_rpcs, CANCELLED by
    # gRPC core's own bound on calls no worker has taken yet; never UNAVAILABLE (a connection
    # lost), DEADLINE_EXCEEDED (queued without end), UNKNOWN or INTERNAL
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "CANCELLED"}, codes
    assert codes.get("OK", 0) > 0
    _assert_bounded(daemon, f)


@needs_root
def test_all_floods_at_once_leave_root_answered_and_torpord_bounded(daemon):
    sock = daemon.cfg.socket_path
    os.chmod(sock, 0o666)
    before = _before(daemon)
    rpcs = _client(OWNER, "rpcs", sock, RPCS, 16)
    assert rpcs.stdout.readline().strip() == "ready"   # its 16 connections hold 16 of PER_UID
    f = _under(daemon, "all at once", [
        rpcs, _client(OWNER, "hold", sock, IDLE, SECONDS),
        _client(NOBODY, "flood", sock, SECONDS), _client(NOBODY, "flood", sock, SECONDS)], before)
    codes, held = f["results"][0]["codes"], f["results"][1]
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "CANCELLED"} and sum(codes.values()) == RPCS
    assert codes.get("OK", 0) > 0
    assert held.get("served", 0) + held.get("silent", 0) <= PER_UID - 16
    # the public socket's backlog may overflow here (one Python process refuses for all):
    # root's clients use their own door; the public route is only reported
    _assert_bounded(daemon, f, public=False)


@needs_root
def test_root_is_answered_when_the_public_socket_takes_no_connection(daemon, base):
    """A flood that fills the public socket's backlog, here a listener that never accepts in
    its place, filled up, does not keep root's clients out: they use root's own door."""
    sock = daemon.cfg.socket_path
    os.rename(sock, base / "moved.sock")
    jam, fillers = bind_unix(sock, 0o666, backlog=0), []
    try:
        while True:
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            fillers.append(c)
            try:
                c.connect(str(sock))
            except BlockingIOError:
                break
        assert _root_call(daemon) < ROOT_WITHIN_S
        with pytest.raises(SidecarError):               # the public route is jammed
            _root_call(daemon, public=True)
    finally:
        for c in fillers:
            c.close()
        jam.close()
        os.rename(base / "moved.sock", sock)
    deadline = time.monotonic() + 10     # gRPC's client backs off from the jammed address
    while True:
        try:
            assert _root_call(daemon, public=True) < ROOT_WITHIN_S
            break
        except SidecarError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@needs_root
def test_out_of_descriptors_torpord_accepts_on_answers_root_then_serves_the_owner(daemon):
    pid, sock = daemon.proc.pid, daemon.cfg.socket_path
    fds = lambda: len(os.listdir(f"/proc/{pid}/fd"))  # noqa: E731
    base, before = fds(), _before(daemon)
    first = _client(OWNER, "hold", sock, PER_UID, SECONDS)
    deadline = time.monotonic() + 20
    while fds() < base + 2 * PER_UID and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fds() >= base + 2 * PER_UID, "the owner's connections were not spliced"
    # far below what is open now: torpord's next descriptor, whatever takes it, is EMFILE
    limit = base + 48
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))
    f = _under(daemon, "emfile", [first, _client(OWNER, "hold", sock, 400, SECONDS)], before)
    assert "Too many open files" in daemon.log_text(), "torpord never ran out of descriptors"
    # the longest-idle went, down to what the limit leaves room for (4 connections)
    assert f["results"][0].get("closed", 0) >= PER_UID - 4, f["results"][0]
    # a gRPC listener that met EMFILE in accept retries it a second later: a call may wait that
    _assert_bounded(daemon, f, within=ROOT_WITHIN_S + 1.0)
    assert _result(_client(OWNER, "call", sock))["code"] == "OK"
    assert resource.prlimit(pid, resource.RLIMIT_NOFILE) == (limit, limit)
    assert fds() <= limit


# -- the proxy's limits, in process, against an echo upstream -------------------------------------

@pytest.fixture
def echo(base):
    path = base / "up.sock"
    srv = bind_unix(path, 0o600)
    stop = threading.Event()

    def serve():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            threading.Thread(target=lambda c=c: [c.sendall(b) for b in iter(
                lambda: c.recv(4096), b"")], daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    yield path
    stop.set()
    srv.close()


def _served(path: Path) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(str(path))
    try:
        s.sendall(b"ping")
        if s.recv(4) == b"ping":
            return s
    except OSError:
        pass
    s.close()
    return None


def _echoes(uid: int, path: Path, n: int) -> tuple[subprocess.Popen, int]:
    """A client of uid holding n connections to path (spawned, not forked: see _client); it
    and how many of them the echo upstream answered through the proxy."""
    kid = _client(uid, "echo", path, n, 30.0)
    line = kid.stdout.readline()
    assert line, f"the echo client said nothing: {kid.stderr.read()[-2000:]}"
    return kid, json.loads(line)["served"]


def _end(kid: subprocess.Popen) -> None:
    kid.kill()
    kid.communicate()


@needs_root
def test_proxy_caps_a_uid_serves_root_when_full_and_times_idle_out(base, echo):
    pub = base / "pub.sock"
    p = PeerCredProxy(pub, echo, [0, OWNER], mode=0o666, max_conns=8, per_uid=6,
                      silent_s=2, idle_s=2)
    p.start()
    try:
        kid, got = _echoes(OWNER, pub, 8)
        assert got == 6                                   # the uid cap
        roots = [_served(pub) for _ in range(3)]
        assert all(roots)           # room for 2; the 3rd takes the longest-idle one's place
        assert p.active() == 8 and p.shed == 1
        time.sleep(3.5)                                   # idle > 2 s: all closed
        assert p.active() == 0
        assert _served(pub) is not None
        _end(kid)
    finally:
        p.close()


@needs_root
def test_proxy_room_follows_the_descriptor_limit(base, echo):
    """Three descriptors a connection, RESERVE_FDS left to the rest of torpord: a low limit
    (here 10 connections' worth) caps the connections before max_conns does."""
    pub = base / "pub.sock"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    p = PeerCredProxy(pub, echo, [0, OWNER], mode=0o666)
    p.start()
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (RESERVE_FDS + 3 * 10, hard))
        assert p.room() == 10
        kid, got = _echoes(OWNER, pub, 12)
        try:
            assert got == 10 and p.active() == 10
        finally:
            _end(kid)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        p.close()
