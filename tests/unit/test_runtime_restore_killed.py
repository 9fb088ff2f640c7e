"""A GPU container restore whose torpor-runtime dies (issue 18's fault suite found it: podman
then waited forever, the restored program CHECKPOINTED on the GPU): the runtime journals the
restore before the real runtime runs, and recovery (engine/recovery.py) lets the real runtime
finish, then stops the container it restored, unless torpord is restoring it right now.
In process, with test_runtime_flows.py's fake runc and fake torpord client."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.test_runtime_flows import (CID, GPU, checkpoint_argv, world,  # noqa: F401
                                           write_spec)
from torpor import config
from torpor.engine import Engine
from torpor.flows import container
from torpor.journal import Journal
from torpor.runtime import main as rt_main
from torpor.runtime import restore as rt_restore


class Killed(BaseException):
    """torpor-runtime dying where it is raised (nothing of its own cleans up after it)."""


def _restore_argv(world, bundle: Path, pid_file: Path) -> list[str]:
    return ["--root", "/r", "restore", "--image-path", str(world["images"]), "--bundle",
            str(bundle), "--pid-file", str(pid_file), "--detach", CID]


def _gone(proc: subprocess.Popen, timeout: float = 5.0) -> bool:
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture
def restored(world, monkeypatch, tmp_path):  # noqa: F811
    """A checkpoint of the GPU container, the process the fake runc "restores" (its pid
    file), and torpor-runtime's restore ready to die in RestoreAndUnlock."""
    write_spec(world["bundle"], gpu=True)
    assert rt_main.main(checkpoint_argv(world["images"])) == 0
    monkeypatch.setattr(rt_restore.container, "place",
                        lambda cfg, m, b: container.Placement({GPU: GPU}))
    new = subprocess.Popen(["sleep", "60"])
    (world["runc"].root / "restore.pid").write_text(str(new.pid))

    def killed(**kw):
        raise Killed()
    monkeypatch.setattr(world["client"], "restore_and_unlock", killed)
    yield new
    new.kill()
    new.wait()


def test_a_restore_whose_runtime_dies_is_stopped_by_the_next_recovery(world, restored,
                                                                      tmp_path):
    argv = _restore_argv(world, world["bundle"], tmp_path / "pid")
    images = sorted(p.name for p in world["images"].iterdir())
    with pytest.raises(Killed):
        rt_main.main(argv)
    cfg = config.load()
    entries = []
    for e, fd in Journal(cfg).orphans():
        os.close(fd)
        entries.append(e)
    assert [(e.kind, e.phase, e.pids) for e in entries] == [("restore", "container-restore", [])]
    c = entries[0].container
    assert c["id"] == CID and c["pid_file"] == str(tmp_path / "pid")
    assert c["argv"] == [str(world["runc"].path), *argv]
    said = Engine(cfg).recover()
    assert _gone(restored), "the half-restored container still runs"
    assert any(f"stopped container {CID} (PID {restored.pid})" in m for m in said), said
    assert list(cfg.journal_dir.glob("*.json")) == []
    assert sorted(p.name for p in world["images"].iterdir()) == images   # checkpoint kept


def test_recovery_leaves_a_container_torpord_is_restoring(world, restored, tmp_path):
    with pytest.raises(Killed):
        rt_main.main(_restore_argv(world, world["bundle"], tmp_path / "pid"))
    cfg = config.load()
    busy = Journal(cfg).begin("restore", [restored.pid])   # torpord's RestoreAndUnlock
    try:
        assert Engine(cfg).recover() == []
        assert restored.poll() is None
        assert len(list(cfg.journal_dir.glob("*.json"))) == 2
    finally:
        busy.close()
    Engine(cfg).recover()
    assert _gone(restored)
    assert list(cfg.journal_dir.glob("*.json")) == []


def test_recovery_waits_for_the_real_runtime_then_stops_what_it_restored(world, tmp_path):
    cfg = config.load()
    journal = Journal(cfg)
    pid_file = tmp_path / "pid"
    runtime = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                "restore", "--pid-file", str(pid_file), CID])
    op = journal.begin("restore", [])
    op.entry.container = {"id": CID, "argv": runtime.args, "pid_file": str(pid_file)}
    op.phase("container-restore")
    op.release()          # torpor-runtime died; its runtime still restores
    engine = Engine(cfg)
    try:
        (entry, fd), = list(journal.orphans())
        t = time.monotonic()
        keep, said = engine._interrupted_container_restore(entry, wait_s=0.3)
        assert keep and time.monotonic() - t >= 0.3 and "still being run" in said[0]
        os.close(fd)
    finally:
        runtime.kill()
        runtime.wait()
    new = subprocess.Popen(["sleep", "60"])
    try:
        pid_file.write_text(f"{new.pid}\n")
        said = engine.recover()
        assert _gone(new) and any("stopped container" in m for m in said), said
        assert list(journal.orphans()) == []
    finally:
        new.kill()
        new.wait()


def test_a_stale_pid_file_is_not_taken_for_the_restored_container(world, tmp_path):
    """The real runtime died before restoring anything: the pid file names an older process
    (an earlier restore's), which is left alone."""
    old = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(2.2)   # started clearly before the entry (start times have 1 s slack)
        cfg = config.load()
        pid_file = tmp_path / "pid"
        pid_file.write_text(str(old.pid))
        op = Journal(cfg).begin("restore", [])
        op.entry.container = {"id": CID, "argv": ["/nonexistent/runc", "restore", CID],
                              "pid_file": str(pid_file)}
        op.phase("container-restore")
        op.release()
        assert Engine(cfg).recover() == []
        assert old.poll() is None
        assert list(cfg.journal_dir.glob("*.json")) == []
    finally:
        old.kill()
        old.wait()
