"""`torpor checkpoint/restore/suspend/resume` of a program under an agent, with real CRIU and
the fake GPU: the program is tests/fakes/fake_agent.py's, a CUDA program of the fake driver
serving the Python fake of the agent's socket. The agent's data files travel in the images
directory through CRIU's dump and restore, the program's connections from torpor are closed
before the dump, and the restored program gets every byte back through its (restored) socket.
The same against the C agent belongs with tests/gpu and the agent's own tests.
"""

from __future__ import annotations

import hashlib
import json
import os
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


class Program:
    def __init__(self, gpu, tmp_path: Path):
        self.agents = tmp_path / "agents"
        self.agents.mkdir(mode=0o700, exist_ok=True)
        self.events = tmp_path / "events"
        log = open(tmp_path / "program.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(PROGRAM), str(self.agents), str(self.events),
             "--bytes", str(5 << 20), "--lib", gpu.libcuda],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            env={**os.environ, **gpu.env(), "PYTHONPATH": os.pathsep.join(sys.path)})
        log.close()
        self.pid = self.proc.pid
        self.sock = self.agents / f"agent-{self.pid}.sock"
        wait_for(lambda: self.sock.exists() and gpu.state(self.pid), 15, "the program")

    def log(self) -> list[str]:
        lines = self.events.read_text().splitlines() if self.events.exists() else []
        self.events.unlink(missing_ok=True)
        return [line.rsplit(" ", 1)[0] for line in lines]

    def status(self) -> dict:
        with AgentClient(self.sock) as a:
            return a.status()


@pytest.fixture
def program(gpu, tmp_path, reaper):
    p = Program(gpu, tmp_path)
    reaper.append(p.pid)
    yield p


@pytest.fixture
def env(torpor, program, tmp_path):
    torpor.env["TORPOR_AGENT_DIR"] = str(program.agents)
    torpor.env["TORPOR_SUSPEND_DIR"] = str(tmp_path / "shm")
    return torpor


def test_checkpoint_and_restore_through_the_agent(env, program, gpu, tmp_path, reaper):
    images = tmp_path / "ck"
    run = env.run("--json", "checkpoint", str(program.pid), "-D", str(images), check=True)
    out = json.loads(run.stdout)
    assert "driver path" not in run.stderr              # under the agent: no advice to start so
    program.proc.wait(timeout=10)
    assert program.log() == ["agent status", "agent prepare", "agent detach"]
    m = out["manifest"]
    entry = m["agent"][str(program.pid)]
    assert entry["bytes"] == 5 << 20 and entry["nspid"] == program.pid
    files = sorted((images / "torpor-gpu" / str(program.pid)).iterdir())
    assert [f.stat().st_size for f in files] == entry["files"]
    # listed with their sizes; no sha256: the agent checks its own chunk sums as it reloads
    assert all(m["files"][f"torpor-gpu/{program.pid}/{f.name}"]["sha256"] is None for f in files)
    insp = env.json("inspect", str(images), "--verify")
    assert insp["verified"] and insp["manifest"]["agent"] == m["agent"]

    r = env.run("restore", "-D", str(images))
    assert r.returncode == 0, r.stderr
    reaper.append(program.pid)
    assert "agent-resume" in r.stderr and "the agent gave back 5.00 MiB" in r.stdout
    assert program.log() == ["agent status", "agent resume"]
    st = program.status()
    assert st["state"] == "running" and st["gate"] == "open" and st["intact"] is True
    assert gpu.state(program.pid)["state"] == 0


def test_leave_running(env, program, gpu, tmp_path):
    r = env.run("checkpoint", str(program.pid), "-D", str(tmp_path / "ck"), "--leave-running")
    assert r.returncode == 0, r.stderr
    assert "the agent moved 5.00 MiB of GPU memory of 1 program(s)" in r.stdout
    # the first status: how much its data takes staged in host memory (flows/writeout.py);
    # the second: whether it could hold its memory (engine.holding: a copier for it)
    assert program.log() == ["agent status", "agent status", "agent status", "agent prepare",
                             "agent detach", "agent status", "agent resume"]
    assert "its GPU data written out while it ran" in r.stdout
    assert alive(program.pid) and program.status()["intact"] is True


