"""Fault injection for containers (issue 18's suite): torpord, or torpor-runtime, SIGKILLed at
a random moment of a podman checkpoint and of a podman restore of a fake-GPU container (real
podman, runc, CRIU; the fake driver, its calls slowed down so that the kills land inside them).

The OCI runtime is this tree's torpor-runtime (the one beside the test's Python, behind a
wrapper that gives it torpor's environment and notes its PID), not the installed one.

After each kill the next torpor action (torpord started again, `torpor ps`, the next podman
command) must leave the container running correctly (its program counts on, RUNNING on the
fake GPU, its processes and cgroup not frozen), or its checkpoint restorable (restored here,
and it counts on from where it was); no journal entry, no open operation, no PID lock held.

The moment is uniform over torpor-runtime's own life in that command, measured once per case
on this machine; TORPOR_FAULT_RUNS sets the kills per case (default 5), TORPOR_FAULT_SEED the
seed (printed with every failure)."""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integration.containers import Podman, _engine_env
from tests.fakes.fakegpu import RUNNING, FakeGpu
from tests.integration.conftest import alive, needs_criu, podman_image, wait_for  # noqa: F401
from tests.integration.test_containers_gpu import Workload, fake_nodes
from tests.integration.torpord import (  # noqa: F401  (fixtures)
    Daemon, base, gpu)

pytestmark = [needs_criu, pytest.mark.criu]
RUNS = int(os.environ.get("TORPOR_FAULT_RUNS", "5"))
SEED = int(os.environ.get("TORPOR_FAULT_SEED", str(random.randrange(1 << 30))))
RUNTIME = Path(sys.executable).parent / "torpor-runtime"   # this tree's, in the test's venv
SLOW_MS = 150   # each driver call torpord makes: a kill can land inside one
MIB = 1 << 20


class Env:
    """One case's world: the fake GPU, torpord, the runtime wrapper and podman."""

    def __init__(self, base: Path, gpu: FakeGpu):
        if not os.access(RUNTIME, os.X_OK):
            pytest.skip(f"no torpor-runtime beside {sys.executable}")
        if shutil.which("podman") is None:
            pytest.skip("needs podman")
        self.base, self.gpu = base, gpu
        self.daemon = Daemon(base, gpu).start()
        self.pids = base / "runtime-pids"
        self.wrapper = base / "torpor-runtime-test"
        env = {k: v for k, v in self.daemon.env.items()
               if k.startswith(("TORPOR_", "FAKE_CUDA")) or k == "LD_LIBRARY_PATH"}
        lines = ["#!/bin/sh"] + [f"export {k}='{v}'" for k, v in env.items()]
        lines += [f'echo "$$ $*" >> {self.pids}', f'exec {RUNTIME} "$@"']
        self.wrapper.write_text("\n".join(lines) + "\n")
        self.wrapper.chmod(0o700)
        self.podman = Podman(str(self.wrapper), timeout=120)
        self.nodes = fake_nodes(base)

    # -- the container ---------------------------------------------------------------------------
    def start(self, name: str, scope: str) -> Workload:
        w = Workload(self.gpu, scope, mem=64 * MIB)
        self.podman.run(name, w.argv, mounts=w.mounts,
                        env={**w.env, "NVIDIA_VISIBLE_DEVICES": self.gpu.uuid(0)},
                        devices=[f"{self.nodes[0]}:/dev/nvidia0",
                                 f"{self.nodes[255]}:/dev/nvidiactl"])
        w.wait_ticking()
        return w

    def command(self, op: str, name: str, archive: Path) -> list[str]:
        if op == "checkpoint":
            return [*self.podman.base, "container", "checkpoint", name]
        return [*self.podman.base, "container", "restore", "--import", str(archive)]

    def runtime_pid(self, op: str, after: int) -> int | None:
        """The PID of the torpor-runtime <op> the wrapper started after line `after`."""
        try:
            lines = self.pids.read_text().splitlines()[after:]
        except FileNotFoundError:
            return None
        for line in lines:
            pid, _, args = line.partition(" ")
            if f" {op} " in f" {args} " and "--help" not in args:
                return int(pid)
        return None

    def lines(self) -> int:
        try:
            return len(self.pids.read_text().splitlines())
        except FileNotFoundError:
            return 0

    # -- torpor's state --------------------------------------------------------------------------
    def torpor(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "torpor.cli.main", *args],
                              env=self.daemon.env, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)

    def journal(self) -> list[str]:
        return sorted(p.name for p in (self.base / "state" / "journal").glob("*.json"))

    def held_locks(self) -> list[str]:
        held = []
        for p in sorted((self.base / "state" / "locks").glob("*.lock")):
            fd = os.open(p, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(p.name)
            finally:
                os.close(fd)
        return held

    def torpords(self) -> list[int]:
        """torpord processes on this case's state directory (one the runtime started, too)."""
        want = f"TORPOR_STATE_DIR={self.base / 'state'}".encode()
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if b"torpor.sidecar.daemon" in (d / "cmdline").read_bytes() and \
                        want in (d / "environ").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                continue
        return out

    def restart(self) -> None:
        """torpord again, unless a torpor-runtime started one meanwhile."""
        if self.torpords():
            return
        try:
            self.daemon.start()
        except AssertionError:   # lost the race to a torpor-runtime starting one
            if not self.torpords():
                raise

    def close(self) -> None:
        self.daemon.stop()
        for pid in self.torpords():   # started by a torpor-runtime while ours was dead
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


@pytest.fixture
def env(base, gpu, podman_image):  # noqa: F811
    e = Env(base, gpu)
    yield e
    e.close()


def _freezer(pid: int) -> Path | None:
    """The file that says whether pid's cgroup is frozen (v2 cgroup.freeze, v1 freezer.state)."""
    try:
        cgroups = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in cgroups:
        _, controllers, path = line.split(":", 2)
        f = Path("/sys/fs/cgroup", path.lstrip("/"), "cgroup.freeze") if controllers == "" \
            else Path("/sys/fs/cgroup/freezer", path.lstrip("/"), "freezer.state") \
            if "freezer" in controllers.split(",") else None
        if f is not None and f.exists():
            return f
    return None


def frozen(pid: int) -> str:
    """Why pid counts as frozen (stopped, or its cgroup frozen), or ''."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""
    if state in ("T", "t"):
        return f"process state {state}"
    f = _freezer(pid)
    said = f.read_text().strip() if f else ""
    return f"{f}: {said}" if said not in ("", "0", "THAWED") else ""


def _snapshot(env: Env) -> str:
    """What a hang leaves to look at: the processes of podman's and torpor's side, where each
    waits, and the end of torpord's log."""
    for pid in env.torpords():   # each writes its threads' stacks into its log
        os.kill(pid, signal.SIGUSR2)
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,stat,wchan:24,etimes,args", "--forest"],
                        capture_output=True, text=True).stdout.splitlines()
    keep = [ps[0]] + [line for line in ps[1:]
                      if any(w in line for w in ("torpor", "runc", "criu", "conmon", "podman"))]
    logs = []
    for path in (env.base / "torpord.log", env.base / "state" / "torpord.log"):
        try:   # the test's torpord's, and one a torpor-runtime started
            logs += [f"{path}:", *path.read_text(errors="replace").splitlines()[-150:]]
        except OSError:
            pass
    return "\n".join(["processes:", *keep, *logs, "journal:", *env.journal()])


