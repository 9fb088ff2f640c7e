"""Programs under the in-process agent (issue 4) on a real GPU: suspend/resume and
checkpoint/restore move their GPU memory through the agent, and they continue bit-exact.

Every scenario runs the program under the agent (`torpor run -- ...`) beside an uninterrupted
reference of the same seed and command line without the agent, and compares their steps files
line by line (compare_steps.py). Programs: PyTorch (default allocator and
expandable_segments:True; CUDA graphs; a cache as large as what it uses), a CUDA C
runtime-API program with streams and events (cuda_streams.cu, built with nvcc), CuPy. The
agent's own figures (what it moved, cache it released) are printed (pytest -s) and checked
where they say what the agent is for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.gpu import programs
from tests.gpu.compare_steps import compare
from tests.gpu.conftest import GPU_SKIP, Torpor, nvml_pids, wait_for
from tests.gpu.test_podman_gpu import _bit_exact as podman_bit_exact
from tests.gpu.test_podman_gpu import _started as podman_started
from tests.gpu.test_podman_gpu import containers, podman  # noqa: F401  (fixtures)


def _agent_reason() -> str | None:
    try:
        from torpor import agent
        agent.library()
    except Exception as e:
        return f"the agent library is not built ({e}): make -C agent, then copy it to " \
               "shim/torpor/_agent/ (tests/gpu/run-on-gpu-host.sh does)"
    return None


AGENT_SKIP = GPU_SKIP or _agent_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(AGENT_SKIP is not None, reason=AGENT_SKIP or "")]

GiB = 1 << 30
GIB = 2.0                                   # bulk memory of most programs
KILL_GIB = float(os.environ.get("TORPOR_TEST_AGENT_KILL_GIB", "16"))
PREPARE_TIMEOUT_S = 20                      # the agent resumes by itself after this
ALLOCATORS = {"default": None, "expandable": "expandable_segments:True"}


# -- fixtures --------------------------------------------------------------------------------
@pytest.fixture
def agent_dir():
    """A short private socket directory (a Unix socket path has at most 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="tpa-", dir="/tmp"))
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def torpor(tmp_path: Path, torpor_env: dict[str, str], agent_dir: Path, monkeypatch) -> Torpor:
    """The CLI, and the programs it runs, with the real driver and agent_dir for the sockets."""
    monkeypatch.setenv("TORPOR_AGENT_DIR", str(agent_dir))
    monkeypatch.delenv("TORPOR_LIBCUDA", raising=False)   # the agent forwards to the real one
    env = programs.with_torpor_path(dict(os.environ, **torpor_env))
    env.pop("TORPOR_LIBCUDA", None)
    env["TORPOR_AGENT_DIR"] = str(agent_dir)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)              # each test says which allocator
    return Torpor(env)


@pytest.fixture(scope="session")
def cuda_exe(tmp_path_factory) -> Path:
    try:
        return programs.build_cuda_streams(tmp_path_factory.mktemp("cuda-build"))
    except programs.NoCompiler as e:
        pytest.skip(str(e))
    except subprocess.CalledProcessError as e:
        pytest.fail(f"nvcc failed on {programs.CUDA_SOURCE}:\n{e.stdout}\n{e.stderr}")


@pytest.fixture
def progs(tmp_path: Path, torpor: Torpor):
    """start(kind, name, gib, agent=..., extra=..., env=..., cuda_exe=...) -> Program."""
    started: list[programs.Program] = []

    def start(kind: str, name: str, gib: float, *, agent: bool = False, extra=(),
              env: dict[str, str] | None = None, cuda_exe: Path | None = None,
              seed: int = 1234) -> programs.Program:
        argv = programs.command(kind, gib, seed=seed, extra=extra, cuda_exe=cuda_exe)
        p = programs.Program(tmp_path, name, argv, env={**torpor.env, **(env or {})},
                             agent=agent)
        started.append(p)
        return p
    yield start
    for p in started:
        p.kill()


