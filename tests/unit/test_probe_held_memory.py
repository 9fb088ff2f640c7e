"""bench/probe_held_memory.c on the fake driver: it builds without the CUDA toolkit, its three
processes talk, the baseline round trip through the driver's checkpoint API runs and checks
every byte, and where the driver lacks exportable handles (the fake does) it stops with a
verdict saying so, in valid JSON. What the real driver answers is for the GPU host
(PROBE_HELD=1 tests/gpu/run-on-gpu-host.sh)."""

import json
import os
import shutil
import subprocess

import pytest

from tests.fakes import fakegpu

ROOT = fakegpu.FAKES_DIR.parents[1]
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def test_probe_runs_the_baseline_and_names_the_first_refusal(tmp_path):
    gpu = fakegpu.FakeGpu(tmp_path / "state")
    binary = tmp_path / "probe"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", str(ROOT / "bench" /
                    "probe_held_memory.c"), "-ldl", "-o", str(binary)], check=True,
                   capture_output=True)
    env = dict(os.environ, **gpu.env())
    r = subprocess.run([str(binary), "--gib", "0.125"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    steps = [(s["phase"], s["step"], s["cuda_result"]) for s in doc["steps"]]
    assert [s for p, s, rc in steps if p == "baseline" and rc == 0] == [
        "map and fill (exportable)", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
        "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock", "every byte back"]
    assert steps[-1] == ("held", "cuMemExportToShareableHandle", 801)
    assert doc["verdict"] == "the program's handle cannot be exported"


def test_probe_refuses_bad_arguments(tmp_path):
    binary = tmp_path / "probe"
    subprocess.run(["gcc", "-O2", str(ROOT / "bench" / "probe_held_memory.c"), "-ldl", "-o",
                    str(binary)], check=True, capture_output=True)
    for args in (["--gib", "0"], ["--gib"], ["--size", "1"]):
        r = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and r.stderr.startswith("usage:"), (args, r.stderr)
