"""Issue 20's benchmark arithmetic, without a GPU: the bounds agent_path.py puts beside each
size (bench/agent_path.py bounds()), upstream_path.py's comparison of its legs (compare_legs,
table) and the yardsticks that need no GPU (bench/yardsticks.py). The GPU host's run only
fills these in; a wrong figure here would be a wrong figure in the docs."""

import json
import os
import time
from pathlib import Path

import pytest

from bench import agent_path, upstream_path, yardsticks

GB = 1e9


def agent_row(moved=55e9, wall=2.0, resume=1.5, driver=True, pause=None):
    a = {"suspend": {"wall_s": wall, "agent": {"bytes": moved},
                     "timings": {"agent-prepare": 1.0, "lock": 0.01, "checkpoint": 0.49}},
         "resume": {"wall_s": resume, "agent": {"bytes": moved},
                    # a resume's timings hold its suspend's too (one engine): only its own count
                    "timings": {"checkpoint": 0.49, "gpu-restore": 0.25, "unlock": 0.05}}}
    if pause:
        a["pause_disk"] = pause
    row = {"gib": 16, "agent": a}
    if driver:
        row["driver"] = {"suspend": {"wall_s": 12.0}, "resume": {"wall_s": 4.0}}
    return row


def test_suspend_and_resume_bounds_are_the_copy_at_the_pinned_rate_plus_the_driver_residual():
    b = agent_path.bounds(agent_row(), {"d2h": 55.0, "h2d": 50.0})
    s, r = b["suspend"], b["resume"]
    assert s["copy_s"] == pytest.approx(1.0) and s["driver_residual_s"] == pytest.approx(0.5)
    assert s["bound_s"] == pytest.approx(1.5) and s["over_bound"] == pytest.approx(2.0 / 1.5)
    assert s["speedup"] == pytest.approx(6.0)
    assert s["speedup_bound_allows"] == pytest.approx(8.0)
    assert s["target_speedup_min"] == 10.0
    assert r["copy_s"] == pytest.approx(1.1) and r["driver_residual_s"] == pytest.approx(0.3)
    assert r["bound_s"] == pytest.approx(1.4) and r["speedup"] == pytest.approx(4.0 / 1.5)


def test_pause_target_is_one_and_a_half_copies_plus_a_second():
    pause = {"paused_s": 2.4, "durable_s": 12.0, "gpu_bytes": 55e9}
    b = agent_path.bounds(agent_row(pause=pause), {"d2h": 55.0, "h2d": 50.0})
    p = b["pause_disk"]
    assert p["copy_s"] == pytest.approx(1.0) and p["target_s"] == pytest.approx(2.5)
    assert p["met"] is True and p["over_target"] == pytest.approx(2.4 / 2.5)
    pause["paused_s"] = 2.6
    assert agent_path.bounds(agent_row(pause=pause), {"d2h": 55.0})["pause_disk"]["met"] is False


def test_the_pause_flows_bound_is_both_copies_plus_the_driver_and_the_dump():
    pause = {"paused_s": 4.0, "durable_s": 12.0, "gpu_bytes": 56e9, "agent": {"bytes": 55e9},
             "timings": {"agent-prepare": 1.2, "lock": 0.1, "checkpoint": 0.3, "dump": 0.5,
                         "gpu-restore": 0.2, "unlock": 0.1, "agent-resume": 1.3,
                         "writeout": 9.0}}
    p = agent_path.bounds(agent_row(pause=pause), {"d2h": 55.0, "h2d": 50.0})["pause_disk"]
    assert p["flow_bound_s"] == pytest.approx(1.0 + 1.1 + 1.2)     # out, back, the rest
    assert p["over_flow_bound"] == pytest.approx(4.0 / 3.3)
    assert "flow's bound 3.30 s" in "".join(agent_path.bound_lines("16", {"pause_disk": p}))
    del pause["agent"]                                              # no agent figure: no bound
    p = agent_path.bounds(agent_row(pause=pause), {"d2h": 55.0, "h2d": 50.0})["pause_disk"]
    assert p["flow_bound_s"] is None and p["over_flow_bound"] is None


