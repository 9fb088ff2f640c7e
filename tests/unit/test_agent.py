"""The in-process agent (agent/, libtorpor-agent.so) against the fake libcuda: interposition
through plain symbols, dlopen+dlsym and cuGetProcAddress(_v2); allocation tracking; the gate
(close waits for calls in flight and holds new ones until open; timeouts reopen it); the
control socket's protocol and who may use it; and a program that never calls the driver runs
as without the agent.

Programs run under LD_PRELOAD=libtorpor-agent.so: tests/fakes/agent_probe.py (ctypes, one
thread per command, timestamps from CLOCK_MONOTONIC like this process's time.monotonic()) and
tests/fakes/agent_plain.c (plain calls, compiled here). Orderings are asserted on those
timestamps, and waits are for states the agent reports (a call in flight, a call held at the
gate), never for a sleep to be long enough.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.fakes.fakegpu import FakeGpu
from tests.fakes.probe_client import PROBE, ProbeProcess
from tests.integration.conftest import wait_for
from torpor.agent import AgentClient, AgentError
from torpor.errors import NotFoundError

ROOT = Path(__file__).resolve().parents[2]
AGENT_DIR = ROOT / "agent"
AGENT_LIB = AGENT_DIR / "build" / "libtorpor-agent.so"
PLAIN_C = ROOT / "tests" / "fakes" / "agent_plain.c"
CC = os.environ.get("CC", "gcc")
NOT_SUPPORTED = 801
INVALID_VALUE = 1

pytestmark = pytest.mark.skipif(shutil.which(CC) is None or shutil.which("make") is None,
                                reason=f"the agent and the fake driver are built with {CC} "
                                       "and make, and this machine lacks one")

_built: Path | None = None


def build_agent() -> Path:
    """make -C agent, once per test process (serialized across processes by a lock)."""
    global _built
    if _built is None:
        (AGENT_DIR / "build").mkdir(exist_ok=True)
        with open(AGENT_DIR / "build" / ".make.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            r = subprocess.run(["make", "-s", "-C", str(AGENT_DIR)], capture_output=True,
                               text=True)
        assert r.returncode == 0, f"building the agent failed:\n{r.stdout}{r.stderr}"
        _built = AGENT_LIB
    return _built


def hooked_symbols() -> list[str]:
    return re.findall(r"^HOOK\((\w+),", (AGENT_DIR / "src" / "hooks.def").read_text(), re.M)


def control(path: Path, line: str, timeout: float = 15.0) -> dict:
    """One command on a fresh connection to an agent's socket; its JSON reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(line.encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                raise AssertionError(f"agent closed the connection; got {buf!r}")
            buf += chunk
    return json.loads(buf)


class Probe(ProbeProcess):
    """agent_probe.py under the agent (its log at debug level), with the agent's socket."""

    def __init__(self, gpu: FakeGpu, workdir: Path, env: dict[str, str] | None = None,
                 prefix: list[str] = (), script: Path = PROBE):
        """prefix: a command the probe runs under (e.g. unshare into namespaces)."""
        self.agent_dir = workdir / "agents"
        full_env = {**os.environ, **gpu.env(), "LD_PRELOAD": str(build_agent()),
                    "TORPOR_AGENT_DIR": str(self.agent_dir), "TORPOR_AGENT_LOG_LEVEL": "10",
                    **(env or {})}
        super().__init__(gpu.libcuda, full_env, workdir / f"probe-{time.monotonic_ns()}.log",
                         prefix, script)

    @property
    def sock(self) -> Path:
        return self.agent_dir / f"agent-{self.pid}.sock"

    def ctl(self, line: str, timeout: float = 15.0) -> dict:
        return control(self.sock, line, timeout)

    def status(self) -> dict:
        with AgentClient(self.sock) as a:   # what torpor itself uses
            return a.status()

    def stderr(self) -> str:
        return self.log()


@pytest.fixture
def gpu(tmp_path):
    with FakeGpu(tmp_path / "gpu") as g:
        yield g


