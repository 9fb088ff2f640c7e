"""torpord end to end: a real torpord subprocess on its real socket, a fake GPU (tests/fakes/),
fake CUDA programs. Also the TorporError <-> gRPC status mapping (no daemon)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))            # tests.fakes.*
try:
    import torpor  # noqa: F401  (the installed one, as ./test.sh runs it)
except ImportError:
    sys.path.insert(0, str(ROOT / "shim"))   # the source tree, e.g. the dev venv
    import torpor  # noqa: F401

PKG = Path(torpor.__file__).resolve().parent
if not (PKG / "_proto" / "torpor_pb2_grpc.py").exists():
    if PKG != (ROOT / "shim" / "torpor").resolve():
        pytest.skip(f"installed torpor at {PKG} lacks torpor._proto: reinstall it",
                    allow_module_level=True)
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py")], check=True,
                   capture_output=True)

import grpc  # noqa: E402

from tests.fakes.fakegpu import CHECKPOINTED, LOCKED, RUNNING, FakeGpu  # noqa: E402
from torpor import config  # noqa: E402
from torpor.errors import (BusyError, ExitCode, NotFoundError, RolledBackError,  # noqa: E402
                           SidecarError, TorporError, UsageError)
from torpor.sidecar import EXIT_CODE_KEY, error_from_rpc, grpc_status  # noqa: E402
from torpor.sidecar.client import Client, ensure_running, ping  # noqa: E402
from torpor.sidecar.convert import Checkpointed, CudaProcess  # noqa: E402
from tests.integration.torpord import Daemon  # noqa: E402

GIB = 1 << 30
NOBODY = 65534
OWNER = 65533

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setuid children, chown)")


# -- the error mapping (no daemon) ------------------------------------------------------------------

@pytest.mark.parametrize("error, status, code", [
    (BusyError("PID 1 is busy"), grpc.StatusCode.ABORTED, 6),
    (NotFoundError("no such"), grpc.StatusCode.NOT_FOUND, 3),
    (UsageError("bad"), grpc.StatusCode.INVALID_ARGUMENT, 2),
    (RolledBackError("lock failed", exit_code=ExitCode.INTERRUPTED), grpc.StatusCode.CANCELLED, 130),
    (RolledBackError("lock failed"), grpc.StatusCode.INTERNAL, 8),
    (TorporError("boom"), grpc.StatusCode.INTERNAL, 1),
    (ValueError("not ours"), grpc.StatusCode.INTERNAL, 1),
])
def test_error_mapping_round_trip(error, status, code):
    got_status, got_code, details, md = grpc_status(error)
    assert (got_status, got_code) == (status, code)
    assert dict(md)[EXIT_CODE_KEY] == str(code)
    assert "\n" not in details
    back = error_from_rpc(got_status, details, md)
    assert back.exit_code == code
    if isinstance(error, TorporError):
        assert type(back) is type(error) and str(back) == str(error)


def test_error_mapping_keeps_hint_and_preflight():
    from torpor.errors import PreflightError
    status, code, details, md = grpc_status(PreflightError("GPU too small\nreally",
                                                           hint="use --device-map"))
    assert status == grpc.StatusCode.FAILED_PRECONDITION and code == 7
    assert details == "GPU too small really (use --device-map)"
    back = error_from_rpc(status, details, [(k, v.encode()) for k, v in md])
    assert isinstance(back, PreflightError) and back.hint == "use --device-map"


def test_rpc_failure_without_trailer_is_sidecar_error():
    err = error_from_rpc(grpc.StatusCode.UNAVAILABLE, "failed to connect", None)
    assert isinstance(err, SidecarError) and err.exit_code == ExitCode.SIDECAR


def test_client_without_socket_is_sidecar_error(tmp_path):
    cfg = config.load(env={"TORPOR_RUN_DIR": str(tmp_path / "run"),
                           "TORPOR_STATE_DIR": str(tmp_path / "state"),
                           "TORPOR_CONFIG": str(tmp_path / "none.toml")})
    assert ping(cfg).status == "warn" and "not running" in ping(cfg).detail
    with Client(cfg) as c, pytest.raises(SidecarError):
        c.list()


# -- fixtures -------------------------------------------------------------------------------------------

@pytest.fixture
def gpu(tmp_path):
    g = FakeGpu(tmp_path / "gpu")
    with g:
        yield g


@pytest.fixture
def base():
    # Short: a Unix socket path must fit in 108 bytes (pytest's tmp_path may not).
    d = Path(tempfile.mkdtemp(prefix="tpd", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_daemon(base, gpu):
    made: list[Daemon] = []

    def make(config_text: str = "") -> Daemon:
        d = Daemon(base, gpu, config_text)
        made.append(d)
        return d
    yield make
    for d in made:
        d.stop()


@pytest.fixture
def daemon(make_daemon):
    return make_daemon().start()


@pytest.fixture
def prog(gpu):
    p = gpu.spawn(gpu_index=0, mem=2 * GIB)
    p.wait_tick(0)
    yield p
    p.kill()


def stalled(prog, settle=0.2, watch=0.4) -> bool:
    time.sleep(settle)
    before = prog.tick()
    time.sleep(watch)
    return prog.tick() == before


def running_again(gpu, prog, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and gpu.state(prog.pid)["state"] != RUNNING:
        time.sleep(0.05)
    if gpu.state(prog.pid)["state"] != RUNNING:
        return False
    before = prog.tick()
    prog.wait_tick(before + 2)
    return True


def journal_entries(d: Daemon) -> list[str]:
    return sorted(p.name for p in (d.cfg.journal_dir).glob("*.json"))


# -- containers ---------------------------------------------------------------------------------------

def test_register_unregister_list_survive_restart(daemon):
    with daemon.client() as c:
        got = c.register_container("ctr-1.a_b", "/run/bundle/ctr-1", [], ["GPU-x"],
                                   {"io.kubernetes.pod.name": "p"})
        assert got.id == "ctr-1.a_b" and got.pids == () and got.registered_at > 0
        c.register_container("ctr-2", "/b2", [os.getpid()])
        # the same id under another runtime root: torpor-hook's <id>@<root key>, its own record
        c.register_container(f"ctr-1.a_b@{'0' * 16}", "/run/bundle/other")
        for bad in ("../x", "a/b", "..", "", "x" * 129, "a..b", f"x@{'A' * 16}", "x@0",
                    f"x@{'0' * 16}/../y"):
            with pytest.raises(UsageError):
                c.register_container(bad, "/b")
        ids = [x.id for x in c.list().containers]
        assert ids == ["ctr-1.a_b", f"ctr-1.a_b@{'0' * 16}", "ctr-2"]
        assert c.unregister_container(f"ctr-1.a_b@{'0' * 16}") is True
    from torpor.cli.ps import containers_by_pid    # `torpor ps` names a registered PID's container
    assert containers_by_pid(daemon.cfg)[os.getpid()] == "ctr-2"
    cdir = daemon.cfg.state_dir / "containers"
    assert stat.S_IMODE(cdir.stat().st_mode) == 0o700
    assert stat.S_IMODE((cdir / "ctr-2.json").stat().st_mode) == 0o600

    assert daemon.kill(signal.SIGTERM) == 0
    daemon.start()
    with daemon.client() as c:
        listing = c.list()
        assert [x.id for x in listing.containers] == ["ctr-1.a_b", "ctr-2"]
        assert listing.containers[0].annotations == {"io.kubernetes.pod.name": "p"}
        assert c.unregister_container("ctr-1.a_b") is True
        with pytest.raises(NotFoundError) as e:
            c.unregister_container("ctr-1.a_b")
        assert e.value.exit_code == 3
        assert c.unregister_container("ctr-1.a_b", missing_ok=True) is False
        assert [x.id for x in c.list().containers] == ["ctr-2"]


def test_sigusr2_writes_every_threads_stack_into_the_log_and_torpord_goes_on(daemon):
    """What a torpord that seems stuck is waiting for (docs/operations.md)."""
    before = len(daemon.log_text())
    daemon.proc.send_signal(signal.SIGUSR2)
    wait_for_text = time.monotonic() + 10
    # faulthandler writes thread after thread: wait for the main thread's stack, not only the first
    while "daemon.py" not in daemon.log_text()[before:] and time.monotonic() < wait_for_text:
        time.sleep(0.05)
    said = daemon.log_text()[before:]
    assert "most recent call first" in said and "daemon.py" in said, said
    assert daemon.proc.poll() is None
    with daemon.client() as c:
        assert c.list().server_pid == daemon.proc.pid


# -- checkpoint -----------------------------------------------------------------------------------------

def test_lock_checkpoint_then_rollback(daemon, gpu, prog):
    with daemon.client() as c:
        r = c.lock_and_checkpoint([prog.pid])
        assert r.op_id and r.pids == (prog.pid,)
        assert r.cuda_processes == (CudaProcess(
            pid=prog.pid, state="RUNNING", gpu_uuids=(gpu.uuid(0),), gpu_memory=2 * GIB,
            gpu_memory_by_gpu={gpu.uuid(0): 2 * GIB}),)
        assert set(r.timings) == {"lock", "checkpoint"}
        assert gpu.state(prog.pid)["state"] == CHECKPOINTED
        assert stalled(prog)
        ops = c.list().operations
        assert [o.op_id for o in ops] == [r.op_id] and ops[0].phase == "dump"
        st = c.status(op_id=r.op_id)
        assert st.processes[0].state == "CHECKPOINTED"
        assert st.processes[0].op_id == r.op_id
        assert len(journal_entries(daemon)) == 1

        rb = c.rollback(r.op_id)
        assert rb.outcome == "rolled-back" and rb.pids == (prog.pid,) and rb.gone == ()
        assert running_again(gpu, prog)
        st = c.status(pids=[prog.pid]).processes[0]
        assert st.state == "RUNNING" and st.gpu_uuids == (gpu.uuid(0),)  # RUNNING is 0
        assert c.list().operations == () and journal_entries(daemon) == []
        with pytest.raises(NotFoundError):
            c.rollback(r.op_id)


def test_finish_after_dump(daemon, gpu, prog):
    with daemon.client() as c:
        c.register_container("ctr", "/b", [prog.pid])
        r = c.lock_and_checkpoint(container_id="ctr")
        assert r.container_id == "ctr" and r.pids == (prog.pid,)
        prog.kill()                                 # what the dump does
        f = c.finish(r.op_id)
        assert f.outcome == "finished" and f.gone == (prog.pid,) and f.resumed == ()
        assert c.list().operations == () and journal_entries(daemon) == []
        with pytest.raises(NotFoundError):
            c.finish(r.op_id)


def test_finish_with_live_processes_resumes_them(daemon, gpu, prog):
    with daemon.client() as c:
        r = c.lock_and_checkpoint([prog.pid])
        f = c.finish(r.op_id)
        assert f.resumed == (prog.pid,)
        assert running_again(gpu, prog)


def test_restore_and_unlock_leave_running(daemon, gpu, prog):
    with daemon.client() as c:
        r = c.lock_and_checkpoint([prog.pid], lock_timeout_s=5)
        assert gpu.state(prog.pid)["state"] == CHECKPOINTED
        out = c.restore_and_unlock(op_id=r.op_id)
        assert out.op_id == r.op_id and out.pids == (prog.pid,)
        assert set(out.timings) == {"gpu-restore", "unlock"}
        assert running_again(gpu, prog)
        assert c.list().operations == ()


def test_restore_and_unlock_restored_container_with_gpu_map(daemon, gpu, prog):
    gpu.set_state(prog.pid, CHECKPOINTED)           # as a CRIU-restored CUDA process is
    assert stalled(prog)
    with daemon.client() as c:
        c.register_container("restored", "/b", [prog.pid])
        out = c.restore_and_unlock(container_id="restored", gpu_map={gpu.uuid(0): gpu.uuid(1)})
        assert out.pids == (prog.pid,) and out.gpu_map == {gpu.uuid(0): gpu.uuid(1)}
        assert running_again(gpu, prog)
        st = gpu.state(prog.pid)
        assert st["gpu"] == gpu.uuid(1) and st["restored_pairs"] == [(gpu.uuid(0), gpu.uuid(1))]
        assert journal_entries(daemon) == []
        with pytest.raises(UsageError):
            c.restore_and_unlock(op_id="x", pids=[prog.pid])


def test_second_lock_on_same_pids_is_aborted_with_exit_code_6(daemon, gpu, prog):
    with daemon.client() as c:
        r = c.lock_and_checkpoint([prog.pid])
        with pytest.raises(BusyError) as e:
            c.lock_and_checkpoint([prog.pid])
        assert e.value.exit_code == 6
        # the raw status, as another client (the Go/C shim) sees it
        pb = c.pb
        with pytest.raises(grpc.RpcError) as raw:
            c.stub.LockAndCheckpoint(pb.LockAndCheckpointRequest(pids=[prog.pid]))
        assert raw.value.code() == grpc.StatusCode.ABORTED
        assert dict(raw.value.trailing_metadata())[EXIT_CODE_KEY] == "6"
        assert "busy" in raw.value.details()
        assert gpu.state(prog.pid)["state"] == CHECKPOINTED   # the first op is untouched
        c.rollback(r.op_id)
        assert running_again(gpu, prog)


def test_concurrent_lock_requests_exactly_one_wins(daemon, gpu, prog):
    gpu.delay("lock", 500)
    results: list[object] = []

    def call() -> None:
        with daemon.client() as c:
            try:
                results.append(c.lock_and_checkpoint([prog.pid]))
            except TorporError as e:
                results.append(e)
    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    won = [r for r in results if isinstance(r, Checkpointed)]
    lost = [r for r in results if isinstance(r, TorporError)]
    assert len(won) == 1 and len(lost) == 1 and isinstance(lost[0], BusyError), results
    with daemon.client() as c:
        c.rollback(won[0].op_id)
    assert running_again(gpu, prog)


def test_open_operation_times_out_and_is_rolled_back(make_daemon, gpu, prog):
    d = make_daemon().start(op_timeout=1)
    with d.client() as c:
        r = c.lock_and_checkpoint([prog.pid])
        assert r.deadline - time.time() < 1.5
        assert gpu.state(prog.pid)["state"] == CHECKPOINTED
        assert running_again(gpu, prog, timeout=10)
        assert c.list().operations == ()
        with pytest.raises(NotFoundError):
            c.finish(r.op_id)
    assert "not ended within" in d.log_text()
    assert journal_entries(d) == []


def test_operation_of_a_dead_caller_is_rolled_back_at_once(daemon, gpu, prog):
    """torpor-runtime passes its PID: killed mid-checkpoint, torpord rolls back within about
    a second, not after the 600 s timeout; while a tracer (CRIU) holds the processes it waits."""
    owner = subprocess.Popen(["sleep", "60"])
    tracer = None
    try:
        with daemon.client() as c:
            with pytest.raises(UsageError, match="not running"):
                c.lock_and_checkpoint([prog.pid], owner_pid=999_999_999)
            r = c.lock_and_checkpoint([prog.pid], owner_pid=owner.pid)
            assert gpu.state(prog.pid)["state"] == CHECKPOINTED
            # a "dump" in progress: gdb-like ptrace attach by a helper process
            tracer = subprocess.Popen([sys.executable, "-c", TRACER, str(prog.pid)],
                                      stdout=subprocess.PIPE)
            assert tracer.stdout.readline().strip() == b"attached"
            owner.kill()
            owner.wait()
            time.sleep(2.5)
            assert gpu.state(prog.pid)["state"] == CHECKPOINTED  # traced: left alone
            assert [o.op_id for o in c.list().operations] == [r.op_id]
            tracer.kill()
            tracer.wait()
            assert running_again(gpu, prog, timeout=5)
            assert c.list().operations == () and journal_entries(daemon) == []
        assert "died without ending it" in daemon.log_text()
    finally:
        for p in (owner, tracer):
            if p is not None and p.poll() is None:
                p.kill()


# PTRACE_SEIZE the PID given, say so, then sleep: the process stays traced while we live.
TRACER = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(0x4206, int(sys.argv[1]), None, None) != 0:
    raise SystemExit(f"ptrace: errno {ctypes.get_errno()}")
print("attached", flush=True)
time.sleep(120)
"""


