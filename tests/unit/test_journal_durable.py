"""Nothing is locked, and no agent prepares, that a recovery would not find (issue 18 item 8):
the engine reads its journal entry back from disk right before (Operation.require_journalled).
A write that did not reach the disk is simulated by a _save that loses it."""

import os

import pytest

from tests.fakes.fake_agent import Events, FakeDriver
from torpor import engine as engine_mod
from torpor.engine import Engine
from torpor.errors import RolledBackError
from torpor.journal import Journal

PID = os.getpid()   # a live process: recovery and rollback look at /proc


@pytest.fixture
def drv(monkeypatch):
    d = FakeDriver(Events(), [PID])
    monkeypatch.setattr(engine_mod, "load_driver", lambda path: d)
    return d


def _lose_writes_from(monkeypatch, phase: str) -> None:
    save = Journal._save
    monkeypatch.setattr(Journal, "_save", lambda self, e: None if e.phase == phase
                        else save(self, e))


def test_a_lost_lock_phase_locks_nothing(cfg, drv, monkeypatch):
    e = Engine(cfg)
    op = e.begin("checkpoint", [PID])
    _lose_writes_from(monkeypatch, "lock")
    with pytest.raises(RolledBackError, match="does not cover the lock"):
        e.lock_and_checkpoint(op, [PID])
    assert "driver lock" not in " ".join(drv.log._items) and drv.unlocked(PID)


def test_a_pid_the_entry_does_not_name_is_not_locked(cfg, drv):
    e = Engine(cfg)
    op = e.begin("checkpoint", [])           # its entry names no PID
    with pytest.raises(RolledBackError, match=f"PIDs missing: \\[{PID}\\]"):
        e.lock_and_checkpoint(op, [PID])
    assert drv.unlocked(PID) and not drv.log._items


def test_an_operation_whose_lock_is_gone_locks_nothing(cfg, drv):
    e = Engine(cfg)
    op = e.begin("checkpoint", [PID])
    (Journal(cfg).dir / f"{op.entry.id}.lock").unlink()   # a recovery would take a new one
    with pytest.raises(RolledBackError, match="lock held: False"):
        e.lock_and_checkpoint(op, [PID])
    assert drv.unlocked(PID) and not drv.log._items


def test_the_entry_on_disk_covers_the_lock(cfg, drv):
    e = Engine(cfg)
    op = e.begin("checkpoint", [PID])
    e.lock_and_checkpoint(op, [PID])
    op.release()                             # as if killed now
    assert Engine(cfg).recover() and drv.unlocked(PID)