@pytest.fixture
def probe(gpu, tmp_path):
    """probe(env=None) -> a started Probe; all are stopped at the end."""
    started: list[Probe] = []

    def start(env: dict[str, str] | None = None) -> Probe:
        p = Probe(gpu, tmp_path, env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


def delay(gpu: FakeGpu, call: str, ms: int) -> None:
    """The fake's delay/<exported name> (fakegpu.py): that call sleeps ms first."""
    (gpu.state_dir / "delay" / call).write_text(f"{ms}\n")


# -- the library ---------------------------------------------------------------------------------

def test_builds_without_warnings_and_exports_only_the_hooked_symbols(tmp_path):
    r = subprocess.run(["make", "-C", str(AGENT_DIR), f"BUILD={tmp_path}",
                        "EXTRA_CFLAGS=-Werror"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning" not in r.stderr
    lib = tmp_path / "libtorpor-agent.so"
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                        text=True, check=True).stdout
    exported = {line.split()[-1] for line in nm.splitlines() if line.strip()}
    assert exported == set(hooked_symbols()) | {"dlsym"}
    for name in ("cuInit", "cuCtxCreate_v2", "cuCtxSynchronize", "cuMemAlloc_v2",
                 "cuMemAllocPitch_v2", "cuMemFree_v2", "cuLaunchKernel", "cuMemcpyHtoD_v2",
                 "cuMemcpyDtoH_v2", "cuStreamSynchronize", "cuGetProcAddress",
                 "cuGetProcAddress_v2"):
        assert name in exported


# -- interposition: the doors --------------------------------------------------------------------

def test_dlsym_and_get_proc_address_give_the_wrappers(probe):
    p = probe()
    agent, fake = str(AGENT_LIB), p.proc.args[-1]
    for door in ("dlsym", "proc", "proc_v2", "global"):
        doc = p.call(f"addr cuMemAlloc {door}")
        assert doc["object"] == agent, (door, doc)
    wrapper = p.call("addr cuMemAlloc dlsym")["fn"]
    assert p.call("addr cuMemAlloc proc")["fn"] == wrapper
    # cuGetProcAddress asked for itself gives the agent's, so libcudart stays behind the door
    assert p.call("addr cuGetProcAddress proc_v2")["object"] == agent
    # a symbol the list lacks is the driver's own, through every door
    for door in ("dlsym", "proc", "proc_v2"):
        assert p.call(f"addr cuDeviceGet {door}")["object"] == fake, door
    # a hooked symbol this driver lacks is not invented by the agent's dlsym
    for door in ("dlsym", "global"):
        assert p.call(f"addr cuLaunchKernel_ptsz {door}")["fn"] is None, door


def test_allocations_through_every_door_are_tracked(probe):
    p = probe()
    assert p.call("init dlsym")["rc"] == 0
    sizes = {"dlsym": 4096, "proc": 1 << 20, "proc_v2": 3 << 20, "global": 12345}
    for door, size in sizes.items():
        assert p.call(f"alloc {size} {door}")["rc"] == 0, door
    st = p.status()
    assert st["allocations"] == 4
    assert st["bytes"] == sum(sizes.values())
    assert st["contexts"] == 1
    assert st["pid"] == p.pid and st["gate"] == "open" and st["in_flight"] == 0


def _run_c_program(gpu: FakeGpu, tmp_path: Path, src: Path, *flags: str
                   ) -> tuple[subprocess.Popen, Path]:
    """Build src against the fake libcuda and start it with the agent preloaded, stdin and
    stdout piped; returns it and its agent directory."""
    exe = tmp_path / src.stem
    subprocess.run([CC, *flags, "-o", str(exe), str(src), f"-L{gpu.build_dir}",
                    "-l:libcuda.so.1", f"-Wl,-rpath,{gpu.build_dir}"], check=True)
    agents = tmp_path / "agents"
    env = {**os.environ, **gpu.env(), "LD_PRELOAD": str(build_agent()),
           "TORPOR_AGENT_DIR": str(agents)}
    return subprocess.Popen([str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env), agents


def test_plain_symbol_calls_reach_the_wrappers_and_rtld_next_keeps_its_caller(gpu, tmp_path):
    proc, agents = _run_c_program(gpu, tmp_path, PLAIN_C, "-ldl")
    try:
        doc = json.loads(proc.stdout.readline())
        assert doc == {"rc": 0, "next_same": True}
        st = control(agents / f"agent-{proc.pid}.sock", "status")
        assert (st["allocations"], st["bytes"], st["contexts"]) == (1, 3 << 20, 1)
    finally:
        proc.communicate("\n", timeout=10)
    assert proc.returncode == 0
    assert not (agents / f"agent-{proc.pid}.sock").exists(), "socket left behind at exit"
    # the same program without the agent: same answers (the check means the same there)
    plain = subprocess.run([str(tmp_path / PLAIN_C.stem)], input="\n", capture_output=True,
                           text=True, env={**os.environ, **gpu.env()}, timeout=10)
    assert json.loads(plain.stdout) == {"rc": 0, "next_same": True}


ARM_CC, QEMU_ARM = "aarch64-linux-gnu-gcc", "qemu-aarch64"


@pytest.mark.skipif(shutil.which(ARM_CC) is None or shutil.which(QEMU_ARM) is None,
                    reason=f"the aarch64 dlsym trampoline runs under {QEMU_ARM}, built by "
                           f"{ARM_CC}; this machine lacks one")
def test_aarch64_build_keeps_rtld_next_and_reaches_the_wrappers(gpu, tmp_path):
    arm = tmp_path / "arm"
    arm.mkdir()
    r = subprocess.run(["make", "-s", "-C", str(AGENT_DIR), f"CC={ARM_CC}", f"BUILD={arm}",
                        "EXTRA_CFLAGS=-Werror"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    subprocess.run([ARM_CC, "-shared", "-fPIC", "-O1", "-fvisibility=hidden",
                    f"-I{AGENT_DIR / 'src'}", "-Wl,-soname,libcuda.so.1", "-o", str(arm / "libcuda.so.1"),
                    str(ROOT / "tests" / "fakes" / "fake_libcuda.c")], check=True)
    exe = arm / "agent_plain"
    subprocess.run([ARM_CC, "-o", str(exe), str(PLAIN_C), f"-L{arm}", "-l:libcuda.so.1", "-ldl"],
                   check=True)
    agents = tmp_path / "agents"
    guest_env = {"LD_LIBRARY_PATH": str(arm), "FAKE_CUDA_STATE_DIR": str(gpu.state_dir),
                 "LD_PRELOAD": str(arm / "libtorpor-agent.so"), "TORPOR_AGENT_DIR": str(agents)}
    argv = [QEMU_ARM, "-L", "/usr/aarch64-linux-gnu"]
    for k, v in guest_env.items():
        argv += ["-E", f"{k}={v}"]
    proc = subprocess.Popen(argv + [str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert json.loads(proc.stdout.readline()) == {"rc": 0, "next_same": True}
        (sock,) = agents.glob("agent-*.sock")
        st = control(sock, "status")
        assert (st["allocations"], st["bytes"], st["contexts"]) == (1, 3 << 20, 1)
    finally:
        proc.communicate("\n", timeout=30)
    assert proc.returncode == 0


def test_a_missing_driver_answers_not_supported(probe):
    p = probe({"TORPOR_AGENT_LIBCUDA": "/nonexistent/libcuda.so.1"})
    assert p.call("init dlsym")["rc"] == NOT_SUPPORTED
    assert "cannot load the driver /nonexistent/libcuda.so.1" in p.stderr()


_FORK = r"""
import ctypes, json, os, sys
lib = ctypes.CDLL(sys.argv[1])
d = sys.argv[2]
ptr = ctypes.c_ulonglong()
assert lib.cuInit(0) == 0
pid = os.fork()
if pid == 0:                        # a child's first driver call: a socket of its own
    before = sorted(os.listdir(d))
    rc = lib.cuInit(0)
    # one write(2) a line: parent and child share the pipe, and print() may write the text
    # and its newline separately, letting the other's line in between
    os.write(1, (json.dumps({"pid": os.getpid(), "before": before, "rc": rc,
                             "after": sorted(os.listdir(d))}) + "\n").encode())
    sys.stdin.readline()
    sys.exit(0)
os.write(1, (json.dumps({"pid": os.getpid()}) + "\n").encode())
os.waitpid(pid, 0)
"""


def test_a_forked_child_gets_its_own_socket(gpu, tmp_path):
    agents = tmp_path / "agents"
    env = {**os.environ, **gpu.env(), "LD_PRELOAD": str(build_agent()),
           "TORPOR_AGENT_DIR": str(agents)}
    proc = subprocess.Popen([sys.executable, "-c", _FORK, gpu.libcuda, str(agents)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        docs = [json.loads(proc.stdout.readline()) for _ in range(2)]
        parent, child = sorted(docs, key=lambda d: "rc" in d)
        assert child["rc"] == 0
        assert child["before"] == [f"agent-{parent['pid']}.sock"]
        assert child["after"] == sorted([f"agent-{parent['pid']}.sock",
                                         f"agent-{child['pid']}.sock"])
        assert control(agents / f"agent-{child['pid']}.sock", "status")["pid"] == child["pid"]
        assert control(agents / f"agent-{parent['pid']}.sock", "status")["pid"] == parent["pid"]
    finally:
        proc.communicate("\n", timeout=10)
    assert proc.returncode == 0
    assert list(agents.iterdir()) == [], "sockets left behind at exit"


# -- tracking ------------------------------------------------------------------------------------

def test_allocations_and_frees_are_counted(probe):
    p = probe()
    assert p.call("init dlsym")["rc"] == 0
    a = p.call("alloc 1000 dlsym")
    b = p.call("alloc 2000000 proc")
    # 1000-byte rows padded to a 512-byte multiple by the fake; it allocates them through
    # its exported cuMemAlloc_v2, a nested call the agent must not count again
    c = p.call("pitch 1000 3 4 proc_v2")
    assert c["rc"] == 0 and c["pitch"] == 1024
    st = p.status()
    assert (st["allocations"], st["bytes"]) == (3, 1000 + 2000000 + 3 * 1024)

    assert p.call(f"free {b['ptr']} dlsym")["rc"] == 0
    assert p.call(f"free {c['ptr']} proc")["rc"] == 0
    st = p.status()
    assert (st["allocations"], st["bytes"]) == (1, 1000)

    # a failed free leaves the table as it was
    assert p.call(f"free {b['ptr']} dlsym")["rc"] == INVALID_VALUE
    assert p.call("free 0x1234 proc_v2")["rc"] == INVALID_VALUE
    assert (p.status()["allocations"], p.status()["bytes"]) == (1, 1000)
    assert p.call(f"free {a['ptr']} dlsym")["rc"] == 0
    assert (p.status()["allocations"], p.status()["bytes"]) == (0, 0)


def test_gated_work_calls_pass_through_to_the_driver(probe):
    p = probe()
    assert p.call("init dlsym")["rc"] == 0
    ptr = p.call("alloc 4096 dlsym")["ptr"]
    for door in ("dlsym", "proc", "proc_v2"):
        assert p.call(f"htod {ptr} 4096 {door}")["rc"] == 0
        assert p.call(f"dtoh {ptr} 4096 {door}")["rc"] == 0
        assert p.call(f"htod {ptr} 4097 {door}")["rc"] == INVALID_VALUE  # the driver's answer
        assert p.call(f"launch {door}")["rc"] == 0
        assert p.call(f"sync {door}")["rc"] == 0
        assert p.call(f"ctxsync {door}")["rc"] == 0


# -- the gate ------------------------------------------------------------------------------------

def test_close_holds_new_calls_until_open(probe):
    p = probe()
    assert p.call("init dlsym")["rc"] == 0
    assert p.ctl("close 5000") == {"ok": True}
    assert p.status()["gate"] == "closed"

    # (through dlsym: the proc doors would be held at cuGetProcAddress, a driver call too)
    held = p.send("alloc 4096 dlsym")
    wait_for(lambda: p.status()["waiting"] == 1, what="the call held at the gate")
    assert not p.done(held)
    t_open = time.monotonic()
    assert p.ctl("open") == {"ok": True}
    doc = p.result(held)
    assert doc["rc"] == 0
    assert doc["t0"] < t_open <= doc["t1"]
    st = p.status()
    assert (st["gate"], st["waiting"], st["allocations"]) == ("open", 0, 1)


def test_close_waits_for_the_call_in_flight_then_synchronizes(gpu, probe):
    p = probe()
    assert p.call("init dlsym")["rc"] == 0
    delay(gpu, "cuStreamSynchronize", 700)
    in_flight = p.send("sync dlsym")
    wait_for(lambda: p.status()["in_flight"] == 1, what="the call in flight")

    assert p.ctl("close 5000") == {"ok": True}
    t_closed = time.monotonic()
    doc = p.result(in_flight)
    assert doc["rc"] == 0 and doc["t1"] - doc["t0"] >= 0.7
    # The call left the driver no earlier than t0 + 0.7 (the fake's sleep), and close answered
    # only after that. (t1 is read after the call returned to Python: no bound on the close.)
    assert doc["t0"] + 0.7 <= t_closed
    st = p.status()
    assert (st["gate"], st["in_flight"]) == ("closed", 0)
    assert re.search(r"gate: context 0x[0-9a-f]+ synchronized", p.stderr())
    assert p.ctl("open") == {"ok": True}


def test_close_timeout_answers_an_error_and_reopens(gpu, probe):
    p = probe()
    assert p.call("init dlsym")["rc"] == 0
    delay(gpu, "cuStreamSynchronize", 2500)
    slow = p.send("sync proc")
    wait_for(lambda: p.status()["in_flight"] == 1, what="the call in flight")

    t0 = time.monotonic()
    assert p.ctl("close 200") == {"ok": False, "error": "timeout"}
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert p.status()["gate"] == "open"
    quick = p.call("alloc 4096 dlsym")           # not held: the gate is open again
    assert quick["rc"] == 0
    assert not p.done(slow)                      # ... while the slow call is still in flight
    assert p.result(slow)["rc"] == 0
    assert "still in flight after 200 ms" in p.stderr()


def test_a_prepare_never_opened_reopens_by_itself(probe):
    p = probe({"TORPOR_AGENT_PREPARE_TIMEOUT_S": "0.5"})
    assert p.call("init dlsym")["rc"] == 0
    t_close = time.monotonic()
    assert p.ctl("close") == {"ok": True}
    held = p.send("alloc 4096 dlsym")
    wait_for(lambda: p.status()["waiting"] == 1, what="the call held at the gate")
    doc = p.result(held)
    assert doc["rc"] == 0
    assert doc["t1"] >= t_close + 0.5 - 0.01     # (the agent's clock is read in whole ms)
    assert p.status()["gate"] == "open"
    assert "without an open: reopening" in p.stderr()


def test_a_client_that_never_reads_its_replies_cannot_stall_the_agent(probe):
    p = probe({"TORPOR_AGENT_PREPARE_TIMEOUT_S": "600"})
    assert p.call("init dlsym")["rc"] == 0
    assert p.ctl("close") == {"ok": True}
    flood = socket.socket(socket.AF_UNIX)
    flood.connect(str(p.sock))
    flood.setblocking(False)
    try:
        try:
            for _ in range(20000):                # until its buffers are full: never read
                flood.send(b"status\n" * 64)
        except OSError:                           # full, or already dropped
            pass
        wait_for(lambda: "does not read its replies: dropped" in p.stderr(),
                 what="the client dropped")
        # the thread serving everyone is not blocked in a send() to that client
        assert p.ctl("status", timeout=5)["gate"] == "closed"
        assert p.ctl("open", timeout=5) == {"ok": True}
    finally:
        flood.close()


def test_the_deadline_reopens_the_gate_while_the_control_thread_is_stuck(gpu, probe):
    p = probe({"TORPOR_AGENT_PREPARE_TIMEOUT_S": "0.5"})
    assert p.call("init dlsym")["rc"] == 0       # one context: close synchronizes it
    gpu.set_state(p.pid, 1)   # LOCKED (fakegpu): the fake's cuCtxSynchronize blocks meanwhile
    threading.Timer(4.0, gpu.set_state, (p.pid, 0)).start()   # ... for 4 s
    answer: list[dict] = []
    closing = threading.Thread(target=lambda: answer.append(p.ctl("close")))
    t_close = time.monotonic()
    closing.start()
    time.sleep(0.1)
    held = p.send("alloc 4096 dlsym")
    # reopened by the waiting call itself, not when the control thread comes back (the
    # fake's calls all block while LOCKED, so the log says when, not the call's t1)
    wait_for(lambda: "without an open: reopening (1 calls were waiting)" in p.stderr(),
             timeout=3.0, what="the gate reopened by its waiter")
    assert time.monotonic() < t_close + 3.5
    assert not answer                            # the control thread is still stuck
    closing.join(timeout=15)
    assert answer == [{"ok": False, "error": "timeout"}]   # the close did not hold
    assert p.result(held)["rc"] == 0


@pytest.mark.parametrize("value", ["inf", "1e300", "0", "nan", "-1"])
def test_a_prepare_timeout_out_of_range_uses_the_default(probe, value):
    p = probe({"TORPOR_AGENT_PREPARE_TIMEOUT_S": value})
    assert p.call("init dlsym")["rc"] == 0
    assert p.ctl("close") == {"ok": True}
    time.sleep(0.3)
    assert p.status()["gate"] == "closed"        # not reopened at once
    assert f"TORPOR_AGENT_PREPARE_TIMEOUT_S={value} is not a number of seconds" in p.stderr()
    assert p.ctl("open") == {"ok": True}


_CANCEL_ERRNO_C = r"""
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>
typedef int CUresult;
CUresult cuInit(unsigned int); CUresult cuStreamSynchronize(void *);
static void *worker(void *a) { (void)a; for (;;) { cuStreamSynchronize(0); usleep(1000); } }
int main(void)
{
	char line[16];
	pthread_t t;
	errno = 1234;                     /* the first driver call starts the agent's socket */
	int rc = cuInit(0);
	printf("{\"rc\": %d, \"errno\": %d}\n", rc, errno); fflush(stdout);
	pthread_create(&t, 0, worker, 0);
	if (!fgets(line, sizeof line, stdin)) return 2;   /* the gate is closed: worker held */
	pthread_cancel(t);
	pthread_join(t, 0);               /* returns once the gate opens */
	printf("cancelled\n"); fflush(stdout);
	cuStreamSynchronize(0);           /* would block for good on a lock left held */
	printf("done\n"); fflush(stdout);
	return 0;
}
"""


def test_cancelling_a_thread_held_at_the_gate_leaves_it_usable_and_errno_is_kept(gpu, tmp_path):
    src = tmp_path / "cancel.c"
    src.write_text(_CANCEL_ERRNO_C)
    proc, agents = _run_c_program(gpu, tmp_path, src, "-pthread")
    try:
        assert json.loads(proc.stdout.readline()) == {"rc": 0, "errno": 1234}
        sock = agents / f"agent-{proc.pid}.sock"
        assert control(sock, "close") == {"ok": True}
        wait_for(lambda: control(sock, "status")["waiting"] == 1, what="the worker held")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(0.2)
        assert control(sock, "open") == {"ok": True}
        assert proc.stdout.readline().strip() == "cancelled"
        assert proc.stdout.readline().strip() == "done"
    finally:
        proc.kill()
        proc.wait()


def test_an_unsafe_socket_directory_is_refused(probe, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)                          # anyone could swap the socket
    p = probe({"TORPOR_AGENT_DIR": str(shared)})
    assert p.call("init dlsym")["rc"] == 0       # the program runs on, without a socket
    assert list(shared.iterdir()) == []
    assert "writable by group or others" in p.stderr()


def test_a_trailing_slash_still_gives_a_private_socket(probe, tmp_path):
    agents = tmp_path / "agents"
    p = probe({"TORPOR_AGENT_DIR": str(agents) + "//"})
    assert p.call("init dlsym")["rc"] == 0
    assert stat.S_IMODE(agents.stat().st_mode) == 0o700
    assert stat.S_IMODE(p.sock.stat().st_mode) == 0o600
    assert p.status()["gate"] == "open"


def test_torpor_client_speaks_the_protocol(gpu, probe, tmp_path):
    p = probe()
    assert p.call("init dlsym")["rc"] == 0
    with AgentClient.for_pid(p.pid, p.agent_dir) as a:
        assert a.status()["gate"] == "open"
        assert a.close(5000)["ok"] is True and a.status()["gate"] == "closed"
        assert a.open()["ok"] is True
        delay(gpu, "cuStreamSynchronize", 1500)
        slow = p.send("sync dlsym")
        wait_for(lambda: a.status()["in_flight"] == 1, what="the call in flight")
        with pytest.raises(AgentError, match="timeout"):
            a.close(100)
        assert p.result(slow)["rc"] == 0
    with pytest.raises(NotFoundError):
        AgentClient.for_pid(p.pid, tmp_path / "elsewhere")
    planted = tmp_path / "planted"
    planted.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(planted / f"agent-{p.pid}.sock"))
        os.chown(planted / f"agent-{p.pid}.sock", 65534, 65534)
        with pytest.raises(AgentError, match="we can trust"):
            AgentClient.for_pid(p.pid, planted)


# -- the control socket --------------------------------------------------------------------------

def test_protocol_answers(probe):
    p = probe()
    assert not p.sock.exists()                   # nothing before the first driver call
    assert p.call("init dlsym")["rc"] == 0
    st = p.status()
    assert set(st) == {"pid", "state", "gate", "in_flight", "waiting", "allocations", "bytes",
                       "movable_allocations", "movable_bytes", "moved_allocations", "contexts",
                       "in_memory", "host_bytes", "holdable", "holdable_bag", "hold_max"}
    assert st["state"] == "running"
    for line in ("detach", "resume", "abort"):
        assert p.ctl(line) == {"ok": False, "error": "not prepared"}, line
    assert p.ctl("prepare soon") == {"ok": False, "error": "bad timeout"}
    for line in ("frobnicate", "status now", "open wide", ""):
        assert p.ctl(line) == {"ok": False, "error": "unknown command"}, line
    assert p.ctl("close soon") == {"ok": False, "error": "bad timeout"}
    assert p.status()["gate"] == "open"
    # several commands on one connection, one reply line each
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(p.sock))
        s.sendall(b"close 1000\nstatus\nopen\nstatus\n")
        buf = b""
        while buf.count(b"\n") < 4:
            buf += s.recv(4096)
    replies = [json.loads(line) for line in buf.decode().splitlines()]
    assert replies[0] == {"ok": True} and replies[2] == {"ok": True}
    assert replies[1]["gate"] == "closed" and replies[3]["gate"] == "open"


_PEER = r"""
import ctypes, json, os, socket, sys
path, how = sys.argv[1], sys.argv[2]
if how == "uid":                    # another user, through and through
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
else:                               # euid 65534 (what SO_PEERCRED reports), but fsuid 0 so
    os.setresuid(65534, 65534, 0)   # that the 0700 directory and 0600 socket let it connect:
    ctypes.CDLL(None).setfsuid(0)   # only the agent's own check can turn it away
out = {}
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(path)
except OSError as e:
    out["connect"] = e.errno
else:
    out["connect"] = 0
    try:                            # disconnected: EOF, or a reset/EPIPE if it came first
        s.sendall(b"status\n")
        out["reply"] = s.recv(4096).decode()
    except (BrokenPipeError, ConnectionResetError):
        out["reply"] = ""
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_host_root_reaches_an_agent_in_a_user_namespace(tmp_path):
    """A program in its own user and pid namespaces (a user-namespaced container: uid 1000
    outside is root inside, host root is not mapped) still answers the host's root, which
    SO_PEERCRED shows as the overflow uid with pid 0; another host user is kept out by the
    socket's permissions."""
    prefix = ["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups",
              "unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child"]
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("no unprivileged user namespaces here")
    work = Path(tempfile.mkdtemp(prefix="torpor-userns-"))   # pytest's tmp is root's, 0700
    try:
        work.chmod(0o777)
        # what uid 1000 runs must be readable by it (the checkout may be in root's home)
        lib, script = work / "libtorpor-agent.so", work / "agent_probe.py"
        shutil.copy(build_agent(), lib)
        shutil.copy(PROBE, script)
        with FakeGpu(work / "gpu") as g:
            for d in [g.state_dir, *g.state_dir.rglob("*")]:
                d.chmod(0o777 if d.is_dir() else 0o666)
            fake = work / "libcuda.so.1"
            shutil.copy(g.libcuda, fake)
            g.libcuda = str(fake)
            p = Probe(g, work, env={"LD_PRELOAD": str(lib)}, prefix=prefix, script=script)
            try:
                assert p.pid == 1                              # its own pid namespace
                assert p.call("init dlsym")["rc"] == 0
                assert p.sock.stat().st_uid == 1000
                st = p.ctl("status")                           # we are root, unmapped there
                assert st["pid"] == 1 and st["gate"] == "open", st
                out = subprocess.run([sys.executable, "-c", _PEER, str(p.sock), "uid"],
                                     capture_output=True, text=True, timeout=30)
                assert json.loads(out.stdout)["connect"] != 0   # EACCES: not the owner
            finally:
                p.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_socket_is_private_and_refuses_other_users(probe):
    import errno
    p = probe()
    assert p.call("init dlsym")["rc"] == 0
    st = os.stat(p.sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(p.agent_dir).st_mode) == 0o700

    def peer(how: str) -> dict:
        r = subprocess.run([sys.executable, "-c", _PEER, str(p.sock), how], capture_output=True,
                           text=True, timeout=20)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    assert peer("uid") == {"connect": errno.EACCES}                     # the file modes
    assert peer("euid") == {"connect": 0, "reply": ""}                  # SO_PEERCRED
    assert re.search(r"refused pid \d+: uid 65534", p.stderr())
    assert p.status()["pid"] == p.pid                                   # root still served


# -- a program that never calls the driver --------------------------------------------------------

_NO_CUDA = r"""
import ctypes, json, os, threading
main = ctypes.CDLL(None)
libm = ctypes.CDLL("libm.so.6")
libm.cos.restype, libm.cos.argtypes = ctypes.c_double, [ctypes.c_double]
print(json.dumps({"cuInit": hasattr(main, "cuInit"), "cuMemAlloc_v2": hasattr(main, "cuMemAlloc_v2"),
                  "cos": libm.cos(0.0), "malloc": hasattr(main, "malloc"),
                  "threads": len(os.listdir("/proc/self/task"))}))
"""


def test_a_program_without_cuda_runs_unchanged(tmp_path):
    agents = tmp_path / "agents"
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    preload = {**base, "LD_PRELOAD": str(build_agent()), "TORPOR_AGENT_DIR": str(agents)}
    for argv in (["sh", "-c", "echo hello; ls / >/dev/null; exit 3"],
                 [sys.executable, "-c", _NO_CUDA]):
        without = subprocess.run(argv, capture_output=True, text=True, env=base, timeout=30)
        with_agent = subprocess.run(argv, capture_output=True, text=True, env=preload,
                                    timeout=30)
        assert (with_agent.returncode, with_agent.stdout, with_agent.stderr) == \
               (without.returncode, without.stdout, without.stderr), argv
    doc = json.loads(with_agent.stdout)
    assert doc == {"cuInit": False, "cuMemAlloc_v2": False, "cos": 1.0, "malloc": True,
                   "threads": 1}
    assert not agents.exists(), "the agent made its directory without a driver call"