def test_no_yardstick_or_no_driver_gives_no_ratio_rather_than_a_wrong_one():
    b = agent_path.bounds(agent_row(driver=False, pause={"paused_s": 1.0, "gpu_bytes": 1e9}),
                          {"error": "no torch"})
    assert b["suspend"]["bound_s"] is None and b["suspend"]["over_bound"] is None
    assert "speedup" not in b["suspend"] and b["pause_disk"]["met"] is None
    lines = agent_path.bound_lines("16", b)      # and the table still prints
    assert len(lines) == 3 and "MISSED" not in "".join(lines)


def leg(steps, e2e, archive, bound=None):
    return {"checkpoint_s": e2e * 0.5, "restore_s": e2e * 0.5, "end_to_end_s": e2e,
            "archive_bytes": archive, "steps_file": str(steps), "disk_bound_s": bound}


def test_upstream_legs_compared_bit_exact_and_against_upstream(tmp_path):
    lines = [f"{i} 0x1.0p+0 {i:016x}\n" for i in range(10)]
    for name, body in (("up", lines), ("agent", lines), ("store", lines[:4] + ["4 x y\n"])):
        (tmp_path / name).write_text("".join(body))
    row = {"gib": 4, "compress": "none", "cache_gib": 4, "legs": {
        "upstream": leg(tmp_path / "up", 20.0, 10 * GB, 12.0),
        "agent": leg(tmp_path / "agent", 10.0, 4.5 * GB, 5.0),
        "store": leg(tmp_path / "store", 8.0, 3 * GB, 4.0),
        "driver": {"leg": "driver", "error": "ContainerError: no"}}}
    upstream_path.compare_legs(row)
    legs, rv = row["legs"], row["ratios_vs_upstream"]
    assert legs["agent"]["bit_exact"] is True and legs["store"]["bit_exact"] is False
    assert set(rv) == {"agent", "store"}
    assert rv["agent"]["end_to_end_speedup"] == pytest.approx(2.0)
    assert rv["agent"]["archive_ratio"] == pytest.approx(0.45)
    assert rv["agent"]["speedup_disk_bound_allows"] == pytest.approx(4.0)
    text = upstream_path.table({"disk": {"write": 1.5, "read": 2.0}, "rows": [row]})
    assert "agent: archive 0.45 of upstream's (issue 20: <= 0.5: ok)" in text
    assert "store: archive 0.30" in text and "ContainerError" in text


def test_disk_probe_measures_and_leaves_nothing(tmp_path):
    d = yardsticks.disk_gbps(tmp_path, 1 / 16)
    assert d["bytes"] == 64 << 20 and d["write"] > 0 and d["read"] > 0
    assert list(tmp_path.iterdir()) == []


def test_stall_watch_sees_the_longest_time_the_steps_stood_still():
    t0 = time.monotonic()

    def step():        # one step every 20 ms, but none from 0.2 s to 0.5 s
        t = time.monotonic() - t0
        return int(t / 0.02) if t < 0.2 else 10 if t < 0.5 else 10 + int((t - 0.5) / 0.02)
    with yardsticks.StallWatch(step) as w:
        time.sleep(0.7)
    assert 0.25 <= w.longest_s <= 0.45 and w.samples > 20


def fake_free(monkeypatch, tmp_path, work_gb, containers_gb=1000):
    """The free space upstream_path sees, whatever this machine's disk holds: work_gb in the
    workdir (under tmp_path), containers_gb in podman's storage (a stand-in directory)."""
    import types
    containers = tmp_path / "containers"
    containers.mkdir(exist_ok=True)
    monkeypatch.setattr(upstream_path, "CONTAINERS", containers)

    def disk_usage(path):
        gb = containers_gb if Path(path).is_relative_to(containers) else work_gb
        return types.SimpleNamespace(free=gb * GB, total=2000 * GB, used=0)
    monkeypatch.setattr(upstream_path.shutil, "disk_usage", disk_usage)
    return containers


