"""torpor-runtime's flows in process (runtime/main.py dispatch, checkpoint.py, restore.py):
a fake runc (an executable script written here that records its argv and answers `state` from
a JSON file), a fake torpord client (records each call, answers with the typed values of
sidecar/convert.py and flows/container.py), os.execv recorded instead of run. No daemon, no
podman, no GPU."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from torpor import agent_data, config, manifest, oci
from torpor.engine import Engine
from torpor.errors import CorruptCheckpointError, ExitCode, SidecarError, TorporError
from torpor.flows import container
from torpor.journal import Journal
from torpor.runtime import argv as rt_argv
from torpor.runtime import checkpoint as rt_checkpoint
from torpor.runtime import main as rt_main
from torpor.runtime import markers
from torpor.runtime import restore as rt_restore
from torpor.sidecar.client import work_timeout
from torpor.sidecar.convert import (Checkpointed, CudaProcess, OperationResult, ProcessStatus,
                                   Restored, Status)
from torpor.store import images as store_images

CID = "c0ffee0123456789"
NAME = f"{CID}@{markers.root_key('/r')}"    # its name at torpor under --root /r (markers.name)
GPU = "GPU-11111111-2222-3333-4444-555555555555"

FAKE_RUNC = textwrap.dedent("""\
    #!{python}
    # fake runc: records argv; `state` answers state.json; `checkpoint` writes an image set
    # (CRIU's names) and exits with checkpoint.rc; `restore` writes --pid-file from restore.pid
    import json, os, sys
    here = os.path.dirname(os.path.abspath(__file__))
    args = sys.argv[1:]
    with open(os.path.join(here, "calls.jsonl"), "a") as f:
        f.write(json.dumps(args) + "\\n")
    def opt(name):
        for i, a in enumerate(args):
            if a == "--" + name and i + 1 < len(args):
                return args[i + 1]
            if a.startswith("--" + name + "="):
                return a.split("=", 1)[1]
        return None
    if "state" in args:
        sys.stdout.write(open(os.path.join(here, "state.json")).read())
        sys.exit(0)
    if "resume" in args or "pause" in args:   # the container's status follows
        path = os.path.join(here, "state.json")
        st = json.load(open(path))
        st["status"] = "running" if "resume" in args else "paused"
        open(path, "w").write(json.dumps(st))
        sys.exit(0)
    if "checkpoint" in args:
        rc = int(open(os.path.join(here, "checkpoint.rc")).read())
        if rc == 0:
            for name in ("inventory.img", "pstree.img", "pages-1.img"):
                with open(os.path.join(opt("image-path"), name), "wb") as f:
                    f.write(name.encode() * 100)
        sys.exit(rc)
    if "restore" in args:
        if opt("pid-file"):
            with open(opt("pid-file"), "w") as f:
                f.write(open(os.path.join(here, "restore.pid")).read())
        sys.exit(0)
    sys.exit(0)
""")


class Exec(BaseException):
    """os.execv, recorded: the flow would have become the real runtime here."""

    def __init__(self, path: str, argv: list[str]):
        super().__init__(path)
        self.path, self.argv = path, list(argv)


class FakeRunc:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir()
        self.path = root / "runc"
        self.path.write_text(FAKE_RUNC.format(python=sys.executable))
        self.path.chmod(0o755)
        self.checkpoint_rc = 0

    def set_state(self, **st: Any) -> None:
        (self.root / "state.json").write_text(json.dumps(st))

    @property
    def checkpoint_rc(self) -> int:
        return int((self.root / "checkpoint.rc").read_text())

    @checkpoint_rc.setter
    def checkpoint_rc(self, rc: int) -> None:
        (self.root / "checkpoint.rc").write_text(str(rc))

    def calls(self) -> list[list[str]]:
        f = self.root / "calls.jsonl"
        return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []

    def commands(self) -> list[str]:
        return [next(a for a in c if not a.startswith("-") and a not in ("/r", "/l"))
                for c in self.calls()]


class FakeClient:
    """torpord's client: each call recorded as (name, kwargs), typed answers."""

    def __init__(self, pid: int, fail: str = ""):
        self.pid, self.fail, self.calls = pid, fail, []
        self.timeouts: list[Any] = []   # each channel's deadline for its calls
        self.answers_owner = True       # False: a torpord from before store_owner
        self.states: dict[int, str] = {}   # status(): PID -> driver state

    def __call__(self, cfg: Any, timeout: Any = None) -> "FakeClient":
        self.timeouts.append(timeout)
        return self

    def __enter__(self) -> "FakeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def _record(self, name: str, **kw: Any) -> None:
        self.calls.append((name, kw))
        if name == self.fail:
            from torpor.errors import TorporError
            raise TorporError(f"fake torpord: {name} failed")

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def lock_and_checkpoint(self, **kw: Any) -> Checkpointed:
        self._record("lock_and_checkpoint", **kw)
        return Checkpointed(op_id="op-1", pids=(self.pid,),
                            cuda_processes=(CudaProcess(self.pid, "CHECKPOINTED", (GPU,), 1 << 20,
                                                        {GPU: 1 << 20}),),
                            timings={"checkpoint": 0.5}, deadline=0.0, container_id=CID,
                            store_owner=self._owner(kw.get("agent_container_id", "")))

    def _owner(self, name: str) -> str:
        """The owner torpord handed the agents fingerprints of, as the service answers it."""
        from torpor.store import fingerprints
        return fingerprints.owner_of(name) if name and self.answers_owner else ""

    def _result(self, op_id: str, outcome: str) -> OperationResult:
        return OperationResult(op_id, "checkpoint", (self.pid,), outcome, {"unlock": 0.1})

    def finish(self, op_id: str) -> OperationResult:
        self._record("finish", op_id=op_id)
        return self._result(op_id, "finished")

    def rollback(self, op_id: str) -> OperationResult:
        self._record("rollback", op_id=op_id)
        return self._result(op_id, "rolled-back")

    def status(self, **kw: Any) -> Status:
        """Each PID asked about: CUDA, in self.states' driver state (RUNNING by default)."""
        self._record("status", **kw)
        return Status(tuple(ProcessStatus(p, True, True, self.states.get(p, "RUNNING"))
                            for p in kw.get("pids") or ()))

    def restore_and_unlock(self, **kw: Any) -> Restored:
        self._record("restore_and_unlock", **kw)
        return Restored(kw.get("op_id") or "op-2", tuple(kw.get("pids") or (self.pid,)),
                        dict(kw.get("gpu_map") or {}), (), {"restore": 0.2})


