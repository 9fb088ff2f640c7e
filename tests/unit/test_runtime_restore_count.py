"""A GPU container restore whose torpord restores fewer CUDA processes than the checkpoint's
manifest holds (seen once: torpord killed and restarted during a podman restore answered
RestoreAndUnlock having restored none, podman reported success, the program stayed
CHECKPOINTED in the driver for good). torpor-runtime fails the restore, stops the container
as it does for any other GPU-phase failure and leaves the checkpoint as it was. In process,
with test_runtime_flows.py's fake runc and fake torpord client."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_runtime_flows import (CID, GPU, checkpoint_argv, world,  # noqa: F401
                                           write_spec)
from torpor import config
from torpor.errors import ExitCode
from torpor.flows import container
from torpor.runtime import main as rt_main
from torpor.runtime import restore as rt_restore
from torpor.sidecar.convert import Checkpointed, CudaProcess, Restored


def _snapshot(images: Path) -> dict[str, str]:
    """Every file of the checkpoint, by name, with its sha256."""
    return {str(p.relative_to(images)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(images.rglob("*")) if p.is_file()}


@pytest.fixture
def checkpoint_of(world, monkeypatch, tmp_path):  # noqa: F811
    """checkpoint_of(n): a checkpoint of the GPU container with n CUDA processes in its
    manifest (the container's init and n - 1 other live processes), then the restore ready:
    the fake runc "restores" a new process, placed on the same GPU. Returns the runtime's
    restore argv."""
    others: list[subprocess.Popen] = []
    new = subprocess.Popen(["sleep", "60"])
    client = world["client"]

    def make(n: int) -> list[str]:
        others.extend(subprocess.Popen(["sleep", "60"]) for _ in range(n - 1))
        pids = (world["pid"], *(p.pid for p in others))

        def lock_and_checkpoint(**kw):
            client.calls.append(("lock_and_checkpoint", kw))
            return Checkpointed(op_id="op-1", pids=pids,
                                cuda_processes=tuple(
                                    CudaProcess(p, "CHECKPOINTED", (GPU,), 1 << 20,
                                                {GPU: 1 << 20}) for p in pids),
                                timings={"checkpoint": 0.5}, deadline=0.0, container_id=CID)
        monkeypatch.setattr(client, "lock_and_checkpoint", lock_and_checkpoint)
        write_spec(world["bundle"], gpu=True)
        assert rt_main.main(checkpoint_argv(world["images"])) == 0
        monkeypatch.setattr(rt_restore.container, "place",
                            lambda cfg, m, b: container.Placement({GPU: GPU}))
        (world["runc"].root / "restore.pid").write_text(str(new.pid))
        client.calls.clear()
        return ["--root", "/r", "restore", "--image-path", str(world["images"]), "--bundle",
                str(world["bundle"]), "--pid-file", str(tmp_path / "pid"), "--detach", CID]
    yield make
    for p in (new, *others):
        p.kill()
        p.wait()


def _torpord_restores(world, monkeypatch, pids: tuple[int, ...]) -> None:
    client = world["client"]

    def restore_and_unlock(**kw):
        client.calls.append(("restore_and_unlock", kw))
        return Restored("op-2", pids, {}, (), {"restore": 0.2})
    monkeypatch.setattr(client, "restore_and_unlock", restore_and_unlock)


def _assert_failed_and_stopped(world, argv, before, capsys, said: str) -> None:
    assert rt_main.main(argv) == ExitCode.ERROR
    assert world["client"].names() == ["ensure", "restore_and_unlock"]
    assert world["runc"].calls()[-1][-3:] == ["kill", CID, "KILL"]   # not left frozen
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"torpor-runtime: error: GPU restore of container {CID} failed: "
                             f"{said}"), err
    assert "the restored container was stopped" in err[0]
    assert f"the checkpoint in {world['images']} is unchanged" in err[0]
    assert _snapshot(world["images"]) == before                        # retry possible
    assert list(config.load().journal_dir.glob("*.json")) == []       # nothing to recover


@pytest.mark.parametrize("reply", [(), (0,)], ids=["no-pids", "no-valid-pid"])
def test_a_restore_where_torpord_restored_no_cuda_process_stops_the_container(
        world, checkpoint_of, monkeypatch, capsys, reply):
    argv = checkpoint_of(1)
    before = _snapshot(world["images"])
    _torpord_restores(world, monkeypatch, reply)
    _assert_failed_and_stopped(world, argv, before, capsys,
                               "torpord restored 0 of the checkpoint's 1 CUDA process(es)")


@pytest.mark.parametrize("named", ["one", "one-twice"])
def test_a_restore_where_torpord_restored_some_but_not_all_cuda_processes_stops_the_container(
        world, checkpoint_of, monkeypatch, capsys, named):
    argv = checkpoint_of(2)
    before = _snapshot(world["images"])
    pid = int((world["runc"].root / "restore.pid").read_text())
    _torpord_restores(world, monkeypatch, (pid,) if named == "one" else (pid, pid))
    _assert_failed_and_stopped(world, argv, before, capsys,
                               "torpord restored 1 of the checkpoint's 2 CUDA process(es)")


def test_a_restore_where_torpord_restored_every_cuda_process_succeeds(
        world, checkpoint_of, monkeypatch):
    argv = checkpoint_of(2)
    pid = int((world["runc"].root / "restore.pid").read_text())
    _torpord_restores(world, monkeypatch, (pid, pid + 1))
    assert rt_main.main(argv) == 0
    assert "kill" not in world["runc"].commands()
