"""A GPU container whose program runs under an agent, through podman (and containerd),
torpor-runtime, torpord,
runc and CRIU, with the fake GPU: the program is tests/fakes/fake_agent.py's (a fake CUDA
program serving the Python fake of the agent's socket in /run/torpor/agents, which
torpor-runtime binds to the container's agent directory on the host, org.torpor.agent=on).

What is checked: torpord has the agent move the memory into the runtime's image directory
before the driver's lock; the files travel in podman's --export archive, listed with checksums
in torpor.json; CRIU neither minds them nor the program's socket; after the import the
restored program (a new host PID, the same PID inside) gets every byte back through its
restored socket, in the agent directory torpor-runtime made for the restored container.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from integration.containers import Containerd, ContainerError
from tests.integration.conftest import agent_dir, wait_for
from tests.integration.test_containers_gpu import (  # noqa: F401  (fixtures)
    GIB, containerd, fake_nodes, name, needs_criu, podman, shim)
from tests.integration.torpord import base, daemon, gpu  # noqa: F401  (fixtures)
from torpor.agent import AgentClient, _peer_pid
import pytest

pytestmark = [needs_criu, pytest.mark.criu]
PROGRAM = Path(__file__).resolve().parents[2] / "tests" / "fakes" / "fake_agent.py"


def agent_workload(gpu, label: str, nbytes: int, events: Path):
    """argv, env, mounts of a container running fake_agent.py on GPU 0, serving its socket in
    /run/torpor/agents (the container's agent directory) and holding nbytes."""
    _argv, env, mounts = gpu.container_workload(label, 0, GIB)
    argv = ["/usr/bin/python3", "-I", str(PROGRAM), "/run/torpor/agents", str(events),
            "--bytes", str(nbytes), "--lib", gpu.libcuda]
    mounts = [m for m in mounts if m[0] != str(PROGRAM)] + [(str(PROGRAM), str(PROGRAM), True)]
    return argv, {**env, "NVIDIA_VISIBLE_DEVICES": gpu.uuid(0)}, mounts


def restored_intact(podman, daemon, name: str, archive: Path, events: Path,
                    expect: tuple[str, ...] = ("agent status", "agent resume")) -> None:
    """podman restores name from archive: its agent saw expect, and runs with every byte."""
    podman.restore(import_=archive)
    assert _events(events) == list(expect)
    with AgentClient(agent_dir(daemon.cfg.run_dir, podman.inspect(name, "{{.Id}}"))
                     / "agent-1.sock") as a:
        st = a.status()
    assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True)


def test_podman_export_import_through_the_agent(podman, gpu, daemon, name, base):
    nodes = fake_nodes(base)
    events = gpu.state_dir / "agent-events"
    argv, env, mounts = agent_workload(gpu, "ag", 5 << 20, events)
    # The annotation: torpor-runtime makes the container's agent directory and binds it to
    # /run/torpor/agents (the program drops the real agent's preload and serves the fake).
    podman.run(name, argv, mounts=mounts, env=env,
               annotations={"org.torpor.agent": "on"},
               devices=[f"{nodes[0]}:/dev/nvidia0", f"{nodes[255]}:/dev/nvidiactl"])
    try:
        cid = podman.inspect(name, "{{.Id}}")
        sock = agent_dir(daemon.cfg.run_dir, cid) / "agent-1.sock"   # PID 1 in the container
        wait_for(lambda: sock.exists() and gpu.proc_entry("ag.1"), 20,
                 "the program under its agent")
        old_pid = podman.pid(name)

        # torpor checkpoint of the container's process: refused before anything is locked,
        # pointing to the engine (CRIU here could not dump its mounts)
        cli = subprocess.run([sys.executable, "-m", "torpor.cli.main", "checkpoint",
                              str(old_pid), "-D", str(base / "cli-ck")], env=daemon.env,
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 2 and f"runs in container {cid}" in cli.stderr, cli.stderr
        assert "podman container checkpoint" in cli.stderr and not (base / "cli-ck").exists()
        assert not events.exists() and podman.state(name) == "running"

        archive = base / "ck.tar"
        podman.checkpoint(name, export=archive, compress="none")
        assert [e.rsplit(" ", 1)[0] for e in events.read_text().splitlines()] == \
            ["agent status", "agent prepare", "agent detach"]
        events.unlink()
        with tarfile.open(archive) as tf:
            names = tf.getnames()
            m = json.loads(tf.extractfile("checkpoint/torpor.json").read())
        entry = m["agent"][str(old_pid)]
        assert entry["nspid"] == 1 and entry["bytes"] == 5 << 20
        for k, size in enumerate(entry["files"]):
            rel = f"torpor-gpu/{old_pid}/gpu-memory-{k}.bin"   # the file table's name
            assert f"checkpoint/torpor-gpu+{old_pid}+gpu-memory-{k}.bin" in names   # flat.py
            assert m["files"][rel]["size"] == size and m["files"][rel]["sha256"] is None
        podman.rm(name)

        # a byte of its GPU data changed: refused as damaged by the agent's resume, the
        # restored container stopped, the archive as it was
        bad = _one_byte_flipped(archive, f"checkpoint/torpor-gpu+{old_pid}+gpu-memory-0.bin",
                                base / "bad.tar")
        with pytest.raises(ContainerError) as err:
            podman.restore(import_=bad)
        out = err.value.stderr + err.value.stdout
        assert "damaged" in out and "unchanged" in out, out
        assert "agent resume" in _events(events)
        podman.rm(name)
        events.unlink()

        podman.restore(import_=archive)
        new_cid = podman.inspect(name, "{{.Id}}")
        assert podman.pid(name) != old_pid
        assert [e.rsplit(" ", 1)[0] for e in events.read_text().splitlines()] == \
            ["agent status", "agent resume"]
        new_dir = agent_dir(daemon.cfg.run_dir, new_cid)
        with AgentClient(new_dir / "agent-1.sock") as a:
            st = a.status()
        assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True)

        # an export made before the flat layout (torpor-gpu/<pid>/...) still imports
        podman.rm(name)
        old = _with_subdirectories(archive, base / "old-layout.tar")
        events.unlink()
        restored_intact(podman, daemon, name, old, events)
    finally:
        podman.rm(name)