@pytest.fixture
def world(tmp_path: Path, torpor_env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    """A fake runc as oci_runtime, os.execv recorded, a running program as the container's
    init (a real PID: the flow reads its process tree and comm)."""
    runc = FakeRunc(tmp_path / "fake-runc")
    monkeypatch.setenv("TORPOR_OCI_RUNTIME", str(runc.path))

    def execv(path: str, argv: list[str]) -> None:
        raise Exec(path, argv)
    monkeypatch.setattr(os, "execv", execv)
    prog = subprocess.Popen(["sleep", "60"])
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    runc.set_state(ociVersion="1.0.2", id=CID, pid=prog.pid, status="running",
                   bundle=str(bundle))
    client = FakeClient(prog.pid)
    for mod in (rt_checkpoint, rt_restore):
        monkeypatch.setattr(mod, "Client", client)
        monkeypatch.setattr(mod, "ensure_running", lambda cfg: client.calls.append(("ensure", {})))
    yield {"runc": runc, "client": client, "bundle": bundle, "pid": prog.pid,
           "images": tmp_path / "images"}
    prog.kill()
    prog.wait()


def write_spec(bundle: Path, gpu: bool) -> None:
    env = ["PATH=/usr/bin"] + ([f"NVIDIA_VISIBLE_DEVICES={GPU}"] if gpu else [])
    devices = [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}] if gpu else []
    spec = {"ociVersion": "1.0.2", "process": {"args": ["sleep"], "env": env},
            "root": {"path": "rootfs"}, "linux": {"devices": devices}}
    (bundle / "config.json").write_text(json.dumps(spec))


def checkpoint_argv(images: Path, *extra: str) -> list[str]:
    return ["--root", "/r", "--log", "/l", "checkpoint", "--image-path", str(images),
            *extra, CID]


def test_non_gpu_checkpoint_execs_runc_with_argv_unchanged(world):
    write_spec(world["bundle"], gpu=False)
    argv = checkpoint_argv(world["images"])
    with pytest.raises(Exec) as e:
        rt_main.main(argv)
    assert e.value.path == str(world["runc"].path)
    assert e.value.argv == [str(world["runc"].path), *argv]
    assert world["client"].calls == []
    assert world["runc"].commands() == ["state"]   # only asked, never told to checkpoint
    assert not world["images"].exists()


def test_gpu_checkpoint_locks_dumps_finishes_and_seals(world):
    write_spec(world["bundle"], gpu=True)
    argv = checkpoint_argv(world["images"])
    assert rt_main.main(argv) == 0
    client, runc = world["client"], world["runc"]
    assert client.names() == ["ensure", "lock_and_checkpoint", "finish"]
    lock = client.calls[1][1]
    assert lock["pids"] == [world["pid"]] and lock["owner_pid"] == os.getpid()
    assert lock["agent_container_id"] == NAME
    assert client.calls[2][1] == {"op_id": "op-1"}
    # runc checkpoint ran with our argv, between the lock and the finish (its image is there)
    assert argv in runc.calls()
    assert runc.commands() == ["state", "checkpoint"]
    images = world["images"]
    assert not (images / manifest.DRAFT).exists()
    m = manifest.read(images)
    assert m["container"]["id"] == CID
    assert m["container"]["visible"] == [GPU] and m["container"]["minors"] == [0]
    assert [p["pid"] for p in m["processes"]] == [world["pid"]]
    assert m["processes"][0]["cuda"] is True
    # no NVML here: the GPU torpord saw it use is listed all the same, its model unknown
    assert m["processes"][0]["gpus"] == [GPU]
    assert m["gpus"] == [{"uuid": GPU, "name": "", "memory_total": 0}]
    assert "pages-1.img" in json.dumps(m["files"])
    assert (images.stat().st_mode & 0o777) == 0o700


