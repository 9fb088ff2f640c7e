"""Checkpoints, restores, suspends and resumes of a program under the agent: the order of the
agent's and the driver's steps, rollback after any of them fails, recovery after a torpor that
died, and torpord's side for containers.

The "program" is this test process: the fake agent (fake_agent.py) serves its socket from a
thread, a FakeDriver stands in for the driver, and CRIU's dump and restore are stubs (the
images are what CRIU would leave). Events from both fakes go into one ordered log.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.fake_agent import Events, FakeAgent, FakeDriver
from torpor import agent_data, criu, engine as engine_mod, gpus, manifest, procs
from torpor.flows import policy, process
from torpor.engine import Engine, targets_of
from torpor.errors import CriuError, RolledBackError, TorporError, UsageError
from torpor.progress import Progress

GPU = "GPU-8c6d2f4e-1b3a-4c5d-9e7f-0a1b2c3d4e5f"
PID = os.getpid()


@dataclasses.dataclass
class World:
    cfg: Any
    events: Events
    driver: FakeDriver
    agent: FakeAgent
    agents_dir: Path
    tmp: Path
    out: io.StringIO

    def engine(self) -> Engine:
        return Engine(self.cfg, Progress(stream=self.out))

    def log(self) -> list[str]:
        """The events so far, and forget them."""
        ev = self.events()
        self.events.clear()
        return [e.replace(f" {PID}", "") for e in ev]

    def journal_entries(self) -> list[Path]:
        return list(self.cfg.journal_dir.glob("*.json"))


@pytest.fixture
def world(cfg, tmp_path, monkeypatch):
    events = Events()
    drv = FakeDriver(events, [PID])
    monkeypatch.setattr(engine_mod, "load_driver", lambda path: drv)
    inv = gpus.Inventory("999.0-fake", [gpus.Gpu(0, GPU, "Fake GPU", 8 << 30, 6 << 30)],
                         [gpus.GpuProcess(PID, GPU, 1 << 30)])
    monkeypatch.setattr(gpus, "discover", lambda: inv)
    agents_dir = tmp_path / "agents"
    agents_dir.mkdir(mode=0o700)
    monkeypatch.setenv("TORPOR_AGENT_DIR", str(agents_dir))
    c = dataclasses.replace(cfg, suspend_dir=tmp_path / "shm" / "torpor", agent_files=3,
                            suspend_in_process=False)   # the default; in_process() below
    fake = FakeAgent(agents_dir / f"agent-{PID}.sock", log=events, driver=drv).start()
    w = World(c, events, drv, fake, agents_dir, tmp_path, io.StringIO())
    yield w
    fake.stop()


@pytest.fixture
def fake_criu(world, monkeypatch):
    """CRIU stubs: a dump leaves the images CRIU would (and 'ends' nothing), a restore brings
    back nothing but says it did; fail["dump"] makes the dump fail as CRIU would."""
    fail: dict[str, bool] = {}

    class Tool:
        version_text = "4.0-fake"

    def dump(tool, cfg, pid, images_dir, leave_running, shell_job, tcp_established=False):
        world.events.add(f"criu dump {pid}")
        if fail.get("dump"):
            (images_dir / manifest.DUMP_LOG).write_text("Error (criu): fake\n")
            (images_dir / "pages-1.img").write_bytes(b"partial")
            raise CriuError("criu dump failed (fake)")
        for name in manifest.REQUIRED_IMAGES:
            (images_dir / name).write_bytes(b"image")
        (images_dir / manifest.DUMP_LOG).write_text(manifest.DUMP_OK + "\n")

    def restore(tool, cfg, images_dir, work_dir, shell_job, tcp_established=False):
        world.events.add(f"criu restore {PID}")
        return PID

    monkeypatch.setattr(criu, "find", lambda cfg: Tool())
    monkeypatch.setattr(criu, "dump", dump)
    monkeypatch.setattr(criu, "restore", restore)
    monkeypatch.setattr(criu, "pstree", lambda d: [{"pid": PID}])
    monkeypatch.setattr(procs, "pid_taken", lambda pid, zombie_grace_s=3.0: False)
    return fail


def data_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


# -- suspend / resume ---------------------------------------------------------------------------

def test_suspend_moves_memory_through_the_agent_then_the_driver(world):
    r = process.suspend(world.engine(), PID)
    assert world.log() == ["agent status", "agent prepare", "agent detach", "driver lock",
                           "driver checkpoint"]
    assert r["agent"][str(PID)]["bytes"] == len(world.agent.original)
    assert world.agent.memory is None and world.agent.state == "detached"
    record = world.engine().journal.suspended()[PID]
    root = Path(record["data_root"])
    assert root.parent == world.cfg.suspend_dir and oct(root.stat().st_mode & 0o777) == "0o700"
    files = data_files(root)
    assert [f.name for f in files] == [agent_data.file_name(k) for k in range(3)]
    assert {oct(f.stat().st_mode & 0o777) for f in files} == {"0o600"}
    assert sum(f.stat().st_size for f in files) == len(world.agent.original)
    out = world.out.getvalue()
    assert "agent-prepare: 3.01 MiB in " in out and ("GB/s)" in out or "MB/s)" in out)

    back = process.resume(world.engine(), PID)
    assert world.log() == ["driver restore", "driver unlock", "agent status", "agent resume"]
    assert world.agent.intact and back["agent"][str(PID)]["bytes"] == len(world.agent.original)
    assert [f["access"] for f in world.agent.seen[-1]["fds"]] == [os.O_RDONLY] * 3
    assert not root.exists() and world.engine().journal.suspended() == {}
    assert world.journal_entries() == []


def fsyncs_under(monkeypatch, root: Path) -> list[str]:
    """From now on, the path of every fsync under root (files and directories), in order."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path == str(root) or path.startswith(f"{root}/"):
            seen.append(path)
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_a_suspend_and_its_resume_journal_without_fsyncs(world, monkeypatch):
    """A suspend's and a resume's journal entries and the suspended record mean nothing once the
    machine went down with the program (journal.CRASH_ONLY): whole (renamed) for a torpor that
    dies, never fsynced on the suspend's critical path. A checkpoint's stay durable."""
    seen = fsyncs_under(monkeypatch, world.cfg.state_dir)
    process.suspend(world.engine(), PID)
    assert world.engine().journal.suspended()[PID]["agent"]["bytes"] == len(world.agent.original)
    process.resume(world.engine(), PID)
    assert world.agent.intact and seen == []

    op = world.engine().begin("checkpoint", [PID])
    op.phase("lock")
    entry = str(world.cfg.journal_dir / f"{op.entry.id}.json")
    tmp = f"{world.cfg.journal_dir}/.{op.entry.id}.json.tmp.{os.getpid()}"
    assert seen == [tmp, str(world.cfg.journal_dir)] * 2     # begin, then the phase
    op.close()
    assert not Path(entry).exists()


def in_process(world: World) -> None:
    """Suspends keep the agent's data in the program (config suspend_in_process)."""
    world.cfg = dataclasses.replace(world.cfg, suspend_in_process=True)


def test_suspend_in_process_keeps_the_memory_in_the_program(world):
    in_process(world)
    r = process.suspend(world.engine(), PID)
    assert world.log() == ["agent status", "agent prepare", "agent detach", "driver lock",
                           "driver checkpoint"]
    assert r["agent"][str(PID)]["in_memory"] is True
    assert all(seen["cmd"] != "prepare" for seen in world.agent.seen)   # sent no fds
    assert world.agent.held is not None and world.agent.state == "detached"
    record = world.engine().journal.suspended()[PID]
    assert not record.get("data_root") and record["agents"][str(PID)]["files"] == 0
    assert not world.cfg.suspend_dir.exists()                 # no files anywhere
    assert "to their own host memory" in world.out.getvalue()

    back = process.resume(world.engine(), PID)
    assert world.log() == ["driver restore", "driver unlock", "agent status", "agent resume"]
    assert world.agent.intact and back["agent"][str(PID)]["bytes"] == len(world.agent.original)
    assert world.engine().journal.suspended() == {} and world.journal_entries() == []


