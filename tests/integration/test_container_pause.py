"""Short pauses for containers (issue 20, item 3): a podman --leave-running checkpoint of a
container under the (fake) agent stages its GPU data in host memory and torpor-runtime (this
venv's, behind a wrapper) writes it into the image directory once the container runs again.

What is checked: the pause (torpor.json's "pause", the runtime's log) ends well before the
write-out, slowed to writeout_rate_mbps, does; podman gets a complete image directory (its
export restores every byte); nothing stays staged; a write-out onto a full disk leaves the
container running, torpor-runtime exits 8 with one line, nothing staged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from integration.containers import Podman
from tests.integration.conftest import agent_dir, wait_for
from tests.integration.test_agent_containers import _events, agent_workload, restored_intact
from tests.integration.test_containers_gpu import (  # noqa: F401  (fixtures)
    fake_nodes, name, needs_criu)
from tests.integration.torpord import Daemon, base, gpu  # noqa: F401  (fixtures)
from torpor.agent import AgentClient

pytestmark = [needs_criu, pytest.mark.criu]
RUNTIME = Path(sys.executable).parent / "torpor-runtime"   # this tree's
NBYTES = 48 << 20
RATE_MBPS = 16          # the write-out takes about 3 s


CONFIG = f"writeout_rate_mbps = {RATE_MBPS}\nsuspend_tmpfs = false\n"
# the staged and the held ways; the deferred copy (the default) has its own fixture below, whose
# copier is the fake GPU's
STAGED = CONFIG + "leave_running_drain = false\n"


@pytest.fixture
def daemon(base, gpu):
    """torpord and torpor-runtime (the same config) staging in this test's own suspend_dir."""
    d = Daemon(base, gpu, STAGED + f'suspend_dir = "{base / "shm"}"\n').start()
    yield d
    d.stop()


@pytest.fixture
def mine(base, daemon, gpu, podman_image):
    return _podman_for(daemon, base)


def _podman_for(daemon: Daemon, base: Path) -> Podman:
    """podman with this tree's torpor-runtime, in daemon's environment (its config)."""
    if not os.access(RUNTIME, os.X_OK):
        pytest.skip(f"no torpor-runtime beside {sys.executable}")
    env = {k: v for k, v in daemon.env.items()
           if k.startswith(("TORPOR_", "FAKE_CUDA")) or k == "LD_LIBRARY_PATH"}
    wrapper = base / "torpor-runtime-mine"
    wrapper.write_text("#!/bin/sh\n" + "".join(f"export {k}='{v}'\n" for k, v in env.items())
                       + f'exec {RUNTIME} "$@"\n')
    wrapper.chmod(0o700)
    return Podman(str(wrapper), timeout=120)


def _start(podman, gpu, daemon, base, name, export: int = 0) -> tuple[Path, Path]:
    nodes = fake_nodes(base)
    events = gpu.state_dir / "agent-events"
    argv, env, mounts = agent_workload(gpu, "pz", NBYTES, events)
    argv += ["--export", str(export)] if export else []
    podman.run(name, argv, mounts=mounts, env=env, annotations={"org.torpor.agent": "on"},
               devices=[f"{nodes[0]}:/dev/nvidia0", f"{nodes[255]}:/dev/nvidiactl"])
    sock = agent_dir(daemon.cfg.run_dir, podman.inspect(name, "{{.Id}}")) / "agent-1.sock"
    wait_for(lambda: sock.exists() and gpu.proc_entry("pz.1"), 20, "the program under its agent")
    return events, sock


def _staged(daemon) -> set[Path]:
    """suspend_dir's entries."""
    d = Path(daemon.cfg.suspend_dir)
    return set(d.iterdir()) if d.is_dir() else set()