def test_gpu_checkpoint_runc_failure_rolls_back(world, capsys):
    write_spec(world["bundle"], gpu=True)
    world["runc"].checkpoint_rc = 3
    assert rt_main.main(checkpoint_argv(world["images"])) == 3
    assert world["client"].names() == ["ensure", "lock_and_checkpoint", "rollback"]
    assert world["client"].calls[2][1] == {"op_id": "op-1"}
    images = world["images"]
    assert not (images / manifest.DRAFT).exists()
    assert not (images / manifest.MANIFEST).exists()
    assert "checkpoint failed (exit 3)" in capsys.readouterr().err


def test_gpu_checkpoint_lock_failure_never_dumps(world):
    write_spec(world["bundle"], gpu=True)
    world["client"].fail = "lock_and_checkpoint"
    assert rt_main.main(checkpoint_argv(world["images"])) != 0
    assert world["client"].names() == ["ensure", "lock_and_checkpoint"]
    assert world["runc"].commands() == ["state"]   # the container was never dumped
    assert not (world["images"] / manifest.DRAFT).exists()


def test_an_image_directory_without_room_for_the_draft_rolls_back_in_one_line(world, monkeypatch,
                                                                              capsys):
    """A full (or read-only) image directory: the draft cannot be written after the lock. The
    GPU state is rolled back, nothing is dumped, and the engine gets one line (exit 8), not an
    internal error."""
    write_spec(world["bundle"], gpu=True)
    draft = world["images"] / manifest.DRAFT

    def full(images, d):   # written, then its fsync found no room: nothing of it may stay
        draft.write_text("{}")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(draft))
    monkeypatch.setattr(rt_checkpoint.manifest, "write_draft", full)
    assert rt_main.main(checkpoint_argv(world["images"])) == ExitCode.ROLLED_BACK
    assert not draft.exists()
    assert world["client"].names() == ["ensure", "lock_and_checkpoint", "rollback"]
    assert world["runc"].commands() == ["state"]   # never dumped
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" not in err, err
    assert f"writing {draft} before the dump: No space left on device" in err, err
    assert "rolled back, it keeps running" in err, err


def test_paused_gpu_container_is_thawed_for_the_gpu_steps_only(world):
    write_spec(world["bundle"], gpu=True)
    runc, client = world["runc"], world["client"]
    runc.set_state(id=CID, pid=world["pid"], status="paused", bundle=str(world["bundle"]))
    seen = []
    lock = client.lock_and_checkpoint

    def spy(**kw):
        seen.append(json.loads((runc.root / "state.json").read_text())["status"])
        return lock(**kw)
    client.lock_and_checkpoint = spy
    assert rt_main.main(checkpoint_argv(world["images"], "--leave-running")) == 0
    assert seen == ["running"]   # torpord's lock reaches running processes
    assert runc.commands() == ["state", "resume", "state", "pause", "checkpoint",
                               "resume", "state", "pause"]   # dumped paused, left paused
    assert json.loads((runc.root / "state.json").read_text())["status"] == "paused"


def test_gpu_checkpoint_pre_dump_is_refused_untouched(world, capsys):
    write_spec(world["bundle"], gpu=True)
    rc = rt_main.main(checkpoint_argv(world["images"], "--pre-dump"))
    assert rc == ExitCode.USAGE
    assert "pre-dump" in capsys.readouterr().err
    assert world["client"].calls == [] and world["runc"].commands() == ["state"]


def test_gpu_checkpoint_leave_running_restores_instead_of_finishing(world):
    write_spec(world["bundle"], gpu=True)
    assert rt_main.main(checkpoint_argv(world["images"], "--leave-running")) == 0
    client = world["client"]
    assert client.names() == ["ensure", "lock_and_checkpoint", "restore_and_unlock"]
    assert client.calls[2][1] == {"op_id": "op-1"}
    assert client.timeouts == [work_timeout(config.load())]   # a hung torpord: a failure
    m = manifest.read(world["images"])
    assert m["leave_running"] is True


def test_gpu_restore_gives_torpord_the_restored_pid(world, monkeypatch, tmp_path):
    write_spec(world["bundle"], gpu=True)
    assert rt_main.main(checkpoint_argv(world["images"])) == 0
    # restore into a new bundle; the restored init is another process than the checkpointed one
    new = subprocess.Popen(["sleep", "60"])
    try:
        bundle = tmp_path / "bundle2"
        bundle.mkdir()
        write_spec(bundle, gpu=True)
        (world["runc"].root / "restore.pid").write_text(str(new.pid))
        placed = container.Placement({GPU: GPU})
        monkeypatch.setattr(rt_restore.container, "place", lambda cfg, m, b: placed)
        client = world["client"]
        client.calls.clear()
        pid_file = tmp_path / "pid"
        argv = ["--root", "/r", "restore", "--image-path", str(world["images"]), "--bundle",
                str(bundle), "--pid-file", str(pid_file), "--detach", CID]
        assert rt_main.main(argv) == 0
        assert client.names() == ["ensure", "restore_and_unlock"]
        assert client.timeouts[-1] == work_timeout(config.load())
        kw = client.calls[1][1]
        assert kw["pids"] == [new.pid]
        assert kw["gpu_map"] == {}   # the same GPU: no pairs for the driver
        assert kw["agent_container_id"] == NAME
        assert world["runc"].calls()[-1] == argv
        spec = json.loads((bundle / "config.json").read_text())
        assert spec["annotations"][oci.ROOT_KEY_ANNOTATION] == markers.root_key("/r")
    finally:
        new.kill()
        new.wait()