@pytest.mark.parametrize("size", ["1m", "8m"])
def test_a_full_disk_gives_the_memory_back(env, program, gpu, tmp_path, size):
    """1 MiB: the agent's prepare fails (no room for 5 MiB); 8 MiB: the data fits, the dump
    does not. Either way the program runs on with every byte, and only CRIU's log stays."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(small)],
                   check=True)
    try:
        r = env.run("checkpoint", str(program.pid), "-D", str(small / "ck"))
        assert r.returncode == 8, r.stderr
        assert ("agent-prepare failed" if size == "1m" else "criu dump failed") in r.stderr
        assert program.log() == ["agent status", "agent prepare"] + (
            ["agent status"] if size == "1m"     # nothing moved: nothing to resume
            else ["agent detach", "agent status", "agent resume"])
        assert alive(program.pid) and program.status()["intact"] is True
        assert gpu.state(program.pid)["state"] == 0
        assert [p.name for p in (small / "ck").iterdir()] in ([], ["dump.log"])
    finally:
        subprocess.run(["umount", "-l", str(small)])


def test_lock_failure_gives_the_memory_back(env, program, gpu, tmp_path):
    gpu.fail("lock", "CUDA_ERROR_UNKNOWN")
    r = env.run("checkpoint", str(program.pid), "-D", str(tmp_path / "ck"))
    assert r.returncode == 8, r.stderr
    assert "lock failed" in r.stderr
    assert program.log() == ["agent status", "agent prepare", "agent detach", "agent status",
                             "agent resume"]
    assert program.status()["intact"] is True
    assert not (tmp_path / "ck" / "torpor-gpu").exists()


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "files"])
def test_suspend_and_resume_through_host_memory(env, program, gpu, tmp_path, in_process):
    config = tmp_path / "config.toml"
    config.write_text(f"suspend_in_process = {str(in_process).lower()}\n")
    env.env["TORPOR_CONFIG"] = str(config)
    r = env.run("suspend", str(program.pid))
    assert r.returncode == 0, r.stderr
    assert "the agent moved 5.00 MiB" in r.stdout
    if in_process:
        assert "to their own host memory" in r.stderr
        assert not (tmp_path / "shm").exists()
    else:
        (shm,) = (tmp_path / "shm").iterdir()
        assert oct(shm.stat().st_mode & 0o777) == "0o700"
    assert program.status()["state"] == "detached"
    ps = env.json("ps")
    row = next(p for p in ps["processes"] if p["pid"] == program.pid)
    assert row["suspended"] and row["agent"] == "detached"
    r = env.run("resume", str(program.pid))
    assert r.returncode == 0, r.stderr
    assert program.status()["intact"] is True
    assert in_process or not shm.exists()
    assert json.loads(env.run("--json", "ps").stdout)["processes"]


@pytest.mark.parametrize("tmpfs", [False, True], ids=["directory", "huge-page-tmpfs"])
def test_a_suspend_dir_a_user_made_first_does_not_stop_suspends(env, program, tmp_path, tmpfs):
    """suspend_dir in a directory like /dev/shm (root's, world-writable, sticky) that a real
    other user (nobody) made first, 0700 with a file in it: `torpor suspend` works as before
    (with TORPOR_SUSPEND_TMPFS too), into a directory of root's; the user's directory is
    moved aside, untouched, and nothing of the program's data is in it."""
    shm = tmp_path / "devshm"
    shm.mkdir()
    os.chmod(shm, 0o1777)
    squat = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            "sh", "-c", "mkdir -m 700 torpor && echo mine > torpor/theirs"],
                           cwd=shm, capture_output=True, text=True)
    assert squat.returncode == 0, squat.stderr
    assert os.stat(shm / "torpor").st_uid == 65534
    env.env["TORPOR_SUSPEND_DIR"] = str(shm / "torpor")
    env.env["TORPOR_SUSPEND_TMPFS"] = str(tmpfs).lower()
    try:
        r = env.run("suspend", str(program.pid))
        assert r.returncode == 0, r.stderr
        st = os.lstat(shm / "torpor")
        assert st.st_uid == 0 and oct(st.st_mode & 0o7777) == "0o700"
        assert os.path.ismount(shm / "torpor") == tmpfs
        (data,) = (shm / "torpor").iterdir()            # the program's data: in root's own
        (aside,) = shm.glob("torpor.squatted-*")
        assert os.lstat(aside).st_uid == 65534 and sorted(os.listdir(aside)) == ["theirs"]
        assert (aside / "theirs").read_text() == "mine\n"
        r = env.run("resume", str(program.pid))
        assert r.returncode == 0, r.stderr
        assert program.status()["intact"] is True
    finally:
        while os.path.ismount(shm / "torpor"):
            subprocess.run(["umount", str(shm / "torpor")], check=True)


