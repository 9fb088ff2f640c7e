"""copier.wait (shim/torpor/copier.py): torpor's own copier is waited for, its one JSON line
read, and killed once it runs past the timeout (this torpor still holds the memory then);
another torpor's copier (a recovery) is only waited for, never signalled: while it runs it may
hold the only copy of a program's GPU data, and the recovery leaves the entry for later."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from torpor import copier, procs
from torpor.agent import AgentError
from torpor.engine import agents


def _own(code: str) -> copier.Copier:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            start_new_session=True)
    return copier.Copier(proc.pid, procs.start_time(proc.pid), proc)


def test_its_reply_is_read():
    c = _own('print(\'{"ok": true, "bytes": 8, "parts": 1, "seconds": 0.1, "x": "text"}\')')
    assert copier.wait(c, 10) == {"ok": True, "bytes": 8, "parts": 1, "seconds": 0.1}


@pytest.mark.parametrize("code,error", [
    ('print(\'{"ok": false, "error": "pinned host memory: CUresult 2"}\')',
     "pinned host memory: CUresult 2"),
    ("print('garbage')", "ended with status 0 and no reply"),
    ("import sys; sys.exit(3)", "ended with status 3 and no reply"),
])
def test_a_failure_or_no_reply_is_a_failure(code, error):
    r = copier.wait(_own(code), 10)
    assert r["ok"] is False and error in r["error"], r


def test_our_own_copier_past_its_time_is_killed():
    c = _own("import time; time.sleep(30)")
    start = time.monotonic()
    r = copier.wait(c, 0.3)
    assert r == {"ok": False, "error": "still copying after 0.3 s: killed"}
    assert time.monotonic() - start < 10 and c.proc.returncode == -9


def test_another_torpors_copier_is_waited_for_never_killed(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            start_new_session=True)
    try:
        foreign = copier.Copier(proc.pid, procs.start_time(proc.pid))
        monkeypatch.setattr(copier, "FOREIGN_WAIT_S", 0.3)
        with pytest.raises(copier.StillCopying, match=f"PID {proc.pid}.* still copying"):
            copier.wait(foreign, 600)
        assert proc.poll() is None                     # not signalled
        proc.kill()
        proc.wait()
        assert copier.wait(foreign, 600) == {"ok": None}   # ended: the files say the rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_reused_pid_is_not_the_copier():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        other = copier.Copier(proc.pid, (procs.start_time(proc.pid) or 0) + 12345)
        assert copier.wait(other, 600) == {"ok": None} and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


# -- ready_copiers and _start_copier with a stand-in copier (no GPU, no build) ------------------

FAKE = r'''#!{py}
import os, socket, sys
a = sys.argv[1:]
ctl = int(a[a.index("--ctl") + 1])
open(os.environ["FAKE_PIDS"], "a").write(f"{{os.getpid()}}\n")
assert "CUDA_VISIBLE_DEVICES" not in os.environ
print('{{"ready":true,"devices":1,"seconds":0}}', flush=True)
s = socket.socket(fileno=ctl)
m = s.recv(64)
print('{{"ok":false,"error":"no plan came"}}', flush=True)
'''


class _Say:
    def __init__(self):
        self.lines = []

    def say(self, s):
        self.lines.append(s)


class _Engine(agents.AgentMoves):
    def __init__(self):
        self.cfg = types.SimpleNamespace(libcuda="/nonexistent/libcuda.so", copier="",
                                         agent_timeout_s=600.0)
        self.progress = _Say()
        self._ready, self._held, self._copiers, self._deferred, self._drains = {}, {}, {}, {}, {}
        self._bags = set()


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    b = tmp_path / "torpor-copier"
    b.write_text(FAKE.format(py=sys.executable))
    b.chmod(0o755)
    monkeypatch.setattr(copier, "BINARY", b)
    pids = tmp_path / "pids"
    pids.write_text("")
    monkeypatch.setenv("FAKE_PIDS", str(pids))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")   # the program's GPU may be any
    return pids


def _running(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return st.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_copier_whose_reply_pipe_is_past_fd_1024_is_ready(stand_in):
    e = _Engine()
    fillers = []
    try:
        while not fillers or fillers[-1] < 1100:
            fillers.append(os.open("/dev/null", os.O_RDONLY))
        e.ready_copiers([101], None)
        assert e._ready[101] is not None, e.progress.lines
    finally:
        for fd in fillers:
            os.close(fd)
        e.drop_copiers()


def test_no_copier_on_a_gpu_with_less_free_than_a_context_may_take(stand_in):
    """NVML's free memory decides before anything starts: a program on a GPU short of
    copier.CONTEXT_ROOM gets none (its context would be made while the program runs) and
    is told so; one on a GPU with room, and one NVML does not show, get theirs. Two programs
    on one GPU with room for one context: the first gets its copier, the second is told
    why not (the first's context counted)."""
    from torpor.gpus import Gpu, GpuProcess, Inventory
    tight, roomy, shared = (f"GPU-{d * 8}-{d * 4}-{d * 4}-{d * 4}-{d * 12}" for d in "123")
    inv = Inventory("999", [Gpu(0, tight, "H200", 80 << 30, copier.CONTEXT_ROOM - 1),
                            Gpu(1, roomy, "H200", 80 << 30, copier.CONTEXT_ROOM),
                            Gpu(2, shared, "H200", 80 << 30,
                                copier.CONTEXT_ROOM + copier.CONTEXT_SIZE - (1 << 20))],
                    [GpuProcess(101, tight, 1 << 30), GpuProcess(102, roomy, 1 << 30),
                     GpuProcess(103, roomy, 1 << 30), GpuProcess(103, tight, 1 << 30),
                     GpuProcess(105, shared, 1 << 30), GpuProcess(106, shared, 1 << 30)])
    e = _Engine()
    try:
        e.ready_copiers([101, 102, 103, 104, 105, 106], inv)
        assert {p for p, c in e._ready.items() if c is not None} == {102, 104, 105}, e._ready
        said = "\n".join(e.progress.lines)
        for pid in (101, 103):
            assert (f"warning: PID {pid}: no torpor-copier: {tight} has 1023 MiB free, less "
                    "than the 1024 MiB a copier's context may take beside the program; its "
                    "GPU memory is copied before the dump") in said, said
        assert (f"warning: PID 106: no torpor-copier: {shared} has 1535 MiB free (about 512 "
                "MiB of it for other programs' copiers), less than the 1024 MiB") in said, said
        assert not any(f"PID {p}" in said for p in (102, 104, 105)), said
        assert len(stand_in.read_text().split()) == 3                   # three started
    finally:
        e.drop_copiers()


def test_an_interrupt_while_copiers_get_ready_leaves_none_running(stand_in, monkeypatch):
    e = _Engine()
    real, real_start, started = copier.ready, copier.prestart, []

    def prestart(*a):
        started.append(real_start(*a))
        return started[-1]

    def ready(c, timeout=30.0):
        real(c, timeout)
        raise KeyboardInterrupt
    monkeypatch.setattr(copier, "prestart", prestart)
    monkeypatch.setattr(copier, "ready", ready)
    with pytest.raises(KeyboardInterrupt):
        e.ready_copiers([101, 102], None)
    e.drop_copiers()                                  # the flow's stack callback
    assert len(started) == 2
    assert all(c.proc.returncode is not None for c in started)   # gone and reaped
    assert not any(_running(c.pid) for c in started)


def test_a_ready_copier_whose_files_cannot_be_opened_is_let_go(stand_in):
    e = _Engine()
    e.ready_copiers([101], None)
    c = e._ready[101]
    assert c is not None
    r, w = os.pipe()
    e._held[101] = [r]

    class Data:
        def for_fill(self, pid, n):
            raise PermissionError(13, "Permission denied")
    t = agents.AgentTarget(101, Path("/nonexistent"), Path("/x"), 101, 1)
    try:
        with pytest.raises(AgentError, match="Permission denied"):
            e._start_copier(types.SimpleNamespace(phase=lambda *a, **k: None), {101: t}, 101,
                            Data(), -1)
        e.drop_copiers()
        assert c.proc.poll() is not None and c.ctl is None
    finally:
        copier.discard(c)
        os.close(r)
        os.close(w)


# -- a systemd scope of its own ------------------------------------------------------------------

SYSTEMD_RUN = r'''#!/bin/sh
# the stand-in for systemd-run --scope: notes its arguments, then execs what follows "--"
printf '%s\n' "$@" > "$FAKE_SYSTEMD_RUN_ARGS"
while [ "$1" != "--" ]; do shift; done
shift
exec "$@"
'''


@pytest.fixture
def systemd(tmp_path, monkeypatch):
    """systemd(script): "systemd is the init" (copier.SYSTEMD_DIR), script its systemd-run on
    PATH (its arguments noted in tmp_path/args), no scope failure known yet; root only."""
    if os.geteuid() != 0:
        pytest.skip("scopes are for root's copiers")
    monkeypatch.setattr(copier, "SYSTEMD_DIR", tmp_path)
    monkeypatch.setattr(copier, "_scope_broken", "")
    monkeypatch.setattr(copier, "_scope_broken_at", 0.0, raising=False)
    monkeypatch.setenv("FAKE_SYSTEMD_RUN_ARGS", str(tmp_path / "args"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    def install(script: str) -> None:
        (bin_dir / "systemd-run").write_text(script)
        (bin_dir / "systemd-run").chmod(0o755)
    return install


def test_where_systemd_runs_the_copier_gets_a_scope_of_its_own(stand_in, systemd, tmp_path):
    """torpord runs as a systemd unit whose stop or restart kills its cgroup whole: the copier,
    which may hold the only copy of a program's memory, is started in a transient scope of its
    own (systemd-run --scope execs it: the same PID, its reply pipe and socket kept)."""
    systemd(SYSTEMD_RUN)
    e = _Engine()
    e.ready_copiers([101], None)
    try:
        c = e._ready[101]
        assert c is not None, e.progress.lines
        args = (tmp_path / "args").read_text().split("\n")
        assert args[0] == "--scope" and f"--unit=torpor-copier-{os.getpid()}-" in "\n".join(args)
        assert args[args.index("--") + 1] == str(copier.BINARY), args
        assert stand_in.read_text().split() == [str(c.pid)]   # exec'd: the PID torpor keeps
    finally:
        e.drop_copiers()


def test_without_systemd_the_copier_runs_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(copier, "SYSTEMD_DIR", tmp_path / "none")
    assert copier.scoped(["/x/torpor-copier", "--ctl", "3"]) == ["/x/torpor-copier", "--ctl", "3"]


FAILING_SYSTEMD_RUN = r"""#!/bin/sh
echo "Failed to connect to bus: No such file or directory" >&2
echo called >> "$FAKE_SYSTEMD_RUN_ARGS"
exit 1
"""


def test_a_systemd_run_that_fails_leaves_the_copier_unscoped_and_says_so(stand_in, systemd,
                                                                        tmp_path):
    """systemd-run refused (no D-Bus, a container that sees the host's /run): the copier is
    started again without a scope, the operator told once, and this process asks no more."""
    systemd(FAILING_SYSTEMD_RUN)
    e = _Engine()
    try:
        e.ready_copiers([101, 102], None)
        assert e._ready[101] is not None and e._ready[102] is not None, e.progress.lines
        said = [line for line in e.progress.lines if "systemd-run" in line]
        assert len(said) == 1 and "status 1" in said[0] and "cgroup" in said[0], said
        assert not any("not ready" in line for line in e.progress.lines), e.progress.lines
        assert copier.scope_broken() == "systemd-run --scope ended with status 1"
        asked = (tmp_path / "args").read_text().split()
        assert len(asked) <= 2           # the first batch only; none once it is known broken
        assert copier.scoped(["/x/torpor-copier"]) == ["/x/torpor-copier"]
    finally:
        e.drop_copiers()


EXITS_2 = r"""#!{py}
import sys
sys.exit(2)   # as copier.c's usage(): an older binary, a bad --devices
"""


def test_a_copier_usage_error_is_not_taken_for_systemd_run_s(stand_in, systemd):
    """Only systemd-run's own failure (status 1, not a word) turns scopes off for the process;
    the copier's usage error (2) is the copier's, said as it is. (A review's demonstration.)"""
    copier.BINARY.write_text(EXITS_2.format(py=sys.executable))
    systemd(SYSTEMD_RUN)    # works: execs the copier
    e = _Engine()
    try:
        e.ready_copiers([101], None)
    finally:
        e.drop_copiers()
    assert copier.scope_broken() == "", e.progress.lines
    assert any("status 2" in line for line in e.progress.lines), e.progress.lines


def test_torpord_logs_that_scopes_are_broken(stand_in, systemd, caplog):
    """torpord's engine says nothing to a terminal (Progress(None)): the scope's failure goes
    to its log."""
    from torpor.progress import Progress
    systemd(FAILING_SYSTEMD_RUN)
    e = _Engine()
    e.progress = Progress(None)
    caplog.set_level(logging.INFO)
    try:
        e.ready_copiers([101], None)
    finally:
        e.drop_copiers()
    assert copier.scope_broken()
    assert any("systemd-run" in r.getMessage() for r in caplog.records), caplog.records


def test_a_scope_failure_is_forgotten_after_its_cool_down(stand_in, systemd, tmp_path):
    """torpord runs for months: one passing systemd-run failure (a D-Bus restart) turns scopes
    off for copier.SCOPE_RETRY_S only; after that the next copier gets its scope again."""
    systemd(FAILING_SYSTEMD_RUN)
    e = _Engine()
    try:
        e.ready_copiers([101], None)
    finally:
        e.drop_copiers()
    assert copier.scope_broken()
    assert copier.scoped(["/x/torpor-copier"]) == ["/x/torpor-copier"]   # within the cool-down
    copier._scope_broken_at -= copier.SCOPE_RETRY_S    # as if that long ago
    assert copier.scope_broken() == ""
    systemd(SYSTEMD_RUN)                               # systemd-run works again
    e = _Engine()
    try:
        e.ready_copiers([101], None)
        assert e._ready[101] is not None and e._ready[101].scoped, e.progress.lines
        assert (tmp_path / "args").read_text().split("\n")[0] == "--scope"
    finally:
        e.drop_copiers()


UNIT_OF_A_REUSED_PID = r'''
import os, sys
from pathlib import Path
from torpor import copier
os.geteuid = lambda: 0
os.getpid = lambda: 4242           # a torpord restarted in a PID namespace: the same PID
copier.SYSTEMD_DIR = Path(sys.argv[1])
print([a for a in copier.scoped(["/x/torpor-copier"]) if a.startswith("--unit=")][0])
'''


def test_a_reused_pid_gets_another_unit_name(tmp_path):
    """A torpord restarted under the PID the last one had must not name its copier's scope as
    one that outlived the last torpord (still copying): the name has a part of its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemd-run").write_text(SYSTEMD_RUN)
    (bin_dir / "systemd-run").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "PYTHONPATH": str(Path(copier.__file__).parent.parent)}
    units = [subprocess.run([sys.executable, "-c", UNIT_OF_A_REUSED_PID, str(tmp_path)],
                            env=env, capture_output=True, text=True, check=True).stdout.strip()
             for _ in range(2)]
    assert all(u.startswith("--unit=torpor-copier-4242-") for u in units), units
    assert units[0] != units[1], units


HANGING_SYSTEMD_RUN = r'''#!{py}
import os, time
open(os.environ["FAKE_SYSTEMD_RUN_ARGS"], "a").write("called\n")
time.sleep(60)   # a D-Bus that never answers: it never execs the copier
'''


def test_a_systemd_run_that_hangs_is_taken_for_a_scope_failure(stand_in, systemd, tmp_path,
                                                                monkeypatch):
    """systemd-run still running (/proc/<pid>/comm) at the copier's ready timeout: said as
    systemd-run's failure and remembered as one, so the next copiers start without a scope
    (not one more ready timeout each); no retry past the timeout, and nothing left running."""
    systemd(HANGING_SYSTEMD_RUN.format(py=sys.executable))
    monkeypatch.setattr(copier, "READY_TIMEOUT_S", 1.0)
    e = _Engine()
    real_prestart, started = copier.prestart, []

    def prestart(*a):
        started.append(real_prestart(*a))
        return started[-1]
    monkeypatch.setattr(copier, "prestart", prestart)
    t0 = time.monotonic()
    try:
        e.ready_copiers([101, 102], None)
        assert e._ready == {101: None, 102: None}, e.progress.lines
    finally:
        e.drop_copiers()
    assert time.monotonic() - t0 < 5
    assert len(started) == 2 and all(c.scoped for c in started)   # no unscoped retry past it
    assert not any(_running(c.pid) for c in started)
    said = [line for line in e.progress.lines if line.startswith("warning: " + copier.SCOPE_FAILED)]
    assert len(said) == 1 and "hangs" in said[0], e.progress.lines
    assert "hangs" in copier.scope_broken()
    monkeypatch.setattr(copier, "prestart", real_prestart)
    e = _Engine()
    try:
        e.ready_copiers([101], None)                       # the next one: no scope, ready
        assert e._ready[101] is not None and not e._ready[101].scoped, e.progress.lines
    finally:
        e.drop_copiers()
    assert (tmp_path / "args").read_text().split() == ["called", "called"]


def test_a_copier_binary_removed_after_its_start_is_not_leaked(stand_in, monkeypatch):
    """prestart decides whether the copier is scoped from its command, before the start: a
    binary gone right after (an upgrade) raises nothing that would leave it running."""
    real_spawn = copier._spawn

    def spawn(*a, **k):
        proc = real_spawn(*a, **k)
        copier.BINARY.unlink()                      # started already
        return proc
    monkeypatch.setattr(copier, "_spawn", spawn)
    c = copier.prestart("/nonexistent/libcuda.so", [])   # returned: the caller can discard it
    copier.discard(c)
    assert not c.scoped and c.ctl is None and c.proc.returncode is not None