def test_upstream_leg_refused_where_the_disk_cannot_hold_its_images_and_archive(tmp_path,
                                                                                monkeypatch):
    """2 x (1.1 x GiB + 3 GB) in the workdir and in podman's storage: 16 GiB needs ~43.8 GB."""
    work = tmp_path / "work"
    work.mkdir()
    containers = fake_free(monkeypatch, tmp_path, work_gb=44)
    assert upstream_path.room(work, 16) == ""
    assert upstream_path.room(work, 0.5) == ""
    fake_free(monkeypatch, tmp_path, work_gb=43)
    assert upstream_path.room(work, 16) == f"needs ~43.8 GB free in {work}, 43.0 GB free"
    assert upstream_path.room(work, 0.5) == ""
    fake_free(monkeypatch, tmp_path, work_gb=1000, containers_gb=7)
    assert upstream_path.room(work, 0.5) == f"needs ~7.2 GB free in {containers}, 7.0 GB free"


def test_a_leg_that_failed_after_its_restore_is_left_out_of_the_comparison(tmp_path):
    (tmp_path / "up").write_text("".join(f"{i} a b\n" for i in range(10)))
    failed = {**leg(tmp_path / "nowhere", 9.0, 1 * GB), "error": "AssertionError: no step"}
    del failed["steps_file"]                # it never stepped on after the restore
    row = {"gib": 16, "compress": "none", "legs": {
        "upstream": leg(tmp_path / "up", 20.0, 10 * GB), "agent": failed}}
    upstream_path.compare_legs(row)
    assert row["legs"]["upstream"]["bit_exact"] is True
    assert row["ratios_vs_upstream"] == {}
    assert "AssertionError: no step" in upstream_path.table({"rows": [row]})


# -- agent_path.py's run, start to end, with the GPU and torpor's flows played by doubles -------
class FakeGpu:
    """What the doubles share: each program's NVML bytes and what its agent moves."""
    def __init__(self):
        self.nvml, self.moved, self.calls = {}, {}, []


class FakeProgram:
    """programs.Program's face over a `sleep` (a real PID, ended by a checkpoint as CRIU's
    dump ends it); its steps advance with time and are the same for every program."""
    gpu: FakeGpu

    def __init__(self, workdir, name, argv, *, env=None, agent=False):
        import subprocess
        self.name, self.agent, self.env = name, agent, env or {}
        self.steps = Path(workdir) / f"{name}.steps"
        self.proc = subprocess.Popen(["sleep", "600"])
        self.pid = self.proc.pid
        gib = float(argv[argv.index("--gib") + 1])
        jax = "jax_program" in " ".join(argv)
        prealloc = jax and self.env.get("XLA_PYTHON_CLIENT_PREALLOCATE") != "false"
        self.gpu.nvml[self.pid] = 106e9 if prealloc else gib * (1 << 30) + 1.2e9
        self.gpu.moved[self.pid] = 3e9 if jax else gib * (1 << 30)
        self.t0 = time.monotonic()

    def step(self):
        return int((time.monotonic() - self.t0) / 0.002)

    def wait_ready(self, timeout=0):
        pass

    def wait_step(self, above, timeout=0):
        while self.step() <= above:
            time.sleep(0.002)
        n = self.step()
        self.steps.write_text("".join(f"{i} 0x1.0p+0 {i:016x}\n" for i in range(n + 1)))
        return n

    def status(self):
        return {"pid": self.pid, "step": self.step(), "ready": True}

    def reap(self, timeout=0):
        self.proc.wait(timeout=10)

    def kill(self):
        self.proc.kill()
        self.proc.wait()


