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
    """A program's files in workdir, named after it (job_program.py's rank<r>.*)."""

    def __init__(self, workdir: Path, name: str):
        self.status_path = workdir / f"{name}.status.json"
        self.steps = workdir / f"{name}.steps"
        self.stall = workdir / f"{name}.stall"
        self.log = workdir / f"{name}.log"

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
                                 "--seed", str(SEED), "--workdir", str(work),
                                 "--devices", os.environ.get("JOB_DEVICES", "")],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, cwd=work)
    yield proc, work, [Rank(work, "rank0"), Rank(work, "rank1")]
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


DDP = Path(__file__).resolve().parent / "ddp_program.py"


def _ddp(work: Path, name: str, max_steps: int = 0) -> subprocess.Popen:
    """ddp_program.py at world size 1 (NCCL, DDP), its files named after name in work."""
    with open(work / f"{name}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, str(DDP), "--gib", "0.5", "--seed", str(SEED),
             "--max-steps", str(max_steps), "--init-file", str(work / f"{name}.rendezvous"),
             "--steps-file", str(work / f"{name}.steps"),
             "--status", str(work / f"{name}.status.json")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, cwd=work)


def test_a_one_rank_nccl_ddp_job_checkpoints_and_restores_bit_exact(torpor, tmp_path):
    """The torchrun code path on one GPU: a DDP model whose gradients go through an NCCL
    all-reduce every step (world size 1: NCCL's communicator, proxy thread and bootstrap
    sockets all there), checkpointed through the driver path and restored, going on exactly
    as an uninterrupted run. Two ranks need two GPUs (agent/NCCL.md)."""
    work = tmp_path / "ddp"
    work.mkdir()
    ref, prog = _ddp(work, "ref", max_steps=50), _ddp(work, "prog")
    try:
        r_ref, r_prog = Rank(work, "ref"), Rank(work, "prog")
        r_prog.wait_step(10, timeout=300)
        images = tmp_path / "ck"
        tcp = type(torpor)(dict(torpor.env, TORPOR_TCP_ESTABLISHED="1"))   # NCCL's bootstrap
        m = tcp.json("checkpoint", str(prog.pid), "-D", str(images), timeout=600)["manifest"]
        prog.wait(timeout=60)
        assert [p["pid"] for p in m["processes"] if p["cuda"]] == [prog.pid]
        at = r_prog.step()
        torpor.json("restore", "-D", str(images), timeout=600)
        r_prog.wait_step(at + 10)
        wait_for(lambda: r_ref.status().get("done"), 300, "the reference run")
        r_prog.wait_step(49)
        n, mismatch = compare(str(r_ref.steps), str(r_prog.steps))
        assert mismatch is None and n >= 49, (n, mismatch, r_prog.status().get("nccl"))
    finally:
        for proc in (ref, prog):
            for kill in (os.killpg, os.kill):   # a restored program is not our child
                try:
                    kill(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
