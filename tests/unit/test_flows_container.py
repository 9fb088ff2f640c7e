"""flows/container.py and flows/policy.py in-process: torpord's container operations on a fake
driver (tests/fakes/fake_agent.FakeDriver), without a daemon, CRIU or GPU.

The "container" is this test process (and a child of it for a second PID): the fake driver
holds their CUDA states, NVML is a fixed inventory."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys

import pytest

from tests.fakes.fake_agent import Events, FakeDriver
from torpor import engine as engine_mod, gpus, placement
from torpor.driver import ProcessState
from torpor.engine import Engine
from torpor.errors import RolledBackError, TorporError, UsageError
from torpor.flows import container, policy
from torpor.progress import Progress
from torpor.store import Store, fingerprints

GPU = "GPU-8c6d2f4e-1b3a-4c5d-9e7f-0a1b2c3d4e5f"
PID = os.getpid()
S = ProcessState


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


@pytest.fixture
def world(cfg, monkeypatch, tmp_path, child):
    drv = FakeDriver(Events(), [PID, child])
    monkeypatch.setattr(engine_mod, "load_driver", lambda path: drv)
    inv = gpus.Inventory("999.0-fake", [gpus.Gpu(0, GPU, "Fake GPU", 8 << 30, 6 << 30)],
                         [gpus.GpuProcess(PID, GPU, 1 << 30)])
    monkeypatch.setattr(gpus, "discover", lambda: inv)
    monkeypatch.setattr(container, "FINISH_GRACE_S", 0.0)
    monkeypatch.setenv("TORPOR_AGENT_DIR", str(tmp_path / "agents"))
    cfg = dataclasses.replace(cfg, store_dir=tmp_path / "store")
    return cfg, drv


def engine(cfg) -> Engine:
    return Engine(cfg, Progress(stream=io.StringIO()))


def fail_once(drv: FakeDriver, call: str) -> None:
    """The next `call` of the driver fails; the one after works (a retry)."""
    real = getattr(drv, call)

    def once(*a, **kw):
        setattr(drv, call, real)
        drv.fail[call] = 0
        try:
            return real(*a, **kw)
        finally:
            drv.fail.pop(call, None)
    setattr(drv, call, once)


def checkpoint(cfg, pids, opened=None) -> tuple[container.Checkpointed, list]:
    ops = []
    ck = container.lock_and_checkpoint(
        engine(cfg), pids, data=None, agent_dir=None, owner_container="c1",
        mode=policy.FingerprintMode.NONE,
        opened=opened or (lambda op, cuda: ops.append((op, cuda))))
    return ck, ops


def journal(cfg) -> list:
    return list(cfg.journal_dir.glob("*.json"))


def test_lock_and_checkpoint_returns_typed_result_and_hands_over_the_op(world):
    cfg, drv = world
    ck, ops = checkpoint(cfg, [PID])
    assert drv.states[PID] == S.CHECKPOINTED
    assert ck.cuda_pids == (PID,) and ck.pids == (PID,) and ck.moved == ()
    assert ck.cuda == (container.CudaProcess(PID, "RUNNING", (GPU,), 1 << 30,
                                             {GPU: 1 << 30}),)
    assert [c for _op, c in ops] == [[PID]] and ops[0][0].entry.id == ck.op_id
    with pytest.raises(dataclasses.FrozenInstanceError):
        ck.op_id = "x"   # type: ignore[misc]
    assert ops[0][0].entry.phase == "dump" and len(journal(cfg)) == 1


def test_lock_and_checkpoint_rolls_back_when_the_table_refuses(world):
    cfg, drv = world

    def refuse(op, cuda):
        raise TorporError("torpord is shutting down")
    with pytest.raises(RolledBackError, match="shutting down"):
        checkpoint(cfg, [PID], refuse)
    assert drv.states[PID] == S.RUNNING and journal(cfg) == []


def test_lock_and_checkpoint_refuses_a_process_not_running(world):
    cfg, drv = world
    drv.states[PID] = S.LOCKED
    with pytest.raises(UsageError, match=f"PID {PID} is LOCKED"):
        checkpoint(cfg, [PID])
    assert journal(cfg) == []


def test_finish_resumes_what_is_still_alive(world):
    cfg, drv = world
    ck, [(op, cuda)] = checkpoint(cfg, [PID])
    r = container.finish(engine(cfg), op, cuda)
    assert (r.outcome, r.op_id, r.pids, r.resumed, r.gone) == \
        ("finished", ck.op_id, (PID,), (PID,), ())
    assert drv.states[PID] == S.RUNNING and journal(cfg) == []


def test_roll_back_failing_keeps_the_journal_entry(world):
    cfg, drv = world
    _ck, [(op, cuda)] = checkpoint(cfg, [PID])
    drv.fail["restore"] = 0
    with pytest.raises(TorporError, match=f"rollback of {op.entry.id} failed") as e:
        container.roll_back(engine(cfg), op, cuda)
    assert e.value.hint == policy.RETRY_HINT and len(journal(cfg)) == 1
    drv.fail.clear()
    r = container.roll_back(engine(cfg), op, cuda)
    assert r.outcome == "rolled-back" and drv.states[PID] == S.RUNNING and journal(cfg) == []


def test_restore_open_retries_once(world):
    cfg, drv = world
    _ck, [(op, cuda)] = checkpoint(cfg, [PID])
    fail_once(drv, "restore")
    r = container.restore_open(engine(cfg), op, cuda, {})
    assert r.pids == (PID,) and r.agents == () and drv.states[PID] == S.RUNNING
    assert journal(cfg) == []
    restores = [e for e in drv.log() if e.startswith("driver restore")]
    assert len(restores) == 2   # the failed one, then the retry


def test_restore_open_failing_twice_says_both_and_keeps_the_entry(world):
    cfg, drv = world
    _ck, [(op, cuda)] = checkpoint(cfg, [PID])
    drv.fail["restore"] = PID
    with pytest.raises(TorporError, match=r"gpu-restore failed: .*injected\); retry failed too: "
                                          f"PID {PID}"):
        container.restore_open(engine(cfg), op, cuda, {})
    assert drv.states[PID] == S.CHECKPOINTED and len(journal(cfg)) == 1


def test_restore_restores_the_checkpointed_and_unlocks_the_locked(world, child):
    cfg, drv = world
    drv.states.update({PID: S.CHECKPOINTED, child: S.LOCKED})
    r = container.restore(engine(cfg), [PID, child], gpu_map={GPU: GPU})
    assert r.pids == tuple(sorted([PID, child])) and r.gpu_map == {GPU: GPU}
    assert drv.states == {PID: S.RUNNING, child: S.RUNNING} and journal(cfg) == []
    log = drv.log()
    assert f"driver restore {PID}" in log and f"driver restore {child}" not in log
    assert log.index(f"driver unlock {PID}") < log.index(f"driver unlock {child}")


def test_restore_retries_once_then_refuses(world, child):
    cfg, drv = world
    drv.states.update({PID: S.CHECKPOINTED})
    fail_once(drv, "unlock")
    assert container.restore(engine(cfg), [PID], gpu_map={}).pids == (PID,)
    assert drv.states[PID] == S.RUNNING
    drv.states[PID] = S.FAILED
    with pytest.raises(TorporError, match="FAILED state"):
        container.restore(engine(cfg), [PID], gpu_map={})
    with pytest.raises(UsageError, match="without the gpu_data_dir"):
        container.restore(engine(cfg), [PID], gpu_map={},
                          agents=[container.AgentEntry(PID, 1, ("a",))])


def test_agent_move_from_the_engine():
    r = {"nspid": 7, "files": [5], "bytes": 10, "chunks": 1, "allocations": 2,
         "cache_released": 0, "seconds": 0.5,
         "fingerprints": {"parts": 3, "skipped": 1, "skipped_bytes": 4}}
    assert container.AgentMove.of(9, r) == container.AgentMove(9, 7, (5,), 10, 1, 2, 0, 0.5,
                                                               3, 1, 4)
    del r["fingerprints"]
    assert container.AgentMove.of(9, r).fingerprinted == 0


# -- policy ----------------------------------------------------------------------------------

def test_fingerprint_plan(cfg, tmp_path):
    store = Store(tmp_path / "store")
    known = fingerprints.Known({"ab" * 16: [None, 4]}, {})
    M = policy.FingerprintMode
    on = dataclasses.replace(cfg, store_stream=True)
    off = dataclasses.replace(cfg, store_stream=False)
    assert policy.fingerprint_plan(on, store, "uid:0", M.NONE, known) == policy.NO_FINGERPRINTS
    assert policy.fingerprint_plan(on, None, "uid:0", M.SKIP, known) == policy.NO_FINGERPRINTS
    index = policy.fingerprint_plan(on, store, "uid:0", M.INDEX, known)
    assert index.skip == frozenset() and index.stream_into is None and index.mode is M.INDEX
    skip = policy.fingerprint_plan(on, store, "uid:0", M.SKIP, known)
    assert skip.skip == known.gpu and skip.stream_into is store and skip.mode is M.SKIP
    assert policy.fingerprint_plan(off, store, "uid:0", M.SKIP, known).stream_into is None
    # read from the store when not given: an empty store has none
    assert policy.fingerprint_plan(on, store, "uid:0", M.SKIP).skip == {}
    assert M.of(False, False) is M.NONE and M.of(True, True) is M.INDEX \
        and M.of(True, False) is M.SKIP


def test_open_store_one_line(cfg, tmp_path):
    (tmp_path / "file").write_text("")
    bad = dataclasses.replace(cfg, store_dir=tmp_path / "file" / "store")
    with pytest.raises(policy.StoreError) as e:
        policy.open_store(bad, "the program was not touched")
    assert e.value.line().startswith(f"cannot open the image store {bad.store_dir}: ")
    assert e.value.line().endswith("; the program was not touched") and "\n" not in str(e.value)
    assert policy.open_store(dataclasses.replace(cfg, store_dir=tmp_path / "s")).where


def test_driver_map_same_gpus_no_pairs():
    assert placement.driver_map({"A": "A", "B": "B"}, {}) == {}
    assert placement.driver_map({"A": "A"}, {"A": "A"}) == {"A": "A"}
    assert placement.driver_map({"A": "B", "B": "B"}, {}) == {"A": "B", "B": "B"}


@pytest.mark.parametrize("where", ["elsewhere/x", "shm", "shm/a/b", "shm/.."])
def test_a_staged_data_dir_only_directly_in_suspend_dir(world, tmp_path, where):
    """LockAndCheckpoint's `staged`: torpord (root) makes and later removes the directory, so
    it takes none but a new one directly in its own suspend_dir; refused before any lock."""
    cfg, drv = world
    cfg = dataclasses.replace(cfg, suspend_dir=tmp_path / "shm")
    with pytest.raises(UsageError, match="staged gpu_data_dir"):
        container.lock_and_checkpoint(
            engine(cfg), [PID], data=tmp_path / where, agent_dir=None, owner_container="c1",
            mode=policy.FingerprintMode.NONE, opened=lambda op, cuda: None, staged=True)
    assert drv.states[PID] == S.RUNNING and journal(cfg) == []
    d = container.staged_data(cfg, tmp_path / "shm" / "1-ab")
    assert d.private_parent and d.root == tmp_path / "shm" / "1-ab"
