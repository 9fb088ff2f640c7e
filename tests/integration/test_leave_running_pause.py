"""Short pauses (issue 20, item 3): a `--leave-running` checkpoint of a program under the agent
stages its GPU data in host memory (suspend_dir) and writes it into the checkpoint directory
once the program runs again (flows/writeout.py). Real CRIU, the fake driver, the Python fake of
the agent (tests/fakes/fake_agent.py), whose program waits at the agent's gate as a real one
does and logs a timestamp every loop: its longest gap is its pause, measured from its side.

The write-out is slowed with config writeout_rate_mbps (a documented setting: it keeps the
write-out from taking all of a disk a training job also reads from)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import alive, needs_criu, wait_for
from torpor.agent import AgentClient

pytestmark = needs_criu
ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "fakes" / "fake_agent.py"
MIB = 1 << 20
DATA = 24 * MIB                      # the fake program's "GPU memory"


class Program:
    def __init__(self, gpu, tmp_path: Path, name: str = "p"):
        self.agents = tmp_path / "agents"
        self.agents.mkdir(mode=0o700, exist_ok=True)
        self.ticks = tmp_path / f"{name}.ticks"
        log = open(tmp_path / f"{name}.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(PROGRAM), str(self.agents), str(tmp_path / f"{name}.events"),
             "--bytes", str(DATA), "--lib", gpu.libcuda, "--ticks", str(self.ticks)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            env={**os.environ, **gpu.env(), "PYTHONPATH": os.pathsep.join(sys.path)})
        log.close()
        self.pid = self.proc.pid
        self.sock = self.agents / f"agent-{self.pid}.sock"
        wait_for(lambda: self.sock.exists() and gpu.state(self.pid) and self.ticks.exists(),
                 15, "the program")

    def times(self) -> list[float]:
        return [float(x) for x in self.ticks.read_text().split()]

    def longest_gap(self, since: float, until: float) -> float:
        t = [x for x in self.times() if since <= x <= until]
        return max(b - a for a, b in zip(t, t[1:]))

    def ticking(self) -> bool:
        n = len(self.times())
        try:
            wait_for(lambda: len(self.times()) > n + 3, 10, "ticks")
        except (AssertionError, TimeoutError):
            return False
        return True

    def status(self) -> dict:
        with AgentClient(self.sock) as a:
            return a.status()


@pytest.fixture
def env(torpor, tmp_path):
    torpor.env["TORPOR_AGENT_DIR"] = str(tmp_path / "agents")
    torpor.env["TORPOR_SUSPEND_DIR"] = str(tmp_path / "shm")
    torpor.env["TORPOR_SUSPEND_TMPFS"] = "false"
    return torpor


def _rate(env, tmp_path: Path, mbps: float) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f"writeout_rate_mbps = {mbps}\n")
    env.env["TORPOR_CONFIG"] = str(config)


def _private(root: Path) -> None:
    for dirpath, dirs, files in os.walk(root):
        assert os.stat(dirpath).st_mode & 0o777 == 0o700, dirpath
        for f in files:
            assert os.stat(os.path.join(dirpath, f)).st_mode & 0o777 == 0o600, f


def _staged_left(tmp_path: Path) -> list[str]:
    shm = tmp_path / "shm"
    return [str(p) for p in shm.rglob("*")] if shm.exists() else []


def test_the_pause_is_shorter_than_the_write(env, gpu, tmp_path, reaper):
    """24 MiB written out at 4 MB/s (6.3 s): the program, paused for the copy to host memory
    and CRIU's dump only, ticks on while it is written; the checkpoint then restores with
    every byte."""
    prog = Program(gpu, tmp_path)
    reaper.append(prog.pid)
    _rate(env, tmp_path, 4)
    images = tmp_path / "ck"
    begun = time.time()
    r = env.run("--json", "checkpoint", str(prog.pid), "-D", str(images), "--leave-running")
    ended = time.time()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    write_s = DATA / 4e6
    assert out["staged"] is True
    assert out["durable_s"] - out["paused_s"] >= 0.9 * write_s, out
    assert out["paused_s"] < write_s / 2, out
    pause = dict(out["manifest"]["pause"])
    criu_stats = pause.pop("criu")
    assert pause == {"paused_s": out["paused_s"], "staged": True, "held": 0}
    assert out["held"] == 0      # a program without TORPOR_AGENT_VMM_EXPORT: nothing held
    # CRIU's own account of its part of the pause (its stats-dump): within the pause, and the
    # program's memory written
    assert set(criu_stats) == {"frozen_s", "memdump_s", "memwrite_s", "pages_written"}
    assert 0 < criu_stats["memwrite_s"] <= criu_stats["memdump_s"] <= criu_stats["frozen_s"] \
        < out["paused_s"], criu_stats
    assert criu_stats["pages_written"] > 0 and out["criu_frozen_s"] == criu_stats["frozen_s"]
    assert out["manifest"]["timings"]["writeout"] >= 0.9 * write_s
    assert f"the program runs again, paused {out['paused_s']:.2f} s; its GPU data is " \
        "written out while it runs" in r.stderr
    assert r.stderr.index("the program runs again") < r.stderr.index("writeout:")
    # the program's own view: its longest stop is the reported pause, not the write
    gap = prog.longest_gap(begun, ended)
    assert gap <= out["paused_s"] + 0.5, (gap, out["paused_s"])
    assert gap < write_s / 2
    assert len([t for t in prog.times() if begun + out["paused_s"] + 1 < t < ended]) > 20
    assert alive(prog.pid) and prog.status()["intact"] is True and prog.ticking()
    # the data is in the directory, private, and nothing is left in host memory
    data = images / "torpor-gpu" / str(prog.pid)
    assert sum(f.stat().st_size for f in data.iterdir()) >= DATA
    _private(images / "torpor-gpu")
    assert not (images / ".torpor-writing").exists()
    assert _staged_left(tmp_path) == []
    assert env.json("inspect", str(images), "--verify")["verified"]
    # ... and it restores, bit-exact (the agent checks every chunk's sum)
    prog.proc.kill()
    prog.proc.wait(timeout=10)
    r = env.run("restore", "-D", str(images))
    assert r.returncode == 0, r.stderr
    assert prog.status()["intact"] is True and prog.ticking()


def test_without_room_in_host_memory_it_writes_while_paused(env, gpu, tmp_path, reaper):
    """suspend_dir on a 2 MiB tmpfs cannot stage 24 MiB: one line says so, and the
    checkpoint is written while the program waits, as before."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(shm)],
                   check=True)
    try:
        prog = Program(gpu, tmp_path)
        reaper.append(prog.pid)
        r = env.run("--json", "checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"),
                    "--leave-running")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["staged"] is False and out["manifest"]["pause"]["staged"] is False
        assert "staging the GPU data in host memory needs 24.00 MiB" in r.stderr
        assert "writeout" not in out["manifest"]["timings"]
        assert prog.status()["intact"] is True and prog.ticking()
        assert env.json("inspect", str(tmp_path / "ck"), "--verify")["verified"]
    finally:
        subprocess.run(["umount", "-l", str(shm)])


