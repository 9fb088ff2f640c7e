"""bench/agent_overhead.py's harness on a machine without a GPU (--workloads cpu): interleaved
runs with and without the agent (`torpor run`), each run's agent mapping checked, the medians
and the overhead written. Its figures mean nothing here; that the GPU host's run will not fail
on the harness is what this checks."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_agent_overhead_harness_interleaves_and_checks_the_agent(torpor_env, tmp_path):
    out = tmp_path / "agent_overhead.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "agent_overhead.py"),
                        "--workloads", "cpu", "--reps", "2", "--warmup", "2", "--steps", "5",
                        "--agent-dir", str(tmp_path / "agents"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert [(x["rep"], x["mode"]) for x in runs] == [(0, "plain"), (0, "agent"),
                                                     (1, "agent"), (1, "plain")]
    assert all(x["agent_mapped"] == (x["mode"] == "agent") and x["n"] == 5 for x in runs), runs
    res = doc["result"]["cpu"]
    assert res["plain"]["runs"] == res["agent"]["runs"] == 2
    assert isinstance(res["overhead_pct"], float) and res["target_pct"] == 1.0
