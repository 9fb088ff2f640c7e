"""A job of two CUDA processes (tests/gpu/job_program.py: a launcher and its two ranks, as
torchrun starts a job) on the real H200 (issue 6, item 3, on one GPU): torpor checkpoints the
launcher's tree as one operation. Every rank is locked before any is checkpointed, so one whose
lock fails has all the others rolled back; checkpointed whole, both ranks come back and
continue bit-exact against uninterrupted references.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integration.gpu import TorchStatus
from tests.gpu.compare_steps import compare
from tests.gpu.conftest import GPU_SKIP, alive, wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")]

JOB = Path(__file__).resolve().parent / "job_program.py"
GIB, SEED = 1.0, 1000


class Rank(TorchStatus):
    def __init__(self, workdir: Path, r: int):
        self.status_path = workdir / f"rank{r}.status.json"
        self.steps = workdir / f"rank{r}.steps"
        self.stall = workdir / f"rank{r}.stall"
        self.log = workdir / f"rank{r}.log"

    def wait_step(self, above: int, timeout: float = 180) -> int:
        wait_for(lambda: self.step() > above, timeout, f"{self.status_path.name}: step > {above}"
                 f" ({self.log.read_text(errors='replace')[-1500:] if self.log.exists() else ''})")
        return self.step()


@pytest.fixture
def job(tmp_path):
    work = tmp_path / "job"
    work.mkdir()
    with open(work / "launcher.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(JOB), "--ranks", "2", "--gib", f"{GIB:g}",
                                 "--seed", str(SEED), "--workdir", str(work)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, cwd=work)
    yield proc, work, [Rank(work, 0), Rank(work, 1)]
    for pid in [proc.pid] + json.loads((work / "job.json").read_text())["pids"] \
            if (work / "job.json").exists() else [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _states(torpor, pids: list[int]) -> dict[int, str]:
    procs = torpor.json("ps")["processes"]
    return {p["pid"]: p["state"] for p in procs if p["pid"] in pids}


def test_a_two_rank_job_is_rolled_back_together_then_checkpointed_whole(
        torpor, programs, job, tmp_path):
    proc, work, ranks = job
    refs = [programs(f"ref{r}", GIB, seed=SEED + r, max_steps=70) for r in range(2)]
    for r in ranks:
        r.wait_step(5, timeout=300)
    pids = json.loads((work / "job.json").read_text())["pids"]

    # 1. the rank torpor locks last (PIDs in order) has work in flight longer than the lock
    # may wait: its lock fails after the other's succeeded, and torpor brings that one back
    # before it says so
    last = ranks[pids.index(max(pids))]
    last.stall.touch()
    wait_for(lambda: last.status().get("stalls", 0) >= 1, 60, "a rank stalling")
    time.sleep(0.3)                           # its spinning kernel is in flight now
    env = dict(torpor.env, TORPOR_LOCK_TIMEOUT="0.5")
    r = subprocess.run([sys.executable, "-m", "torpor.cli.main", "checkpoint", str(proc.pid),
                        "-D", str(tmp_path / "ck-failed")], env=env, capture_output=True,
                       text=True, timeout=300)
    last.stall.unlink()
    assert r.returncode == 8 and "rolled back to running" in r.stderr, (r.returncode, r.stderr)
    assert all(alive(p) for p in pids + [proc.pid])
    at = [rk.step() for rk in ranks]
    for rk, a in zip(ranks, at):
        rk.wait_step(a + 3)                   # both train on
    assert set(_states(torpor, pids).values()) == {"RUNNING"}

    # 2. the job checkpointed whole (every rank locked, then checkpointed), then restored
    images = tmp_path / "ck"
    m = torpor.json("checkpoint", str(proc.pid), "-D", str(images), timeout=900)["manifest"]
    proc.wait(timeout=60)
    assert sorted(p["pid"] for p in m["processes"] if p["cuda"]) == sorted(pids)
    at = [rk.step() for rk in ranks]
    out = torpor.json("restore", "-D", str(images), timeout=900)
    assert sorted(out["cuda_pids"]) == sorted(pids)
    for rk, a in zip(ranks, at):
        rk.wait_step(a + 10)
    for ref, rk in zip(refs, ranks):
        ref.wait_done(69)
        rk.wait_step(69, timeout=300)
        n, mismatch = compare(str(ref.steps), str(rk.steps))
        assert mismatch is None, f"{rk.steps.name} diverged at {mismatch}"
        assert n >= 69