def _leave_running(podman, name: str, images: Path, until: str) -> subprocess.Popen:
    """`podman container checkpoint --leave-running name`, started once `until` appears in
    the image directory (".torpor-writing": the dump under way; "torpor-gpu": the write-out),
    looked for every millisecond: the moment a kill is meant to land in is short."""
    ck = subprocess.Popen([*podman.base, "container", "checkpoint", "--leave-running", name],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (images / until).exists():
        if time.monotonic() > deadline or ck.poll() is not None:
            out, _ = ck.communicate()
            raise AssertionError(f"no {until} in {images}: {out}")
        time.sleep(0.001)
    return ck


def test_leave_running_pause_is_shorter_than_the_write_out(mine, gpu, daemon, base, name):
    podman = mine
    events, sock = _start(podman, gpu, daemon, base, name)
    try:
        archive = base / "ck.tar"
        podman.checkpoint(name, export=archive, leave_running=True, compress="none")
        assert podman.state(name) == "running"
        assert _events(events)[-1] == "agent resume"   # the agent has its memory back
        assert _staged(daemon) == set()
        with tarfile.open(archive) as tf:
            m = json.loads(tf.extractfile("checkpoint/torpor.json").read())
            names = tf.getnames()
        pause = m["pause"]
        assert pause["staged"] is True, (pause, daemon.log_text())
        writeout_s = NBYTES / (RATE_MBPS * 1e6)
        # paused for the copy to host memory and the dump only; durable after the write-out
        assert pause["durable_s"] - pause["paused_s"] >= 0.8 * writeout_s, pause
        assert pause["paused_s"] < pause["durable_s"] / 2, pause
        assert m["timings"]["writeout"] >= 0.8 * writeout_s, m["timings"]
        pid = next(iter(m["agent"]))
        assert all(f"checkpoint/torpor-gpu+{pid}+gpu-memory-{k}.bin" in names
                   for k in range(len(m["agent"][pid]["files"]))), names
        log = (daemon.cfg.state_dir / "runtime.log").read_text()
        assert f"paused {pause['paused_s']:.2f} s, durable after" in log, log[-2000:]
        with AgentClient(sock) as a:
            assert a.status()["state"] == "running"

        podman.rm(name)
        events.unlink()
        restored_intact(podman, daemon, name, archive, events)
    finally:
        podman.rm(name)


def test_a_container_holds_its_gpu_memory_through_the_pause(mine, gpu, daemon, base, name):
    """A container whose agent exports its memory (TORPOR_AGENT_VMM_EXPORT=1's held memory):
    torpord takes the descriptors at LockAndCheckpoint, keeps them with the open operation
    through runc's dump, and its RestoreAndUnlock maps them back, copying nothing back; the
    checkpoint still has every byte (its data written out from the staging) and restores."""
    podman = mine
    events, sock = _start(podman, gpu, daemon, base, name, export=2)
    try:
        archive = base / "ck.tar"
        podman.checkpoint(name, export=archive, leave_running=True, compress="none")
        assert podman.state(name) == "running"
        ev = _events(events)
        assert ev[-2:] == ["agent resume", "agent resume-held"], ev
        assert _staged(daemon) == set()
        with tarfile.open(archive) as tf:
            m = json.loads(tf.extractfile("checkpoint/torpor.json").read())
        assert m["pause"]["held"] == 2 and m["pause"]["staged"] is True, m["pause"]
        assert m["pause"]["criu"]["pages_written"] > 0, m["pause"]
        pid = next(iter(m["agent"]))
        assert m["agent"][pid]["bytes"] == NBYTES, m["agent"][pid]
        with AgentClient(sock) as a:
            st = a.status()
        assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True)
        held = [fd for fd in os.listdir(f"/proc/{daemon.proc.pid}/fd")
                if "memfd:" in _link(daemon.proc.pid, fd)]
        assert held == [], held      # torpord keeps none once it is over

        podman.rm(name)
        events.unlink()
        # from the data files: every byte was written out
        restored_intact(podman, daemon, name, archive, events)
    finally:
        podman.rm(name)