def test_sigterm_rolls_back_open_operations_and_exits_0(daemon, gpu, prog):
    with daemon.client() as c:
        c.lock_and_checkpoint([prog.pid])
    assert daemon.kill(signal.SIGTERM) == 0
    assert running_again(gpu, prog)
    assert not daemon.cfg.socket_path.exists()
    assert journal_entries(daemon) == []


def _checkpoint_in_background(daemon, gpu, prog, timeout=None):
    """LockAndCheckpoint from a thread; returns (thread, results) once the program is LOCKED
    (the fake's delayed checkpoint call is then in flight)."""
    results: list[object] = []

    def call() -> None:
        try:
            with daemon.client() as c:
                results.append(c.lock_and_checkpoint([prog.pid], timeout=timeout))
        except BaseException as e:
            results.append(e)
    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 10
    while gpu.state(prog.pid)["state"] != LOCKED and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gpu.state(prog.pid)["state"] == LOCKED
    return t, results


def test_sigkill_mid_checkpoint_then_new_torpord_recovers(daemon, gpu, prog):
    gpu.delay("checkpoint", 5000)
    t, errors = _checkpoint_in_background(daemon, gpu, prog)
    time.sleep(0.3)                                   # inside the (delayed) checkpoint call
    assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
    t.join(20)
    assert len(errors) == 1 and isinstance(errors[0], SidecarError), errors
    assert errors[0].exit_code == ExitCode.SIDECAR
    assert stalled(prog, settle=0) and gpu.state(prog.pid)["state"] == LOCKED
    assert len(journal_entries(daemon)) == 1

    gpu.clear_faults()
    daemon.start()                                    # stale socket and pid file replaced
    assert running_again(gpu, prog)
    assert f"recovered {prog.pid}" in daemon.log_text()
    assert journal_entries(daemon) == []
    with daemon.client() as c:                        # and the PID is free for a new op
        c.rollback(c.lock_and_checkpoint([prog.pid]).op_id)
    assert running_again(gpu, prog)