@pytest.mark.parametrize("damaged", [False, True], ids=["failed", "damaged"])
def test_gpu_restore_failure_stops_the_restored_container(world, monkeypatch, tmp_path, capsys,
                                                          damaged):
    """torpord's restore fails: the container is stopped, the checkpoint kept; exit 9 where
    the GPU data was found damaged (its agent's check, through torpord), else 1."""
    write_spec(world["bundle"], gpu=True)
    assert rt_main.main(checkpoint_argv(world["images"])) == 0
    before = sorted(p.name for p in world["images"].iterdir())
    (world["runc"].root / "restore.pid").write_text(str(world["pid"]))
    monkeypatch.setattr(rt_restore.container, "place",
                        lambda cfg, m, b: container.Placement({GPU: GPU}))
    client = world["client"]
    client.fail = "restore_and_unlock"
    if damaged:
        def fails(**kw: Any) -> None:
            raise CorruptCheckpointError("agent 'resume': the data files are damaged")
        client.restore_and_unlock = fails
    argv = ["restore", "--image-path", str(world["images"]), "--bundle", str(world["bundle"]),
            "--pid-file", str(tmp_path / "pid"), "--detach", CID]
    assert rt_main.main(argv) == (ExitCode.CORRUPT if damaged else ExitCode.ERROR)
    assert world["runc"].calls()[-1][-3:] == ["kill", CID, "KILL"]
    assert "container was stopped" in capsys.readouterr().err
    assert sorted(p.name for p in world["images"].iterdir()) == before   # checkpoint kept


@pytest.mark.parametrize("spec", ["none", "cpu"])
def test_restore_of_a_plain_checkpoint_execs_runc(world, tmp_path, spec):
    """No torpor.json, and no spec that names a GPU (none readable, or a CPU container's):
    runc as it is, nothing asked of torpord."""
    if spec == "cpu":
        write_spec(world["bundle"], gpu=False)
    images = tmp_path / "plain"
    images.mkdir()
    argv = ["restore", "--image-path", str(images), "--bundle", str(world["bundle"]), CID]
    with pytest.raises(Exec) as e:
        rt_main.main(argv)
    assert e.value.argv == [str(world["runc"].path), *argv]
    assert world["client"].calls == []


def _foreign_gpu_restore(world: dict, tmp_path: Path) -> list[str]:
    """The argv of a detached restore of a GPU container from a checkpoint with no torpor.json
    (an empty directory: the fake runc restores anything), world's program its new PID."""
    write_spec(world["bundle"], gpu=True)
    images = tmp_path / "plain"
    images.mkdir()
    (world["runc"].root / "restore.pid").write_text(str(world["pid"]))
    return ["restore", "--image-path", str(images), "--bundle", str(world["bundle"]),
            "--pid-file", str(tmp_path / "pid"), "--detach", CID]


@pytest.mark.parametrize("state", ["CHECKPOINTED", "LOCKED", "RUNNING"])
def test_a_foreign_checkpoint_of_a_gpu_container_gets_its_frozen_gpu_state_back(
        world, tmp_path, capsys, state):
    """No torpor.json (another tool's checkpoint, or torpor's driver-path one with its manifest
    removed, which holds nothing else of torpor's): runc restores it, then torpord gives any
    process the driver still holds checkpointed or locked its GPU state back (runc alone would
    leave it frozen for good), with a warning; all running (CRIU's cuda plugin gave it back):
    nothing asked, nothing said. The container is marked (its delete comes back to torpor)."""
    argv = _foreign_gpu_restore(world, tmp_path)
    client = world["client"]
    client.states[world["pid"]] = state
    assert rt_main.main(argv) == 0
    assert world["runc"].commands()[-1] == "restore"
    frozen = state != "RUNNING"
    assert client.names() == ["ensure", "status"] + ["restore_and_unlock"] * frozen
    assert client.calls[1][1]["pids"][0] == world["pid"]   # its tree, from the root
    if frozen:
        assert client.calls[2] == ("restore_and_unlock", {"pids": [world["pid"]], "gpu_map": {}})
    err = capsys.readouterr().err
    assert ("no torpor.json" in err and f"PID(s) {world['pid']} checkpointed" in err) is frozen
    assert frozen or err == ""
    assert markers.present(config.load(), rt_argv.parse(["delete", CID]))
    assert not list(Journal(config.load()).orphans())   # settled: nothing to recover