def _link(pid: int, fd: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def _fill(path: Path) -> None:
    """Fill path's filesystem up (the write-out racing for the same space)."""
    block = b"\xa5" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError:
                try:
                    f.write(block[:4096])
                except OSError:
                    return


def test_disk_full_during_the_write_out_leaves_the_container_running(mine, gpu, daemon, base,
                                                                     name):
    podman = mine
    events, sock = _start(podman, gpu, daemon, base, name)
    images = podman.bundle(name) / "checkpoint"
    images.mkdir(mode=0o700, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192m,mode=0700", "tmpfs", str(images)],
                   check=True)
    try:
        ck = subprocess.Popen([*podman.base, "container", "checkpoint",
                               "--leave-running", name], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        # the container runs again, its data being written out: the disk fills up
        wait_for(lambda: (images / ".torpor-writing").exists()
                 and (images / "torpor-gpu").exists(), 60, "the write-out")
        _fill(images / "filler")
        out, _ = ck.communicate(timeout=120)
        assert ck.returncode != 0, out
        assert "writeout failed" in out and "the container runs on" in out, out
        assert podman.state(name) == "running"
        with AgentClient(sock) as a:
            st = a.status()
        assert (st["state"], st["gate"]) == ("running", "open"), st
        assert _staged(daemon) == set()
        assert (images / "torpor-damaged.txt").exists() and \
            not (images / "torpor.json").exists(), sorted(os.listdir(images))
    finally:
        subprocess.run(["umount", "-l", str(images)], check=False)
        podman.rm(name)


def _runtime_pids(cid: str) -> list[int]:
    """torpor-runtime's checkpoint of cid (the wrapper execs it), however it is started."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"torpor-runtime" in a for a in argv) and b"checkpoint" in argv \
                and cid.encode() in argv:
            out.append(int(d.name))
    return out


def test_torpor_runtime_killed_during_the_write_out_is_recovered(mine, gpu, daemon, base, name):
    """SIGKILL of torpor-runtime while it writes out: the container runs on; the next
    recovery (its journal entry) marks the image directory damaged, never a checkpoint, and
    nothing of the staging stays in host memory."""
    from torpor.engine import Engine
    podman = mine
    events, sock = _start(podman, gpu, daemon, base, name)
    cid = podman.inspect(name, "{{.Id}}")
    images = podman.bundle(name) / "checkpoint"
    try:
        ck = _leave_running(podman, name, images, "torpor-gpu")
        for pid in _runtime_pids(cid):
            os.kill(pid, 9)
        out, _ = ck.communicate(timeout=120)
        assert ck.returncode != 0, out
        assert podman.state(name) == "running"
        # ours, or torpord's periodic one, whichever comes first
        wait_for(lambda: Engine(daemon.cfg).recover() is not None
                 and (images / "torpor-damaged.txt").exists(), 60, "the recovery")
        assert (images / "torpor-damaged.txt").exists() and \
            not (images / "torpor.json").exists(), sorted(os.listdir(images))
        assert _staged(daemon) == set()
        with AgentClient(sock) as a:
            st = a.status()
        assert (st["state"], st["gate"]) == ("running", "open"), st
    finally:
        podman.rm(name)


def test_torpor_runtime_killed_during_the_dump_is_rolled_back(mine, gpu, daemon, base, name):
    """SIGKILL of torpor-runtime once the image directory is marked (the dump under way):
    torpord rolls its operation back (the agents get their data back from the staging, which
    then goes), and the recovery of the runtime's own entry marks the directory damaged."""
    from torpor.engine import Engine
    podman = mine
    events, sock = _start(podman, gpu, daemon, base, name)
    cid = podman.inspect(name, "{{.Id}}")
    images = podman.bundle(name) / "checkpoint"
    try:
        ck = _leave_running(podman, name, images, ".torpor-writing")
        for pid in _runtime_pids(cid):
            os.kill(pid, 9)
        assert not (images / "torpor-gpu").exists()   # killed before its write-out
        out, _ = ck.communicate(timeout=120)
        assert ck.returncode != 0, out
        wait_for(lambda: _staged(daemon) == set() and _events(events)[-1] == "agent resume", 60,
                 "torpord's rollback")
        assert podman.state(name) == "running"
        # never a checkpoint: marked damaged by the recovery of the runtime's entry (ours, or
        # torpord's periodic one), or still marked WRITING (killed before its entry was made)
        Engine(daemon.cfg).recover()
        assert not (images / "torpor.json").exists(), sorted(os.listdir(images))
        assert (images / "torpor-damaged.txt").exists() or \
            (images / ".torpor-writing").exists(), sorted(os.listdir(images))
        with AgentClient(sock) as a:
            st = a.status()
        assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True), st
    finally:
        podman.rm(name)


def _kill_torpord(daemon) -> None:
    """SIGKILL of torpord (and any a torpor-runtime started meanwhile), then a new one."""
    want = f"TORPOR_STATE_DIR={daemon.cfg.state_dir}".encode()
    for d in Path("/proc").iterdir():
        try:
            if b"torpor.sidecar.daemon" in (d / "cmdline").read_bytes() and \
                    want in (d / "environ").read_bytes().split(b"\0"):
                os.kill(int(d.name), 9)
        except (OSError, ValueError):
            continue
    daemon.proc.wait(timeout=20)
    try:
        daemon.start()
    except AssertionError:      # lost the race to one a torpor-runtime started
        pass


def _runs_on_with_no_checkpoint(podman, daemon, name: str, images: Path, sock: Path) -> None:
    """After torpord's death mid-checkpoint and its successor's recovery: the container runs,
    its agent open and intact, no checkpoint left, no journal entry."""
    from torpor.engine import Engine
    assert podman.state(name) == "running"
    Engine(daemon.cfg).recover()
    assert not (images / "torpor.json").exists(), sorted(os.listdir(images))
    with AgentClient(sock) as a:
        st = a.status()
    assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True), st
    assert not list((daemon.cfg.state_dir / "journal").glob("*.json"))