def _assert_counting(env: Env, w: Workload, name: str, floor: int, where: str) -> None:
    """The container's program runs: not frozen, RUNNING on the fake GPU, counting past floor."""
    pid = env.podman.pid(name)
    assert pid > 0 and not frozen(pid), f"{where}: container PID {pid}: {frozen(pid)}"
    try:
        w.wait_ticking(floor, timeout=20)
        w.wait_ticking(w.tick() + 2, timeout=20)
    except AssertionError:
        pytest.fail(f"{where}: the container runs but its program does not count "
                    f"({w.doc()}; GPU entry {w.entry()}; {frozen(pid)})")
    assert w.entry().get("state") == RUNNING, f"{where}: GPU entry {w.entry()}"


def _assert_clean(env: Env, where: str) -> str:
    """The next torpor command: `torpor ps` recovers and answers; then nothing left behind."""
    ps = env.torpor("ps")
    assert ps.returncode == 0, f"{where}: torpor ps: {ps.stderr}"
    # torpord ends an operation whose caller died by itself (a call in flight may open one yet)
    try:
        wait_for(lambda: not env.daemon.client().list().operations and not env.journal(), 30,
                 "torpord's open operations and the journal to empty")
    except AssertionError:
        pytest.fail(f"{where}: left open: {env.daemon.client().list().operations}; journal "
                    f"entries {env.journal()}; {ps.stderr}")
    # an operation drops its PID locks just after its journal entry (journal.Operation.close:
    # the other order would show recovery an entry whose owner looks dead): a moment later
    try:
        wait_for(lambda: env.held_locks() == [], 10, "the PID locks to be released")
    except AssertionError:
        pytest.fail(f"{where}: PID locks held: {env.held_locks()}")
    return ps.stderr