# -- helpers ---------------------------------------------------------------------------------
def show(what: str, obj) -> None:
    print(f"\n{what}: {json.dumps(obj, indent=1, sort_keys=True, default=str)}", flush=True)


def agent_record(result: dict, pid: int) -> dict:
    """What the agent of pid reported, from a process.* result or a manifest: "agent" as
    {pid: {...}} (or a list of {"pid", ...}); {} when there is none."""
    for key in ("agent", "agents"):
        a = result.get(key)
        if isinstance(a, dict):
            rec = a.get(str(pid), a.get(pid))
            if isinstance(rec, dict):
                return rec
        elif isinstance(a, list):
            for rec in a:
                if isinstance(rec, dict) and rec.get("pid") == pid:
                    return rec
    return {}


def agent_status(prog: programs.Program, agent_dir: Path, timeout: float = 30.0) -> dict:
    from torpor.agent import AgentClient
    with AgentClient.for_pid(prog.pid, agent_dir, timeout=timeout) as a:
        return a.status()


def try_status(prog: programs.Program, agent_dir: Path) -> dict:
    """The agent's status, or {} while it cannot answer (busy moving memory, say)."""
    from torpor.errors import TorporError
    try:
        return agent_status(prog, agent_dir, timeout=5.0)
    except TorporError:
        return {}


def under_agent(prog: programs.Program, agent_dir: Path, min_bytes: float) -> dict:
    """The program's agent answers and serves at least min_bytes as movable memory."""
    sock = agent_dir / f"agent-{prog.pid}.sock"
    wait_for(sock.exists, 60, f"the agent's socket {sock}")
    st = agent_status(prog, agent_dir)
    show(f"agent status of {prog.name}", st)
    assert st.get("state") == "running" and st.get("gate") == "open", st
    assert st.get("movable_bytes", 0) >= min_bytes, \
        f"the agent serves {st.get('movable_bytes')} movable bytes, wanted >= {min_bytes:.0f}"
    return st


def moved_bytes(result: dict, pid: int, what: str) -> dict:
    rec = agent_record(result, pid)
    show(f"{what} result", result)
    assert rec, f"{what}: no agent figures for PID {pid}: the driver moved everything"
    return rec


def bit_exact(ref: programs.Program, prog: programs.Program, more: int = 10) -> None:
    """prog goes `more` steps on from where it is; the reference gets there too; every step
    both wrote agrees."""
    last = prog.step() + more
    prog.wait_step(last, timeout=300)
    ref.wait_step(last, timeout=300)
    n, mismatch = compare(str(ref.steps), str(prog.steps))
    assert mismatch is None, f"diverged at {mismatch}"
    assert n >= last, f"only {n} common steps"


def suspend_resume(torpor: Torpor, prog: programs.Program, gib: float) -> dict:
    """suspend: the GPU released, the agent moved the bulk, the program stopped; resume."""
    r = torpor.json("suspend", str(prog.pid), timeout=600)
    rec = moved_bytes(r, prog.pid, "suspend")
    assert rec.get("bytes", 0) >= gib * GiB, rec
    assert r["gpu_memory_released"] >= gib * GiB
    assert prog.pid not in nvml_pids()               # nothing of it left on the GPU
    time.sleep(0.5)                                 # a step past its GPU work may still write
    at = prog.step()
    time.sleep(1.0)
    assert prog.step() == at                        # held at the gate / by the driver lock
    back = torpor.json("resume", str(prog.pid), timeout=600)
    show("resume result", back)
    prog.wait_step(at + 10)
    return rec