def test_agent_path_runs_every_operation_of_issue_20s_command(torpor_env, tmp_path,
                                                             monkeypatch, capsys):
    """The GPU host's command (--where fit --pause --driver-max-gib --no-driver-checkpoints
    --jax-gib, sizes 16 and 64) through agent_path.main with doubles for the GPU: the 16 GiB
    program checkpoints to the disk, the 64 GiB one (its data larger than the disk) to host
    memory, each after its leave-running pause; the driver only at 16 GiB and only for suspend
    and resume; JAX's preallocated arena sized by what its agent moves; every figure and bound
    in the JSON and the table; nothing left in either root."""
    import signal
    import sys
    import types
    gpu = FakeGpu()
    FakeProgram.gpu = gpu
    disk, shm = tmp_path / "disk", tmp_path / "shm"

    def discover():
        return types.SimpleNamespace(gpus=[types.SimpleNamespace(name="fake")],
                                     driver_version="0",
                                     memory_of=lambda pid: int(gpu.nvml.get(pid, 0)))

    def agent_rec(pid):
        return {str(pid): {"bytes": int(gpu.moved[pid]), "zero_bytes": 0}}

    def suspend(engine, pid):
        gpu.calls.append(("suspend", pid))
        return {"timings": {"lock": 0.001, "checkpoint": 0.3}, "agent": agent_rec(pid),
                "gpu_memory_released": int(gpu.nvml[pid])}

    def resume(engine, pid):
        gpu.calls.append(("resume", pid))
        return {"timings": {"lock": 0.001, "checkpoint": 0.3, "gpu-restore": 0.2,
                            "unlock": 0.01}, "agent": agent_rec(pid)}

    def checkpoint(engine, pid, images, leave_running=False):
        gpu.calls.append(("checkpoint-lr" if leave_running else "checkpoint", pid, images))
        (images / "torpor-gpu").mkdir(parents=True)
        (images / "torpor-gpu" / "data.bin").write_bytes(b"x" * 4096)
        (images / "pages-1.img").write_bytes(b"y" * 1024)
        if not leave_running:
            os.kill(pid, signal.SIGKILL)
        m = {"timings": {"lock": 0.001, "checkpoint": 0.3, "dump": 0.4}, "agent": agent_rec(pid)}
        if leave_running:
            m["pause"] = {"paused_s": 0.5, "staged": True}
        return m

    def restore(engine, images):
        gpu.calls.append(("restore", images))
        return {"timings": {"restore": 0.4}, "agent": {}}

    def disk_usage(path):
        free = 60e9 if Path(path).is_relative_to(disk) else 118e9    # a 64 GB disk
        return types.SimpleNamespace(free=free, total=2 * free, used=free)

    monkeypatch.setattr(agent_path.programs, "Program", FakeProgram)
    monkeypatch.setattr(agent_path.gpus, "discover", discover)
    monkeypatch.setattr(agent_path.procs, "mem_available", lambda: 130e9)
    monkeypatch.setattr(agent_path.shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(agent_path, "pinned_copy_gbps", lambda gib: {"d2h": 50.0, "h2d": 50.0})
    for name, fn in (("suspend", suspend), ("resume", resume), ("checkpoint", checkpoint),
                     ("restore", restore)):
        monkeypatch.setattr(agent_path.process, name, fn)
    real_find = agent_path.importlib.util.find_spec
    monkeypatch.setattr(agent_path.importlib.util, "find_spec",
                        lambda n, *a: object() if n == "jax" else real_find(n, *a))
    out = tmp_path / "agent_path.json"
    monkeypatch.setattr(sys, "argv", [
        "agent_path.py", "--sizes", "16", "64", "--shm-root", str(shm), "--disk-root", str(disk),
        "--where", "fit", "--pause", "--driver-max-gib", "16", "--no-driver-checkpoints",
        "--jax-gib", "2", "--cache-gib", "0", "--overhead-reps", "0",
        "--agent-dir", str(tmp_path / "agents"), "--out", str(out)])
    assert agent_path.main() == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["pinned_copy_gb_per_s"] == {"d2h": 50.0, "h2d": 50.0} and not doc["errors"]
    r16, r64 = doc["runs"]
    assert set(k for k in r16["agent"] if k.startswith(("pause_", "checkpoint_"))) == \
        {"pause_disk", "checkpoint_disk"}
    assert "checkpoint_wall_s" in r16["agent"]["checkpoint_disk"]
    assert set(r16["driver"]) >= {"suspend", "resume", "bit_exact"}
    assert not any(k.startswith("checkpoint_") for k in r16["driver"])
    assert r16["bounds"]["suspend"]["speedup"] is not None and r16["agent"]["bit_exact"]
    assert r16["bounds"]["pause_disk"]["target_s"] == pytest.approx(
        1.5 * 16 * (1 << 30) / 50e9 + 1)
    assert "needs" in r64["agent"]["checkpoint_disk"]["skipped"]       # 69 GB > the disk
    assert "checkpoint_wall_s" in r64["agent"]["checkpoint_shm"] and "pause_shm" in r64["agent"]
    assert r64["driver"] == {"skipped": "above --driver-max-gib 16"}
    assert "speedup" not in r64["bounds"]["suspend"]
    jax = doc["jax"]["agent"]
    assert jax["bit_exact"] and "checkpoint_wall_s" in jax["checkpoint_disk"]  # 3 GB moved
    assert doc["jax"]["bounds"]["suspend"]["moved_bytes"] == 3e9
    text = capsys.readouterr().out
    assert "pause_shm: paused 0.50 s" in text and "jax suspend" in text
    assert list(disk.iterdir()) == [] and list(shm.iterdir()) == []


# -- upstream_path.py's run, start to end, with podman and the GPU played by doubles ----------
class FakePodman:
    """Podman's face: a checkpoint writes an archive whose size stands for the GPU memory the
    leg keeps (upstream and the driver path: live + cached; the agent: live only)."""
    made: list = []

    def __init__(self, runtime, timeout=0):
        self.runtime, self.alive = runtime, set()
        FakePodman.made.append(self)

    def ensure_image(self):
        return "img"

    def rm(self, name):
        self.alive.discard(name)

    def inspect(self, name, fmt):
        return f"{name}-id"

    def pid(self, name):
        return os.getpid()

    def checkpoint(self, name, export, compress, timeout=0):
        c = FakeContainer.started[name]
        cached = c.extra[1] if c.extra else "0"
        keeps = c.gib + (float(cached) if c.annotations.get("org.torpor.agent") == "off"
                         or self.runtime == "runc" else 0)
        with open(export, "wb") as f:
            f.truncate(int(keeps * (1 << 20)))      # MiB standing for GiB
        if self.runtime == "runc":
            upstream_path.CALL_LOG.write_text("lock 1 0\ncheckpoint 1 0\n")

    def restore(self, import_, timeout=0):
        assert import_.exists()


class FakeContainer:
    started: dict = {}

    def __init__(self, podman, name, work, gib, seed=0, annotations=None, extra=()):
        self.name, self.gib, self.annotations, self.extra = name, gib, annotations or {}, extra
        self.steps = Path(work) / f"{name}.steps"
        self.n = 0
        FakeContainer.started[name] = self

    def start(self):
        pass

    def wait_ready(self, timeout=0):
        pass

    def status(self):
        return {"reserved": 1, "allocated": 1}

    def step(self):
        return self.n

    def wait_step(self, above, timeout=0):
        self.n = above + 1
        self.steps.write_text("".join(f"{i} 0x1.0p+0 {i:016x}\n" for i in range(self.n + 1)))
        return self.n


def doubles_for_upstream_path(tmp_path, monkeypatch):
    """upstream_path.main's podman, container, plugin and archive reader played by doubles."""
    import contextlib
    monkeypatch.setattr(upstream_path, "Podman", FakePodman)
    monkeypatch.setattr(upstream_path, "TorchContainer", FakeContainer)
    monkeypatch.setattr(upstream_path, "upstream_plugin",
                        lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(upstream_path, "CALL_LOG", tmp_path / "calls.log")
    monkeypatch.setattr(upstream_path.archive, "manifest_from_archive",
                        lambda p: {"agent": {"1": {}}, "sizes": {"gpu_memory": 1},
                                   "timings": {"dump": 0.1}})


def test_upstream_path_runs_the_16_gib_rows_and_the_cache_row(torpor_env, tmp_path,
                                                              monkeypatch, capsys):
    """`--sizes 16 --cache-gib 4` through upstream_path.main with doubles for podman and the
    container, on a disk (faked) with room for every leg: the disk is measured first, the
    16 GiB row has all four legs, the cache row upstream, agent and store, each leg with its
    disk bound; the cache row's archive ratio is what the legs kept; nothing stays in the
    workdir; exit 0."""
    import sys
    work = tmp_path / "work"
    doubles_for_upstream_path(tmp_path, monkeypatch)
    fake_free(monkeypatch, tmp_path, work_gb=44)        # 16 GiB's legs need ~43.8 GB
    out = tmp_path / "u.json"
    monkeypatch.setattr(sys, "argv", [
        "upstream_path.py", "--sizes", "16", "--cache-gib", "4", "--disk-probe-gib", "0.0625",
        "--workdir", str(work), "--out", str(out)])
    assert upstream_path.main() == 0, capsys.readouterr().out
    assert "incomplete" not in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["disk"]["write"] > 0 and doc["disk"]["read"] > 0
    big, cache = doc["rows"]
    assert list(big["legs"]) == ["upstream", "driver", "agent", "store"]
    assert (cache["gib"], cache["cache_gib"], list(cache["legs"])) == \
        (4, 4, ["upstream", "agent", "store"])
    for row in (big, cache):
        for v in row["legs"].values():
            assert v["bit_exact"] and v["disk_bound_s"] > 0 and v["over_disk_bound"] > 0, v
    assert big["legs"]["upstream"]["plugin_ran"] is True
    assert cache["ratios_vs_upstream"]["agent"]["archive_ratio"] == pytest.approx(0.5)
    assert cache["legs"]["store"]["store_cleanup"]["snapshots_removed"] == []
    assert "agent: archive 0.50 of upstream's (issue 20: <= 0.5: ok)" in doc["table"]
    assert [p.name for p in work.iterdir() if p.suffix == ".tar"] == []


def test_upstream_path_skips_the_legs_without_room_says_why_and_exits_1(torpor_env, tmp_path,
                                                                        monkeypatch, capsys):
    """The same run on a disk (faked) with 34 GB free, CI's: every leg of the 16 GiB row is
    skipped with what it needed and what was free, in the JSON and the table, none of them
    started; the cache row (4+4 GiB, ~25 GB) runs bit-exact; the exit status is 1 and the last
    line names the skipped legs (bench/README.md: a skipped leg is a comparison not made)."""
    import sys
    work = tmp_path / "work"
    doubles_for_upstream_path(tmp_path, monkeypatch)
    fake_free(monkeypatch, tmp_path, work_gb=34)
    FakeContainer.started = {}
    out = tmp_path / "u.json"
    monkeypatch.setattr(sys, "argv", [
        "upstream_path.py", "--sizes", "16", "--cache-gib", "4", "--disk-probe-gib", "0.0625",
        "--workdir", str(work), "--out", str(out)])
    assert upstream_path.main() == 1
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    big, cache = doc["rows"]
    why = f"needs ~43.8 GB free in {work}, 34.0 GB free"
    assert {leg: r.get("skipped") for leg, r in big["legs"].items()} == \
        {leg: why for leg in ("upstream", "driver", "agent", "store")}
    assert not any(n.startswith("ub-") and "-16-" in n for n in FakeContainer.started)
    assert "ratios_vs_upstream" not in big
    assert all(v["bit_exact"] for v in cache["legs"].values()) and len(cache["legs"]) == 3
    assert len([ln for ln in text.splitlines() if ln.startswith("{") and why in ln]) == 4
    assert len([ln for ln in doc["table"].splitlines()
                if ln.split()[:2] == ["16", "none"] and "needs ~43.8 GB free in" in ln]) == 4
    assert text.rstrip().splitlines()[-1] == (
        "incomplete (exit 1): skipped for room: 16 none upstream, 16 none driver, "
        "16 none agent, 16 none store; failed or not bit-exact: none")
