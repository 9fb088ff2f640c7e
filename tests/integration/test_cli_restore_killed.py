"""A restore killed at any moment never leaves a frozen program (issue 18, item 1).

CRIU restores a tree through its restorer: each process waits, signals blocked, on a futex
CRIU wakes when all are back. A CRIU killed half-way leaves them there for good. torpor has
CRIU outlive it (its own session, no parent-death signal) and journals every PID of the image
and CRIU's work directory: the next torpor command finishes what CRIU finished, or stops the
frozen tree, and the checkpoint stays restorable.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import COUNTER, alive, needs_criu, read_count, wait_for

pytestmark = needs_criu

PROGRAM = COUNTER + """
import sys, time
buf = bytearray(300 << 20)               # 300 MiB of pages: a restore of about a second
for i in range(0, len(buf), 4096):
    buf[i] = 1
n = 0
while True:
    n += 1
    tick(sys.argv[1], n)
    time.sleep(0.02)
"""


def _criu_restoring() -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if len(argv) > 1 and argv[0].endswith(b"criu") and argv[1] == b"restore":
                found.append(int(name))
    return found


def _ticking(counter: Path, timeout: float = 10.0) -> bool:
    def read() -> int:
        return read_count(counter)
    start = read()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if read() > start + 5:
            return True
        time.sleep(0.05)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "-"


@pytest.mark.parametrize("kill_criu_too", [False, True], ids=["torpor", "torpor-and-criu"])
def test_a_killed_restore_leaves_the_program_running_or_its_checkpoint_restorable(
        torpor, tmp_path, reaper, kill_criu_too):
    delays = [0.0, 0.1, 0.2, 0.3, 0.45] if not kill_criu_too else [0.05, 0.2, 0.4]
    for i, delay in enumerate(delays):
        counter = tmp_path / f"n{i}"
        prog = subprocess.Popen([sys.executable, "-c", PROGRAM, str(counter)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        reaper.append(prog.pid)
        wait_for(lambda: counter.exists(), timeout=60, what="program start")
        images = tmp_path / f"ck{i}"
        torpor.run("checkpoint", str(prog.pid), "-D", str(images), check=True)
        prog.wait(timeout=10)
        t = torpor.start("restore", "-D", str(images))
        criu = wait_for(_criu_restoring, timeout=30, what="CRIU restoring")
        time.sleep(delay)
        t.kill()
        if kill_criu_too:
            for p in criu:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        t.wait()
        said = torpor.run("ps").stderr                 # any command recovers first
        where = f"delay {delay}, kill_criu_too={kill_criu_too}: {said}"
        if alive(prog.pid):
            assert _ticking(counter), f"restored program frozen ({_state(prog.pid)}); {where}"
            assert not _criu_restoring()
        else:
            r = torpor.run("restore", "-D", str(images))
            assert r.returncode == 0, f"checkpoint not restorable: {r.stderr}; {where}"
            assert _ticking(counter), f"program restored again does not run; {where}"
        os.kill(prog.pid, signal.SIGKILL)
        wait_for(lambda: not alive(prog.pid), timeout=10, what="program gone")


def test_criu_killed_during_a_restore_leaves_nothing_frozen_once_torpor_returns(torpor, tmp_path,
                                                                                reaper):
    """CRIU cleans up a restore that fails, not one that is killed: torpor, still alive, stops
    the tasks CRIU left in its restorer before it returns, and the checkpoint restores after."""
    counter = tmp_path / "n"
    prog = subprocess.Popen([sys.executable, "-c", PROGRAM, str(counter)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    reaper.append(prog.pid)
    wait_for(lambda: counter.exists(), timeout=60, what="program start")
    images = tmp_path / "ck"
    torpor.run("checkpoint", str(prog.pid), "-D", str(images), check=True)
    prog.wait(timeout=10)
    for delay in (0.1, 0.3):
        t = torpor.start("restore", "-D", str(images))
        criu = wait_for(_criu_restoring, timeout=30, what="CRIU restoring")
        time.sleep(delay)
        for p in criu:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = t.communicate(timeout=60)
        if t.returncode == 0:          # CRIU had finished: a restored, running program
            assert _ticking(counter), err
            os.kill(prog.pid, signal.SIGKILL)
            wait_for(lambda: not alive(prog.pid), timeout=10, what="program gone")
            continue
        assert t.returncode == 5, err
        assert not alive(prog.pid) or _state(prog.pid) == "Z", \
            f"left {_state(prog.pid)} after torpor returned: {err}"
        assert "it had restored so far" in err or not alive(prog.pid), err
    r = torpor.run("restore", "-D", str(images))
    assert r.returncode == 0, r.stderr
    assert _ticking(counter)