def checkpoint_restore(torpor: Torpor, prog: programs.Program, images: Path, gib: float) -> dict:
    """checkpoint (CRIU, bare) with the GPU memory in torpor-gpu/, restore, 10 steps on."""
    m = torpor.json("checkpoint", str(prog.pid), "-D", str(images), timeout=600)["manifest"]
    rec = moved_bytes(m, prog.pid, "checkpoint manifest")
    assert rec.get("bytes", 0) >= gib * GiB, rec
    data = images / "torpor-gpu"
    assert data.is_dir() and sum(f.stat().st_size for f in data.rglob("*") if f.is_file()) \
        >= gib * GiB
    prog.reap()
    at = prog.step()
    r = torpor.json("restore", "-D", str(images), timeout=600)
    show("restore result", r)
    assert r["cuda_pids"] == [prog.pid]
    assert agent_record(r, prog.pid), "restore: the agent did not get the memory back"
    prog.wait_step(at + 10)
    return rec


def alloc_env(name: str) -> dict[str, str]:
    conf = ALLOCATORS[name]
    return {"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else {}



# -- zero memory (issue 20, item 2) -----------------------------------------------------------
ZERO_GIB = float(os.environ.get("TORPOR_TEST_ZERO_GIB", "8"))
JAX_ENV = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"}


def only_data_moved(rec: dict, data_max: float, zero_min: float, what: str) -> tuple[int, int]:
    """rec (an agent's --json figures) moved at most data_max bytes and found at least zero_min
    zero: the zeros never crossed PCIe."""
    moved, zero = int(rec.get("bytes", -1)), int(rec.get("zero_bytes", -1))
    print(f"\n{what}: moved {moved / GiB:.3f} GiB, zeros {zero / GiB:.3f} GiB, agent "
          f"{rec.get('seconds')} s", flush=True)
    assert 0 < moved <= data_max, f"{what}: moved {moved} bytes, wanted at most {data_max:.0f}"
    assert zero >= zero_min, f"{what}: {zero} zero bytes, wanted at least {zero_min:.0f}"
    return moved, zero


def zeros_round_trip(torpor: Torpor, prog: programs.Program, tmp_path: Path, data_max: float,
                     zero_min: float) -> None:
    """suspend/resume, then checkpoint/restore: each moves only the data (the --json figures;
    the checkpoint's data files hold the data alone: the zero parts are holes) and the
    resume/restore memsets the zeros back."""
    at = prog.step()
    r = torpor.json("suspend", str(prog.pid), timeout=600)
    moved, zero = only_data_moved(moved_bytes(r, prog.pid, "suspend"), data_max, zero_min,
                                  "suspend")
    back = torpor.json("resume", str(prog.pid), timeout=600)
    assert agent_record(back, prog.pid).get("zero_bytes", 0) >= zero_min, back
    at = prog.wait_step(at + 3)
    images = tmp_path / "ck"
    m = torpor.json("checkpoint", str(prog.pid), "-D", str(images), timeout=600)["manifest"]
    moved, zero = only_data_moved(moved_bytes(m, prog.pid, "checkpoint"), data_max, zero_min,
                                  "checkpoint")
    disk = sum(f.stat().st_blocks * 512 for f in (images / "torpor-gpu").rglob("*.bin"))
    assert disk <= moved + 256 * (1 << 20), f"the data files take {disk} bytes for {moved}"
    prog.reap()
    r = torpor.json("restore", "-D", str(images), timeout=600)
    rec = agent_record(r, prog.pid)
    show("restore result", r)
    assert rec.get("zero_bytes") == zero and rec.get("bytes") == moved, rec
    prog.wait_step(at + 3)


# -- PyTorch ---------------------------------------------------------------------------------
@pytest.mark.parametrize("allocator", sorted(ALLOCATORS))
def test_torch_suspend_resume_checkpoint_restore(torpor, progs, agent_dir, tmp_path, allocator):
    env = alloc_env(allocator)
    ref = progs("torch", "ref", GIB, env=env)
    prog = progs("torch", "prog", GIB, env=env, agent=True)
    prog.wait_ready()
    prog.wait_step(5)
    assert prog.status().get("alloc_conf", "") == env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    under_agent(prog, agent_dir, GIB * GiB)
    suspend_resume(torpor, prog, GIB)
    checkpoint_restore(torpor, prog, tmp_path / "ck", GIB)
    st = agent_status(prog, agent_dir)               # the restored program's agent answers
    assert st.get("state") == "running" and st.get("gate") == "open", st
    bit_exact(ref, prog)


def test_torch_cuda_graphs_checkpoint_restore(torpor, progs, agent_dir, tmp_path):
    ref = progs("torch", "ref", GIB, extra=["--graphs"])
    prog = progs("torch", "prog", GIB, extra=["--graphs"], agent=True)
    prog.wait_ready()
    prog.wait_step(10)                               # past the warm-up: replaying the graph
    under_agent(prog, agent_dir, GIB * GiB)
    checkpoint_restore(torpor, prog, tmp_path / "ck", GIB)
    bit_exact(ref, prog, more=20)


def test_a_damaged_gpu_data_file_fails_the_restore_as_damaged(torpor, progs, agent_dir,
                                                              tmp_path):
    """One byte of the agent's data file changed after the checkpoint: the agent's check (its
    GPU fingerprints) fails the restore in agent-resume with exit 9, the restored program is
    stopped, the checkpoint unchanged; the byte put back, the restore continues bit-exact."""
    ref = progs("torch", "ref", GIB)
    prog = progs("torch", "prog", GIB, agent=True)
    prog.wait_ready()
    prog.wait_step(5)
    under_agent(prog, agent_dir, GIB * GiB)
    images = tmp_path / "ck"
    torpor.json("checkpoint", str(prog.pid), "-D", str(images), timeout=600)
    prog.reap()
    victim = max(images.glob("torpor-gpu/**/gpu-memory-*.bin"), key=lambda f: f.stat().st_size)
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        at = f.tell()
        block = f.read(64 << 20)
        at += next(i for i, b in enumerate(block) if b)   # data, not a zero part's hole
        f.seek(at)
        good = f.read(1)
        f.seek(at)
        f.write(bytes([good[0] ^ 1]))
    r = torpor.run("restore", "-D", str(images), timeout=600)
    show("damaged restore", {"rc": r.returncode, "stderr": r.stderr[-2000:]})
    assert r.returncode == 9 and "damaged" in r.stderr and "unchanged" in r.stderr, r.stderr
    wait_for(lambda: not programs.alive(prog.pid), 30, "the restored program stopped")
    with open(victim, "r+b") as f:
        f.seek(at)
        f.write(good)
    step = prog.step()
    torpor.json("restore", "-D", str(images), timeout=600)
    prog.wait_step(step + 10)
    bit_exact(ref, prog)


@pytest.mark.parametrize("allocator", sorted(ALLOCATORS))
def test_prepare_releases_allocator_cache(torpor, progs, agent_dir, allocator):
    """A program whose PyTorch cache holds as much as it uses: the agent releases the cache
    instead of moving it, and the program continues bit-exact."""
    cache = 4.0
    env = alloc_env(allocator)
    extra = ["--cache-gib", f"{cache:g}"]
    ref = progs("torch", "ref", 1.0, extra=extra, env=env)
    prog = progs("torch", "prog", 1.0, extra=extra, env=env, agent=True)
    prog.wait_ready()
    prog.wait_step(5)
    before = prog.status()
    show("torch's figures before", {k: before.get(k) for k in ("reserved", "allocated",
                                                               "alloc_conf")})
    assert before["reserved"] - before["allocated"] >= (cache - 0.5) * GiB   # cached, unused
    st = under_agent(prog, agent_dir, (1.0 + cache - 0.5) * GiB)          # cache included
    r = torpor.json("suspend", str(prog.pid), timeout=600)
    rec = moved_bytes(r, prog.pid, "suspend")
    if "cache_released" in rec:
        assert rec["cache_released"] > 0, rec
    assert rec["bytes"] <= st["movable_bytes"] - (cache - 1.0) * GiB, \
        f"the agent moved {rec['bytes']} of {st['movable_bytes']} bytes: the cache went too"
    at = prog.step()
    torpor.json("resume", str(prog.pid), timeout=600)
    prog.wait_step(at + 5)
    after = prog.status()
    show("torch's figures after", {k: after.get(k) for k in ("reserved", "allocated")})
    bit_exact(ref, prog)


@pytest.mark.parametrize("after", ["recovery", "deadline"])
def test_sigkill_of_torpor_mid_agent_prepare(torpor, progs, agent_dir, tmp_path, after):
    """torpor killed while the agent moves 16 GiB out to a checkpoint's data files (on disk:
    seconds, a window to kill in; a suspend's copy into the program's memory is over in a
    fraction of one): the program gets its memory back, from torpor's recovery (the next
    command) or from the agent's own prepare deadline."""
    from torpor.agent import AgentClient, AgentError
    env = {"TORPOR_AGENT_PREPARE_TIMEOUT_S": str(PREPARE_TIMEOUT_S)}
    ref = progs("torch", "ref", KILL_GIB)
    prog = progs("torch", "prog", KILL_GIB, env=env, agent=True)
    prog.wait_ready(600)
    prog.wait_step(5)
    under_agent(prog, agent_dir, KILL_GIB * GiB)
    journal = tmp_path / "state" / "journal"
    t = torpor.start("checkpoint", str(prog.pid), "-D", str(tmp_path / "images"))

    def journaled_prepare() -> bool:
        if t.poll() is not None:
            raise AssertionError(f"torpor checkpoint ended before its agent-prepare: "
                                 f"{t.communicate()}")
        for f in journal.glob("*.json"):
            try:
                e = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if e.get("phase") == "agent-prepare" and e.get("agents"):
                return True
        return False
    wait_for(journaled_prepare, 120, "the journal's agent-prepare")

    def agent_busy() -> str:
        """Why the agent counts as mid-prepare ('' while it is not yet)."""
        try:
            with AgentClient.for_pid(prog.pid, agent_dir, timeout=0.2) as a:
                st = a.status()
        except AgentError:
            return "its control thread is busy (preparing)"
        if st.get("gate") == "closed" or st.get("state") != "running":
            return f"state {st.get('state')}, gate {st.get('gate')}"
        return ""
    why = wait_for(agent_busy, 60, "the agent to start preparing")
    t.kill()
    out, err = t.communicate()
    print(f"\nkilled torpor checkpoint: {why}\n{err[-2000:]}", flush=True)
    at = prog.step()
    st = agent_status(prog, agent_dir, timeout=120)      # after the prepare, if it was running
    show("agent status after the kill", st)
    if after == "recovery":
        ps = torpor.run("ps", timeout=600)
        print(ps.stderr)
        assert ps.returncode == 0, ps.stderr
        assert "recovered" in ps.stderr, ps.stderr
    else:
        assert st.get("state") != "detached", \
            f"the kill came after the detach (only recovery helps then): {st}"
        wait_for(lambda: try_status(prog, agent_dir).get("state") == "running",
                 PREPARE_TIMEOUT_S + 120, "the agent's prepare deadline")
    wait_for(lambda: try_status(prog, agent_dir).get("gate") == "open", 120, "an open gate")
    prog.wait_step(at + 10, timeout=300)
    ps = torpor.run("ps", timeout=600)                  # whatever the journal still holds
    assert ps.returncode == 0, ps.stderr
    st = agent_status(prog, agent_dir)
    assert st.get("state") == "running" and st.get("gate") == "open", st
    bit_exact(ref, prog)


PAUSE_GIB = float(os.environ.get("TORPOR_TEST_PAUSE_GIB", "8"))
PINNED_GBPS = 50.0                          # the H200 host's pinned copy rate, about


# the ways a --leave-running checkpoint keeps its pause short: the copy out and back (plain),
# the memory held on the GPU through the pause (held: no copy back), and held with the copy out
# left to torpor-copier beside the driver's checkpoint and the dump (drain: the defaults, no
# setting at all, since 2026-12-06); expandable: the defaults for PyTorch's expandable segments
# (its own cuMemCreate, POSIX descriptors asked for: one allocation every 20 MiB, 400 and more
# at 8 GiB, past the 200 one message carries: their descriptors travel in a bag since
# 2026-12-07, agent/src/fdbag.h)
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
PAUSE_WAYS = {"plain": ({"TORPOR_AGENT_VMM_EXPORT": "0"}, {"TORPOR_LEAVE_RUNNING_DRAIN": "0"}),
              "held": ({}, {"TORPOR_LEAVE_RUNNING_DRAIN": "0"}),
              "drain": ({}, {}),
              "expandable": (EXPANDABLE, {})}
DRAINED = ("drain", "expandable")


@pytest.mark.parametrize("way", list(PAUSE_WAYS))
def test_leave_running_pauses_for_the_copy_not_the_write(torpor, progs, agent_dir, tmp_path,
                                                         way):
    """A --leave-running checkpoint of a PyTorch program holding PAUSE_GIB (default 8) GiB: it
    is paused while its GPU memory goes to host memory and CRIU dumps, not while the data is
    written to disk (flows/writeout.py): the pause ends before the write-out does, the
    program's own steps stall no longer than the pause, and the checkpoint then restores (the
    left-running program killed first) and continues bit-exact. Issue 20's target, paused_s <=
    1.5 x (GPU bytes / ~50 GB/s) + 1 s, is checked last: short of it the test is an expected
    failure (xfail) until the mover reaches the copy limit (issue 20 item 4), not a pass.
    Each way of PAUSE_WAYS: held and drain must say they held (and drain that its copier
    filled the files), and restore bit-exact like the plain one."""
    program_env, torpor_env = PAUSE_WAYS[way]
    torpor.env.update(torpor_env)
    ref = progs("torch", "ref", PAUSE_GIB, env=EXPANDABLE if way == "expandable" else None)
    prog = progs("torch", "prog", PAUSE_GIB, agent=True, env=program_env)
    prog.wait_ready(600)
    prog.wait_step(5)
    under_agent(prog, agent_dir, PAUSE_GIB * GiB * 0.9)
    images = tmp_path / "ck"
    t = torpor.start("--json", "checkpoint", str(prog.pid), "-D", str(images),
                     "--leave-running")
    seen: list[tuple[float, int]] = []            # (when, step) as the program reports it
    while t.poll() is None:
        seen.append((time.monotonic(), prog.step()))
        time.sleep(0.01)
    out, err = t.communicate()
    print(err[-4000:], flush=True)
    assert t.returncode == 0, err
    r = json.loads(out)
    rec = moved_bytes(r["manifest"], prog.pid, "leave-running checkpoint")
    gpu_bytes = rec["bytes"]
    limit = 1.5 * gpu_bytes / (PINNED_GBPS * 1e9) + 1.0
    pause = r["manifest"].get("pause") or {}
    show("pause", {"way": way, "paused_s": r["paused_s"], "durable_s": r["durable_s"],
                   "limit_s": limit, "staged": r["staged"], "gpu_bytes": gpu_bytes,
                   "held": pause.get("held"), "drained": pause.get("drained"),
                   "criu": pause.get("criu"), "timings": r["manifest"]["timings"]})
    if way != "plain":   # why not: the agent's info line in the program's log
        assert pause.get("held"), (way, pause, prog.tail(6000))
    if way == "expandable":   # one allocation every 20 MiB: past one message's 200
        assert pause["held"] > 200, pause
    if way in DRAINED:
        assert (pause.get("drained") or {}).get("bytes", 0) >= PAUSE_GIB * GiB * 0.9, pause
    assert r["staged"] is True, err
    assert gpu_bytes >= PAUSE_GIB * GiB * 0.9, rec
    writeout = r["manifest"]["timings"].get("writeout", 0)
    assert writeout > 0 and r["paused_s"] < r["durable_s"], (r["paused_s"], r["durable_s"])
    # the program's side: its longest stall while torpor ran (a step's own time added)
    assert len(seen) > 10, "torpor ended before the program was watched"
    stall, since = 0.0, seen[0]
    for when, step in seen[1:]:
        if step != since[1]:
            stall, since = max(stall, when - since[0]), (when, step)
    step_s = 1.0 / max(prog.status().get("steps_per_s") or 1.0, 1e-3)
    print(f"longest stall of the program's steps: {stall:.2f} s (a step: {step_s:.3f} s)")
    assert stall <= r["paused_s"] + 2 * step_s + 0.5, (stall, r["paused_s"])
    prog.wait_step(prog.step() + 5)                   # running on, on the GPU
    assert torpor.json("inspect", str(images), "--verify")["verified"]
    if way != "plain":
        # periodic checkpoints: the memory taken back is imported handles, which the driver
        # does not export again; the agent's kept descriptors (marked: the driver's are all
        # one device node) hold it again, and the restore comes from this second one
        images = tmp_path / "ck2"
        again = torpor.json("checkpoint", str(prog.pid), "-D", str(images), "--leave-running",
                            timeout=600)
        pause2 = again["manifest"].get("pause") or {}
        show("second pause", {"paused_s": again["paused_s"], "held": pause2.get("held"),
                              "drained": pause2.get("drained")})
        assert pause2.get("held"), (way, pause2, prog.tail(6000))
        if way in DRAINED:
            assert (pause2.get("drained") or {}).get("bytes", 0) >= PAUSE_GIB * GiB * 0.9
        prog.wait_step(prog.step() + 5)
        assert torpor.json("inspect", str(images), "--verify")["verified"]
    prog.kill()
    at = prog.step()
    back = torpor.json("restore", "-D", str(images), timeout=600)
    show("restore result", back)
    assert agent_record(back, prog.pid), "restore: the agent did not get the memory back"
    prog.wait_step(at + 10)
    bit_exact(ref, prog)
    if r["paused_s"] > limit:
        # what of the pause no copy can shorten: the driver's checkpoint and restore, CRIU's
        # dump (the reference program runs on the same GPU meanwhile)
        t = r["manifest"]["timings"]
        floor = sum(t.get(k, 0) for k in ("checkpoint", "dump", "gpu-restore"))
        pytest.xfail(f"paused {r['paused_s']:.2f} s, issue 20's target {limit:.2f} s; the "
                     f"driver's checkpoint and restore and CRIU's dump took {floor:.2f} s of "
                     f"it, the agent's prepare and resume "
                     f"{t.get('agent-prepare', 0) + t.get('agent-resume', 0):.2f} s")


# -- CUDA C (runtime API, streams and events) ------------------------------------------------
def test_cuda_streams_suspend_resume_checkpoint_restore(torpor, progs, agent_dir, tmp_path,
                                                        cuda_exe):
    ref = progs("cuda", "ref", GIB, cuda_exe=cuda_exe)
    prog = progs("cuda", "prog", GIB, cuda_exe=cuda_exe, agent=True)
    prog.wait_ready()
    prog.wait_step(5)
    under_agent(prog, agent_dir, GIB * GiB)
    suspend_resume(torpor, prog, GIB)
    checkpoint_restore(torpor, prog, tmp_path / "ck", GIB)
    bit_exact(ref, prog)


# -- CuPy ------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="CuPy is not installed")
def test_cupy_suspend_resume(torpor, progs, agent_dir):
    ref = progs("cupy", "ref", GIB)
    prog = progs("cupy", "prog", GIB, agent=True)
    prog.wait_ready()
    prog.wait_step(5)
    under_agent(prog, agent_dir, GIB * GiB)
    suspend_resume(torpor, prog, GIB)
    bit_exact(ref, prog)


# -- podman ----------------------------------------------------------------------------------
def test_podman_agent_export_import_continues_bit_exact(podman, containers, tmp_path):  # noqa: F811
    from torpor import agent, archive, config
    from torpor.oci import AGENT_ANNOTATION
    ref, tc = podman_started(containers, "agent1", GIB, last=59, at_step=10,
                             annotations={AGENT_ANNOTATION: "on"})
    cid = podman.inspect(tc.name, "{{.Id}}")
    # <id>@<key of podman's runtime root> (runtime/lifecycle.py agent_name)
    dirs = agent.container_dirs(config.load().run_dir)
    wait_for(lambda: list(dirs.glob(f"{cid}@*/agent-*.sock")), 60,
             f"an agent socket in {dirs}/{cid}@*")
    with agent.AgentClient(next(dirs.glob(f"{cid}@*/agent-*.sock"))) as a:
        st = a.status()
    show("container agent status", st)
    assert st.get("movable_bytes", 0) >= GIB * GiB, st
    arch = tmp_path / "agent1.tar"
    podman.checkpoint(tc.name, export=arch, compress="none")
    m = archive.manifest_from_archive(arch)
    show("archive's torpor.json agent", m.get("agent"))
    assert any(r.get("bytes", 0) >= GIB * GiB for r in (m.get("agent") or {}).values()), \
        "the container's agent moved no GPU memory"
    at = tc.step()
    podman.rm(tc.name)
    podman.restore(import_=arch)
    tc.wait_step(at + 10)
    podman_bit_exact(ref, tc, 59)


# -- zero memory (issue 20, item 2) ----------------------------------------------------------
def test_torch_zero_memory_never_crosses_pcie(torpor, progs, agent_dir, tmp_path):
    """1 GiB of random bulk and ZERO_GIB of torch.zeros: suspend/resume and checkpoint/restore
    move about the 1 GiB, continue bit-exact, the zeros' windows checked every step."""
    extra = ["--zeros-gib", f"{ZERO_GIB:g}"]
    ref = progs("torch", "ref", 1.0, extra=extra)
    prog = progs("torch", "prog", 1.0, extra=extra, agent=True)
    prog.wait_ready()
    prog.wait_step(5)
    under_agent(prog, agent_dir, (1 + ZERO_GIB) * GiB)
    zeros_round_trip(torpor, prog, tmp_path, 1.5 * GiB, (ZERO_GIB - 0.1) * GiB)
    # every 256 MiB window of bulk and zeros is checked once in (1 + ZERO_GIB) * 4 steps
    bit_exact(ref, prog, more=int((1 + ZERO_GIB) * 4) + 4)


def test_jax_default_preallocation_moves_its_data_not_its_arena(torpor, progs, agent_dir,
                                                                tmp_path):
    """JAX with its default preallocation (75 % of the GPU, one arena mostly never written):
    the agent moves its state, not its arena (issue 20: it moved all of it before). The
    reference runs without preallocation beside it (two arenas would not fit)."""
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed")
    ref = progs("jax", "ref", 1.0, env={**JAX_ENV, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    ref.wait_ready()
    prog = progs("jax", "prog", 1.0, env=JAX_ENV, agent=True)
    prog.wait_ready()
    prog.wait_step(5)
    st = under_agent(prog, agent_dir, 16 * GiB)          # the arena is movable
    arena = st["movable_bytes"]
    # what its arena ever held: the state (2 GiB), and what making it and a step's
    # temporaries wrote before the allocator reused it; the rest of ~100 GiB stays zeros
    zeros_round_trip(torpor, prog, tmp_path, 12 * GiB, arena - 12 * GiB)
    bit_exact(ref, prog)
