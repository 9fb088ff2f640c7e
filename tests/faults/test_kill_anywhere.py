"""Fault injection (issue 18's suite): torpor SIGKILLed at a random moment of checkpoint,
restore, suspend and resume, of a CPU program, of a fake-GPU program and of a fake-GPU program
under the real agent (`torpor run`: libtorpor-agent.so moves its memory) (real CRIU, the fake
driver). After each kill the next torpor command recovers, and then the program must run
correctly (ticking, RUNNING on the GPU, or suspended on purpose and resumable), or be gone with
its checkpoint sealed and restorable; nothing frozen, no journal entry left.

The moment is uniform over the operation's own duration, measured once per case on this
machine; TORPOR_FAULT_RUNS sets the kills per case (default 10), TORPOR_FAULT_SEED the seed
(printed with every failure)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fakes.fakegpu import CHECKPOINTED, RUNNING
from tests.integration.conftest import alive, needs_criu, wait_for

pytestmark = needs_criu
RUNS = int(os.environ.get("TORPOR_FAULT_RUNS", "10"))
SEED = int(os.environ.get("TORPOR_FAULT_SEED", str(random.randrange(1 << 30))))

CPU_PROGRAM = """
import os, sys, time
buf = bytearray(os.urandom(1 << 20)) * 64          # 64 MiB: dumps and restores take a while
n = 0
while True:
    n += 1
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write('{"tick": %d}' % n)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(0.02)
"""


class CpuProgram:
    """A CPU program whose status file counts its ticks, FakeProgram-alike."""

    def __init__(self, status: Path):
        import json
        self._json = json
        self.status_path = status
        self.proc = subprocess.Popen([sys.executable, "-c", CPU_PROGRAM, str(status)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        wait_for(lambda: self.tick() > 0, timeout=60, what="program start")

    def tick(self) -> int:
        try:
            return int(self._json.loads(self.status_path.read_text()).get("tick", -1))
        except (OSError, ValueError):
            return -1

    def wait_tick(self, above: int, timeout: float = 10.0) -> int:
        return wait_for(lambda: (t := self.tick()) > above and t, timeout, f"tick > {above}")


class AgentProgram(CpuProgram):
    """A fake CUDA program started by `torpor run`, the C agent preloaded: 64 MiB of written
    GPU memory the agent moves (zeros would not move)."""

    def __init__(self, torpor, gpu, status: Path, agents: Path):
        from tests.fakes.fakegpu import PROGRAM
        import json
        self._json = json
        self.status_path, self.agents = status, agents
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torpor.cli.main", "run", "--", sys.executable, str(PROGRAM),
             "--mem", str(64 << 20), "--status", str(status), "--lib", gpu.libcuda,
             "--fill", f"0:{64 << 20}"],
            env=torpor.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid
        wait_for(lambda: self.tick() > 0 and (agents / f"agent-{self.pid}.sock").exists(),
                 timeout=60, what="the program under the agent")

    def agent_state(self) -> tuple[str, str]:
        from torpor.agent import AgentClient
        with AgentClient.for_pid(self.pid, self.agents) as a:
            st = a.status()
        return st.get("state"), st.get("gate")


def _journal(tmp: Path) -> list[Path]:
    return sorted((tmp / "state" / "journal").glob("*.json"))


def _kill_tree(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    wait_for(lambda: not alive(pid), timeout=10, what=f"{pid} gone")


class Case:
    """One operation of one kind of program, ready to be run (and killed) again and again."""

    def __init__(self, kind: str, op: str, torpor, gpu, tmp: Path):
        self.kind, self.op, self.torpor, self.gpu, self.tmp = kind, op, torpor, gpu, tmp
        self.n = 0

    def program(self):
        self.n += 1
        if self.kind == "cpu":
            return CpuProgram(self.tmp / f"cpu{self.n}.json")
        if self.kind == "agent":
            agents = self.tmp / "agents"
            self.torpor.env["TORPOR_AGENT_DIR"] = str(agents)
            return AgentProgram(self.torpor, self.gpu, self.tmp / f"agent{self.n}.json", agents)
        return self.gpu.spawn(mem=64 << 20)

    def prepare(self, prog, images: Path) -> None:
        """What must be true before the operation: a checkpoint to restore, a suspended
        program to resume."""
        if self.op == "restore":
            self.torpor.run("checkpoint", str(prog.pid), "-D", str(images), check=True)
            prog.proc.wait(timeout=10)
        elif self.op == "resume":
            self.torpor.run("suspend", str(prog.pid), check=True)

    def argv(self, prog, images: Path) -> list[str]:
        return {"checkpoint": ["checkpoint", str(prog.pid), "-D", str(images)],
                "checkpoint-left-running": ["checkpoint", str(prog.pid), "-D", str(images),
                                            "--leave-running"],
                "restore": ["restore", "-D", str(images)],
                "suspend": ["suspend", str(prog.pid)],
                "resume": ["resume", str(prog.pid)]}[self.op]

    def gpu_state(self, pid: int) -> int | None:
        if self.kind == "cpu":
            return RUNNING
        st = self.gpu.state(pid)
        return None if st is None else st["state"]

    def check(self, prog, images: Path, where: str) -> str:
        """After recovery: the program runs correctly, or its checkpoint restores. Returns
        which of the two it was."""
        ps = self.torpor.run("ps")
        assert ps.returncode == 0, f"{where}: torpor ps after the kill: {ps.stderr}"
        assert _journal(self.tmp) == [], f"{where}: journal entries left: {ps.stderr}"
        if alive(prog.pid):
            state = self.gpu_state(prog.pid)
            if state == CHECKPOINTED and self.op in ("suspend", "resume"):
                r = self.torpor.run("resume", str(prog.pid))    # suspended on purpose: resumable
                assert r.returncode == 0, f"{where}: resume after the kill: {r.stderr}"
                state = self.gpu_state(prog.pid)
            assert state == RUNNING, f"{where}: left in GPU state {state}; {ps.stderr}"
            if self.kind == "agent":     # its memory back on the GPU, its gate open
                st = prog.agent_state()
                assert st == ("running", "open"), f"{where}: agent left {st}; {ps.stderr}"
            t = prog.tick()
            try:
                prog.wait_tick(t + 3, timeout=10)
            except (TimeoutError, AssertionError):
                pytest.fail(f"{where}: the program is alive but frozen; {ps.stderr}")
            return "running"
        assert self.op in ("checkpoint", "restore"), f"{where}: the program died"
        if prog.proc.poll() is None:     # our child, ended by the dump: reap it for the restore
            prog.proc.wait(timeout=10)
        insp = self.torpor.run("inspect", str(images), "--verify")
        assert insp.returncode == 0, f"{where}: program gone, checkpoint not whole: " \
                                     f"{insp.stderr}; recovery said: {ps.stderr}"
        r = self.torpor.run("restore", "-D", str(images))
        assert r.returncode == 0, f"{where}: checkpoint not restorable: {r.stderr}"
        t = prog.tick()
        prog.wait_tick(t + 3, timeout=10)
        if self.kind == "agent":
            st = prog.agent_state()
            assert st == ("running", "open"), f"{where}: restored agent {st}"
        return "restorable"


CASES = [("cpu", "checkpoint"), ("cpu", "checkpoint-left-running"), ("cpu", "restore"),
         ("gpu", "checkpoint"), ("gpu", "checkpoint-left-running"), ("gpu", "restore"),
         ("gpu", "suspend"), ("gpu", "resume"),
         ("agent", "checkpoint"), ("agent", "checkpoint-left-running"), ("agent", "restore"),
         ("agent", "suspend"), ("agent", "resume")]


@pytest.mark.parametrize("kind,op", CASES, ids=[f"{k}-{o}" for k, o in CASES])
def test_sigkill_of_torpor_at_a_random_moment(kind, op, torpor, gpu, tmp_path):
    rng = random.Random(f"{SEED}-{kind}-{op}")
    case = Case(kind, op, torpor, gpu, tmp_path)
    # the operation's own duration, once, unkilled
    prog = case.program()
    images = tmp_path / "ck-measure"
    case.prepare(prog, images)
    t0 = time.monotonic()
    r = torpor.run(*case.argv(prog, images))
    duration = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    _kill_tree(prog.pid)
    outcomes = []
    for i in range(RUNS):
        prog = case.program()
        images = tmp_path / f"ck{i}"
        case.prepare(prog, images)
        delay = rng.uniform(0, duration)
        where = f"{kind} {op} run {i}, killed at {delay:.3f} s of {duration:.2f} s " \
                f"(TORPOR_FAULT_SEED={SEED})"
        t = torpor.start(*case.argv(prog, images))
        time.sleep(delay)
        t.send_signal(signal.SIGKILL)
        t.wait()
        outcomes.append(case.check(prog, images, where))
        _kill_tree(prog.pid)
        shutil.rmtree(images, ignore_errors=True)
    print(f"{kind} {op}: {RUNS} kills over {duration:.2f} s, seed {SEED}: "
          f"{outcomes.count('running')} running, {outcomes.count('restorable')} restorable")


def test_a_resume_killed_before_it_names_its_agents_gives_the_memory_back(torpor, gpu, tmp_path):
    """A resume of a suspended program under the agent, SIGKILLed right after its journal entry
    began (the entry names no agents yet: a torpor stand-in begins it and dies, as a kill at
    that moment leaves it). The next command's recovery must have the agent take its memory
    back from the suspend's data (the suspend record names it) before that data goes, not
    leave the program with its GPU state RUNNING, its agent detached and its gate closed:
    frozen, its data deleted (seen once in the random kills)."""
    case = Case("agent", "resume", torpor, gpu, tmp_path)
    prog = case.program()
    try:
        torpor.run("suspend", str(prog.pid), check=True)
        dies = subprocess.run(
            [sys.executable, "-c",
             "import os, sys\n"
             "from torpor import config\n"
             "from torpor.journal import Journal\n"
             "Journal(config.load()).begin('resume', [int(sys.argv[1])])\n"
             "os.kill(os.getpid(), 9)", str(prog.pid)],
            env=torpor.env, capture_output=True, text=True, timeout=60)
        assert dies.returncode == -9, dies.stderr
        assert len(_journal(tmp_path)) == 1
        assert case.check(prog, tmp_path / "unused", "resume killed as it began") == "running"
    finally:
        _kill_tree(prog.pid)
