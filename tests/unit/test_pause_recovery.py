"""A container's staged --leave-running checkpoint (runtime/pause.py) whose torpor-runtime
dies after torpord gave the agents their data back but before its write-out named the
staging: the next recovery removes the staging (GPU data in host memory, possibly GiBs of
it), but never while another entry, torpord's operation, still names it: then a recovery after
that operation has ended does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torpor import agent_data, config
from torpor.engine import Engine
from torpor.journal import Journal
from torpor.runtime import pause


@pytest.fixture
def cfg(torpor_env, tmp_path, monkeypatch):
    monkeypatch.setenv("TORPOR_SUSPEND_DIR", str(tmp_path / "shm"))
    return config.load()


def _staged(cfg) -> agent_data.DataDir:
    stage = agent_data.DataDir(Path(cfg.suspend_dir) / "ck-stage", private_parent=True)
    stage.make()
    (stage.root / "gpu-memory-0.bin").write_bytes(b"\x5a" * 4096)
    return stage


def _images(tmp_path: Path) -> Path:
    images = tmp_path / "images"
    images.mkdir()
    return images


def test_pause_begin_names_the_staging_in_its_entry(cfg, tmp_path):
    stage = _staged(cfg)
    op = pause.begin(cfg, _images(tmp_path), stage)
    try:
        assert (op.entry.phase, op.entry.data_root, op.entry.scratch) == \
            ("stage", str(stage.root), False)
    finally:
        op.close()


def test_a_runtime_dead_before_its_write_out_leaves_no_staging(cfg, tmp_path):
    stage, images = _staged(cfg), _images(tmp_path)
    pause.begin(cfg, images, stage).release()     # torpor-runtime died; torpord's op ended
    said = Engine(cfg).recover()
    assert not stage.root.exists(), said
    assert (images / "torpor-damaged.txt").exists(), sorted(os.listdir(images))
    assert list(Journal(cfg).orphans()) == []


def test_the_staging_stays_while_torpords_operation_names_it(cfg, tmp_path):
    stage, images = _staged(cfg), _images(tmp_path)
    torpord = Journal(cfg).begin("checkpoint", [])   # live: gives the agents their data back
    torpord.phase("dump", data_root=str(stage.root), scratch=True)
    try:
        pause.begin(cfg, images, stage).release()
        Engine(cfg).recover()
        assert (stage.root / "gpu-memory-0.bin").read_bytes() == b"\x5a" * 4096
        assert (images / "torpor-damaged.txt").exists()
        Engine(cfg).recover()                        # still named: still there
        assert stage.root.exists()
    finally:
        torpord.close()
    # torpord's operation ended: the next recovery (torpord's own every few seconds, or the
    # next command's) removes the staging, and the entry that kept it goes with it (it stayed
    # behind, removed by nothing, and held GiBs of host memory)
    said = Engine(cfg).recover()
    assert not stage.root.exists(), said
    assert any("removed the staged GPU data" in m for m in said), said
    assert list(Journal(cfg).orphans()) == []
    assert Engine(cfg).recover() == []


def test_torpord_and_the_runtime_both_dead_leave_nothing_after_one_recovery(cfg, tmp_path,
                                                                           monkeypatch):
    """Both died: torpord's entry (its staging its scratch) and the runtime's. Whichever the
    journal lists first, one recovery gives back, removes the staging, and forgets both."""
    stage, images = _staged(cfg), _images(tmp_path)
    torpord = Journal(cfg).begin("checkpoint", [])
    torpord.phase("agent-detach", data_root=str(stage.root), scratch=True)
    pause.begin(cfg, images, stage).release()
    torpord.release()
    listed = Journal.orphans

    def runtime_first(self):
        return iter(sorted(listed(self), key=lambda o: o[0].phase != "stage"))
    monkeypatch.setattr(Journal, "orphans", runtime_first)
    Engine(cfg).recover()
    assert not stage.root.exists()
    assert list(cfg.journal_dir.glob("*.json")) == []
