"""bench/probe_held_memory.c on the fake driver: it builds without the CUDA toolkit, its three
processes talk, the baseline round trip through the driver's checkpoint API runs and checks
every byte, the held and descriptor-only round trips run through (the fake exports a handle's
memory as a descriptor and imports it again, as the H200's driver does), and where the driver
lacks exportable handles (the fake told so) it stops with a verdict saying so, in valid JSON.
What the real driver answers is for the GPU host (PROBE_HELD=1 tests/gpu/run-on-gpu-host.sh)."""

import json
import os
import shutil
import subprocess

import pytest

from tests.fakes import fakegpu

ROOT = fakegpu.FAKES_DIR.parents[1]
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

ROUND_TRIP = ["cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
              "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"]


def _run(tmp_path, fail_export: bool = False, env: dict | None = None):
    gpu = fakegpu.FakeGpu(tmp_path / "state")
    binary = tmp_path / "probe"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", str(ROOT / "bench" /
                    "probe_held_memory.c"), "-ldl", "-o", str(binary)], check=True,
                   capture_output=True)
    if fail_export:      # a driver without exportable handles (fakegpu.py's fail/<call>)
        (gpu.state_dir / "fail" / "cuMemExportToShareableHandle").write_text("801\n")
    env = dict(os.environ, **gpu.env(), **(env or {}))
    r = subprocess.run([str(binary), "--gib", "0.125"], env=env, capture_output=True,
                       text=True, timeout=120)
    doc = json.loads(r.stdout)
    return r, doc, [(s["phase"], s["step"], s["cuda_result"]) for s in doc["steps"]]


def test_probe_runs_the_held_and_descriptor_only_round_trips(tmp_path):
    r, doc, steps = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    phase = lambda name: [(s, rc) for p, s, rc in steps if p == name]  # noqa: E731
    assert phase("baseline") == [(s, 0) for s in ["map and fill (exportable)", *ROUND_TRIP,
                                                  "every byte back"]]
    # the holder's imported handle is not exported again (as on the H200: CUresult 1), so
    # the program takes back the descriptor it exported before the checkpoint
    assert phase("held") == [
        ("program exports its handle", 0), ("holder imports and maps it", 0),
        ("program unmaps and releases its own", 0), *[(s, 0) for s in ROUND_TRIP],
        ("cuMemExportToShareableHandle (held)", 1),
        ("program imports its pre-checkpoint descriptor at the same address", 0),
        ("every byte back, nothing copied", 0)]
    assert phase("fdonly") == [(s, 0) for s in [
        "program maps fresh memory of its own", "program exports its handle",
        "program unmaps and releases its own", *ROUND_TRIP,
        "program imports the kept descriptor", "every byte back, nothing copied"]]
    # held by the program itself, then the imported handle exported again: the fake refuses
    # that as the H200's driver did in the holder
    assert phase("selfheld") == [(s, 0) for s in [
        "program maps fresh memory of its own", "program exports and keeps the descriptor",
        "program unmaps and releases its own", *ROUND_TRIP,
        "program imports its own descriptor", "every byte back, nothing copied"]] + [
        ("cuMemExportToShareableHandle (imported)", 1)]
    # the fake has no cuMemcpyDtoD_v2: the snapshot says so, and each process's answers stay
    # with their own commands after it
    assert phase("snapshot") == [("cuMemcpyDtoD", 801)]
    # the drain: the holder copies the released memory out and checks it while the driver
    # locks and checkpoints the program; the program then takes it back intact
    assert phase("drain") == [(s, 0) for s in [
        "program maps fresh memory of its own", "program exports its handle",
        "program unmaps and releases its own", *ROUND_TRIP[:2],
        "(the lock and checkpoint ended, seconds after the drain began)",
        "holder copied all of it out beside them (copy seconds)",
        "(the drain ended, seconds after it began)", *ROUND_TRIP[2:],
        "program imports the kept descriptor", "every byte back"]]
    assert phase("done") == [("program ends", 0), ("holder ends", 0)]
    assert doc["verdict"] == (
        "held memory survives the driver's checkpoint: no copy back needed (handed back by "
        "the descriptor exported before the checkpoint); without a holder: a descriptor alone "
        "holds it; held by the program itself: its own descriptor holds it (the checkpoint's "
        "time says whether the driver saved it); the imported handle does not export again; "
        "drain: another process copies released memory out while the driver checkpoints its "
        "program (the steps' times say at what rate and at what cost)")


def test_a_drain_that_finds_other_bytes_says_so(tmp_path):
    """The holder checks every byte it drains against the program's pattern: memory another
    process changed (here: the program's seed is not the one the holder is told, as if the
    descriptor were another allocation's) is refused, not reported as drained."""
    r, doc, steps = _run(tmp_path, env={"PROBE_DRAIN_SEED_XOR": "1"})
    assert r.returncode == 0, r.stderr
    assert ("drain", "every byte to the host, as written", 1) in steps
    assert doc["verdict"].endswith("drain: the holder could not copy the released memory out")


def test_probe_names_a_driver_without_exportable_handles(tmp_path):
    r, doc, steps = _run(tmp_path, fail_export=True)
    assert r.returncode == 1, r.stderr
    assert [s for p, s, rc in steps if p == "baseline" and rc == 0] == [
        "map and fill (exportable)", *ROUND_TRIP, "every byte back"]
    assert steps[-1] == ("held", "cuMemExportToShareableHandle", 801)
    assert doc["verdict"] == "the program's handle cannot be exported"


def test_probe_refuses_bad_arguments(tmp_path):
    binary = tmp_path / "probe"
    subprocess.run(["gcc", "-O2", str(ROOT / "bench" / "probe_held_memory.c"), "-ldl", "-o",
                    str(binary)], check=True, capture_output=True)
    for args in (["--gib", "0"], ["--gib"], ["--size", "1"]):
        r = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and r.stderr.startswith("usage:"), (args, r.stderr)