@pytest.mark.parametrize("client_timeout, delay_ms", [
    (0.5, 3000),     # the client gave up: gRPC forgets the call, its handler runs on
    (None, 8000),    # the client waits: the checkpoint outlasts server.stop's 5 s grace
], ids=["client-gone", "past-grace"])
def test_sigterm_during_lock_and_checkpoint_rolls_it_back(daemon, gpu, prog, client_timeout,
                                                          delay_ms):
    """A stop while LockAndCheckpoint is in flight waits for its handler, which must not leave
    an operation behind that nobody rolls back."""
    gpu.delay("checkpoint", delay_ms)
    t, results = _checkpoint_in_background(daemon, gpu, prog, timeout=client_timeout)
    if client_timeout:
        t.join(10)
        assert len(results) == 1 and isinstance(results[0], TorporError), results
    time.sleep(0.3)                                   # inside the (delayed) checkpoint call
    assert gpu.state(prog.pid)["state"] == LOCKED
    assert daemon.kill(signal.SIGTERM) == 0, daemon.log_text()
    t.join(20)
    assert len(results) == 1, results
    assert gpu.state(prog.pid)["state"] == RUNNING
    assert journal_entries(daemon) == []
    gpu.clear_faults()
    assert running_again(gpu, prog)


def test_startup_recovery_failure_is_logged_not_fatal(make_daemon, base, tmp_path):
    """An unexpected error in engine.recover() at start must not keep torpord down."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "from torpor.engine import Engine\n"
        "def recover(self):\n"
        "    raise RuntimeError('recovery exploded')\n"
        "Engine.recover = recover\n")
    d = make_daemon()
    d.env["PYTHONPATH"] = os.pathsep.join([str(hooks), d.env["PYTHONPATH"]])
    d.start()
    with d.client() as c:
        assert c.list().server_pid == d.proc.pid
    assert "recovery exploded" in d.log_text()


def test_second_torpord_on_same_run_dir_refuses(daemon):
    p = subprocess.run([sys.executable, "-m", "torpor.sidecar.daemon", "--foreground"],
                       env=daemon.env, capture_output=True, text=True, timeout=30)
    assert p.returncode == ExitCode.SIDECAR and "already running" in p.stderr
    assert ping(daemon.cfg).status == "ok"


# -- peer credentials -----------------------------------------------------------------------------------

_PROBE = """
import os, socket, sys
uid, path = int(sys.argv[1]), sys.argv[2]
os.setgroups([]); os.setgid(uid); os.setuid(uid)
assert os.geteuid() == uid
# the HTTP/2 preface and an empty SETTINGS frame: a gRPC server answers with its own SETTINGS
# frame (served), a refused connection is closed at once (refused)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
try:
    s.connect(path)
    s.sendall(b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
    data = s.recv(64)
except (ConnectionResetError, BrokenPipeError):
    data = b""
finally:
    s.close()
print("served" if len(data) >= 9 and data[3] == 4 else "refused", end="")
"""


def _connect_as(uid: int, path: Path) -> str:
    """A child that drops to uid/gid `uid` itself (no supplementary groups) probes the socket.
    Spawned, never forked: a fork of this process, which has used gRPC, runs gRPC's fork
    handlers (Popen's user= forks too), which can leave its threads stuck."""
    r = subprocess.run([sys.executable, "-c", _PROBE, str(uid), str(path)], capture_output=True,
                       text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return r.stdout


@needs_root
def test_peer_credentials_non_root_refused_root_and_owner_served(make_daemon, base):
    os.chmod(base, 0o711)
    d = make_daemon(f"socket_owner_uid = {OWNER}\n").start()
    sock = d.cfg.socket_path
    st = sock.stat()
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_uid == OWNER
    assert stat.S_IMODE(d.cfg.run_dir.stat().st_mode) == 0o711
    assert stat.S_IMODE((d.cfg.run_dir / "private").stat().st_mode) == 0o700
    os.chmod(sock, 0o666)       # a too-open socket must still not let anyone in

    assert _connect_as(NOBODY, sock) == "refused"
    assert _connect_as(OWNER, sock) == "served"
    with d.client() as c:
        assert c.list().server_pid == d.proc.pid       # root is served meanwhile
    log = d.log_text()
    assert f"uid {NOBODY}" in log and "refused connection from pid" in log
    assert not [ln for ln in log.splitlines() if "refused connection" in ln and f"uid {OWNER} " in ln]


# -- doctor, ping, ensure_running -------------------------------------------------------------------------

def test_doctor_rpc_and_ping(daemon, gpu):
    with daemon.client() as c:
        checks = {ch.name: ch for ch in c.doctor()}
    assert {"criu", "kernel", "state dir", "driver", "gpus"} <= set(checks)
    assert checks["driver"].status == "ok", checks["driver"]
    assert checks["gpus"].status == "ok" and gpu.uuid(0) in checks["gpus"].detail
    p = ping(daemon.cfg)
    assert p.status == "ok" and f"pid {daemon.proc.pid}" in p.detail


def test_ensure_running_starts_torpord(base, gpu, monkeypatch):
    d = Daemon(base, gpu)
    for k in ("TORPOR_STATE_DIR", "TORPOR_RUN_DIR", "TORPOR_CONFIG", "PYTHONPATH",
              "TORPOR_LIBCUDA", "LD_LIBRARY_PATH", "FAKE_CUDA_STATE_DIR"):
        monkeypatch.setenv(k, d.env[k])
    assert ping(d.cfg).status == "warn"
    check = ensure_running(d.cfg)
    try:
        assert check.status == "ok"
        with d.client() as c:
            pid = c.list().server_pid
        assert ensure_running(d.cfg).detail == check.detail          # no second one
        assert "listening on" in (d.cfg.state_dir / "torpord.log").read_text()
    finally:
        os.kill(pid, signal.SIGTERM)
        from torpor.sidecar import client as client_module
        for p in client_module._started:
            p.wait(timeout=15)
    deadline = time.monotonic() + 15
    while ping(d.cfg).status == "ok" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ping(d.cfg).status == "warn"


# -- handlers in-process (faults a real torpord cannot be given) ---------------------------------------

class Aborted(Exception):
    def __init__(self, status, details, md):
        super().__init__(f"{status}: {details}")
        self.status, self.details, self.md = status, details, dict(md or [])


class FakeContext:
    """Just enough of a grpc.ServicerContext for calling a handler directly."""

    def __init__(self):
        self.md = None

    def set_trailing_metadata(self, md):
        self.md = md

    def abort(self, status, details):
        raise Aborted(status, details, self.md)


@pytest.fixture
def service(base, gpu, monkeypatch):
    from torpor.sidecar.service import Service
    env = {"TORPOR_STATE_DIR": str(base / "state"), "TORPOR_RUN_DIR": str(base / "run"),
           "TORPOR_CONFIG": str(base / "none.toml"), **gpu.env()}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    gpu.activate()                                    # gpu's close() deactivates
    made: list[Service] = []

    def make(op_timeout_s: float = 600) -> Service:
        made.append(Service(config.load(env=env), op_timeout_s))
        return made[-1]
    yield make
    for s in made:
        s.shutdown()


def _journal(svc) -> list[str]:
    return sorted(p.name for p in svc.cfg.journal_dir.glob("*.json"))


def test_failure_after_checkpoint_rolls_back_at_once(service, gpu, prog, monkeypatch):
    """The journal write after the checkpoint fails (full disk): roll back now, not later."""
    from torpor.journal import Operation
    svc = service()
    real_phase = Operation.phase

    def phase(self, name, **kw):
        if name == "dump":
            raise OSError(28, "No space left on device")
        return real_phase(self, name, **kw)
    monkeypatch.setattr(Operation, "phase", phase)
    req = svc.pb.LockAndCheckpointRequest(pids=[prog.pid])
    with pytest.raises(Aborted) as e:
        svc.LockAndCheckpoint(req, FakeContext())
    assert e.value.md[EXIT_CODE_KEY] == str(int(ExitCode.ROLLED_BACK)), e.value
    assert "No space left" in e.value.details
    assert gpu.state(prog.pid)["state"] == RUNNING
    assert svc.ops.open_ops() == [] and _journal(svc) == []
    monkeypatch.setattr(Operation, "phase", real_phase)
    assert running_again(gpu, prog)


def test_operation_deadline_ignores_wall_clock_steps(service, gpu, prog, monkeypatch):
    """The automatic rollback runs on the monotonic clock: a clock step neither fires nor
    delays it."""
    svc = service(op_timeout_s=1.0)
    r = svc.LockAndCheckpoint(svc.pb.LockAndCheckpointRequest(pids=[prog.pid]), FakeContext())
    assert r.deadline - time.time() < 1.5             # still wall clock for clients
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)    # a step forward
    svc.ops.start_reaper()
    time.sleep(0.5)
    assert [o.id for o in svc.ops.open_ops()] == [r.op_id]
    assert gpu.state(prog.pid)["state"] == CHECKPOINTED
    monkeypatch.setattr(time, "time", lambda: real_time() - 3600)    # a step back
    deadline = time.monotonic() + 5
    while (svc.ops.open_ops() or _journal(svc)) and time.monotonic() < deadline:
        time.sleep(0.05)                              # the reaper takes it, then rolls back
    assert svc.ops.open_ops() == [] and _journal(svc) == []
    monkeypatch.setattr(time, "time", real_time)
    assert running_again(gpu, prog)
