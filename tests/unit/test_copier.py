"""copier.wait (shim/torpor/copier.py): torpor's own copier is waited for, its one JSON line
read, and killed once it runs past the timeout (this torpor still holds the memory then);
another torpor's copier (a recovery) is only waited for, never signalled: while it runs it may
hold the only copy of a program's GPU data, and the recovery leaves the entry for later."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from torpor import copier, procs


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