def test_suspend_in_process_rolls_back_from_memory_when_the_lock_fails(world):
    in_process(world)
    world.driver.fail["lock"] = 0
    with pytest.raises(RolledBackError, match="lock failed: .*rolled back"):
        process.suspend(world.engine(), PID)
    assert world.log()[-2:] == ["agent status", "agent resume"]
    assert world.agent.intact and world.driver.unlocked(PID)
    assert world.journal_entries() == [] and world.engine().journal.suspended() == {}


def test_a_failed_resume_from_memory_is_said_and_can_be_retried(world):
    in_process(world)
    process.suspend(world.engine(), PID)
    world.agent.fail["resume"] = "re-creating GPU memory: out of memory"
    with pytest.raises(TorporError, match="stays in the program's host memory"):
        process.resume(world.engine(), PID)
    del world.agent.fail["resume"]
    process.resume(world.engine(), PID)
    assert world.agent.intact and world.engine().journal.suspended() == {}


def mounts_allowed(where: Path) -> bool:
    """Can this test mount a tmpfs (root, and not forbidden by a container)?"""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "probe",
                                            str(where)], capture_output=True).returncode:
        return False
    subprocess.run(["umount", str(where)], check=True)
    return True


@pytest.fixture
def huge_tmpfs(world):
    """suspend_tmpfs on, the mount it makes taken away after the test."""
    if not mounts_allowed(world.tmp / "probe"):
        pytest.skip("mounting a tmpfs needs root outside a restricted container")
    world.cfg = dataclasses.replace(world.cfg, suspend_tmpfs=True)
    yield world.cfg.suspend_dir
    while os.path.ismount(world.cfg.suspend_dir):
        subprocess.run(["umount", str(world.cfg.suspend_dir)], check=True)


def mount_of(path: Path) -> list[str]:
    """The fields of /proc/self/mounts for the mount point path, or []."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        if line.split()[1] == str(path):
            return line.split()
    return []


def test_a_suspend_mounts_a_huge_page_tmpfs_on_an_empty_suspend_dir(world, huge_tmpfs):
    process.suspend(world.engine(), PID)
    fields = mount_of(huge_tmpfs)
    assert fields[2] == "tmpfs" and "huge=within_size" in fields[3].split(",")
    assert {"nosuid", "nodev", "noexec"} <= set(fields[3].split(","))
    root = Path(world.engine().journal.suspended()[PID]["data_root"])
    assert root.parent == huge_tmpfs and oct(huge_tmpfs.stat().st_mode & 0o777) == "0o700"
    assert sum(f.stat().st_size for f in data_files(root)) == len(world.agent.original)
    process.resume(world.engine(), PID)
    assert world.agent.intact
    # the next suspend finds the mount and makes no second one over it
    process.suspend(world.engine(), PID)
    assert sum(1 for line in Path("/proc/self/mounts").read_text().splitlines()
               if line.split()[1] == str(huge_tmpfs)) == 1
    process.resume(world.engine(), PID)
    assert world.agent.intact


def test_suspends_at_once_mount_one_tmpfs(world, huge_tmpfs):
    huge_tmpfs.mkdir(parents=True, mode=0o700)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        mounted = list(pool.map(lambda _: agent_data.mount_huge_tmpfs(huge_tmpfs), range(6)))
    assert mounted == [True] * 6
    assert sum(1 for line in Path("/proc/self/mounts").read_text().splitlines()
               if line.split()[1] == str(huge_tmpfs)) == 1


def test_no_mount_hides_what_suspend_dir_holds(world, huge_tmpfs):
    huge_tmpfs.mkdir(parents=True, mode=0o700)
    (huge_tmpfs / "older").write_bytes(b"a suspended program's data")
    process.suspend(world.engine(), PID)
    assert not mount_of(huge_tmpfs) and (huge_tmpfs / "older").read_bytes().startswith(b"a susp")
    process.resume(world.engine(), PID)
    assert world.agent.intact


def test_a_mount_that_fails_leaves_a_plain_directory(world, huge_tmpfs, monkeypatch):
    monkeypatch.setattr(agent_data, "HUGE_TMPFS_OPTIONS", "huge=no-such-policy")
    process.suspend(world.engine(), PID)
    assert not mount_of(huge_tmpfs)
    root = Path(world.engine().journal.suspended()[PID]["data_root"])
    assert sum(f.stat().st_size for f in data_files(root)) == len(world.agent.original)
    process.resume(world.engine(), PID)
    assert world.agent.intact


NOBODY = 65534


def _as_nobody_in(where: Path, action) -> None:
    """action() run in where by a child that is really uid nobody; it must succeed."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.chdir(where)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (another user, chown)")
@pytest.mark.parametrize("tmpfs", [False, True], ids=["directory", "huge-page-tmpfs"])
def test_a_suspend_dir_another_user_made_first_is_taken_back(world, request, caplog, tmpfs):
    """suspend_dir in a directory like /dev/shm (root's, world-writable, sticky), made first by
    another user (their own, 0700, a file in it): the suspend works all the same. The user's
    directory is moved aside, untouched and still theirs, root makes its own in its place
    (with suspend_tmpfs: and mounts on that), and the log names the user."""
    import logging
    import stat

    shm = world.cfg.suspend_dir.parent
    shm.mkdir()
    os.chmod(shm, 0o1777)

    def squat() -> None:
        os.mkdir("torpor", 0o700)
        Path("torpor/theirs").write_text("nobody's")
    _as_nobody_in(shm, squat)
    if tmpfs:
        request.getfixturevalue("huge_tmpfs")
    with caplog.at_level(logging.WARNING, logger="torpor.agent_data"):
        process.suspend(world.engine(), PID)
    base = world.cfg.suspend_dir
    st = os.lstat(base)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    assert Path(world.engine().journal.suspended()[PID]["data_root"]).parent == base
    assert bool(mount_of(base)) == tmpfs
    [aside] = shm.glob("torpor.squatted-*")
    assert os.lstat(aside).st_uid == NOBODY and stat.S_IMODE(os.lstat(aside).st_mode) == 0o700
    assert [p.name for p in aside.iterdir()] == ["theirs"] \
        and (aside / "theirs").read_text() == "nobody's"
    assert f"uid {NOBODY} had put its own entry at {base}" in caplog.text
    assert str(aside) in caplog.text
    process.resume(world.engine(), PID)
    assert world.agent.intact


def test_a_suspend_without_host_memory_for_it_is_refused_before_anything(world, monkeypatch):
    """The driver path moves all of NVML's figure to host memory: checked up front."""
    world.agent.stop()
    monkeypatch.setattr(procs, "mem_available", lambda: 512 << 20)   # the GPU holds 1 GiB
    with pytest.raises(UsageError, match="needs 1.00 GiB of host memory .* 512"):
        process.suspend(world.engine(), PID)
    assert world.log() == [] and world.journal_entries() == []


@pytest.mark.parametrize("where", ["files", "in-process"])
def test_under_the_agent_its_data_is_what_must_fit_in_host_memory(world, monkeypatch, where):
    """NVML says 1 GiB (a JAX arena: mostly zeros); the agent's data is 3 MiB. Less host
    memory than NVML's figure suspends; less than the data is refused by the agent before it
    copies, and everything rolls back."""
    if where == "in-process":
        in_process(world)
    monkeypatch.setattr(procs, "mem_available", lambda: 512 << 20)
    process.suspend(world.engine(), PID)
    assert world.agent.host_budget == 512 << 20
    process.resume(world.engine(), PID)
    assert world.agent.intact

    monkeypatch.setattr(procs, "mem_available", lambda: 1 << 20)
    with pytest.raises(RolledBackError, match="needs 3\\d+ bytes of host memory .* 1048576 "
                                              "bytes are available"):
        process.suspend(world.engine(), PID)
    assert world.agent.state == "running" and world.agent.intact
    assert world.journal_entries() == [] and world.engine().journal.suspended() == {}


