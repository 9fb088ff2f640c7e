"""bench/host_bounds.c on the fake driver: it builds without the CUDA toolkit, runs every
measurement, writes valid JSON and leaves nothing in its directory. Its rates mean nothing
here (the fake's DMA is a memcpy); that the GPU host's run will not fail on it is what this
checks, as device time is too short to debug a benchmark there."""

import json
import os
import shutil
import subprocess

import pytest

from tests.fakes import fakegpu

ROOT = fakegpu.FAKES_DIR.parents[1]
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def test_host_bounds_runs_every_measurement_on_the_fake_driver(tmp_path):
    gpu = fakegpu.FakeGpu(tmp_path / "state")
    binary, sink = tmp_path / "host_bounds", tmp_path / "sink"
    sink.mkdir()
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-pthread",
                    str(ROOT / "bench" / "host_bounds.c"), "-ldl", "-o", str(binary)],
                   check=True, capture_output=True)
    env = dict(os.environ, **gpu.env())
    r = subprocess.run([str(binary), "--gib", "0.125", "--threads", "2", "--rounds", "1",
                        "--register-gib", "0.0625", "--stages", "4,8", "--dir", str(sink)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    runs = doc["runs"]
    seen = {(x["what"], x.get("sink") or x.get("kind"), x.get("direction"),
             x.get("under_dma"), x.get("stage_mib"), x.get("threads")) for x in runs}
    assert {w for w, *_ in seen} == {"pcie", "copy", "staged", "register"}
    sinks = {"pwrite", "pwrite-whole", "map", "map-nt", "map-nt-fault", "anon"}
    assert {s for w, s, *_ in seen if w == "copy"} == sinks
    assert {(s, m) for w, s, d, u, m, t in seen if w == "staged" and d == "out"} == \
        {(s, m) for s in sinks for m in (4, 8)}
    assert {u for w, *_, u, _m, _t in seen if w == "copy"} == {True, False}
    assert {k for w, k, *_ in seen if w == "register"} == \
        {"anon-4k", "anon-thp", "hugetlb", "tmpfs-map"}
    for x in runs:
        if "skipped" not in x:
            assert x["bytes"] > 0 and x["wall_s"] > 0, x
            assert x.get("gb_per_s", 1) > 0, x
    assert list(sink.iterdir()) == []    # every file it made is gone
    assert len(r.stderr.splitlines()) == len(runs)


def test_host_bounds_refuses_bad_arguments(tmp_path):
    binary = tmp_path / "host_bounds"
    subprocess.run(["gcc", "-O2", "-pthread", str(ROOT / "bench" / "host_bounds.c"), "-ldl",
                    "-o", str(binary)], check=True, capture_output=True)
    for args in (["--threads", "0"], ["--gib"], ["--stages", "4,x"], ["--what", "1"]):
        r = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and r.stderr.startswith("usage:"), (args, r.stderr)
