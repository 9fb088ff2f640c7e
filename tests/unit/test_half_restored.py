"""A restore whose CRIU ended without finishing: the tasks it had forked to become the
image's processes (CRIU's own command line until their memory is restored) are frozen in its
restorer for good. Recovery stops them instead of waiting for them as if they were CRIU, and
a restore whose CRIU is killed while torpor lives stops them at once."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from torpor import config, criu
from torpor.engine import Engine
from torpor.journal import Journal


@pytest.fixture
def cfg(torpor_env):
    return config.load()


def _task_of_a_killed_criu(work) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "restore",
                          "--work-dir", str(work)])
    deadline = time.monotonic() + 5
    while p.pid not in criu.restoring(work) and time.monotonic() < deadline:
        time.sleep(0.01)
    return p


def test_the_frozen_tasks_of_a_killed_restore_are_stopped_not_waited_for(cfg, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    op = Journal(cfg).begin("restore", [])
    task = _task_of_a_killed_criu(work)
    try:
        op.phase("restore", pids=[], work_dir=str(work), image_pids=[task.pid])
        op.release()     # torpor and CRIU killed
        t0 = time.monotonic()
        said = Engine(cfg).recover()
        assert time.monotonic() - t0 < 5, said
        assert task.wait(timeout=5) == -9, said
        assert any("stopped 1 half-restored process" in m for m in said), said
        assert not work.exists()
    finally:
        task.kill()
        task.wait()


def test_a_restore_killed_with_torpor_alive_stops_what_it_left(cfg, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    engine = Engine(cfg)
    with engine.begin("restore", []) as op:
        task = _task_of_a_killed_criu(work)
        try:
            op.phase("restore", pids=[], work_dir=str(work), image_pids=[task.pid])
            assert engine.stop_half_restored(op.entry) == [task.pid]
            assert task.wait(timeout=5) == -9
        finally:
            task.kill()
            task.wait()