@pytest.mark.parametrize("export", [0, 2])
def test_torpord_killed_during_the_dump_of_a_staged_checkpoint(mine, gpu, daemon, base, name,
                                                               export):
    """SIGKILL of torpord while runc dumps (its operation open, the agents' data staged; with
    export, their memory held by torpord's descriptors, which close with it): the new
    torpord's recovery gives the agents their data back from the staging and removes it;
    torpor-runtime, its operation lost, says the container runs on and leaves no
    checkpoint."""
    podman = mine
    events, sock = _start(podman, gpu, daemon, base, name, export=export)
    images = podman.bundle(name) / "checkpoint"
    try:
        ck = _leave_running(podman, name, images, ".torpor-writing")
        assert not (images / "torpor-gpu").exists()    # still dumping
        if export:   # torpord holds the container's memory now
            held = [fd for fd in os.listdir(f"/proc/{daemon.proc.pid}/fd")
                    if "memfd:" in _link(daemon.proc.pid, fd)]
            assert len(held) == export, held
        _kill_torpord(daemon)
        out, _ = ck.communicate(timeout=120)
        assert ck.returncode != 0, out
        wait_for(lambda: _staged(daemon) == set() and _events(events)[-1] == "agent resume", 60,
                 "the new torpord's recovery")
        assert "agent resume-held" not in _events(events)   # the held memory went with it
        _runs_on_with_no_checkpoint(podman, daemon, name, images, sock)
    finally:
        podman.rm(name)


def test_torpord_killed_during_the_write_out_changes_nothing(mine, gpu, daemon, base, name):
    """The write-out is torpor-runtime's alone (torpord's operation ended when the container
    got its GPU back): torpord's death then leaves a whole checkpoint and nothing staged."""
    podman = mine
    events, sock = _start(podman, gpu, daemon, base, name)
    images = podman.bundle(name) / "checkpoint"
    try:
        ck = _leave_running(podman, name, images, "torpor-gpu")
        _kill_torpord(daemon)
        out, _ = ck.communicate(timeout=120)
        assert ck.returncode == 0, out
        m = json.loads((images / "torpor.json").read_text())
        assert m["pause"]["staged"] is True and m["pause"]["durable_s"] > m["pause"]["paused_s"]
        assert _staged(daemon) == set() and podman.state(name) == "running"
        with AgentClient(sock) as a:
            st = a.status()
        assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True), st
    finally:
        podman.rm(name)


# -- the deferred copy (leave_running_drain): copiers fill the staging beside runc's dump --------

FAKE_COPIER = Path(__file__).resolve().parents[1] / "fakes" / "fake_copier.py"