def _under_the_agent(torpor, gpu, tmp_path: Path, reaper, env: dict | None = None,
                     pieces: int = 1) -> tuple[subprocess.Popen, Path, Path]:
    """The fake CUDA program with 64 MiB of data under `torpor run` (the C agent preloaded),
    its agent answering: (the process, its status file, its agents directory). Skips with an
    agent library that predates prepare, or a fake driver without the VMM API. pieces: that
    many allocations of 2 MiB instead, 4 KiB of data at the start of each."""
    from tests.fakes.fakegpu import PROGRAM
    agents = tmp_path / "agents"
    status = tmp_path / "status.json"
    torpor.env["TORPOR_AGENT_DIR"] = str(agents)
    log = open(tmp_path / "program.log", "wb")
    size = [str(64 << 20), "--fill", f"0:{64 << 20}"] if pieces == 1 else \
        [str(pieces * (2 << 20)), "--pieces", str(pieces), "--fill", "0:4096"]
    proc = subprocess.Popen([sys.executable, "-m", "torpor.cli.main", "run", "--",
                             sys.executable, str(PROGRAM), "--mem", *size,   # data: zeros
                             "--status", str(status), "--lib", gpu.libcuda],  # would not move
                            env={**torpor.env, **(env or {})}, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log, start_new_session=True)
    log.close()
    reaper.append(proc.pid)
    wait_for(lambda: status.exists() and (agents / f"agent-{proc.pid}.sock").exists(), 20,
             "the program under the agent")
    with AgentClient.for_pid(proc.pid, agents) as a:
        st = a.status()
    if "state" not in st:
        pytest.skip("the agent library predates prepare")
    if not st.get("movable_bytes"):
        pytest.skip("the fake driver serves no VMM memory: nothing for the agent to move")
    return proc, status, agents


@pytest.mark.parametrize("store", [False, True], ids=["files", "store"])
def test_the_real_agent_through_checkpoint_and_restore(torpor, gpu, tmp_path, reaper, store):
    """`torpor run` preloads libtorpor-agent.so into the fake CUDA program; its 64 MiB
    allocation is movable: the checkpoint has the agent write it into the images, the restore
    has it read back, and the program goes on ticking. Into the image store (--store), the
    agent streams it straight into the store, and back from there (store/stream.py). Skipped
    with an agent library that predates prepare (no "state" in its status), or a fake driver
    without the VMM API."""
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper)
    images = tmp_path / "ck"
    torpor.env["TORPOR_STORE_DIR"] = str(tmp_path / "store")
    ck = torpor.json("checkpoint", str(proc.pid), "-D", str(images),
                     *(["--store", "one"] if store else []))
    m = ck["manifest"]
    proc.wait(timeout=10)
    entry = m["agent"][str(proc.pid)]
    assert entry["bytes"] == 64 << 20 and sum(entry["files"]) >= 64 << 20
    if store:
        assert entry["streamed"]["bytes"] == 64 << 20, entry
        assert ck["stored"]["streamed"] == entry["streamed"]["parts"] >= 16, ck["stored"]
    else:
        assert "streamed" not in entry
        assert torpor.json("inspect", str(images), "--verify")["verified"]
    r = torpor.json("restore", "-D", str(images))
    assert r["agent"][str(proc.pid)]["bytes"] == 64 << 20
    assert r["agent"][str(proc.pid)].get("streamed", False) is store
    ticks_on(proc.pid, status, agents)
    assert gpu.state(proc.pid)["state"] == 0


