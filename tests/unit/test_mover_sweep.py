"""bench/mover_sweep.py's harness without a GPU: its programs and torpor's suspend/resume stood
in for, so that the one run it gets on the GPU host does not end in a Python error. Every
variant runs at the first size, the default and the fastest others at the next; a program whose
bulk changed across its suspends, or whose losses differ from the reference's, fails the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import mover_sweep  # noqa: E402

GOOD_RATE = {"default": 20.0, "no-presize": 15.0, "buffers4": 22.0, "hostcheck": 30.0, "gpucheck-buffers4": 31.0,
             "direct": 10.0, "direct-gpucheck": 41.0, "direct-whole-gpucheck": 5.0,
             "plain": 19.8, "hold": 19.0, "drain": 19.5, "stage-chunk": 18.0, "stage-part": 25.0, "stage-part-buffers4": 24.0,
             "write-block": 21.0}


class FakeProgram:
    """Writes torch_program.py's steps lines as it is waited on: loss by step, a checksum by
    slice (`bad`: different after its first resume)."""

    pids = 4000

    def __init__(self, work: Path, name: str, env: dict, gib: float, bad: bool):
        self.name, self.env, self.gib, self.bad = name, env, gib, bad
        FakeProgram.pids += 1
        self.pid = FakeProgram.pids
        self.steps = work / f"{name}.steps"
        self.log = work / f"{name}.log"
        self.log.write_text("torpor-agent[1]: mover: tuned: ...\n" if env else "")
        self.steps.write_text("")
        self.n, self.resumed = 0, False
        self.nwin = mover_sweep.windows(gib)

    def _write(self, upto: int) -> None:
        with open(self.steps, "a") as f:
            while self.n < upto:
                self.n += 1
                k = self.n % self.nwin
                f.write(f"{self.n} loss{self.n} {k + (1000 if self.bad and self.resumed else 0):016x}\n")

    def wait_ready(self, timeout: float = 0) -> None:
        pass

    def wait_step(self, above: int, timeout: float = 0) -> int:
        self._write(above + 1)
        return self.n

    def step(self) -> int:
        return self.n

    def tail(self, n: int = 0) -> str:
        return ""

    def kill(self) -> None:
        pass


@pytest.fixture
def sweep(monkeypatch, tmp_path):
    """main() with FakePrograms and a stand-in of torpor's flows; returns (run, programs)."""
    from torpor.flows import process
    progs: dict[str, FakeProgram] = {}
    bad: set[str] = set()

    def start(self, name, gib, env, *, agent=True, max_steps=0, sleep=0.01):
        p = FakeProgram(self.work, name, env, gib, name.rsplit("-", 1)[0] in bad)
        progs[name] = p
        self.started.append(p)
        return p

    def reply(p: FakeProgram, rate: float) -> dict:
        moved = int(p.gib * 1.07e9)
        return {"agent": {str(p.pid): {"bytes": moved, "seconds": moved / rate / 1e9 + 0.01,
                                       "phases": {"copy": moved / rate / 1e9},
                                       "zero": {"bytes": 0}}}, "timings": {"agent-prepare": 1}}

    def by_pid(pid: int) -> FakeProgram:
        return next(p for p in progs.values() if p.pid == pid)

    def suspend(engine, pid):
        p = by_pid(pid)
        return reply(p, GOOD_RATE[p.name.rsplit("-", 1)[0]])

    def resume(engine, pid):
        p = by_pid(pid)
        p.resumed = True
        return reply(p, 25.0)

    monkeypatch.setattr(mover_sweep.Sweep, "start", start)
    monkeypatch.setattr(mover_sweep.Sweep, "engine", lambda self, overrides=None: None)
    monkeypatch.setattr(mover_sweep.Sweep, "reference_losses",
                        lambda self, upto: {s: f"loss{s}" for s in range(1, upto + 1)})
    monkeypatch.setattr(process, "suspend", suspend)
    monkeypatch.setattr(process, "resume", resume)
    monkeypatch.setattr(mover_sweep.time, "sleep", lambda s: None)
    out = tmp_path / "sweep.json"

    def run(*extra: str) -> tuple[int, dict]:
        rc = mover_sweep.main(["--sizes", "1", "2", "--warm-gib", "0", "--ck-root",
                               str(tmp_path / "ck"), "--pinned-gib", "0.001", "--out", str(out),
                               *extra])
        return rc, json.loads(out.read_text())
    run.bad = bad
    return run, progs


def test_every_variant_then_the_fastest_at_the_next_size(sweep):
    run, progs = sweep
    rc, doc = run()
    assert [(r["variant"], r["gib"]) for r in doc["runs"]] == \
        [(v, 1) for v in mover_sweep.VARIANTS] + \
        [("direct-gpucheck", 2), ("default", 2), ("gpucheck-buffers4", 2)]
    for r in doc["runs"]:
        assert r["slices_ok"] and r["losses_ok"] and "error" not in r, r
        assert r["losses_agree_across_programs"], r
        assert len(r["rounds"]) == 2
        s = r["rounds"][0]["suspend"]
        assert s["copy_gbps"] == pytest.approx(GOOD_RATE[r["variant"]], rel=1e-3)
        assert (r["agent_tuned_line"] != "") == bool(mover_sweep.VARIANTS[r["variant"]])
    # no torch here: the pinned limit is an error, so the run fails, but every row is there
    assert doc["errors"] and "pinned" in doc["errors"][0] and rc == 1
    assert doc["runs"][0]["rounds"][0]["suspend"].get("copy_of_limit") is None


def test_a_program_whose_bulk_changed_fails_the_run(sweep, monkeypatch):
    run, progs = sweep
    monkeypatch.setattr(mover_sweep, "pinned_limit", lambda gib, reps: {})
    run.bad.add("direct")
    rc, doc = run("--variants", "default", "direct", "--top", "1")
    rows = {(r["variant"], r["gib"]): r for r in doc["runs"]}
    assert rows[("direct", 1)]["slices_ok"] is False and rows[("direct", 1)]["slice_mismatch_steps"]
    assert rows[("default", 1)]["slices_ok"] is True
    assert ("direct", 2) not in rows             # a variant that changed data is never chosen
    assert rc == 1
    assert "NO" in mover_sweep.table(doc)


def test_the_budget_skips_programs_not_the_record(sweep):
    run, _ = sweep
    rc, doc = run("--budget-s", "0")
    assert doc["runs"] == [] and len(doc["skipped"]) >= len(mover_sweep.VARIANTS)
    assert rc == 1 or doc["errors"]