def _one_byte_flipped(archive: Path, member: str, out: Path) -> Path:
    """archive with one byte of member, halfway, changed."""
    import io
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m) if m.isfile() else None
            if m.name == member:
                raw = bytearray(data.read())
                raw[len(raw) // 2] ^= 1
                data = io.BytesIO(bytes(raw))
            dst.addfile(m, data)
    return out


def _with_subdirectories(archive: Path, out: Path) -> Path:
    """archive with its flat files (flat.py) back in their subdirectories, as torpor wrote
    checkpoints before."""
    from torpor import flat
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        made: set[str] = set()
        for m in src.getmembers():
            data = src.extractfile(m) if m.isfile() else None
            head, _, leaf = m.name.rpartition("/")
            tree = flat.decode(leaf) if head == "checkpoint" else None
            if tree is not None:
                for parent in reversed(tree.parents[:-1]):
                    if str(parent) not in made:
                        made.add(str(parent))
                        d = tarfile.TarInfo(f"checkpoint/{parent}")
                        d.type, d.mode = tarfile.DIRTYPE, 0o700
                        dst.addfile(d)
                m.name = f"checkpoint/{tree}"
            dst.addfile(m, data)
    assert made, "no flat file in the archive"
    return out


def _events(path: Path) -> list[str]:
    return [e.rsplit(" ", 1)[0] for e in path.read_text().splitlines()] if path.exists() else []


def test_containerd_checkpoint_restore_through_the_agent(containerd, gpu, daemon, name, base):
    """ctr checkpoint (the task keeps running: the agent reloads from the image directory after
    the dump) and ctr restore into a new container, whose agent reloads from the checkpoint
    image containerd made of that directory."""
    events = gpu.state_dir / "agent-events"
    argv, env, mounts = agent_workload(gpu, "agc", 3 << 20, events)
    containerd.run(name, argv, mounts=mounts, env=env,
                   annotations={"org.torpor.agent": "on"})
    ref = f"localhost/torpor-test-agent:{name.lower()}"
    new = f"{name}-r"[:60]
    try:
        sock = agent_dir(daemon.cfg.run_dir, name) / "agent-1.sock"
        wait_for(lambda: sock.exists() and gpu.proc_entry("agc.1"), 20,
                 "the program under its agent")
        old_pid = containerd.pid(name)
        containerd.checkpoint(name, ref, leave_running=True)
        # the leave-running staging's status (runtime/pause.py), whether it could hold its
        # memory (a copier for it: engine.holding), then the prepare's
        assert _events(events) == ["agent status", "agent status", "agent status",
                                   "agent prepare", "agent detach", "agent status",
                                   "agent resume"]
        with AgentClient(sock) as a:
            st = a.status()
        assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True)
        events.unlink()
        containerd.rm(name)

        containerd.restore(ref, new)
        assert containerd.state(new) == "running" and containerd.pid(new) != old_pid
        assert _events(events) == ["agent status", "agent resume"]
        with AgentClient(agent_dir(daemon.cfg.run_dir, new) / "agent-1.sock") as a:
            st = a.status()
        assert (st["state"], st["gate"], st["intact"]) == ("running", "open", True)
    finally:
        containerd.rm(name)
        containerd.rm(new)
        containerd.rm_image(ref)