def test_a_damaged_gpu_data_file_fails_the_restore_as_damaged(torpor, gpu, tmp_path, reaper):
    """A byte of the C agent's data file changed after the checkpoint: the restore fails in
    agent-resume (the agent's checksums; --verify checks these files by size) with exit 9,
    damaged, in one line; the restored program is stopped and the checkpoint left as it was,
    so that the byte put back restores it."""
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper)
    images = tmp_path / "ck"
    torpor.json("checkpoint", str(proc.pid), "-D", str(images))
    proc.wait(timeout=10)
    victim = max(images.glob("torpor-gpu/**/gpu-memory-*.bin"), key=lambda p: p.stat().st_size)
    good = victim.read_bytes()
    at = next(i for i in range(len(good) // 2, len(good)) if good[i])   # data, not a hole
    victim.write_bytes(good[:at] + bytes([good[at] ^ 1]) + good[at + 1:])
    r = torpor.run("restore", "-D", str(images))
    assert r.returncode == 9, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "agent-resume" in errors[0], r.stderr
    assert "damaged" in errors[0] and "unchanged" in errors[0], r.stderr
    assert not alive(proc.pid)
    victim.write_bytes(good)   # as it was: the restore goes through
    torpor.json("restore", "-D", str(images))
    ticks_on(proc.pid, status, agents)


def test_the_real_agent_holds_its_memory_through_a_leave_running_checkpoint(torpor, gpu,
                                                                             tmp_path, reaper):
    """A program started with TORPOR_AGENT_VMM_EXPORT=1: `torpor checkpoint --leave-running`
    takes its allocations' descriptors at detach and the resume maps them back (the agent's
    log says nothing was copied); the checkpoint still holds every byte, in its data files."""
    plog = tmp_path / "program.log"
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper, {
        "TORPOR_AGENT_VMM_EXPORT": "1", "TORPOR_AGENT_LOG_LEVEL": "20"})
    images = tmp_path / "ck"
    r = torpor.run("checkpoint", str(proc.pid), "-D", str(images), "--leave-running")
    assert r.returncode == 0, r.stderr
    assert "held on the GPU through the dump" in r.stdout + r.stderr
    text = plog.read_text(errors="replace")
    assert "held on the GPU by their descriptors" in text, text[-3000:]
    assert "nothing copied" in text and "not taken back" not in text, text[-3000:]
    assert torpor.json("inspect", str(images), "--verify")["verified"]
    ticks_on(proc.pid, status, agents)
    # the checkpoint stands on its own: every byte is in its data files (their restore is
    # test_the_real_agent_through_checkpoint_and_restore's; this program's log, open in it,
    # grew since, which CRIU would refuse)
    m = json.loads((images / "torpor.json").read_text())
    entry = m["agent"][str(proc.pid)]
    assert entry["bytes"] == 64 << 20 and sum(entry["files"]) >= 64 << 20, entry
    # the next periodic checkpoint holds again: the memory is an imported handle now, which
    # the driver does not export again, and the agent hands out the descriptor it kept
    r = torpor.run("checkpoint", str(proc.pid), "-D", str(tmp_path / "ck2"), "--leave-running",
                   "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["held"] == 1, r.stdout
    text = plog.read_text(errors="replace")
    assert text.count("nothing copied") == 2 and "not taken back" not in text, text[-3000:]
    assert torpor.json("inspect", str(tmp_path / "ck2"), "--verify")["verified"]


def ticks_on(pid: int, status: Path, agents: Path) -> None:
    """The program under the agent ticks on (its status file), its agent running, gate open."""
    tick = json.loads(status.read_text())["tick"]
    wait_for(lambda: json.loads(status.read_text() or "{}").get("tick", 0) > tick + 2, 10,
             "the program ticking on")
    with AgentClient.for_pid(pid, agents) as a:
        st = a.status()
    assert (st["state"], st["gate"]) == ("running", "open")


def _digest(pid: int, status: Path, size: int = 64 << 20) -> str:
    """sha256 of the program's allocation, read from its memory (the fake's device memory is
    the program's own: test_agent_zeros_cli.py)."""
    h = hashlib.sha256()
    with open(f"/proc/{pid}/mem", "rb") as mem:
        mem.seek(json.loads(status.read_text())["ptr"])
        for _ in range(size // (16 << 20)):
            h.update(mem.read(16 << 20))
    return h.hexdigest()


def _held_by(pid: int) -> list[str]:
    """The fake GPU memory's descriptors open in process pid (fake_libcuda.c's memfds)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if "fake-cuda-mem" in link:
            out.append(link)
    return out


@pytest.mark.parametrize("slow_call,state_when_killed", [
    ("checkpoint", 1),   # LOCKED: killed in the driver's checkpoint, before the dump
    ("restore", 2),      # CHECKPOINTED: killed after the dump, before the unlock
])
def test_a_torpor_killed_while_it_holds_the_memory_is_recovered_from_the_files(
        torpor, gpu, tmp_path, reaper, slow_call, state_when_killed):
    """`torpor checkpoint --leave-running` SIGKILLed while it holds the program's GPU
    memory by its descriptors (after `detach hold`): they close with it, and the next torpor
    (`torpor ps`) gives the program its memory back from the staged data files; it ticks on,
    its data intact, nothing left staged nor journalled."""
    from tests.fakes.fakegpu import RUNNING
    torpor.env["TORPOR_SUSPEND_DIR"] = str(tmp_path / "shm")
    proc, status, agents = _under_the_agent(torpor, gpu, tmp_path, reaper, {
        "TORPOR_AGENT_VMM_EXPORT": "1", "TORPOR_AGENT_LOG_LEVEL": "20"})
    before = _digest(proc.pid, status)
    gpu.delay(slow_call, 20000, pid=proc.pid)
    t = torpor.start("checkpoint", str(proc.pid), "-D", str(tmp_path / "ck"), "--leave-running")
    try:
        wait_for(lambda: (gpu.state(proc.pid) or {}).get("state") == state_when_killed
                 and _held_by(t.pid) and time.sleep(0.3) is None, 30,
                 f"torpor to hold the memory in the driver's {slow_call}")
        assert _held_by(t.pid)   # still holding when it dies
    finally:
        t.kill()
        t.communicate()
    gpu.clear_faults()
    assert t.returncode == -9
    assert gpu.state(proc.pid)["state"] == state_when_killed
    ps = torpor.run("ps")   # any command first rolls back what a dead torpor left
    assert ps.returncode == 0, ps.stderr
    assert "recovered" in ps.stderr and str(proc.pid) in ps.stderr, ps.stderr
    assert gpu.state(proc.pid)["state"] == RUNNING
    ticks_on(proc.pid, status, agents)
    assert _digest(proc.pid, status) == before
    text = (tmp_path / "program.log").read_text(errors="replace")
    assert "held on the GPU by their descriptors" in text, text[-3000:]   # it held
    assert "nothing copied" not in text, text[-3000:]                     # and copied back
    assert list((tmp_path / "shm").iterdir()) == []
    assert list((tmp_path / "state" / "journal").glob("*.json")) == []
