"""`torpor checkpoint --leave-running` with the deferred copy (config leave_running_drain;
copier.py, agent/PROTOCOL.md "The deferred copy"): the real C agent in the fake CUDA program
holds its memory and leaves the copy to torpor-copier, which fills the data files while the
driver checkpoints the program and CRIU dumps it. The checkpoint's files are the ones a plain
checkpoint writes; a torpor killed while the copier runs leaves it to finish, and the next
torpor gives the program its memory back from those files; a copier that fails fails the
checkpoint, never the program."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from tests.integration.conftest import needs_criu, wait_for
from tests.integration.test_agent_cli import _digest, _held_by, _under_the_agent, ticks_on

pytestmark = needs_criu
HELD = {"TORPOR_AGENT_VMM_EXPORT": "1", "TORPOR_AGENT_LOG_LEVEL": "20"}


def _data(images: Path, pid: int) -> list[bytes]:
    return [f.read_bytes() for f in sorted((images / "torpor-gpu" / str(pid)).iterdir())]


@pytest.fixture
def drained(torpor, tmp_path):
    torpor.env["TORPOR_SUSPEND_DIR"] = str(tmp_path / "shm")
    torpor.env["TORPOR_LEAVE_RUNNING_DRAIN"] = "1"
    return torpor


def test_the_copier_fills_the_files_beside_the_dump(drained, gpu, tmp_path, reaper):
    torpor = drained
    plog = tmp_path / "program.log"
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper, HELD)
    before = _digest(proc.pid, status)
    images = tmp_path / "ck"
    r = torpor.run("checkpoint", str(proc.pid), "-D", str(images), "--leave-running")
    assert r.returncode == 0, r.stderr
    assert "copying it into the data files meanwhile" in r.stdout + r.stderr
    assert "64.00 MiB of it copied into the checkpoint beside the dump" in r.stdout, r.stdout
    text = plog.read_text(errors="replace")
    assert "left to the copier" in text and "nothing copied" in text, text[-3000:]
    m = json.loads((images / "torpor.json").read_text())
    assert m["agent"][str(proc.pid)]["deferred"] is True
    drain = m["pause"]["drained"]
    assert drain["programs"] == 1 and drain["bytes"] == 64 << 20, m["pause"]
    # the copier's own account: its setup (imports, buffers) and its copy
    assert 0 <= drain["setup_seconds"] and 0 <= drain["copy_seconds"] <= drain["seconds"], drain
    assert torpor.json("inspect", str(images), "--verify")["verified"]
    ticks_on(proc.pid, status, agents)
    assert _digest(proc.pid, status) == before

    # the same program checkpointed the plain way: the same data files, byte for byte
    torpor.env["TORPOR_LEAVE_RUNNING_DRAIN"] = "0"
    plain = tmp_path / "plain"
    r = torpor.run("checkpoint", str(proc.pid), "-D", str(plain), "--leave-running")
    assert r.returncode == 0, r.stderr
    assert "deferred" not in json.loads((plain / "torpor.json").read_text())["agent"][
        str(proc.pid)]
    assert _data(images, proc.pid) == _data(plain, proc.pid)


def _killed_while_its_copier_runs(torpor, gpu, tmp_path: Path, reaper):
    """A program under the agent whose leave-running checkpoint's torpor was SIGKILLed in the
    driver's checkpoint while its copier still copies (held up in its pinned buffers), the
    faults cleared: (proc, status, agents, its digest before)."""
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper, HELD)
    before = _digest(proc.pid, status)
    gpu.delay("checkpoint", 20000, pid=proc.pid)
    (gpu.state_dir / "delay" / "cuMemHostAlloc").write_text("3000\n")   # the copier's alone
    t = torpor.start("checkpoint", str(proc.pid), "-D", str(tmp_path / "ck"), "--leave-running")
    try:
        wait_for(lambda: (gpu.state(proc.pid) or {}).get("state") == 1 and _held_by(t.pid)
                 and time.sleep(0.3) is None, 30, "torpor in the driver's checkpoint, holding")
    finally:
        t.kill()
        t.communicate()
    assert t.returncode == -9
    gpu.clear_faults()
    (gpu.state_dir / "delay" / "cuMemHostAlloc").unlink(missing_ok=True)
    return proc, status, agents, before


def test_a_torpor_killed_while_its_copier_runs_is_recovered_from_the_files(
        drained, gpu, tmp_path, reaper):
    """torpor SIGKILLed in the driver's checkpoint while its copier is still copying (held up
    in its pinned buffers): the copier, in a session of its own, finishes the files, and the
    next torpor (`torpor ps`) waits for it, then gives the program its memory back from them;
    every byte as it was, nothing left staged nor journalled."""
    from tests.fakes.fakegpu import RUNNING
    torpor = drained
    proc, status, agents, before = _killed_while_its_copier_runs(torpor, gpu, tmp_path, reaper)
    start = time.monotonic()
    ps = torpor.run("ps")
    assert ps.returncode == 0, ps.stderr
    assert "recovered" in ps.stderr and str(proc.pid) in ps.stderr, ps.stderr
    # it waited for the copier, still copying when torpor died, then read its files
    assert "agent-drain done" in ps.stderr, ps.stderr
    assert gpu.state(proc.pid)["state"] == RUNNING
    ticks_on(proc.pid, status, agents)
    assert _digest(proc.pid, status) == before
    text = (tmp_path / "program.log").read_text(errors="replace")
    assert "left to the copier" in text and "nothing copied" not in text, text[-3000:]
    assert list((tmp_path / "shm").iterdir()) == []
    assert list((tmp_path / "state" / "journal").glob("*.json")) == []
    assert time.monotonic() - start < 60


def test_a_checkpoint_whose_recovery_waited_for_a_copier_waits_for_its_own(
        drained, gpu, tmp_path, reaper):
    """torpor SIGKILLed while its copier copies; the next command is a checkpoint of the same
    program: its recovery waits for the old copier and gives the memory back, and then its own
    checkpoint waits for its own copier too (the old copier's reply, heard in the same engine,
    once answered for the new copy: the program was resumed unfilled, the checkpoint failed)."""
    torpor = drained
    proc, status, agents, before = _killed_while_its_copier_runs(torpor, gpu, tmp_path, reaper)
    images = tmp_path / "ck2"
    r = torpor.run("checkpoint", str(proc.pid), "-D", str(images), "--leave-running")
    assert r.returncode == 0, r.stderr
    assert "recovered" in r.stderr and "agent-drain done" in r.stderr, r.stderr
    assert r.stderr.count("agent-drain done") == 2, r.stderr   # the old copier's, then its own
    assert json.loads((images / "torpor.json").read_text())["agent"][str(proc.pid)]["deferred"]
    assert torpor.run("inspect", str(images), "--verify").returncode == 0
    ticks_on(proc.pid, status, agents)
    assert _digest(proc.pid, status) == before
    plain = tmp_path / "plain"
    torpor.env["TORPOR_LEAVE_RUNNING_DRAIN"] = "0"
    assert torpor.run("checkpoint", str(proc.pid), "-D", str(plain),
                      "--leave-running").returncode == 0
    assert _data(images, proc.pid) == _data(plain, proc.pid)
    assert list((tmp_path / "shm").iterdir()) == []
    assert list((tmp_path / "state" / "journal").glob("*.json")) == []


def test_a_copier_that_fails_fails_the_checkpoint_not_the_program(drained, gpu, tmp_path,
                                                                   reaper):
    torpor = drained
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper, HELD)
    before = _digest(proc.pid, status)
    images = tmp_path / "ck"
    (gpu.state_dir / "fail" / "cuMemHostAlloc").write_text("2\n")   # only the copier's
    try:
        r = torpor.run("checkpoint", str(proc.pid), "-D", str(images), "--leave-running")
    finally:
        (gpu.state_dir / "fail" / "cuMemHostAlloc").unlink()
    assert r.returncode == 8, r.stderr
    assert "the copy of the GPU memory into the data files failed" in r.stderr, r.stderr
    assert "pinned host memory" in r.stderr and "runs on" in r.stderr, r.stderr
    assert (images / "torpor-damaged.txt").exists()
    assert not (images / "torpor.json").exists()
    ticks_on(proc.pid, status, agents)
    assert _digest(proc.pid, status) == before
    assert list((tmp_path / "shm").iterdir()) == []
    assert list((tmp_path / "state" / "journal").glob("*.json")) == []


def test_a_program_that_dies_before_its_resume_keeps_its_checkpoint(drained, gpu, tmp_path,
                                                                    reaper):
    """The program is killed after the driver unlocked it, while its resume waits for the
    copier (held up in its pinned buffers): the resume then finds it gone. The copier's reply,
    heard once, still counts: the checkpoint, all that is left of the program, is sealed whole,
    not abandoned as a copy that "ended and said nothing"."""
    torpor = drained
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper, HELD)
    images = tmp_path / "ck"
    (gpu.state_dir / "delay" / "cuMemHostAlloc").write_text("3000\n")   # the copier's alone
    t = torpor.start("checkpoint", str(proc.pid), "-D", str(images), "--leave-running")
    try:
        wait_for(lambda: any(c.call == "unlock" for c in gpu.calls()), 30,
                 "the driver's unlock, the copier still copying")
        proc.kill()
        proc.wait()
        out, err = t.communicate(timeout=120)
    finally:
        if t.poll() is None:
            t.kill()
            t.communicate()
    gpu.clear_faults()
    assert "agent-drain" in err and "agent-resume" not in err.split("agent-drain")[1].split(
        "\n")[0], err
    assert (images / "torpor.json").exists(), err
    assert not (images / "torpor-damaged.txt").exists(), err
    m = json.loads((images / "torpor.json").read_text())
    assert m["agent"][str(proc.pid)]["deferred"] is True
    assert m["pause"]["drained"]["bytes"] == 64 << 20, m["pause"]
    assert torpor.json("inspect", str(images), "--verify")["verified"]


def test_a_copier_without_room_for_its_context_leaves_the_copy_to_the_agent(
        drained, gpu, tmp_path, reaper):
    """No room on the GPU for the copier's context (or a GPU in exclusive-process mode): the
    copier is not ready before the pause, the operator is told, and the agent copies before
    the dump as without a copier. The checkpoint is whole; the program runs on intact."""
    torpor = drained
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper, HELD)
    before = _digest(proc.pid, status)
    images = tmp_path / "ck"
    (gpu.state_dir / "fail" / "cuDevicePrimaryCtxRetain").write_text("2\n")
    try:
        r = torpor.run("checkpoint", str(proc.pid), "-D", str(images), "--leave-running")
    finally:
        (gpu.state_dir / "fail" / "cuDevicePrimaryCtxRetain").unlink()
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert (f"PID {proc.pid}: torpor-copier is not ready (a context on GPU 0: CUresult 2): "
            "its GPU memory is copied before the dump") in out, out
    assert "copying it into the data files meanwhile" not in out, out
    m = json.loads((images / "torpor.json").read_text())
    assert "deferred" not in m["agent"][str(proc.pid)] and "drained" not in m["pause"], m
    assert torpor.json("inspect", str(images), "--verify")["verified"]
    ticks_on(proc.pid, status, agents)
    assert _digest(proc.pid, status) == before
    assert list((tmp_path / "state" / "journal").glob("*.json")) == []


def test_no_copier_is_started_on_a_gpu_short_of_room_for_its_context(
        drained, gpu, tmp_path, reaper):
    """A GPU with less free memory than a context may take (copier.CONTEXT_ROOM): the
    copier's context, made while the program runs, could leave the program's next
    allocation without room. None is started (the fake driver would have made one: only
    NVML's free memory says no); the operator is told, the agent copies before the dump,
    and the program runs on intact."""
    torpor = drained
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper, HELD)
    before = _digest(proc.pid, status)
    (uuid, name, _), *others = gpu.gpus
    gpu.set_gpus([(uuid, name, (64 << 20) + (512 << 20)), *others])   # 512 MiB free or less
    images = tmp_path / "ck"
    r = torpor.run("checkpoint", str(proc.pid), "-D", str(images), "--leave-running")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert f"warning: PID {proc.pid}: no torpor-copier: {uuid} has " in out, out
    assert "MiB free, less than the 1024 MiB a copier's context may take" in out, out
    assert "copying it into the data files meanwhile" not in out, out
    assert "torpor-copier is not ready" not in out, out   # none started, none failed
    m = json.loads((images / "torpor.json").read_text())
    assert "deferred" not in m["agent"][str(proc.pid)] and "drained" not in m["pause"], m
    assert torpor.json("inspect", str(images), "--verify")["verified"]
    ticks_on(proc.pid, status, agents)
    assert _digest(proc.pid, status) == before


def test_a_drained_checkpoint_restores(drained, gpu, tmp_path, reaper):
    """The program is gone; its checkpoint, whose copy a copier made, brings it back. CRIU
    dumped the agent while its save was deferred, so the restore tells it the files are
    filled (a sealed checkpoint's are): every byte as it was."""
    torpor = drained
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper, HELD)
    before = _digest(proc.pid, status)
    images = tmp_path / "ck"
    r = torpor.run("checkpoint", str(proc.pid), "-D", str(images), "--leave-running")
    assert r.returncode == 0, r.stderr
    assert json.loads((images / "torpor.json").read_text())["pause"]["drained"]["bytes"] > 0
    proc.kill()
    proc.wait(timeout=10)
    _as_dumped(images, tmp_path / "program.log")   # it ran on, logging, after the dump
    out = torpor.json("restore", "-D", str(images))
    assert out["agent"][str(proc.pid)]["bytes"] == 64 << 20, out
    ticks_on(proc.pid, status, agents)
    assert _digest(proc.pid, status) == before


def _as_dumped(images: Path, log: Path) -> None:
    """log cut back to the size CRIU saw at the dump (it reopens open files in place)."""
    import pycriu
    with open(images / "files.img", "rb") as f:
        entries = pycriu.images.load(f)["entries"]
    size = next(e["reg"]["size"] for e in entries
                if "reg" in e and e["reg"]["name"].endswith(log.name))
    os.truncate(log, int(size))


def _digest_pieces(pid: int, status: Path) -> str:
    """sha256 of every 2 MiB allocation of a --pieces program, in order, read from its memory."""
    h = hashlib.sha256()
    with open(f"/proc/{pid}/mem", "rb") as mem:
        for ptr in json.loads(status.read_text())["ptrs"]:
            mem.seek(ptr)
            h.update(mem.read(2 << 20))
    return h.hexdigest()


def test_more_than_200_allocations_are_held_and_drained_and_restore(drained, gpu, tmp_path,
                                                                     reaper):
    """PyTorch's expandable segments are one allocation every 20 MiB: past 200 of them their
    held descriptors travel in one bag (agent/src/fdbag.h) from the agent to torpor, to the
    copier and back. Through the CLI: held, drained by the copier, twice in a row (the kept
    descriptors), and the checkpoint restores every byte."""
    torpor = drained
    n = 220
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper, HELD, pieces=n)
    before = _digest_pieces(proc.pid, status)
    for k in range(2):
        images = tmp_path / f"ck{k}"
        r = torpor.run("checkpoint", str(proc.pid), "-D", str(images), "--leave-running")
        assert r.returncode == 0, r.stderr
        pause = json.loads((images / "torpor.json").read_text())["pause"]
        assert pause["held"] == n and pause["drained"]["bytes"] > 0, pause
        ticks_on(proc.pid, status, agents)
        assert _digest_pieces(proc.pid, status) == before
    proc.kill()
    proc.wait(timeout=10)
    _as_dumped(images, tmp_path / "program.log")
    torpor.json("restore", "-D", str(images))
    ticks_on(proc.pid, status, agents)
    assert _digest_pieces(proc.pid, status) == before


def test_more_than_200_allocations_are_held_without_a_copier_too(torpor, gpu, tmp_path,
                                                                 reaper):
    """leave_running_drain = false (and a checkpoint into the store, or a container with
    fingerprints): no copier, but the memory is held through the pause all the same, past 200
    allocations too (torpor asks its agent for a bag of them wherever the agent says it can)."""
    torpor.env["TORPOR_SUSPEND_DIR"] = str(tmp_path / "shm")
    torpor.env["TORPOR_LEAVE_RUNNING_DRAIN"] = "0"
    n = 220
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper, HELD, pieces=n)
    before = _digest_pieces(proc.pid, status)
    images = tmp_path / "ck"
    r = torpor.run("checkpoint", str(proc.pid), "-D", str(images), "--leave-running")
    assert r.returncode == 0, r.stderr
    pause = json.loads((images / "torpor.json").read_text())["pause"]
    assert pause["held"] == n and not pause.get("drained"), pause
    ticks_on(proc.pid, status, agents)
    assert _digest_pieces(proc.pid, status) == before
