"""The demo target program (shim/torpor/demo/program.py), run in CPU mode as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROGRAM = Path(__file__).resolve().parents[2] / "shim" / "torpor" / "demo" / "program.py"


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    status = tmp_path / "status.json"
    out = open(tmp_path / "out.log", "w")
    err = open(tmp_path / "err.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(PROGRAM), "--status", str(status), "--mib", "4",
         "--interval", "0.01", *args],
        stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=tmp_path)
    out.close()
    err.close()
    return proc, status


def read_status(status: Path) -> dict | None:
    try:
        return json.loads(status.read_text())
    except FileNotFoundError:
        return None


def wait_for(status: Path, pred, proc: subprocess.Popen, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = read_status(status)  # replaced atomically: never half-written
        if st is not None and pred(st):
            return st
        if proc.poll() is not None:
            raise AssertionError(f"program exited {proc.returncode}; status {read_status(status)}")
        time.sleep(0.01)
    raise AssertionError(f"timed out; last status {read_status(status)}")


@pytest.fixture
def cleanup():
    procs = []
    yield procs.append
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_cpu_mode_ticks_and_verifies(tmp_path, cleanup):
    proc, status = start(tmp_path, "--cpu", "--verify-every", "5")
    cleanup(proc)
    st = wait_for(status, lambda s: s["tick"] >= 12, proc)
    assert st["pid"] == proc.pid
    assert st["mode"] == "cpu" and st["device"] is None and st["mib"] == 4
    assert st["last_error"] is None and len(st["sha256_expected"]) == 64
    assert st["verified_ok"] is True and st["verified_tick"] >= 10 and st["verified_tick"] % 5 == 0
    assert st["verifications"] >= 3  # the one at start, ticks 5 and 10
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    lines = (tmp_path / "out.log").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torpor demo: pid ")


def test_sigusr1_triggers_full_verify(tmp_path, cleanup):
    proc, status = start(tmp_path, "--cpu", "--verify-every", "0")
    cleanup(proc)
    st = wait_for(status, lambda s: s["tick"] >= 3, proc)
    assert st["verifications"] == 1 and st["verified_tick"] == 0  # only the one at start
    os.kill(proc.pid, signal.SIGUSR1)
    st = wait_for(status, lambda s: s["verifications"] == 2, proc)
    assert st["verified_ok"] is True and st["verified_tick"] >= 3 and st["last_error"] is None


def test_max_ticks_exits_zero(tmp_path, cleanup):
    proc, status = start(tmp_path, "--cpu", "--max-ticks", "7", "--verify-every", "7")
    cleanup(proc)
    assert proc.wait(timeout=20) == 0
    st = read_status(status)
    assert st["tick"] == 7 and st["verified_tick"] == 7 and st["verified_ok"] is True


def test_falls_back_to_cpu_without_libcuda(tmp_path, cleanup):
    proc, status = start(tmp_path, "--libcuda", str(tmp_path / "no-such-libcuda.so"),
                         "--max-ticks", "2")
    cleanup(proc)
    assert proc.wait(timeout=20) == 0
    st = read_status(status)
    assert st["mode"] == "cpu" and "no-such-libcuda" in st["note"]


@pytest.mark.parametrize("verify_every, caught_by", [("1", "full verify"), ("0", "does not match")])
def test_corruption_is_detected(tmp_path, cleanup, verify_every, caught_by):
    # verify-every 1: the flipped MiB is not the one this tick's rotating check reads, so the
    # full verify at the same tick catches it; verify-every 0: the rotating check does, later.
    proc, status = start(tmp_path, "--cpu", "--verify-every", verify_every,
                         "--self-test-corrupt-at", "3")
    cleanup(proc)
    assert proc.wait(timeout=20) == 3
    st = read_status(status)
    assert st["last_error"] and caught_by in st["last_error"], st
    assert st["verified_ok"] is False and st["tick"] < 3 + 4
    if verify_every == "1":
        assert st["last_error"].startswith("tick 3: full verify")
    assert "FAILED" in (tmp_path / "err.log").read_text()
    assert len((tmp_path / "out.log").read_text().splitlines()) == 1