def _criu_size(env, gpu, tmp_path: Path, reaper) -> int:
    """What CRIU's dump of such a program takes (a checkpoint of another one)."""
    other = Program(gpu, tmp_path, "measure")
    reaper.append(other.pid)
    env.run("checkpoint", str(other.pid), "-D", str(tmp_path / "m"), "--leave-running",
            check=True)
    other.proc.kill()
    total = sum(f.stat().st_size for f in (tmp_path / "m").rglob("*") if f.is_file())
    gpu_data = sum(f.stat().st_size for f in (tmp_path / "m" / "torpor-gpu").rglob("*"))
    return total - gpu_data


def test_a_full_disk_after_the_pause(env, gpu, tmp_path, reaper):
    """-D on a tmpfs with room for CRIU's dump but not the GPU data: the write-out fails
    after the program was resumed. It runs on with every byte, torpor says so (exit 8), the
    directory is marked damaged and refused by inspect and restore (exit 9), and nothing is
    left staged in host memory."""
    small = tmp_path / "small"
    small.mkdir()
    size = _criu_size(env, gpu, tmp_path, reaper) + 4 * MIB
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(small)],
                   check=True)
    try:
        prog = Program(gpu, tmp_path)
        reaper.append(prog.pid)
        images = small / "ck"
        r = env.run("checkpoint", str(prog.pid), "-D", str(images), "--leave-running")
        assert r.returncode == 8, r.stderr
        assert "writeout failed: No space left on device; the program runs on" in r.stderr
        assert alive(prog.pid) and prog.status()["intact"] is True and prog.ticking()
        assert gpu.state(prog.pid)["state"] == 0
        assert sorted(p.name for p in images.iterdir()) == ["dump.log", "torpor-damaged.txt"]
        assert _staged_left(tmp_path) == []
        i = env.run("inspect", str(images))
        assert i.returncode == 9 and "damaged" in i.stderr and "incomplete" in i.stderr, i.stderr
        prog.proc.kill()
        prog.proc.wait(timeout=10)
        r = env.run("restore", "-D", str(images))
        assert r.returncode == 9 and "damaged" in r.stderr, r.stderr
    finally:
        subprocess.run(["umount", "-l", str(small)])