class Case:
    """One operation with one victim, run (and killed) again and again on one container: a
    checkpoint's goes on running (or is restored) after each kill, a restore's checkpoint is
    exported once and imported each time."""

    def __init__(self, env: Env, victim: str, op: str, name: str):
        self.env, self.victim, self.op, self.name = env, victim, op, name
        self.archive = env.base / "ck.tar"
        self.w = env.start(name, "cf")
        if any(Path(p).exists() for p in ("/sys/fs/cgroup/freezer",
                                          "/sys/fs/cgroup/cgroup.controllers")):
            assert _freezer(env.podman.pid(name)), "the container's freezer state cannot be read"
        self.floor = -1   # a restore's program must count beyond its tick at the checkpoint
        if op == "restore":
            env.podman.checkpoint(name, export=self.archive, compress="none")
            self.floor = self.w.tick()
            self.remove()

    def tick_floor(self) -> int:
        return self.floor if self.op == "restore" else self.w.tick()

    def measure(self) -> float:
        """torpor-runtime's own life in one unkilled operation."""
        p, _, seen = self.launch()
        _, err = p.communicate(timeout=180)
        duration = time.monotonic() - seen
        assert p.returncode == 0, err
        self.after(self.tick_floor(), "unkilled")
        return duration

    def after(self, floor: int, where: str) -> None:
        """Ready for the next run: a checkpointed container restored, a restored one removed."""
        if self.op == "checkpoint":
            if self.env.podman.state(self.name) != "running":
                self.env.podman.restore(self.name)
            _assert_counting(self.env, self.w, self.name, floor, where)
        else:
            _assert_counting(self.env, self.w, self.name, floor, where)
            self.remove()

    def remove(self) -> None:
        """The restored container gone, and what its program wrote past the checkpoint."""
        self.env.podman.rm(self.name)
        self.w.status.unlink(missing_ok=True)

    def launch(self) -> tuple[subprocess.Popen, int, float]:
        """The podman command, and the torpor-runtime it started (its PID, seen when)."""
        before = self.env.lines()
        p = subprocess.Popen(self.env.command(self.op, self.name, self.archive),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=_engine_env(), stdin=subprocess.DEVNULL)
        pid = wait_for(lambda: self.env.runtime_pid(self.op, before) or p.poll() is not None,
                       60, f"torpor-runtime {self.op}")
        assert pid is not True, f"podman {self.op} ended without torpor-runtime: " \
                                f"{p.communicate()}"
        return p, pid, time.monotonic()

    def kill(self, runtime_pid: int) -> None:
        if self.victim == "torpord":
            victims = self.env.torpords()   # ours, or one a torpor-runtime started
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not any(alive(p) for p in victims), 10, "torpord gone")
            self.env.daemon.proc.poll()
        else:
            try:
                os.kill(runtime_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def check(self, p: subprocess.Popen, floor: int, where: str) -> str:
        """After the kill: the next action recovers; the container runs, or its checkpoint
        restores. Returns which of the two."""
        env = self.env
        if self.victim == "torpord":
            env.restart()          # the next torpor action: torpord again (its recovery)
        first = env.torpor("ps")   # and the next torpor command (its recovery)
        assert first.returncode == 0, f"{where}: torpor ps after the kill: {first.stderr}"
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            seen = _snapshot(env)
            p.kill()
            _, err = p.communicate()
            pytest.fail(f"{where}: podman {self.op} hung after the kill and a torpor command "
                        f"(which said: {first.stderr.strip()}): {err}\n{seen}")
        said = f"podman exited {p.returncode}: {err.strip()[-600:]}; torpor ps said: " \
               f"{first.stderr.strip()}"
        recovered = _assert_clean(env, where)
        state = env.podman.state(self.name) if self._exists() else "absent"
        print(f"{where}: container {state}; {said}".replace("\n", " ")[:400])
        if state == "running":
            self.after(floor, f"{where} ({said})")
            return "running"
        # not running: its checkpoint must restore; one that torpord's death did not stop is
        # reported as made (podman exports it, and no operator restarts it afresh)
        assert self.victim != "torpord" or self.op != "checkpoint" or p.returncode == 0, \
            f"{where}: the container was checkpointed, but podman was told it failed: {said}"
        if self.op == "checkpoint":
            r = env.podman.restore(self.name, check=False)
        else:
            self.remove()
            r = env.podman.restore(import_=self.archive, check=False)
        assert r.returncode == 0, f"{where}: the container is {state} and its checkpoint " \
                                  f"does not restore: {r.stderr.strip()[-800:]}; {said}; " \
                                  f"recovery said: {recovered}"
        self.after(floor, f"{where}, restored again ({said})")
        return "restorable"

    def _exists(self) -> bool:
        return self.env.podman._p("container", "exists", self.name,
                                  check=False).returncode == 0


CASES = [("torpord", "checkpoint"), ("torpord", "restore"),
         ("torpor-runtime", "checkpoint"), ("torpor-runtime", "restore")]


@pytest.mark.parametrize("victim,op", CASES, ids=[f"{v}-{o}" for v, o in CASES])
def test_sigkill_during_a_container_operation(victim, op, env, gpu):
    rng = random.Random(f"{SEED}-{victim}-{op}")
    name = f"tcf{os.getpid()}-{victim[-7:]}-{op}"
    for call in ("lock", "checkpoint", "restore", "unlock"):
        gpu.delay(call, SLOW_MS)
    try:
        case = Case(env, victim, op, name)
        duration = case.measure()
        outcomes = []
        for i in range(RUNS):
            delay = rng.uniform(0, duration)
            where = f"{victim} killed at {delay:.3f} s of {duration:.2f} s into podman {op}, " \
                    f"run {i} (TORPOR_FAULT_SEED={SEED})"
            floor = case.tick_floor()
            p, pid, seen = case.launch()
            time.sleep(max(0.0, seen + delay - time.monotonic()))
            case.kill(pid)
            outcomes.append(case.check(p, floor, where))
        print(f"{victim} {op}: {RUNS} kills over {duration:.2f} s, seed {SEED}: "
              f"{outcomes.count('running')} running, {outcomes.count('restorable')} restorable")
    finally:
        env.podman.rm(name)