@pytest.mark.parametrize("exc", [TorporError, CorruptCheckpointError])
def test_a_foreign_gpu_checkpoint_whose_gpu_state_cannot_be_given_back_is_stopped(
        world, tmp_path, capsys, exc):
    argv = _foreign_gpu_restore(world, tmp_path)
    world["client"].states[world["pid"]] = "CHECKPOINTED"

    def fails(**kw: Any) -> None:
        raise exc("the driver refused")
    world["client"].restore_and_unlock = fails
    assert rt_main.main(argv) == (ExitCode.CORRUPT if exc is CorruptCheckpointError
                                  else ExitCode.ERROR)
    assert world["runc"].calls()[-1][-3:] == ["kill", CID, "KILL"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "container was stopped" in err, err
    assert "the driver refused" in err


@pytest.mark.parametrize("down", ["not started", "not answering"])
def test_a_foreign_gpu_checkpoint_without_torpord_is_left_as_runc_restored_it(
        world, tmp_path, capsys, monkeypatch, down):
    """torpord cannot be started, or does not answer the question: nothing is known of the
    processes' GPU state, and the container stays as the runtime restored it, with a
    warning (a CRIU-cuda-plugin checkpoint is whole; torpor's own would stay frozen)."""
    argv = _foreign_gpu_restore(world, tmp_path)
    if down == "not started":
        def not_started(cfg: Any) -> None:
            raise SidecarError("torpord is not running")
        monkeypatch.setattr(rt_restore, "ensure_running", not_started)
    else:
        world["client"].fail = "status"
    assert rt_main.main(argv) == 0
    assert world["runc"].commands()[-1] == "restore"
    assert "restore_and_unlock" not in world["client"].names()
    assert "GPU state was not checked" in capsys.readouterr().err
    assert not list(Journal(config.load()).orphans())


def test_a_runtime_killed_in_a_foreign_gpu_restore_leaves_it_to_recovery(world, tmp_path):
    """torpor-runtime dies (the engine's timeout, the OOM killer) after runc restored and
    before the GPU state is settled: its journal entry makes recovery stop the container,
    whose frozen processes nobody else would give their GPU state back."""
    argv = _foreign_gpu_restore(world, tmp_path)

    def killed(**kw: Any) -> None:
        raise KeyboardInterrupt   # any end but a TorporError: as a SIGKILL leaves it
    world["client"].status = killed
    assert rt_main.main(argv) == ExitCode.INTERRUPTED
    entries = [e for e, fd in Journal(config.load()).orphans() if not os.close(fd)]
    assert [e.kind for e in entries] == ["restore"]
    assert entries[0].container["id"] == CID


def test_bundle_without_readable_spec_passes_through(world):
    # state names a bundle with no config.json
    argv = checkpoint_argv(world["images"])
    with pytest.raises(Exec) as e:
        rt_main.main(argv)
    assert e.value.argv == [str(world["runc"].path), *argv]
    assert world["client"].calls == []
    assert not world["images"].exists()


def test_bundle_with_broken_spec_passes_through(world):
    (world["bundle"] / "config.json").write_text("{not json")
    argv = checkpoint_argv(world["images"], "--leave-running")
    with pytest.raises(Exec) as e:
        rt_main.main(argv)
    assert e.value.argv == [str(world["runc"].path), *argv]
    assert world["client"].calls == []


def _agent_files(client: FakeClient, pid: int) -> None:
    """The fake torpord's lock also has an "agent" move memory into gpu_data_dir (<pid>/...)."""
    lock = client.lock_and_checkpoint

    def moving(**kw: Any) -> Checkpointed:
        d = Path(kw["gpu_data_dir"]) / str(pid)
        d.mkdir(parents=True, mode=0o700)
        for k in range(2):
            (d / f"gpu-memory-{k}.bin").write_bytes(bytes([k]) * 1000)
        return lock(**kw)
    client.lock_and_checkpoint = moving


def test_gpu_checkpoint_leaves_no_subdirectory_and_restore_puts_them_back(world, monkeypatch,
                                                                         tmp_path):
    """containerd 2's CRI copies the image directory as plain files: torpor-runtime's
    checkpoint ends flat (an earlier checkpoint's flat files gone first), its restore puts the
    tree back before anything runs."""
    write_spec(world["bundle"], gpu=True)
    images = world["images"]
    images.mkdir(mode=0o700)
    (images / "torpor-gpu+1+gpu-memory-0.bin").write_bytes(b"an earlier checkpoint's")
    _agent_files(world["client"], 4242)
    assert rt_main.main(checkpoint_argv(images)) == 0
    assert all(p.is_file() for p in images.iterdir()), sorted(os.listdir(images))
    assert sorted(p.name for p in images.glob("torpor-gpu+*")) == \
        ["torpor-gpu+4242+gpu-memory-0.bin", "torpor-gpu+4242+gpu-memory-1.bin"]
    m = manifest.read(images)
    assert m["files"]["torpor-gpu/4242/gpu-memory-1.bin"]["size"] == 1000
    manifest.verify(images, m)
    monkeypatch.setattr(rt_restore.container, "place",
                        lambda cfg, m, b: container.Placement({GPU: GPU}))
    argv = ["restore", "--image-path", str(images), "--bundle", str(world["bundle"]), CID]
    assert rt_main.main(argv) == 0
    assert (images / "torpor-gpu" / "4242" / "gpu-memory-1.bin").read_bytes() == b"\x01" * 1000
    assert not list(images.glob("torpor-gpu+*"))


def test_restore_refuses_a_hostile_flat_name_before_runc(world, monkeypatch, capsys):
    write_spec(world["bundle"], gpu=True)
    images = world["images"]
    _agent_files(world["client"], 4242)
    assert rt_main.main(checkpoint_argv(images)) == 0
    (images / "torpor-gpu+4242+..+x").write_bytes(b"x")
    monkeypatch.setattr(rt_restore.container, "place",
                        lambda cfg, m, b: container.Placement({GPU: GPU}))
    world["runc"].root.joinpath("calls.jsonl").unlink()
    argv = ["restore", "--image-path", str(images), "--bundle", str(world["bundle"]), CID]
    assert rt_main.main(argv) == ExitCode.CORRUPT
    assert "not a valid flat name" in capsys.readouterr().err
    assert world["runc"].calls() == []                      # nothing restored
    assert (images / "torpor-gpu+4242+gpu-memory-0.bin").exists()   # nothing moved


@pytest.mark.parametrize("how", ["removed", "dangling link", "link"])
def test_a_torpor_checkpoint_without_its_manifest_is_refused_not_handed_to_runc(
        world, monkeypatch, capsys, tmp_path, how):
    """torpor.json gone, or a link (pointing nowhere or elsewhere) in its place: runc alone
    would restore the program with its GPU state never given back (frozen for good), or fail
    with a message about torpor's agent directory. Refused before anything runs (exit 9)."""
    write_spec(world["bundle"], gpu=True)
    images = world["images"]
    _agent_files(world["client"], 4242)
    assert rt_main.main(checkpoint_argv(images)) == 0
    capsys.readouterr()
    (images / "torpor.json").unlink()
    if how == "dangling link":
        (images / "torpor.json").symlink_to("/nonexistent/torpor.json")
    elif how == "link":
        (tmp_path / "elsewhere.json").write_text("{}")
        (images / "torpor.json").symlink_to(tmp_path / "elsewhere.json")
    world["runc"].root.joinpath("calls.jsonl").unlink()
    argv = ["restore", "--image-path", str(images), "--bundle", str(world["bundle"]), CID]
    assert rt_main.main(argv) == ExitCode.CORRUPT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "torpor-runtime: error:" in err, err
    assert ("no torpor.json" if how == "removed" else "link") in err, err
    assert world["runc"].calls() == []                      # nothing restored


def test_a_checkpoint_that_cannot_be_flattened_is_kept_whole_with_a_warning(world, capsys):
    """flat.py refuses (here a link among the agents' files): the checkpoint is done, kept with
    its subdirectories (podman and ctr take it), and the user is told containerd's CRI
    cannot archive it."""
    write_spec(world["bundle"], gpu=True)
    client = world["client"]
    _agent_files(client, 4242)
    lock = client.lock_and_checkpoint

    def with_link(**kw: Any) -> Checkpointed:
        out = lock(**kw)
        (Path(kw["gpu_data_dir"]) / "4242" / "planted").symlink_to("/etc/hostname")
        return out
    client.lock_and_checkpoint = with_link
    assert rt_main.main(checkpoint_argv(world["images"], "--leave-running")) == 0
    err = capsys.readouterr().err
    assert "subdirectories kept" in err and "not a regular file" in err
    images = world["images"]
    assert (images / "torpor-gpu" / "4242" / "gpu-memory-0.bin").is_file()
    assert not list(images.glob("torpor-gpu+*"))
    with pytest.raises(CorruptCheckpointError, match="symbolic link"):   # never restored
        manifest.verify(images, manifest.read(images))


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_error_in_the_runtime_log_is_one_parseable_line(tmp_path, fmt):
    """containerd and conmon read the error from --log in --log-format; runc's stderr, quoted
    into torpor's message, may hold '"' and '\\': in the text format (logrus's, values quoted
    as Go's %q) they must not end msg early nor forge a field."""
    import re
    from torpor.runtime import argv as rt_argv
    log = tmp_path / "runc.log"
    inv = rt_argv.parse(["--log", str(log), "--log-format", fmt, "checkpoint", CID])
    message = 'runc state x failed: container "x" does not exist level=error msg="forged" \\'
    rt_main.report(inv, message)
    lines = log.read_text().splitlines()
    assert len(lines) == 1
    if fmt == "json":
        assert json.loads(lines[0])["msg"] == f"torpor: {message}"
    else:
        m = re.fullmatch(r'time="[^"]+" level=error msg=("(?:[^"\\]|\\.)*")', lines[0])
        assert m, lines[0]
        assert json.loads(m.group(1)) == f"torpor: {message}"


def _unrunnable(path: Path) -> None:
    """An executable the kernel will not run: its interpreter is missing (ENOENT at exec)."""
    path.write_text("#!/nonexistent/interpreter\n")
    path.chmod(0o755)


@pytest.mark.parametrize("argv", [["list"], ["--root", "/r", "delete", CID],
                                  ["--root", "/r", "state", CID]])
def test_a_runtime_that_cannot_run_is_one_line(world, monkeypatch, capsys, argv):
    """runc broken between the front's check and the exec (or a script whose interpreter is
    gone): one line and exit 2, never a traceback nor an 'internal error'."""
    _unrunnable(world["runc"].path)

    def execv(path: str, args: list[str]) -> None:   # what the real one does with it
        raise FileNotFoundError(2, "No such file or directory")
    monkeypatch.setattr(os, "execv", execv)
    assert rt_main.main(argv) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error" not in err
    assert f"cannot run the OCI runtime {world['runc'].path}" in err


def test_a_directory_is_no_runtime(world, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TORPOR_OCI_RUNTIME", str(tmp_path))
    assert rt_main.main(["list"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert f"OCI runtime '{tmp_path}' not found" in err and err.count("\n") == 1


def test_gpu_checkpoint_with_a_runtime_that_cannot_start_rolls_back(world, capsys):
    """The dump cannot start (runc gone after the lock): the GPU state is rolled back at once,
    as for a dump that failed, not left for torpord to find its owner dead."""
    write_spec(world["bundle"], gpu=True)
    client = world["client"]
    lock = client.lock_and_checkpoint

    def then_break(**kw: Any) -> Checkpointed:
        out = lock(**kw)
        _unrunnable(world["runc"].path)
        return out
    client.lock_and_checkpoint = then_break
    assert rt_main.main(checkpoint_argv(world["images"])) == ExitCode.USAGE
    assert client.names() == ["ensure", "lock_and_checkpoint", "rollback"]
    err = capsys.readouterr().err
    assert "cannot run the OCI runtime" in err and "rolled back" in err
    assert not (world["images"] / manifest.DRAFT).exists()


@pytest.mark.parametrize("where", ["a-file", "under-a-file", "too-long"])
def test_gpu_checkpoint_into_an_image_path_that_cannot_be_a_directory(world, capsys, tmp_path,
                                                                      where):
    """--image-path is the caller's: one that cannot be made a directory is a usage error in
    one line (exit 2), before torpord is asked anything; the container keeps running."""
    write_spec(world["bundle"], gpu=True)
    f = tmp_path / "afile"
    f.write_text("x")
    images = {"a-file": f, "under-a-file": f / "sub", "too-long": tmp_path / ("x" * 300)}[where]
    assert rt_main.main(checkpoint_argv(images)) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert f"error: --image-path {images}: " in err and "internal error" not in err
    assert world["client"].calls == [] and world["runc"].commands() == ["state"]


def test_agent_directory_left_by_an_earlier_container_of_the_id_is_taken_again(cfg):
    """The agent's socket directory belongs to the container's uid once made; a second
    create or restore of that id (a delete that never came, a restore retried) must not be
    refused as 'can be changed by uid 1000' (a restore then failed with exit 2)."""
    from torpor.runtime import lifecycle
    spec = {"process": {"user": {"uid": 1000, "gid": 1000}}}
    first = lifecycle.agent_dir(cfg, CID, spec)
    assert (first.stat().st_uid, first.stat().st_mode & 0o777) == (1000, 0o700)
    first.chmod(0o755)
    again = lifecycle.agent_dir(cfg, CID, {"process": {"user": {"uid": 1001, "gid": 1001}}})
    assert again == first
    st = again.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1001, 1001, 0o700)
    assert (again.parent.stat().st_uid, again.parent.stat().st_mode & 0o777) == (0, 0o700)


def test_agent_directory_is_never_reached_through_a_link(cfg, tmp_path):
    from torpor.runtime import lifecycle
    target = tmp_path / "elsewhere"
    target.mkdir()
    lifecycle.agent_dir(cfg, "other", {})
    link = cfg.run_dir / "agents" / CID
    link.symlink_to(target)
    with pytest.raises(OSError):
        lifecycle.agent_dir(cfg, CID, {"process": {"user": {"uid": 1000}}})
    assert target.stat().st_uid == 0


def _packed_checkpoint(world: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A GPU container checkpoint packed into the store at tmp_path/store."""
    monkeypatch.setenv("TORPOR_STORE_DIR", str(tmp_path / "store"))
    write_spec(world["bundle"], gpu=True)
    spec = json.loads((world["bundle"] / "config.json").read_text())
    spec["annotations"] = {"org.torpor.store": "on"}
    (world["bundle"] / "config.json").write_text(json.dumps(spec))
    assert rt_main.main(checkpoint_argv(world["images"])) == 0


def test_a_packed_restore_keeps_gc_off_the_store_until_torpord_is_done(world, monkeypatch,
                                                                      tmp_path):
    """The chunks a packed checkpoint's restore imports (or fetches) are in no snapshot, and
    torpord streams GPU data from them after runc's restore: the runtime holds the store's
    lock (shared) until torpord is done, so a gc in between waits rather than take them."""
    from torpor.errors import BusyError
    from torpor.store import Store
    _packed_checkpoint(world, monkeypatch, tmp_path)
    assert store_images.is_packed(world["images"])
    (world["runc"].root / "restore.pid").write_text(str(world["pid"]))
    monkeypatch.setattr(rt_restore.container, "place",
                        lambda cfg, m, b: container.Placement({GPU: GPU}))
    client = world["client"]
    gc_meanwhile = []
    restore_and_unlock = client.restore_and_unlock

    def during(**kw: Any) -> Restored:
        try:
            Store(tmp_path / "store").gc(timeout=0.2)
            gc_meanwhile.append("ran")
        except BusyError:
            gc_meanwhile.append("waited")
        return restore_and_unlock(**kw)
    monkeypatch.setattr(client, "restore_and_unlock", during)
    argv = ["restore", "--image-path", str(world["images"]), "--bundle", str(world["bundle"]),
            "--pid-file", str(tmp_path / "pid"), "--detach", CID]
    assert rt_main.main(argv) == 0
    assert gc_meanwhile == ["waited"]
    Store(tmp_path / "store").gc(timeout=0.2)     # the restore over: gc runs


def test_a_foreground_packed_restore_lets_gc_go_on_while_the_container_runs(world, monkeypatch,
                                                                            tmp_path):
    """Without --detach runc runs the restored container until it ends: the store's lock goes
    once torpord is done, before that wait, or gc would wait for the container's whole life."""
    from torpor.errors import BusyError
    from torpor.runtime import runc as rt_runc
    from torpor.store import Store
    _packed_checkpoint(world, monkeypatch, tmp_path)
    (world["runc"].root / "restore.pid").write_text(str(world["pid"]))
    monkeypatch.setattr(rt_restore.container, "place",
                        lambda cfg, m, b: container.Placement({GPU: GPU}))
    gc_while_running = []
    run = rt_runc.Runtime.run

    def watched(self, *a: Any, **kw: Any) -> Any:
        proc = run(self, *a, **kw)
        if self.inv.command != "restore":
            return proc
        wait = proc.wait

        def container_runs(*wa: Any, **wkw: Any) -> int:
            try:
                Store(tmp_path / "store").gc(timeout=0.2)
                gc_while_running.append("ran")
            except BusyError:
                gc_while_running.append("waited")
            return wait(*wa, **wkw)
        proc.wait = container_runs
        return proc
    monkeypatch.setattr(rt_runc.Runtime, "run", watched)
    argv = ["restore", "--image-path", str(world["images"]), "--bundle", str(world["bundle"]),
            "--pid-file", str(tmp_path / "pid"), CID]
    assert rt_main.main(argv) == 0
    assert gc_while_running == ["ran"]


def test_a_torpord_lost_in_lock_and_checkpoint_keeps_its_staging_for_recovery(
        torpor_env, tmp_path, monkeypatch):
    """torpord died (or the call timed out) after its agents detached, their data staged in
    host memory: torpor-runtime gets an error but must not remove the staging, the only
    copy of that data, which the journal entry's recovery gives back from."""
    import contextlib
    from torpor.errors import SidecarError
    from torpor.runtime import pause
    monkeypatch.setenv("TORPOR_SUSPEND_DIR", str(tmp_path / "shm"))
    cfg = config.load()
    stage = agent_data.DataDir(Path(cfg.suspend_dir) / "ck-stage", private_parent=True)
    monkeypatch.setattr(pause, "staging", lambda *a, **k: stage)
    monkeypatch.setattr(rt_checkpoint, "ensure_running", lambda cfg: None)

    class DyingTorpord:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def lock_and_checkpoint(self, **kw):
            op = Engine(cfg).begin("checkpoint", [])
            stage.make()
            (stage.root / "4242").mkdir()
            (stage.root / "4242" / "gpu-memory-0.bin").write_bytes(b"\x5a" * 4096)
            op.phase("agent-detach", data_root=str(stage.root), scratch=True,
                     agents={4242: {"socket": "/nonexistent", "data": str(stage.root),
                                    "name": 4242, "files": 1}})
            op.release()                      # ... and then it is SIGKILLed
            raise SidecarError("torpord: connection lost (UNAVAILABLE)")

    monkeypatch.setattr(rt_checkpoint, "Client", DyingTorpord)
    images = tmp_path / "images"
    images.mkdir()
    with pytest.raises(SidecarError):
        rt_checkpoint._checkpoint(cfg, None, "c1", "c1", {}, None, 4242, images,
                                  agent_data.DataDir(images / agent_data.DATA_DIR),
                                  contextlib.nullcontext(), True, None, images)
    (orphan,) = [e for e, fd in Journal(cfg).orphans()]
    assert orphan.data_root == str(stage.root)
    assert (stage.root / "4242" / "gpu-memory-0.bin").exists()


def test_a_container_whose_deferred_copy_failed_has_no_checkpoint_and_runs_on(
        torpor_env, tmp_path, monkeypatch):
    """RestoreAndUnlock said the copiers did not fill the staging (drain_error): nothing is
    written out, the image directory is marked damaged, nothing stays staged or journaled,
    and the error says the container runs on."""
    from torpor.errors import RolledBackError
    from torpor.runtime import pause
    monkeypatch.setenv("TORPOR_SUSPEND_DIR", str(tmp_path / "shm"))
    cfg = config.load()
    stage = agent_data.DataDir(Path(cfg.suspend_dir) / "ck-stage", private_parent=True).make()
    images = tmp_path / "images"
    images.mkdir()
    op = pause.begin(cfg, images, stage)
    ck = Checkpointed(op_id="op-1", pids=(1,), cuda_processes=(), timings={}, deadline=0.0,
                      container_id=CID)
    with pytest.raises(RolledBackError, match="the copy of the GPU memory into the data files "
                       r"failed \(PID 7: pinned host memory\); the container runs on"):
        pause.after(cfg, CID, images, {}, stage, op, ck, True, 0.0, {},
                    drain_error="PID 7: pinned host memory")
    assert not stage.root.exists()
    assert (images / "torpor-damaged.txt").exists()
    assert list(Journal(cfg).orphans()) == [] and list(cfg.journal_dir.glob("*.json")) == []