def test_podman_store_checkpoint_asks_the_agent_for_fingerprints(podman, gpu, daemon, shim,
                                                                 name, base):
    """org.torpor.store=on with an agent: torpor-runtime holds the store's lock and torpord
    asks the agent for GPU fingerprints (skip, or index only when left running); the
    checkpoint is packed and the import resumes the agent from the store's chunks."""
    store = base / "store"
    shim.write(TORPOR_STORE_DIR=str(store))
    nodes = fake_nodes(base)
    events = gpu.state_dir / "agent-events"
    argv, env, mounts = agent_workload(gpu, "ag", 5 << 20, events)
    podman.run(name, argv, mounts=mounts, env=env,
               annotations={"org.torpor.agent": "on", "org.torpor.store": "on"},
               devices=[f"{nodes[0]}:/dev/nvidia0", f"{nodes[255]}:/dev/nvidiactl"])
    try:
        cid = podman.inspect(name, "{{.Id}}")
        sock = agent_dir(daemon.cfg.run_dir, cid) / "agent-1.sock"
        wait_for(lambda: sock.exists() and gpu.proc_entry("ag.1"), 20,
                 "the program under its agent")
        podman.checkpoint(name, leave_running=True)       # packed; then again, exported
        assert "agent prepare-fp" in _events(events), _events(events)
        assert "agent prepare-stream" not in _events(events)   # left running: data files
        events.unlink()
        archive = base / "ck.tar"
        podman.checkpoint(name, export=archive, compress="none")
        # ending the container, its GPU data streamed straight into the store (stream.py)
        assert {"agent prepare-fp", "agent prepare-stream"} <= set(_events(events)), \
            _events(events)
        assert len(list((store / "snapshots").glob("*.json"))) == 2
        # the export's pack took the unchanged page images by host fingerprint
        packs = re.findall(r"already stored \((\d+) known by fingerprint\)", shim.log(daemon))
        assert len(packs) == 2 and int(packs[1]) > 0, packs
        with tarfile.open(archive) as tf:
            names = tf.getnames()
        assert "checkpoint/torpor-store.json" in names, names
        assert sorted((store / "snapshots").glob("*.json")), "nothing packed"
        events.unlink()
        podman.rm(name)
        # its GPU data streamed from the store (store/stream.py), not unpacked into files
        restored_intact(podman, daemon, name, archive, events,
                        ("agent status", "agent resume", "agent resume-stream"))
    finally:
        podman.rm(name)


def test_one_id_in_two_containerd_namespaces_has_two_agents(containerd, shim, gpu, daemon,
                                                            name, base):
    """`ctr -n a run ... X` and `ctr -n b run ... X`: runc roots .../runc/a and .../runc/b.
    Each container's agent is in its own directory (both programs are PID 1 inside, so one
    directory would hold a single agent-1.sock), each checkpoint reaches its own agent, and
    the delete of one leaves the other's directory and torpord record."""
    other = Containerd(str(shim.path), namespace="torpor-test-other")
    other.ensure_image()
    ev_a, ev_b = gpu.state_dir / "agent-events-a", gpu.state_dir / "agent-events-b"
    argv, env, mounts = agent_workload(gpu, "nsa", 3 << 20, ev_a)
    containerd.run(name, argv, mounts=mounts, env=env, annotations={"org.torpor.agent": "on"})
    argv, env, mounts = agent_workload(gpu, "nsb", 2 << 20, ev_b)
    other.run(name, argv, mounts=mounts, env=env, annotations={"org.torpor.agent": "on"})
    ref = f"localhost/torpor-test-agent-ns:{name.lower()}"
    agents = daemon.cfg.run_dir / "agents"
    try:
        dirs = sorted(agents.glob(f"{name}@*"))
        assert len(dirs) == 2 and not (agents / name).exists(), dirs
        wait_for(lambda: all((d / "agent-1.sock").exists() for d in dirs)
                 and gpu.proc_entry("nsa.1") and gpu.proc_entry("nsb.1"), 20,
                 "both programs under their agents")
        pids = {}
        for d in dirs:     # each socket is the agent of a program of its own (host PID)
            with AgentClient(d / "agent-1.sock") as a:
                pids[d] = _peer_pid(a.sock)
        assert sorted(pids.values()) == sorted([containerd.pid(name), other.pid(name)])
        mine = next(d for d in dirs if pids[d] == containerd.pid(name))
        wait_for(lambda: sorted(c.id for c in daemon.client().list().containers)
                 == sorted(d.name for d in dirs), 10, "a record for each")

        containerd.checkpoint(name, ref, leave_running=True)
        assert "agent prepare" in _events(ev_a) and "agent prepare" not in _events(ev_b)

        other.rm(name)
        assert [d for d in agents.glob(f"{name}@*")] == [mine]
        assert [c.id for c in daemon.client().list().containers] == [mine.name]
        with AgentClient(mine / "agent-1.sock") as a:
            assert a.status()["state"] == "running"
    finally:
        containerd.rm(name)
        other.rm(name)
        containerd.rm_image(ref)
    assert list(agents.glob(f"{name}@*")) == []