@pytest.mark.parametrize("where", ["files", "in-process"])
def test_an_agent_older_than_the_host_budget_is_checked_by_all_it_could_move(world, monkeypatch,
                                                                          where):
    """A program started under an agent from before `prepare ... host=N` (torpor upgraded
    since): its agent refuses the word; all it could move (3 MiB: its status) must fit, or
    the suspend is refused with nothing moved, the program running."""
    if where == "in-process":
        in_process(world)
    world.agent.before_host_budget = True
    need = len(world.agent.original)
    monkeypatch.setattr(procs, "mem_available", lambda: need - 1)
    with pytest.raises(RolledBackError, match=f"PID {PID}: its GPU data needs up to {need} "
                                              f"bytes of host memory .* {need - 1} bytes are "
                                              "available for it"):
        process.suspend(world.engine(), PID)
    assert "driver lock" not in world.log()
    assert world.agent.state == "running" and world.agent.intact
    assert world.journal_entries() == [] and world.engine().journal.suspended() == {}

    monkeypatch.setattr(procs, "mem_available", lambda: need)
    r = process.suspend(world.engine(), PID)
    assert world.log() == ["agent status", "agent prepare", "agent status", "agent prepare",
                           "agent detach", "driver lock", "driver checkpoint"]
    assert r["agent"][str(PID)]["bytes"] == need and world.agent.host_budget is None
    process.resume(world.engine(), PID)
    assert world.agent.intact


def test_a_stale_socket_s_program_is_checked_as_the_driver_path(world, monkeypatch):
    """A socket nobody answers on (its program was killed under the agent; this PID is
    another program now) puts the PID on the driver path at the probe: NVML's 1 GiB must fit
    in host memory, or nothing is locked or moved."""
    world.agent.stop()
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(world.agent.path))
    monkeypatch.setattr(procs, "mem_available", lambda: 512 << 20)
    try:
        with pytest.raises(UsageError, match=f"suspending {PID} needs 1.00 GiB of host "
                                             f"memory .*PID {PID}[)]; 512"):
            process.suspend(world.engine(), PID)
    finally:
        s.close()
    assert world.log() == [] and world.driver.states[PID] == world.driver.S.RUNNING
    assert world.journal_entries() == [] and world.engine().journal.suspended() == {}
    assert not world.cfg.suspend_dir.exists() or not list(world.cfg.suspend_dir.iterdir())


def test_the_driver_path_takes_nvml_s_figure_and_the_agents_share_the_rest(world):
    """Host memory for a suspend of two programs, one under its agent: the other's GPU memory
    (NVML's figure: the driver moves all of it) comes off what the host has, the agent may
    take the rest; more than the host has for the driver's part is refused."""
    e, sock = world.engine(), world.agent.path
    host = engine_mod.HostMemory(10 << 30, {PID: 8 << 30, 4242: 3 << 30}, "suspending 1")
    assert e._host_budgets([PID, 4242], {PID: sock}, host) == {PID: 7 << 30}
    assert e._host_budgets([PID, 4242], {}, dataclasses.replace(
        host, available=11 << 30)) == {}
    with pytest.raises(UsageError, match="suspending 1 needs 11.00 GiB of host memory for its "
                                         "GPU memory .*PIDs \\d+, 4242\\); 10.00 GiB is"):
        e._host_budgets([PID, 4242], {}, host)
    assert e._host_budgets([PID], {PID: sock}, None) == {PID: None}
    assert world.log() == []


def test_a_program_without_agent_takes_the_driver_path(world):
    world.agent.stop()
    r = process.suspend(world.engine(), PID)
    assert world.log() == ["driver lock", "driver checkpoint"] and r["agent"] == {}
    assert not world.cfg.suspend_dir.exists() or not list(world.cfg.suspend_dir.iterdir())
    process.resume(world.engine(), PID)
    assert world.log() == ["driver restore", "driver unlock"]


def test_use_agent_false_ignores_the_agent(world):
    world.cfg = dataclasses.replace(world.cfg, use_agent=False)
    process.suspend(world.engine(), PID)
    assert world.log() == ["driver lock", "driver checkpoint"]
    process.resume(world.engine(), PID)


def test_a_stale_socket_is_the_driver_path_said(world):
    world.agent.stop()
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(world.agent.path))       # what a program killed under the agent leaves
    try:
        process.suspend(world.engine(), PID)
    finally:
        s.close()
    assert world.log() == ["driver lock", "driver checkpoint"]
    assert "stale socket" in world.out.getvalue()
    process.resume(world.engine(), PID)


def test_lock_failure_after_prepare_gives_the_memory_back(world):
    world.driver.fail["lock"] = 0
    with pytest.raises(RolledBackError, match="lock failed: .*CUDA_ERROR_FAKE.*rolled back"):
        process.suspend(world.engine(), PID)
    assert world.log() == ["agent status", "agent prepare", "agent detach", "driver lock",
                           "agent status", "agent resume"]
    assert world.agent.intact and world.driver.unlocked(PID)
    assert list(world.cfg.suspend_dir.iterdir()) == []        # the data went with it
    assert world.journal_entries() == [] and world.engine().journal.suspended() == {}


def test_checkpoint_failure_rolls_back_driver_first_then_agent(world):
    world.driver.fail["checkpoint"] = PID
    with pytest.raises(RolledBackError, match="checkpoint failed"):
        process.suspend(world.engine(), PID)
    assert world.log() == ["agent status", "agent prepare", "agent detach", "driver lock",
                           "driver checkpoint", "driver unlock", "agent status", "agent resume"]
    assert world.agent.intact


@pytest.mark.parametrize("fault", [{"fail": "out of memory"}, {"raw": b"not json\n"},
                                   {"raw": b'{"ok": true}\n'}])
def test_a_failed_prepare_fails_the_operation_cleanly(world, fault):
    if "fail" in fault:
        world.agent.fail["prepare"] = fault["fail"]
    else:
        world.agent.raw["prepare"] = fault["raw"]
    with pytest.raises(RolledBackError, match="agent-prepare failed: PID \\d+: .*rolled back"):
        process.suspend(world.engine(), PID)
    log = world.log()
    assert "driver lock" not in log and "agent resume" not in log   # nothing was moved
    assert world.agent.intact and list(world.cfg.suspend_dir.iterdir()) == []
    assert world.journal_entries() == []


def test_a_failed_detach_resumes_from_the_files(world):
    world.agent.fail["detach"] = "cannot"
    with pytest.raises(RolledBackError, match="agent-detach failed: PID \\d+: agent 'detach': "
                                              "cannot"):
        process.suspend(world.engine(), PID)
    assert world.log()[-2:] == ["agent status", "agent resume"]
    assert world.agent.intact


def test_an_agent_that_does_not_answer_fails_the_checkpoint(world, monkeypatch):
    monkeypatch.setattr(engine_mod, "STATUS_TIMEOUT_S", 0.3)
    world.agent.hang.add("status")
    with pytest.raises(RolledBackError, match="did not answer 'status'"):
        process.suspend(world.engine(), PID)
    assert "driver lock" not in world.log() and world.agent.intact


def test_an_agent_holding_memory_out_is_refused(world):
    process.suspend(world.engine(), PID)
    world.driver.states[PID] = world.driver.S.RUNNING     # as if the driver had been resumed
    world.engine().journal.clear_suspended(PID)
    with pytest.raises(RolledBackError, match="its agent is detached"):
        process.suspend(world.engine(), PID)


def test_a_failed_agent_resume_is_reported_and_can_be_retried(world):
    process.suspend(world.engine(), PID)
    root = Path(world.engine().journal.suspended()[PID]["data_root"])
    victim = data_files(root)[0]
    good = victim.read_bytes()
    victim.write_bytes(b"\0" * len(good))
    with pytest.raises(TorporError, match="agent resume failed .*checksum mismatch.*its GPU "
                                          f"memory stays in {root}") as err:
        process.resume(world.engine(), PID)
    assert err.value.exit_code == 9 and err.value.hint == policy.DAMAGED_HINT   # its data
    assert world.driver.unlocked(PID) and world.agent.state == "detached"
    assert root.exists() and PID in world.engine().journal.suspended()
    victim.write_bytes(good)
    r = process.resume(world.engine(), PID)     # the driver is RUNNING: the agent still is due
    assert r["pids"] == [PID] and world.agent.intact and not root.exists()


# -- checkpoint / restore (CRIU stubbed) ---------------------------------------------------------

