"""torpor SIGKILLed while its driver lock is in flight (issue 18 item 8), on the fake GPU.

The journal entry is durable before every lock (Operation.require_journalled): whenever torpor
dies, the next torpor command finds every program it locked or checkpointed and rolls it back.
Seeds are printed; TORPOR_LOCK_KILLS sets the number of kills per command.
"""

import json
import os
import random
import time
from pathlib import Path

import pytest

from tests.fakes.fakegpu import CHECKPOINTED, LOCKED, RUNNING
from tests.integration.conftest import needs_criu, wait_for

pytestmark = needs_criu


def _journal(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "state" / "journal").glob("*.json"))


def _in_phase(tmp_path: Path, phase: str) -> bool:
    for p in _journal(tmp_path):
        try:
            if json.loads(p.read_text()).get("phase") == phase:
                return True
        except (OSError, ValueError):
            pass
    return False


@pytest.mark.parametrize("command", ["checkpoint", "suspend"])
def test_torpor_killed_in_a_delayed_lock_is_always_rolled_back(torpor, gpu, tmp_path, command):
    seed = int(os.environ.get("TORPOR_FAULT_SEED", time.time_ns() % 1_000_000))
    print(f"seed {seed}")
    rng = random.Random(seed)
    runs = int(os.environ.get("TORPOR_LOCK_KILLS", "8"))
    seen = {RUNNING: 0, LOCKED: 0, CHECKPOINTED: 0}
    with gpu.spawn() as prog:
        for i in range(runs + 1):
            gpu.delay("lock", 500)
            gpu.delay("checkpoint", 500)
            args = [command, str(prog.pid)] + (["-D", str(tmp_path / f"ck{i}")]
                                               if command == "checkpoint" else [])
            t = torpor.start(*args)
            wait_for(lambda: _in_phase(tmp_path, "lock") or t.poll() is not None, timeout=30,
                     what="the lock phase")
            if i < runs:
                delay = rng.uniform(0, 0.9)   # in the lock's delay, or the checkpoint's after it
                time.sleep(delay)
            elif seen[LOCKED] + seen[CHECKPOINTED]:
                t.kill()
                t.wait()
                gpu.clear_faults()
                torpor.run("ps")
                break
            else:   # a loaded machine: no random kill landed after a lock; one surely does
                t0 = time.monotonic()
                wait_for(lambda: gpu.state(prog.pid)["state"] == LOCKED, timeout=30,
                         what="the lock")
                delay = time.monotonic() - t0
            t.kill()
            t.wait()
            gpu.clear_faults()
            then = gpu.state(prog.pid)["state"]
            seen[then] = seen.get(then, 0) + 1
            ps = torpor.run("ps")   # the next torpor command rolls back what was left
            where = f"seed {seed}, run {i}, killed {delay:.2f} s into the lock ({then})"
            assert ps.returncode == 0, f"{where}: {ps.stderr}"
            assert gpu.state(prog.pid)["state"] == RUNNING, f"{where}: {ps.stderr}"
            if then != RUNNING:
                assert "recovered" in ps.stderr and str(prog.pid) in ps.stderr, where
            assert _journal(tmp_path) == [], where
            assert not (tmp_path / "state" / "suspended" / f"{prog.pid}.json").exists(), where
            prog.wait_tick(prog.tick() + 2)
    assert seen[LOCKED] + seen[CHECKPOINTED] > 0, f"seed {seed}: no kill landed after a lock"


def test_a_stale_suspended_record_does_not_keep_a_lock(torpor, gpu, tmp_path):
    """A resume killed between its unlock and clearing its record leaves the program RUNNING
    with a record saying it is suspended; a checkpoint of it killed while LOCKED must still
    be rolled back (recovery left it LOCKED, its entry forgotten)."""
    with gpu.spawn() as prog:
        torpor.json("suspend", str(prog.pid))
        record = tmp_path / "state" / "suspended" / f"{prog.pid}.json"
        stale = record.read_text()
        torpor.json("resume", str(prog.pid))
        record.write_text(stale)                  # as the killed resume leaves it
        assert gpu.state(prog.pid)["state"] == RUNNING
        gpu.delay("checkpoint", 20000)
        t = torpor.start("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"))
        wait_for(lambda: gpu.state(prog.pid)["state"] == LOCKED, timeout=30, what="the lock")
        t.kill()
        t.wait()
        gpu.clear_faults()
        ps = torpor.run("ps")
        assert gpu.state(prog.pid)["state"] == RUNNING, ps.stderr
        assert "recovered" in ps.stderr and _journal(tmp_path) == []
        assert not record.exists()
        prog.wait_tick(prog.tick() + 2)