@pytest.fixture
def drained(base, gpu, podman_image):
    """torpord and torpor-runtime with leave_running_drain; the copier is the stand-in for the
    fake agent's memory (its held descriptors are memfds of the bytes)."""
    d = Daemon(base, gpu, CONFIG + f'suspend_dir = "{base / "shm"}"\n'
               "leave_running_drain = true\n" + f'copier = "{FAKE_COPIER}"\n').start()
    yield d, _podman_for(d, base)
    d.stop()


def test_a_container_copy_is_left_to_a_copier_beside_the_dump(drained, gpu, base, name):
    """podman's --leave-running checkpoint of a container whose agent holds its memory: the
    copier fills the staging while runc dumps, the container gets its memory back mapped,
    the export has every byte (it restores intact) and says what was copied beside the dump."""
    daemon, podman = drained
    events, sock = _start(podman, gpu, daemon, base, name, export=2)
    try:
        archive = base / "ck.tar"
        podman.checkpoint(name, export=archive, leave_running=True, compress="none")
        assert podman.state(name) == "running"
        ev = _events(events)
        assert "agent prepare-defer" in ev and ev[-1] == "agent resume-held", ev
        assert _staged(daemon) == set()
        with tarfile.open(archive) as tf:
            m = json.loads(tf.extractfile("checkpoint/torpor.json").read())
        assert m["pause"]["drained"] == {"bytes": NBYTES} and m["pause"]["held"] == 2, m["pause"]
        assert "copier-ready" in m["timings"], m["timings"]
        with AgentClient(sock) as a:
            st = a.status()
        assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True)

        podman.rm(name)
        events.unlink()
        restored_intact(podman, daemon, name, archive, events)   # from the copier's files
    finally:
        podman.rm(name)


def test_a_container_copy_that_fails_fails_the_checkpoint_not_the_container(drained, gpu,
                                                                           base, name):
    daemon, podman = drained
    events, sock = _start(podman, gpu, daemon, base, name, export=2)
    images = podman.bundle(name) / "checkpoint"
    (gpu.state_dir / "fail").mkdir(exist_ok=True)
    (gpu.state_dir / "fail" / "torpor-copier").write_text("pinned host memory: CUresult 2\n")
    try:
        ck = subprocess.run([*podman.base, "container", "checkpoint", "--leave-running", name],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=120)
        assert ck.returncode != 0, ck.stdout
        assert "the copy of the GPU memory into the data files failed" in ck.stdout, ck.stdout
        assert "pinned host memory" in ck.stdout and "the container runs on" in ck.stdout
        assert podman.state(name) == "running"
        with AgentClient(sock) as a:
            st = a.status()
        assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True)
        assert _staged(daemon) == set()
        assert (images / "torpor-damaged.txt").exists() and \
            not (images / "torpor.json").exists(), sorted(os.listdir(images))
    finally:
        (gpu.state_dir / "fail" / "torpor-copier").unlink(missing_ok=True)
        podman.rm(name)


def test_torpord_killed_during_the_dump_of_a_drained_checkpoint(drained, gpu, base, name):
    """The default way (held memory, the copy left to a copier): SIGKILL of torpord while runc
    dumps. Its descriptors close with it, but the copier, in its own session, keeps its own
    and finishes the files; the new torpord's recovery waits for it and gives the agent its
    memory back from them (checked chunk by chunk by the fake agent). The container runs on,
    intact, and no checkpoint is left."""
    daemon, podman = drained
    events, sock = _start(podman, gpu, daemon, base, name, export=2)
    images = podman.bundle(name) / "checkpoint"
    try:
        ck = _leave_running(podman, name, images, ".torpor-writing")
        assert not (images / "torpor-gpu").exists()    # still dumping
        _kill_torpord(daemon)
        out, _ = ck.communicate(timeout=120)
        assert ck.returncode != 0, out

        def recovered() -> bool:
            with AgentClient(sock) as a:
                st = a.status()
            return _staged(daemon) == set() and st["state"] == "running"
        wait_for(recovered, 60, "the new torpord's recovery")
        assert "agent prepare-defer" in _events(events)
        _runs_on_with_no_checkpoint(podman, daemon, name, images, sock)
    finally:
        podman.rm(name)