def test_checkpoint_and_restore_carry_the_memory_in_the_images(world, fake_criu):
    images = world.tmp / "ckpt"
    m = process.checkpoint(world.engine(), PID, images)
    assert world.log() == ["agent status", "agent prepare", "agent detach", "driver lock",
                           "driver checkpoint", "criu dump"]
    entry = m["agent"][str(PID)]
    assert entry["nspid"] == PID and entry["bytes"] == len(world.agent.original)
    rels = agent_data.rel_paths(PID, 3)
    assert [m["files"][r]["size"] for r in rels] == entry["files"]
    assert not any(m["files"][r]["sha256"] for r in rels)   # sizes only: the agent sums them
    assert oct((images / agent_data.DATA_DIR).stat().st_mode & 0o777) == "0o700"
    manifest.verify(images, manifest.read(images))

    r = process.restore(world.engine(), images)
    assert world.log() == ["criu restore", "driver restore", "driver unlock", "agent status",
                           "agent resume"]
    assert world.agent.intact and r["agent"][str(PID)]["bytes"] == len(world.agent.original)
    assert world.journal_entries() == []


def test_no_copier_for_an_agent_that_cannot_hold(world, fake_criu):
    """The deferred copy is the default, but only an agent whose status says "holdable" can
    leave its copy to a copier: for the others (TORPOR_AGENT_VMM_EXPORT=0, memory not
    exportable) no copier is started, no GPU context made beside the program, nothing said."""
    assert world.cfg.leave_running_drain is True            # the default
    out: list[str] = []
    eng = world.engine()
    eng.progress.say = out.append
    m = process.checkpoint(eng, PID, world.tmp / "ck", leave_running=True)
    assert "copier-ready" not in m["timings"], m["timings"]
    assert not [line for line in out if "torpor-copier" in line or "copiers" in line]
    assert world.agent.intact and m["pause"]["held"] == 0


def test_leave_running_gives_the_memory_back_after_the_dump(world, fake_criu):
    images = world.tmp / "ckpt"
    m = process.checkpoint(world.engine(), PID, images, leave_running=True)
    # the first status: what staging its data in host memory takes (flows/writeout.py); the
    # second: whether it can hold its memory (a copier for it, engine.holding: it cannot)
    assert world.log() == ["agent status", "agent status", "agent status", "agent prepare",
                           "agent detach",
                           "driver lock", "driver checkpoint", "criu dump", "driver restore",
                           "driver unlock", "agent status", "agent resume"]
    assert world.agent.intact
    assert sum(m["files"][r]["size"] for r in agent_data.rel_paths(PID, 3)) == \
        len(world.agent.original)
    # staged in suspend_dir (host memory), written out after the resume, nothing left there
    prepared = next(s for s in world.agent.seen if s["cmd"] == "prepare")
    assert all(f["path"].startswith(str(world.cfg.suspend_dir)) for f in prepared["fds"])
    assert list(world.cfg.suspend_dir.iterdir()) == []
    assert m["pause"]["staged"] is True and "writeout" in m["timings"]
    manifest.verify(images, manifest.read(images))


def test_failed_dump_resumes_the_agent_then_clears_the_images(world, fake_criu):
    fake_criu["dump"] = True
    images = world.tmp / "ckpt"
    with pytest.raises(RolledBackError, match="dump failed"):
        process.checkpoint(world.engine(), PID, images)
    assert world.log()[-4:] == ["driver restore", "driver unlock", "agent status",
                                "agent resume"]
    assert world.agent.intact
    assert sorted(p.name for p in images.iterdir()) == [manifest.DUMP_LOG]


def test_damaged_agent_data_is_caught_by_the_agent_and_the_restore_stopped(world, fake_criu,
                                                                           monkeypatch):
    """The agents' files carry no sha256 in torpor.json (the agent checks each chunk as it
    reloads): a damaged one passes verify, fails the agent's resume, and the restored program
    is stopped; the checkpoint stays as it was."""
    images = world.tmp / "ckpt"
    process.checkpoint(world.engine(), PID, images)
    world.log()
    f = images / agent_data.rel_paths(PID, 3)[0]
    data = f.read_bytes()
    damaged = bytes([data[0] ^ 0xFF]) + data[1:]     # a changed byte, whatever the data was
    f.write_bytes(damaged)
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    with pytest.raises(TorporError, match="restore failed in agent-resume: .*checksum mismatch"
                       ) as err:
        process.restore(world.engine(), images)
    assert err.value.exit_code == 9   # damaged, as the agent's reply says
    assert killed == [(PID, signal.SIGKILL)]
    assert f.read_bytes() == damaged


def test_restore_whose_agent_resume_fails_stops_the_program(world, fake_criu, monkeypatch):
    images = world.tmp / "ckpt"
    process.checkpoint(world.engine(), PID, images)
    world.agent.fail["resume"] = "no memory on this GPU"
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    with pytest.raises(TorporError, match="restore failed in agent-resume: .*no memory on this "
                                          "GPU.*checkpoint .* is unchanged"):
        process.restore(world.engine(), images)
    assert killed == [(PID, signal.SIGKILL)]
    assert data_files(images / agent_data.DATA_DIR)                       # the checkpoint is intact


def test_cli_reports_what_the_agent_moved(world, fake_criu, capsys):
    from torpor.cli import context, inspect
    images = world.tmp / "ckpt"
    m = process.checkpoint(world.engine(), PID, images)
    line = context.agent_line(m["agent"])
    assert line.startswith("the agent moved 3.01 MiB of GPU memory of 1 program(s) in ")
    assert line.rstrip().endswith("/s)")
    skipping = {k: {**r, "fingerprints": {"parts": 4, "skipped": 3, "skipped_bytes": 12 << 20}}
                for k, r in m["agent"].items()}
    assert context.agent_line(skipping).rstrip().endswith(
        "; 12.00 MiB more the image store had already stayed where it was (GPU fingerprints)")
    ctx = context.Context(cfg=world.cfg, json=False, progress=Progress(None))
    inspect.run(type("A", (), {"path": images, "verify": False})(), ctx)
    assert "agent moved 3.01 MiB into 3 file(s)" in capsys.readouterr().out


# -- recovery -------------------------------------------------------------------------------------

class Died(BaseException):
    """torpor 'dies' here: nothing after it runs, the journal entry stays."""


@pytest.mark.parametrize("where", ["after-prepare", "after-checkpoint"])
def test_recovery_gives_the_memory_back(world, monkeypatch, where):
    e = world.engine()
    op = e.begin("suspend", [PID])
    data = agent_data.DataDir.scratch(world.cfg, PID)
    if where == "after-prepare":   # prepared, never detached, driver untouched
        monkeypatch.setattr("torpor.agent.AgentClient.detach",
                            lambda self: (_ for _ in ()).throw(Died()))
        with pytest.raises(Died):
            e._prepare_agents(op, e.agent_sockets([PID]), data, scratch=True)
        monkeypatch.undo()
        monkeypatch.setattr(engine_mod, "load_driver", lambda path: world.driver)
    else:                          # detached, locked and checkpointed by the driver
        e.lock_and_checkpoint(op, [PID], data=data, scratch=True)
    op.release()                   # its locks go, as with a SIGKILL
    world.log()
    messages = world.engine().recover()
    want = ["agent status", "agent resume"]
    if where == "after-checkpoint":
        want = ["driver restore", "driver unlock"] + want
    assert world.log() == want
    assert world.agent.intact and world.driver.unlocked(PID)
    assert any("back the GPU memory their agent had moved" in m for m in messages)
    assert not data.root.exists() and world.journal_entries() == []
    assert world.engine().recover() == []


def test_a_recovery_after_the_resume_does_not_say_it_gave_memory_back(world):
    """A torpor killed after its program had its memory back (a leave-running checkpoint's
    write-out or seal): the recovery finds the agent running, reloads nothing, and does not
    say it gave the memory back."""
    e = world.engine()
    op = e.begin("suspend", [PID])
    data = agent_data.DataDir.scratch(world.cfg, PID)
    e.lock_and_checkpoint(op, [PID], data=data, scratch=True)
    e.restore_and_unlock(op, [PID], agents=targets_of(op.entry.agents))
    op.release()                   # its locks go, as with a SIGKILL
    world.log()
    messages = world.engine().recover()
    assert world.log() == ["agent status"]        # asked, nothing reloaded
    assert world.agent.intact
    assert not any("back the GPU memory" in m for m in messages), messages
    assert any("running again" in m for m in messages), messages
    assert world.journal_entries() == []