def test_torpor_killed_while_writing_out(env, gpu, tmp_path, reaper):
    """torpor SIGKILLed in the write-out: the program runs on with every byte, nothing of its
    data stays in host memory (the staged files were unlinked once open), the directory is no
    checkpoint (no torpor.json), and the next torpor marks it damaged: never sealed."""
    prog = Program(gpu, tmp_path)
    reaper.append(prog.pid)
    _rate(env, tmp_path, 1)
    images = tmp_path / "ck"
    t = env.start("checkpoint", str(prog.pid), "-D", str(images), "--leave-running")
    try:
        wait_for(lambda: (images / "torpor-gpu" / str(prog.pid)).exists(), 60, "the write-out")
        time.sleep(1)
        assert t.poll() is None, t.communicate()
        os.kill(t.pid, signal.SIGKILL)
        t.wait(timeout=10)
    finally:
        if t.poll() is None:
            t.kill()
            t.wait()
    assert alive(prog.pid) and prog.status()["intact"] is True and prog.ticking()
    assert _staged_left(tmp_path) == []
    assert (images / ".torpor-writing").exists() and not (images / "torpor.json").exists()
    i = env.run("inspect", str(images))
    assert i.returncode == 3, i.stderr             # not a checkpoint; inspect recovers nothing
    r = env.run("ps")                              # the next command's recovery
    assert r.returncode == 0, r.stderr
    assert "marked the checkpoint" in r.stderr and "damaged" in r.stderr, r.stderr
    assert sorted(p.name for p in images.iterdir()) == ["dump.log", "torpor-damaged.txt"]
    assert not list((tmp_path / "state" / "journal").glob("*.json"))
    i = env.run("inspect", str(images))
    assert i.returncode == 9 and "incomplete" in i.stderr, i.stderr
    assert prog.status()["intact"] is True and prog.ticking()


def test_into_the_image_store(env, gpu, tmp_path, reaper):
    """--store with --leave-running: the agent's fingerprint index is staged and written out
    with the data, the pack takes the directory once it is whole, and it restores from the
    store with every byte."""
    prog = Program(gpu, tmp_path)
    reaper.append(prog.pid)
    env.env["TORPOR_STORE_DIR"] = str(tmp_path / "store")
    images = tmp_path / "ck"
    out = env.json("checkpoint", str(prog.pid), "-D", str(images), "--leave-running",
                   "--store", "one")
    assert out["staged"] is True and out["stored"]["name"] == "one"
    assert out["durable_s"] >= out["paused_s"] > 0
    assert out["manifest"]["agent"][str(prog.pid)]["fingerprints"]["parts"] == 0
    assert f"torpor-gpu/{prog.pid}/gpu-fingerprints.txt" in out["manifest"]["files"]
    assert _staged_left(tmp_path) == []
    assert prog.status()["intact"] is True and prog.ticking()
    prog.proc.kill()
    prog.proc.wait(timeout=10)
    r = env.run("restore", "-D", str(images))
    assert r.returncode == 0, r.stderr
    assert prog.status()["intact"] is True and prog.ticking()