@pytest.mark.parametrize("in_proc", [False, True], ids=["files", "in-process"])
def test_recovery_after_a_torpor_killed_mid_checkpoint(world, tmp_path, in_proc):
    """A real death: another torpor process (its own FakeDriver, the same agent) is SIGKILLed
    in its driver checkpoint; this one finds the journal entry and rolls back."""
    code = textwrap.dedent(f"""
        import dataclasses, os, signal
        from pathlib import Path
        from tests.fakes.fake_agent import Events, FakeDriver
        from torpor import config, engine, gpus
        from torpor.flows import process
        from torpor.errors import NoDriverError
        drv = FakeDriver(Events(), [{PID}])
        drv.checkpoint = lambda pid: os.kill(os.getpid(), signal.SIGKILL)
        engine.load_driver = lambda path: drv
        def nonvml(): raise NoDriverError("none")
        gpus.discover = nonvml
        cfg = dataclasses.replace(config.load(), suspend_dir=Path({str(world.cfg.suspend_dir)!r}),
                                  agent_files=2, suspend_in_process={in_proc!r})
        process.suspend(engine.Engine(cfg), {PID})
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert world.log() == ["agent status", "agent prepare", "agent detach"]
    assert world.agent.state == "detached"
    world.driver.states[PID] = world.driver.S.LOCKED     # where the dead one left it
    (entry,) = world.journal_entries()
    doc = json.loads(entry.read_text())
    if in_proc:
        assert doc["agents"][str(PID)]["files"] == 0 and not doc.get("data_root")
    else:
        assert doc["agents"][str(PID)]["files"] == 2 and doc["scratch"] is True
    messages = world.engine().recover()
    assert world.log() == ["driver unlock", "agent status", "agent resume"]
    assert world.agent.intact and world.journal_entries() == []
    if in_proc:
        assert any("into the program's host memory" in m for m in messages), messages
        assert not world.cfg.suspend_dir.exists()
    else:
        assert list(world.cfg.suspend_dir.iterdir()) == []


# -- torpord (containers) ------------------------------------------------------------------------

class Aborted(Exception):
    pass


class Ctx:
    def set_trailing_metadata(self, md: Any) -> None:
        self.md = md

    def abort(self, status: Any, details: str) -> None:
        raise Aborted(details)


@pytest.fixture
def torpord(world, monkeypatch):
    from torpor.agent import container_dir
    from torpor.sidecar.service import Service
    cdir = container_dir(world.cfg.run_dir, "ctr1")
    cdir.mkdir(parents=True, mode=0o700)
    world.agent.stop()
    world.agent = FakeAgent(cdir / f"agent-{PID}.sock", log=world.events,
                            driver=world.driver).start()
    s = Service(world.cfg, op_timeout_s=60)
    yield s
    world.agent.stop()


def test_torpord_checkpoint_rollback_and_restore_of_a_container(world, torpord):
    pb = torpord.pb
    image = world.tmp / "image"
    image.mkdir(mode=0o700)
    data = image / agent_data.DATA_DIR
    req = pb.LockAndCheckpointRequest(pids=[PID], no_descendants=True, gpu_data_dir=str(data),
                                      agent_container_id="ctr1")
    ck = torpord.LockAndCheckpoint(req, Ctx())
    assert world.log() == ["agent status", "agent prepare", "agent detach", "driver lock",
                           "driver checkpoint"]
    (a,) = ck.agents
    assert a.pid == PID and a.nspid == PID and a.bytes == len(world.agent.original)
    assert sum(a.files) == a.bytes and len(data_files(data)) == 3

    torpord.Rollback(pb.OperationRequest(op_id=ck.op_id), Ctx())     # the dump failed
    assert world.log() == ["driver restore", "driver unlock", "agent status", "agent resume"]
    assert world.agent.intact
    agent_data.DataDir(data).remove()                                      # as torpor-runtime does

    ck = torpord.LockAndCheckpoint(req, Ctx())                       # again; this dump works
    agents = list(ck.agents)
    torpord.ops.take(ck.op_id).op.close()     # the container is gone; restored: CHECKPOINTED
    world.log()
    r = torpord.RestoreAndUnlock(pb.RestoreAndUnlockRequest(
        pids=[PID], no_descendants=True, gpu_data_dir=str(data), agents=agents,
        agent_container_id="ctr1"), Ctx())
    assert world.log() == ["driver restore", "driver unlock", "agent status", "agent resume"]
    assert world.agent.intact and [x.pid for x in r.agents] == [PID]
    assert r.agents[0].bytes == len(world.agent.original)


def test_torpord_leave_running_resumes_the_agent(world, torpord):
    pb = torpord.pb
    image = world.tmp / "image"
    image.mkdir(mode=0o700)
    ck = torpord.LockAndCheckpoint(pb.LockAndCheckpointRequest(
        pids=[PID], no_descendants=True, gpu_data_dir=str(image / agent_data.DATA_DIR),
        agent_container_id="ctr1"), Ctx())
    world.log()
    torpord.RestoreAndUnlock(pb.RestoreAndUnlockRequest(op_id=ck.op_id), Ctx())
    assert world.log() == ["driver restore", "driver unlock", "agent status", "agent resume"]
    assert world.agent.intact and data_files(image / agent_data.DATA_DIR)


def test_a_restore_and_unlock_failing_with_an_os_error_leaves_the_operation_to_recovery(
        world, torpord, monkeypatch):
    """RestoreAndUnlock took the operation out of torpord's table, then the journal's disk
    was full: the error reaches the caller, and the entry is left to recovery (its locks
    dropped), which gives the program its GPU state back once the disk has room again; no
    PID stays locked by a lost operation."""
    import errno
    from torpor import journal as journal_mod
    pb = torpord.pb
    world.cfg.suspend_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    ck = torpord.LockAndCheckpoint(pb.LockAndCheckpointRequest(
        pids=[PID], no_descendants=True, gpu_data_dir=str(world.cfg.suspend_dir / "stage-1"),
        agent_container_id="ctr1", staged=True), Ctx())
    real = journal_mod.write_json

    def full(path, doc, **kw):
        if doc.get("phase") == "gpu-restore":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, doc, **kw)
    monkeypatch.setattr(journal_mod, "write_json", full)
    with pytest.raises(Exception, match="No space left"):
        torpord.RestoreAndUnlock(pb.RestoreAndUnlockRequest(op_id=ck.op_id), Ctx())
    monkeypatch.setattr(journal_mod, "write_json", real)     # the disk has room again
    assert torpord.ops.open_ops() == []
    world.log()
    world.engine().recover()                                  # torpord's periodic recovery
    assert world.agent.intact, (world.agent.state, world.log())
    world.engine().begin("checkpoint", [PID]).close()        # no BusyError: nothing locked


def test_torpord_lock_failure_resumes_and_removes_the_data(world, torpord):
    pb = torpord.pb
    image = world.tmp / "image"
    image.mkdir(mode=0o700)
    world.driver.fail["lock"] = 0
    with pytest.raises(Aborted, match="lock failed"):
        torpord.LockAndCheckpoint(pb.LockAndCheckpointRequest(
            pids=[PID], no_descendants=True, gpu_data_dir=str(image / agent_data.DATA_DIR),
            agent_container_id="ctr1"), Ctx())
    assert world.agent.intact and not (image / agent_data.DATA_DIR).exists()


def test_torpord_restore_without_the_program_is_an_error(world, torpord):
    pb = torpord.pb
    world.driver.states[PID] = world.driver.S.CHECKPOINTED
    gone = pb.AgentData(pid=77, nspid=999999, files=[1])
    with pytest.raises(Aborted, match="PID 77 .*not among the restored processes"):
        torpord.RestoreAndUnlock(pb.RestoreAndUnlockRequest(
            pids=[PID], no_descendants=True, gpu_data_dir=str(world.tmp), agents=[gone],
            agent_container_id="ctr1"), Ctx())
    with pytest.raises(Aborted, match="gpu_data_dir"):
        torpord.RestoreAndUnlock(pb.RestoreAndUnlockRequest(
            pids=[PID], no_descendants=True, agents=[gone]), Ctx())



def test_an_agent_without_prepare_takes_the_driver_path_said(world):
    """The agent before issue 4 answers status without a state: it cannot move memory."""
    world.agent.raw["status"] = b'{"pid": 1, "gate": "open", "in_flight": 0, "waiting": 0, ' \
                                b'"allocations": 0, "bytes": 0, "contexts": 1}\n'
    process.suspend(world.engine(), PID)
    assert world.log() == ["agent status", "driver lock", "driver checkpoint"]
    assert "cannot move memory (no prepare)" in world.out.getvalue()
    process.resume(world.engine(), PID)
    assert world.log() == ["driver restore", "driver unlock"]


def test_torpord_never_takes_an_existing_directory_for_its_data(world, torpord):
    pb = torpord.pb
    image = world.tmp / "image"
    (image / agent_data.DATA_DIR).mkdir(parents=True)
    keep = image / agent_data.DATA_DIR / "precious"
    keep.write_text("x")
    with pytest.raises(Aborted, match="exists already"):
        torpord.LockAndCheckpoint(pb.LockAndCheckpointRequest(
            pids=[PID], no_descendants=True, gpu_data_dir=str(image / agent_data.DATA_DIR),
            agent_container_id="ctr1"), Ctx())
    assert keep.read_text() == "x" and world.agent.intact
    with pytest.raises(Aborted, match="absolute"):
        torpord.LockAndCheckpoint(pb.LockAndCheckpointRequest(
            pids=[PID], gpu_data_dir="relative/dir", agent_container_id="ctr1"), Ctx())


def test_no_agent_prepares_unless_the_journal_on_disk_names_it(world, monkeypatch):
    """A recovery resumes the agents its journal entry names: an entry that did not reach the
    disk (a lost write, simulated) stops the operation before any prepare."""
    from torpor.journal import Journal
    save = Journal._save
    monkeypatch.setattr(Journal, "_save", lambda self, e: None if e.phase == "agent-prepare"
                        else save(self, e))
    with pytest.raises(RolledBackError, match="does not cover the agent-prepare"):
        process.suspend(world.engine(), PID)
    assert not any(e.startswith("agent prepare") or e.startswith("driver lock")
                   for e in world.log())
    assert world.agent.intact


# -- held GPU memory (agent/PROTOCOL.md `detach hold`, `resume held=N`) ---------------------------

def _open_fds(agent: FakeAgent) -> set[str]:
    """This process's descriptors once the fake agent (a thread of it) closed its side of
    every connection."""
    agent.wait_idle()
    return set(os.listdir("/proc/self/fd"))


def test_leave_running_holds_the_memory_through_the_dump_and_maps_it_back(world, fake_criu):
    """A program whose agent exported its memory (TORPOR_AGENT_VMM_EXPORT=1): torpor takes the
    descriptors at detach, keeps them through the driver's checkpoint and the dump, and the
    resume maps them back: the data files are not read, and no descriptor is left open."""
    world.agent.export = 3
    before = _open_fds(world.agent)
    m = process.checkpoint(world.engine(), PID, world.tmp / "ckpt", leave_running=True)
    log = world.log()
    assert log[log.index("agent prepare"):] == [
        "agent prepare", "agent detach", "driver lock", "driver checkpoint", "criu dump",
        "driver restore", "driver unlock", "agent status", "agent resume", "agent resume-held"]
    assert world.agent.intact and world.agent.resumed_held is True
    assert "held on the GPU through the dump" in world.out.getvalue()
    # the checkpoint itself has every byte: written out from the staged files as before
    assert sum(m["files"][r]["size"] for r in agent_data.rel_paths(PID, 3)) == \
        len(world.agent.original)
    assert "held" not in m["agent"][str(PID)]     # this operation's, not the checkpoint's
    manifest.verify(world.tmp / "ckpt", manifest.read(world.tmp / "ckpt"))
    assert _open_fds(world.agent) == before
    # the next checkpoint (periodic ones) holds its own memory and maps that back, not
    # refused as the earlier one's
    world.agent.resumed_held = None
    process.checkpoint(world.engine(), PID, world.tmp / "ckpt2", leave_running=True)
    assert world.agent.intact and world.agent.resumed_held is True
    assert _open_fds(world.agent) == before


def test_leave_running_says_why_the_memory_is_not_held(world, fake_criu):
    """An agent asked to hold that held nothing says why; the operator is told, the copy back
    is as without held memory, and the manifest keeps no word of it."""
    world.agent.hold_error = "an allocation of 4096 bytes at 0x7f00 is not exportable"
    m = process.checkpoint(world.engine(), PID, world.tmp / "ckpt", leave_running=True)
    assert f"PID {PID}: its GPU memory is copied back after the dump, not held on the GPU " \
        "(an allocation of 4096 bytes at 0x7f00 is not exportable)" in world.out.getvalue()
    assert world.agent.intact and world.agent.resumed_held is False
    assert "hold_error" not in m["agent"][str(PID)]


def test_a_checkpoint_that_ends_the_program_holds_nothing(world, fake_criu):
    world.agent.export = 2
    before = _open_fds(world.agent)
    process.checkpoint(world.engine(), PID, world.tmp / "ckpt")
    assert "agent detach" in world.log() and world.agent.exported == []
    assert world.agent.resumed_held is None and _open_fds(world.agent) == before


def test_a_suspend_holds_nothing(world):
    """A suspend frees the GPU: its memory is never held."""
    world.agent.export = 2
    process.suspend(world.engine(), PID)
    assert world.agent.exported == [] and world.agent.state == "detached"
    process.resume(world.engine(), PID)
    assert world.agent.intact and world.agent.resumed_held is False


def test_a_failed_dump_rolls_back_through_the_held_memory(world, fake_criu):
    world.agent.export = 2
    fake_criu["dump"] = True
    before = _open_fds(world.agent)
    with pytest.raises(RolledBackError, match="dump failed"):
        process.checkpoint(world.engine(), PID, world.tmp / "ckpt", leave_running=True)
    assert world.log()[-2:] == ["agent resume", "agent resume-held"]
    assert world.agent.intact and _open_fds(world.agent) == before


def test_held_memory_the_agent_does_not_recognise_is_copied_back_from_the_files(world,
                                                                               fake_criu):
    world.agent.export = 2
    real_export = world.agent._export

    def export() -> int:   # the agent recorded other files than it sends
        n = real_export()
        world.agent.exported_ids = [(0, 0)] * n
        return n

    world.agent._export = export
    before = _open_fds(world.agent)
    process.checkpoint(world.engine(), PID, world.tmp / "ckpt", leave_running=True)
    log = world.log()
    assert "agent held-refused" in log and "agent resume-held" not in log
    assert world.agent.intact and world.agent.resumed_held is False
    assert _open_fds(world.agent) == before


def test_an_agent_that_sends_fewer_descriptors_than_it_said_is_resumed_from_the_files(
        world, fake_criu):
    world.agent.export = 2
    real_detach = world.agent._do_detach

    def detach(arg, fds):   # says 2, sends 1
        reply = real_detach(arg, fds)
        os.close(world.agent._out_fds.pop())
        return reply

    world.agent._do_detach = detach
    before = _open_fds(world.agent)
    process.checkpoint(world.engine(), PID, world.tmp / "ckpt", leave_running=True)
    assert world.agent.intact and world.agent.resumed_held is False
    assert _open_fds(world.agent) == before


def test_the_manifest_and_the_cli_say_how_much_stayed_on_the_gpu(world, fake_criu):
    from torpor.cli.checkpoint import pause_line
    world.agent.export = 3
    m = process.checkpoint(world.engine(), PID, world.tmp / "ck", leave_running=True)
    assert m["pause"]["held"] == 3 and manifest.read(world.tmp / "ck")["pause"]["held"] == 3
    assert "3 allocation(s) of GPU memory kept on the GPU (not copied back)" in \
        pause_line(m["pause"], 1.0)
    world.log()
    world.agent.export = 0      # nothing held: the line says nothing of it
    m = process.checkpoint(world.engine(), PID, world.tmp / "ck2", leave_running=True)
    assert m["pause"]["held"] == 0 and "kept on the GPU" not in pause_line(m["pause"], 1.0)


def test_a_rollback_that_fails_still_closes_the_held_descriptors(world, fake_criu):
    """The driver's checkpoint fails and so does the rollback's unlock: the journal entry
    stays for the next torpor, which resumes from the files; this one must not keep the
    program's GPU memory held meanwhile (with it, the next resume would hold it twice)."""
    world.agent.export = 2
    world.driver.fail.update(checkpoint=PID, unlock=PID)
    e = world.engine()
    before = _open_fds(world.agent)
    with pytest.raises(TorporError, match="rollback failed"):
        process.checkpoint(e, PID, world.tmp / "ckpt", leave_running=True)
    assert e._held == {} and _open_fds(world.agent) == before
    assert world.agent.state == "detached" and world.journal_entries() != []
    world.driver.fail.clear()
    world.engine().recover()
    assert world.agent.intact and world.agent.resumed_held is False
    assert world.journal_entries() == []


def test_recovery_after_a_torpor_killed_while_it_holds_the_memory(world, tmp_path):
    """A --leave-running checkpoint's torpor SIGKILLed in CRIU's dump, after `detach hold`:
    its held descriptors (the only ones left: the agent closed its own) went with it, so the
    GPU memory is gone; the next torpor gives the program its memory back from the staged
    files, intact, and leaves nothing staged nor journalled."""
    world.agent.export = 2
    images, said = tmp_path / "ckpt", tmp_path / "held.json"
    code = textwrap.dedent(f"""
        import dataclasses, json, os, signal
        from pathlib import Path
        from tests.fakes.fake_agent import Events, FakeDriver
        from torpor import config, criu, engine, gpus
        from torpor.flows import process
        from torpor.errors import NoDriverError
        drv = FakeDriver(Events(), [{PID}])
        engine.load_driver = lambda path: drv
        def nonvml(): raise NoDriverError("none")
        gpus.discover = nonvml
        cfg = dataclasses.replace(config.load(), suspend_dir=Path({str(world.cfg.suspend_dir)!r}),
                                  agent_files=2, suspend_in_process=False)
        e = engine.Engine(cfg)
        class Tool:
            version_text = "4.0-fake"
        def dump(tool, cfg, pid, images_dir, **kw):   # torpor dies in the dump
            fds = [fd for held in e._held.values() for fd in held]
            Path({str(said)!r}).write_text(json.dumps(
                {{"pids": list(e._held), "fds": [os.readlink(f"/proc/self/fd/{{fd}}")
                                                  for fd in fds]}}))
            os.kill(os.getpid(), signal.SIGKILL)
        criu.find = lambda cfg: Tool()
        criu.dump = dump
        process.checkpoint(e, {PID}, Path({str(images)!r}), leave_running=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -9, proc.stderr
    held = json.loads(said.read_text())
    assert held["pids"] == [PID] and len(held["fds"]) == 2     # it held them in the dump
    assert all("fake-held" in f for f in held["fds"])
    assert world.log()[-2:] == ["agent prepare", "agent detach"]
    assert world.agent.state == "detached" and world.agent.exported == []
    world.driver.states[PID] = world.driver.S.CHECKPOINTED   # where the dead one left it
    (entry,) = world.journal_entries()
    doc = json.loads(entry.read_text())
    assert doc["phase"] == "dump" and doc["scratch"] is True
    assert Path(doc["data_root"]).parent == world.cfg.suspend_dir   # staged
    messages = world.engine().recover()
    assert world.log() == ["driver restore", "driver unlock", "agent status", "agent resume"]
    assert world.agent.intact and world.agent.resumed_held is False   # from the files
    assert any("back the GPU memory their agent had moved" in m for m in messages), messages
    assert list(world.cfg.suspend_dir.iterdir()) == [] and world.journal_entries() == []
    assert not (images / manifest.DRAFT).exists()
    assert world.engine().recover() == []


def test_a_leave_running_checkpoint_of_two_programs_one_holding(world, fake_criu, monkeypatch):
    """Two programs under the agent in one tree: the one whose agent exported its memory is
    mapped back, the other copied back from the files, both at once (_parallel), and no
    descriptor is left open."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        monkeypatch.setattr("torpor.agent._peer_pid", lambda sock: 0)  # one process serves both
        world.driver.states[child.pid] = world.driver.S.RUNNING
        other = FakeAgent(world.agents_dir / f"agent-{child.pid}.sock", log=world.events,
                          driver=world.driver, pid=child.pid).start()
        try:
            world.agent.export = 2
            before = _open_fds(world.agent)
            process.checkpoint(world.engine(), PID, world.tmp / "ckpt", leave_running=True)
            ev = world.events()
            assert {f"agent resume {PID}", f"agent resume {child.pid}",
                    f"agent resume-held {PID}"} <= set(ev)
            assert f"agent resume-held {child.pid}" not in ev
            assert world.agent.intact and world.agent.resumed_held is True
            assert other.intact and other.resumed_held is False
            assert _open_fds(world.agent) == before
        finally:
            other.stop()
    finally:
        child.kill()
        child.wait()


def test_held_memory_moves_from_the_checkpoints_engine_to_the_restores(world):
    """torpord's two calls of a container's leave-running checkpoint, each with its engine:
    the first hands what its agents hold over (take_held: it keeps none, so its end closes
    nothing), the second takes it (give_held) and its resume maps the memory back."""
    world.agent.export = 2
    a = world.engine()
    op = a.begin("checkpoint", [PID])
    a.lock_and_checkpoint(op, [PID], data=agent_data.DataDir.scratch(world.cfg, PID),
                          scratch=True, hold=True)
    held = a.take_held()
    assert list(held) == [PID] and len(held[PID]) == 2
    assert a.held_counts() == {} and a.take_held() == {}
    a.release_held()                  # the first call's end: nothing of it to close
    files = {(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in held[PID]}   # still open
    assert len(files) == 2
    b = world.engine()
    b.give_held(held)
    assert b.held_counts() == {PID: 2}
    agents = targets_of(op.entry.agents)
    back = b.restore_and_unlock(op, [PID], agents=agents)
    assert back[PID]["held"] is True and world.agent.resumed_held is True
    assert world.log()[-2:] == ["agent resume", "agent resume-held"]
    b.release_held()
    assert world.agent.intact
    # the resume closed them all: none of their files is open in this process any more
    open_files = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
            open_files.add((st.st_dev, st.st_ino))
        except OSError:
            pass
    assert not files & open_files
    op.close()


def test_a_restore_onto_another_gpu_lets_the_held_memory_go_first(world):
    """Held memory is on the GPU it was on: an engine's restore that remaps the program's GPU
    closes what it holds before anything, and the program copies its memory from the files."""
    world.agent.export = 2
    e = world.engine()
    op = e.begin("checkpoint", [PID])
    e.lock_and_checkpoint(op, [PID], data=agent_data.DataDir.scratch(world.cfg, PID),
                          scratch=True, hold=True)
    assert e.held_counts() == {PID: 2}
    back = e.restore_and_unlock(op, [PID], gpu_map={"GPU-aaaa": "GPU-bbbb"},
                                agents=targets_of(op.entry.agents))
    assert e.held_counts() == {} and back[PID]["held"] is False
    assert world.agent.resumed_held is False and world.agent.intact
    op.close()


# -- a container's deferred copy (torpord: copiers fill the staging beside the dump) -------------

FAKE_COPIER = Path(__file__).resolve().parents[1] / "fakes" / "fake_copier.py"


@pytest.fixture
def drain_torpord(world, monkeypatch):
    """torpord with leave_running_drain on, its copier the stand-in for the fake agent's
    memory (tests/fakes/fake_copier.py), the container's agent holding its memory."""
    from torpor import copier
    from torpor.agent import container_dir
    from torpor.sidecar.service import Service
    monkeypatch.setattr(copier, "BINARY", FAKE_COPIER)
    cdir = container_dir(world.cfg.run_dir, "ctr1")
    cdir.mkdir(parents=True, mode=0o700)
    world.agent.stop()
    world.agent = FakeAgent(cdir / f"agent-{PID}.sock", log=world.events,
                            driver=world.driver).start()
    world.agent.export = 2
    world.cfg.suspend_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    s = Service(dataclasses.replace(world.cfg, leave_running_drain=True), op_timeout_s=60)
    yield s
    world.agent.stop()


def _staged_checkpoint(torpord, drain: bool = True) -> tuple[Any, Path]:
    stage = torpord.cfg.suspend_dir / "stage-1"
    ck = torpord.LockAndCheckpoint(torpord.pb.LockAndCheckpointRequest(
        pids=[PID], no_descendants=True, gpu_data_dir=str(stage), agent_container_id="ctr1",
        staged=True, drain=drain), Ctx())
    return ck, stage


def test_a_caller_that_does_not_read_drain_errors_gets_no_deferred_copy(world, drain_torpord):
    """An older torpor-runtime (no `drain` in its request) would write out and seal a staging
    a failed copier left empty: torpord copies in the agents for it, as without copiers."""
    ck, stage = _staged_checkpoint(drain_torpord, drain=False)
    assert "agent prepare-defer" not in world.log()
    r = drain_torpord.RestoreAndUnlock(drain_torpord.pb.RestoreAndUnlockRequest(
        op_id=ck.op_id), Ctx())
    assert r.drained == 0 and r.drain_error == "", r
    assert world.agent.intact
    files = sorted((stage / str(PID)).iterdir())
    assert [f.read_bytes() for f in files] == _layout(world.agent.original, 3)


def _layout(original: bytes, n: int) -> list[bytes]:
    """The fake agent's data files: file k holds chunks k, k + n, ... back to back."""
    from tests.fakes.fake_agent import CHUNK
    chunks = [original[i:i + CHUNK] for i in range(0, len(original), CHUNK)]
    return [b"".join(chunks[k::n]) for k in range(n)]


def test_a_container_copy_is_left_to_a_copier_beside_the_dump(world, drain_torpord):
    """A staged (--leave-running) checkpoint of a container whose agent holds its memory:
    the copier, ready before the pause, fills the staging while runc dumps; RestoreAndUnlock
    waits for it, maps the memory back and says what it copied. The staging then holds what
    a plain prepare writes, byte for byte."""
    ck, stage = _staged_checkpoint(drain_torpord)
    log = world.log()
    assert "agent prepare-defer" in log and "agent detach" in log, log
    assert "copier-ready" in ck.timings
    r = drain_torpord.RestoreAndUnlock(drain_torpord.pb.RestoreAndUnlockRequest(
        op_id=ck.op_id), Ctx())
    assert r.drain_error == "" and r.drained == len(world.agent.original), r
    assert world.agent.intact and world.agent.resumed_held is True
    files = sorted((stage / str(PID)).iterdir())
    assert [f.read_bytes() for f in files] == _layout(world.agent.original, 3)
    assert drain_torpord.ops.open_ops() == [] and world.journal_entries() == []


def test_a_container_copy_that_fails_says_so_and_the_program_runs_on(world, drain_torpord,
                                                                     monkeypatch):
    monkeypatch.setenv("FAKE_COPIER_FAIL", "pinned host memory: CUresult 2")
    ck, stage = _staged_checkpoint(drain_torpord)
    r = drain_torpord.RestoreAndUnlock(drain_torpord.pb.RestoreAndUnlockRequest(
        op_id=ck.op_id), Ctx())
    assert r.drain_error == f"PID {PID}: pinned host memory: CUresult 2", r
    assert world.agent.intact and world.agent.resumed_held is True
    assert drain_torpord.ops.open_ops() == [] and world.journal_entries() == []


def test_a_restore_in_place_is_the_only_one_of_a_container_with_a_deferred_copy(
        world, drain_torpord, monkeypatch):
    """The copier copies the memory on the GPU it is on: a RestoreAndUnlock that would move
    that GPU is refused, and the operation stays open for the restore in place."""
    monkeypatch.setenv("FAKE_COPIER_DELAY_S", "0.3")
    ck, stage = _staged_checkpoint(drain_torpord)
    with pytest.raises(Aborted, match="cannot move them .GPU-aaaa -> GPU-bbbb"):
        drain_torpord.RestoreAndUnlock(drain_torpord.pb.RestoreAndUnlockRequest(
            op_id=ck.op_id, gpu_map={"GPU-aaaa": "GPU-bbbb"}), Ctx())
    assert [o.id for o in drain_torpord.ops.open_ops()] == [ck.op_id]
    r = drain_torpord.RestoreAndUnlock(drain_torpord.pb.RestoreAndUnlockRequest(
        op_id=ck.op_id, gpu_map={"GPU-aaaa": "GPU-aaaa"}), Ctx())
    assert r.drain_error == "" and r.drained == len(world.agent.original), r
    assert world.agent.intact and world.agent.resumed_held is True
    files = sorted((stage / str(PID)).iterdir())
    assert [f.read_bytes() for f in files] == _layout(world.agent.original, 3)


def test_a_failed_dump_of_a_container_with_a_deferred_copy_rolls_back_through_the_memory(
        world, drain_torpord, monkeypatch):
    """runc's dump failed (Rollback) while the copier still copies: the rollback waits for it,
    then maps the held memory back; nothing copied back, nothing left open."""
    monkeypatch.setenv("FAKE_COPIER_DELAY_S", "0.5")
    ck, _ = _staged_checkpoint(drain_torpord)
    drain_torpord.Rollback(drain_torpord.pb.OperationRequest(op_id=ck.op_id), Ctx())
    assert world.agent.intact and world.agent.resumed_held is True
    assert drain_torpord.ops.open_ops() == [] and world.journal_entries() == []


def test_a_finish_of_a_container_with_a_deferred_copy_waits_for_the_copier(
        world, drain_torpord, monkeypatch):
    """A Finish (the dump ended the program; here it lives on, so it is brought back): the
    copier is waited for before the memory is let go, and the program comes back from the
    files it filled."""
    monkeypatch.setenv("FAKE_COPIER_DELAY_S", "0.5")
    ck, _ = _staged_checkpoint(drain_torpord)
    drain_torpord.Finish(drain_torpord.pb.OperationRequest(op_id=ck.op_id), Ctx())
    assert world.agent.intact and world.agent.resumed_held is False
    assert drain_torpord.ops.open_ops() == [] and world.journal_entries() == []


def test_an_end_that_cannot_make_an_engine_gives_unfilled_memory_back_to_the_agent(
        world, drain_torpord, monkeypatch):
    """The operation's end could make no engine (its state directory unusable): the held
    memory of a copy not yet filled is not closed away (the copier, which may fail, would
    hold the only copy): it goes back to the program's agent."""
    monkeypatch.setenv("FAKE_COPIER_DELAY_S", "0.5")
    monkeypatch.setenv("FAKE_COPIER_FAIL", "pinned host memory: CUresult 2")
    ck, _ = _staged_checkpoint(drain_torpord)
    o = drain_torpord.ops.take(ck.op_id)
    assert o.held and o.copies
    copiers = list(o.copies.copiers.values())

    def no_engine():
        raise TorporError("journal: the state directory is unusable")
    with pytest.raises(TorporError):
        with o.ending(no_engine):
            pass
    for c in copiers:   # the copier fails and exits: its descriptors go with it
        c.proc.communicate()
    assert world.agent.exported, "nobody holds the GPU memory"
    o.op.release()
    world.engine().recover()          # the entry's recovery takes the memory back
    assert world.agent.intact and world.agent.resumed_held is True


def test_a_restore_says_drained_only_for_a_deferred_checkpoint(world, fake_criu, monkeypatch):
    """`drained` is for an agent dumped while its save was deferred: a plain checkpoint's
    restore sends a plain resume, which an agent older than the word takes."""
    images = world.tmp / "ckpt"
    process.checkpoint(world.engine(), PID, images)
    real = world.agent._do_resume

    def old_resume(arg, fds):
        if "drained" in arg.split():
            for fd in fds:
                os.close(fd)
            return {"ok": False, "error": "unknown command"}
        return real(arg, fds)
    world.agent.__dict__["_do_resume"] = old_resume
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    process.restore(world.engine(), images)
    assert world.agent.intact and killed == []
