"""torpord's service in-process, over a fake engine: no daemon, no socket, no driver.

The handlers are called as gRPC would call them (request message, context); the engine they
make is FakeEngine, which keeps each PID's driver state in a dict and records its calls. Covers
the container registry, the operation table (timeouts, the reaper, the caller's death, shutdown
rollback, a rollback that fails) and the refusals of bad requests.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from torpor.driver import ProcessState
from torpor.engine import Copies
from torpor.errors import ExitCode, RolledBackError, SidecarError, TorporError
from torpor.progress import Progress
from torpor.sidecar import EXIT_CODE_KEY
from torpor.sidecar.service import Service

PID = os.getpid()          # alive; its state is the fake engine's


class Aborted(Exception):
    def __init__(self, status: grpc.StatusCode, details: str, md: Any):
        super().__init__(f"{status}: {details}")
        self.status, self.details, self.md = status, details, dict(md or [])

    @property
    def exit_code(self) -> int:
        return int(self.md[EXIT_CODE_KEY])


class Ctx:
    md: Any = None

    def set_trailing_metadata(self, md: Any) -> None:
        self.md = md

    def abort(self, status: grpc.StatusCode, details: str) -> None:
        raise Aborted(status, details, self.md)


class FakeOp:
    """A journal operation: what the handlers and the table read and call."""

    def __init__(self, world: "World", kind: str, pids: list[int]):
        self.world = world
        world.seq += 1
        self.entry = SimpleNamespace(id=f"op-{world.seq}", kind=kind, pids=pids, phase="start",
                                     agents={}, started=time.time(), data_root="", scratch=False)
        self.ended = ""

    def phase(self, name: str, **kw: Any) -> None:
        self.entry.phase = name

    def close(self) -> None:
        self.ended = "closed"

    def release(self) -> None:
        self.ended = "released"
        if self.world.open_held():   # recovery may claim it now, and copy from the files
            self.world.calls.append(("released while held", self.entry.id))

    def abandon(self) -> None:
        self.ended = self.ended or "abandoned"


class FakeEngine:
    def __init__(self, world: "World", cfg: Any = None):
        self.world, self.cfg = world, cfg
        self.progress = Progress(stream=None)
        self.driver = SimpleNamespace(unlock=lambda p: world.set(p, ProcessState.RUNNING))
        self._held: dict[int, list[int]] = {}

    # the held descriptors as the real engine keeps them (engine/agents.py)
    def take_held(self) -> dict[int, list[int]]:
        held, self._held = {p: f for p, f in self._held.items() if f}, {}
        return held

    def give_held(self, held: dict[int, list[int]]) -> None:
        for p, fds in held.items():
            if fds:
                self._held[p] = list(fds)

    def held_counts(self) -> dict[int, int]:
        return {p: len(f) for p, f in self._held.items() if f}

    # no deferred copies in this world (engine/agents.py's Copies)
    def take_copies(self) -> Copies:
        return Copies()

    def give_copies(self, c: Copies) -> None:
        assert not c

    def wait_copiers(self) -> None:
        pass

    def drop_copiers(self) -> None:
        pass

    def drain_report(self, back: Any) -> tuple[dict[str, Any], dict[int, str]]:
        return {}, {}

    def release_held(self) -> None:
        for fds in self._held.values():
            for fd in fds:
                os.close(fd)
        self._held = {}

    def _map_back(self, pids: Any) -> dict[int, bool]:
        """The resume of each pid: mapped back through its held descriptors (then closed, as
        the real engine's resume closes them) or not; a resume that copies while descriptors
        are open somewhere (the memory twice on the GPU) is recorded."""
        out = {}
        for p in pids:
            if not self._held.get(p) and self.world.open_held():
                self.world.calls.append(("copied while held", p))
            fds = self._held.pop(p, [])
            self.world.calls.append(("held", p, len(fds)))
            for fd in fds:
                os.close(fd)
            out[p] = bool(fds)
        return out

    def begin(self, kind: str, pids: list[int]) -> FakeOp:
        self.world.ops.append(FakeOp(self.world, kind, pids))
        return self.world.ops[-1]

    def cuda_states(self, pids: Any) -> dict[int, ProcessState]:
        return {p: self.world.states[p] for p in pids if p in self.world.states}

    def lock_and_checkpoint(self, op: FakeOp, pids: list[int], data: Any, agent_dir: Any,
                            **kw: Any) -> dict[int, dict[str, Any]]:
        self.world.calls.append(("lock_and_checkpoint", tuple(pids)))
        self.world.hold_asked.append(kw.get("hold", False))
        for p in pids:
            self.world.set(p, ProcessState.CHECKPOINTED)
            if kw.get("hold") and p in self.world.hold:
                self._held[p] = [os.memfd_create(f"held-{p}-{i}", os.MFD_CLOEXEC)
                                 for i in range(self.world.hold[p])]
                self.world.held_fds += self._held[p]
        return self.world.moved

    def rollback(self, pids: Any, gpu_map: Any = None, agents: Any = None) -> list[str]:
        self.world.calls.append(("rollback", tuple(pids)))
        if self.world.rollback_problems:
            return list(self.world.rollback_problems)
        self._map_back(pids)
        for p in pids:
            self.world.set(p, ProcessState.RUNNING)
        return []

    def fail(self, op: FakeOp, pids: list[int], error: BaseException, during: str) -> None:
        self.rollback(pids)
        op.close()
        raise RolledBackError(f"{during} failed: {error}")

    def restore_and_unlock(self, op: FakeOp, pids: list[int], gpu_map: Any = None,
                           agents: Any = None) -> dict[int, dict[str, Any]]:
        self.world.calls.append(("restore_and_unlock", tuple(pids)))
        if any(o != m for o, m in (gpu_map or {}).items()):   # as the real engine's
            self.release_held()
        if self.world.restore_fails:
            raise TorporError("the driver's restore failed")
        back = self._map_back(pids)
        for p in pids:
            self.world.set(p, ProcessState.RUNNING)
        return {p: {"bytes": 1, "seconds": 0.0, "held": back.get(p, False)}
                for p in (agents or {})}

    def recover(self) -> list[str]:
        return []


class World:
    def __init__(self) -> None:
        self.states: dict[int, ProcessState] = {}
        self.calls: list[tuple] = []
        self.ops: list[FakeOp] = []
        self.moved: dict[int, dict[str, Any]] = {}
        self.rollback_problems: list[str] = []
        self.seq = 0
        self.hold: dict[int, int] = {}       # pid -> descriptors its agent holds (hold=True)
        self.restore_fails = False
        self.hold_asked: list[bool] = []     # each lock_and_checkpoint's hold
        self.held_fds: list[int] = []        # every descriptor handed out

    def open_held(self) -> list[int]:
        """Those of held_fds still open (in this process: no other opened since)."""
        out = []
        for fd in self.held_fds:
            try:
                os.fstat(fd)
                out.append(fd)
            except OSError:
                pass
        return out

    def set(self, pid: int, state: ProcessState) -> None:
        self.states[pid] = state


class FakeService(Service):
    world: World

    def engine(self, cfg: Any = None) -> Any:
        return FakeEngine(self.world, cfg or self.cfg)


@pytest.fixture
def world() -> World:
    w = World()
    w.set(PID, ProcessState.RUNNING)
    return w


@pytest.fixture
def service(cfg, world):
    made: list[FakeService] = []

    def make(op_timeout_s: float = 600) -> FakeService:
        s = FakeService(cfg, op_timeout_s)
        s.world = world
        made.append(s)
        return s
    yield make
    for s in made:
        s.shutdown()


def lock(svc: Service, **kw: Any) -> Any:
    kw.setdefault("pids", [PID])
    return svc.LockAndCheckpoint(svc.pb.LockAndCheckpointRequest(no_descendants=True, **kw), Ctx())


# -- registration ----------------------------------------------------------------------------------

def test_register_list_unregister(service, cfg):
    svc = service()
    got = svc.RegisterContainer(svc.pb.RegisterContainerRequest(
        id="ctr-1", bundle="/b", pids=[PID], gpu_uuids=["GPU-a"], annotations={"k": "v"}), Ctx())
    assert got.id == "ctr-1" and list(got.pids) == [PID] and got.registered_at > 0
    path = cfg.state_dir / "containers" / "ctr-1.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    listing = svc.List(svc.pb.ListRequest(), Ctx())
    assert [c.id for c in listing.containers] == ["ctr-1"]
    assert dict(listing.containers[0].annotations) == {"k": "v"}
    assert listing.server_pid == os.getpid() and listing.op_timeout_s == 600

    r = svc.UnregisterContainer(svc.pb.UnregisterContainerRequest(id="ctr-1"), Ctx())
    assert r.existed and not path.exists()
    with pytest.raises(Aborted) as e:
        svc.UnregisterContainer(svc.pb.UnregisterContainerRequest(id="ctr-1"), Ctx())
    assert e.value.status == grpc.StatusCode.NOT_FOUND and e.value.exit_code == ExitCode.NOT_FOUND
    r = svc.UnregisterContainer(svc.pb.UnregisterContainerRequest(id="ctr-1", missing_ok=True),
                                Ctx())
    assert not r.existed


KEY = "0123456789abcdef"      # a runtime root's key (runtime/markers.py root_key)
# names that are neither <id> nor <id>@<16 lowercase hex>: each could lead elsewhere, or
# name a second file for one container
HOSTILE_NAMES = ["../x", "a/b", "..", "x" * 129, f"x@{KEY.upper()}", "x@0123", f"x@{KEY}0",
                 f"x@{KEY}/..", "x@../../../etc", f"@{KEY}", f"..@{KEY}", f"x@@{KEY}",
                 f"x@{KEY}\n", f"x@{KEY}@{KEY}", f"x/@{KEY}", f"x@{KEY[:-1]}/", "x@", "x\n"]


@pytest.mark.parametrize("cid", ["", *HOSTILE_NAMES])
def test_register_refuses_bad_ids(service, cfg, cid):
    svc = service()
    with pytest.raises(Aborted) as e:
        svc.RegisterContainer(svc.pb.RegisterContainerRequest(id=cid, pids=[PID]), Ctx())
    assert e.value.exit_code == ExitCode.USAGE
    assert list((cfg.state_dir / "containers").iterdir()) == []


def test_one_id_under_two_runtime_roots_has_two_records(service, cfg):
    """torpor-hook registers a container torpor-runtime created as <id>@<root key>: the same
    id under another root is another record, and the poststop or delete of one leaves the
    other's. A bare id in a request means its one record; two must be told apart."""
    svc = service()
    pb = svc.pb
    other = "fedcba9876543210"
    for name in (f"ctr@{KEY}", f"ctr@{other}"):
        svc.RegisterContainer(pb.RegisterContainerRequest(id=name, pids=[PID]), Ctx())
    listing = svc.List(pb.ListRequest(), Ctx())
    assert sorted(c.id for c in listing.containers) == [f"ctr@{KEY}", f"ctr@{other}"]
    assert "2 runtime roots" in _refused(lambda: lock(svc, pids=[], container_id="ctr")).details
    assert svc.UnregisterContainer(pb.UnregisterContainerRequest(id=f"ctr@{other}"),
                                   Ctx()).existed
    assert not svc.UnregisterContainer(pb.UnregisterContainerRequest(id="ctr", missing_ok=True),
                                       Ctx()).existed     # no record of the id alone
    assert [c.id for c in svc.List(pb.ListRequest(), Ctx()).containers] == [f"ctr@{KEY}"]
    r = lock(svc, pids=[], container_id="ctr")       # its one record now
    assert list(r.pids) == [PID]
    svc.Rollback(pb.OperationRequest(op_id=r.op_id), Ctx())
    r = lock(svc, pids=[], container_id=f"ctr@{KEY}")
    svc.Rollback(pb.OperationRequest(op_id=r.op_id), Ctx())


def test_register_refuses_pid_1_and_below(service):
    svc = service()
    for pid in (1, 0, -5):
        with pytest.raises(Aborted) as e:
            svc.RegisterContainer(svc.pb.RegisterContainerRequest(id="c", pids=[pid]), Ctx())
        assert e.value.exit_code == ExitCode.USAGE and "> 1" in e.value.details


def test_checkpoint_of_a_registered_container(service, world):
    svc = service()
    svc.RegisterContainer(svc.pb.RegisterContainerRequest(id="c", pids=[PID]), Ctx())
    r = lock(svc, pids=[], container_id="c")
    assert list(r.pids) == [PID] and r.container_id == "c"
    assert svc.ops.get(r.op_id).container_id == "c"


# -- the operation table -------------------------------------------------------------------------

def test_open_then_rollback(service, world):
    world.moved = {PID: {"nspid": 1, "files": [4], "bytes": 4, "chunks": 1, "allocations": 1,
                         "cache_released": 0, "seconds": 0.1}}
    svc = service()
    r = lock(svc)
    assert [p.pid for p in r.cuda_processes] == [PID] and r.cuda_processes[0].state == "RUNNING"
    assert [(a.pid, a.nspid, list(a.files)) for a in r.agents] == [(PID, 1, [4])]
    assert world.states[PID] == ProcessState.CHECKPOINTED
    assert [o.id for o in svc.ops.open_ops()] == [r.op_id] and world.ops[0].entry.phase == "dump"
    st = svc.Status(svc.pb.StatusRequest(op_id=r.op_id), Ctx())
    assert st.operation.op_id == r.op_id and st.processes[0].op_id == r.op_id

    rb = svc.Rollback(svc.pb.OperationRequest(op_id=r.op_id), Ctx())
    assert rb.outcome == "rolled-back" and list(rb.pids) == [PID] and list(rb.gone) == []
    assert world.states[PID] == ProcessState.RUNNING and world.ops[0].ended == "closed"
    assert svc.ops.open_ops() == []
    for handler in (svc.Rollback, svc.Finish):          # exactly one caller ends it
        with pytest.raises(Aborted) as e:
            handler(svc.pb.OperationRequest(op_id=r.op_id), Ctx())
        assert e.value.exit_code == ExitCode.NOT_FOUND


def test_finish_with_the_process_alive_resumes_it(service, world):
    svc = service()
    r = lock(svc)
    f = svc.Finish(svc.pb.OperationRequest(op_id=r.op_id), Ctx())
    assert f.outcome == "finished" and list(f.resumed) == [PID] and list(f.gone) == []
    assert world.states[PID] == ProcessState.RUNNING and world.ops[0].ended == "closed"


def test_leave_running_restores_the_open_operation(service, world):
    svc = service()
    r = lock(svc)
    out = svc.RestoreAndUnlock(svc.pb.RestoreAndUnlockRequest(op_id=r.op_id), Ctx())
    assert out.op_id == r.op_id and list(out.pids) == [PID]
    assert ("restore_and_unlock", (PID,)) in world.calls and svc.ops.open_ops() == []


# -- held GPU memory: a --leave-running (staged) checkpoint's agents hold their memory by
# descriptors through the dump; the open operation keeps them between the calls ---------------

def lock_staged(svc: Service, **kw: Any) -> Any:
    """A --leave-running checkpoint's lock: its agents' data staged in suspend_dir."""
    svc.world.seq += 1
    return lock(svc, staged=True,
                gpu_data_dir=str(svc.cfg.suspend_dir / f"stage-{svc.world.seq}"), **kw)


def _held_by(svc: Service, op_id: str) -> int:
    o = svc.ops.get(op_id)
    return sum(map(len, o.held.values())) if o else 0


def test_a_staged_checkpoint_holds_and_its_restore_maps_the_memory_back(service, world):
    world.hold = {PID: 3}
    svc = service()
    r = lock_staged(svc)
    assert world.hold_asked == [True]
    assert _held_by(svc, r.op_id) == 3 and len(world.open_held()) == 3   # with the operation
    svc.RestoreAndUnlock(svc.pb.RestoreAndUnlockRequest(op_id=r.op_id), Ctx())
    assert ("held", PID, 3) in world.calls            # the restore's engine got them all
    assert world.open_held() == [] and svc.ops.open_ops() == []


def test_a_checkpoint_that_ends_the_program_holds_nothing(service, world):
    world.hold = {PID: 2}
    svc = service()
    r = lock(svc)
    assert world.hold_asked == [False] and _held_by(svc, r.op_id) == 0
    svc.Finish(svc.pb.OperationRequest(op_id=r.op_id), Ctx())
    assert world.held_fds == []


@pytest.mark.parametrize("end", ["rollback", "timeout", "caller", "shutdown"])
def test_every_rollback_of_a_held_operation_goes_through_the_memory(service, world, end):
    """The dump failed (the runtime rolls back), nobody ended it in time, its caller died,
    torpord stops: the rollback's engine maps the held memory back (no copy), nothing stays
    open in torpord."""
    world.hold = {PID: 2}
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        svc = service(op_timeout_s=30)
        r = lock_staged(svc, owner_pid=owner.pid)
        assert _held_by(svc, r.op_id) == 2
        if end == "rollback":
            svc.Rollback(svc.pb.OperationRequest(op_id=r.op_id), Ctx())
        elif end == "timeout":
            svc.ops.reap(svc.ops.get(r.op_id).expires)
        elif end == "caller":
            owner.kill()
            owner.wait()
            svc.ops.reap(time.monotonic())
        else:
            svc.shutdown()
    finally:
        owner.kill()
        owner.wait()
    assert ("held", PID, 2) in world.calls and ("rollback", (PID,)) in world.calls
    assert world.states[PID] == ProcessState.RUNNING
    assert world.open_held() == [] and svc.ops.open_ops() == []


def test_finish_closes_what_a_staged_operation_held(service, world):
    """A runtime that finishes a staged operation (its dump ended the container after all):
    the held memory goes, and the live program is rolled back from its files."""
    world.hold = {PID: 2}
    svc = service()
    r = lock_staged(svc)
    svc.Finish(svc.pb.OperationRequest(op_id=r.op_id), Ctx())
    assert ("held", PID, 0) in world.calls    # resumed (still alive) from its files ...
    assert ("copied while held", PID) not in world.calls   # ... once the memory was let go
    assert world.open_held() == []


def test_a_restore_onto_other_gpus_lets_the_held_memory_go_first(service, world):
    """Held memory is on the GPU it was on: a RestoreAndUnlock that remaps the program to
    another GPU lets it go and the program copies its data back from the files there."""
    world.hold = {PID: 2}
    svc = service()
    r = lock_staged(svc)
    svc.RestoreAndUnlock(svc.pb.RestoreAndUnlockRequest(
        op_id=r.op_id, gpu_map={"GPU-aaaa": "GPU-bbbb"}), Ctx())
    assert ("held", PID, 0) in world.calls and ("copied while held", PID) not in world.calls
    assert world.open_held() == [] and svc.ops.open_ops() == []


@pytest.mark.parametrize("how", ["restore", "rollback"])
def test_a_failed_end_of_a_held_operation_leaves_nothing_open(service, world, how):
    """The restore fails and so does its retry, or a rollback fails: the journal entry stays
    for recovery, which copies from the files, so nothing may stay held in torpord."""
    world.hold = {PID: 2}
    svc = service()
    r = lock_staged(svc)
    world.restore_fails = True
    world.rollback_problems = ["PID 1: the agent does not answer"]
    with pytest.raises(Aborted):
        if how == "restore":
            svc.RestoreAndUnlock(svc.pb.RestoreAndUnlockRequest(op_id=r.op_id), Ctx())
        else:
            svc.Rollback(svc.pb.OperationRequest(op_id=r.op_id), Ctx())
    assert world.open_held() == [] and svc.ops.open_ops() == []
    assert world.ops[0].ended == "released"   # kept for recovery ...
    assert ("released while held", r.op_id) not in world.calls   # ... once nothing is held


@pytest.mark.parametrize("where", ["before the table", "the table"])
def test_a_held_operation_that_fails_to_open_rolls_back_through_its_memory(
        service, world, monkeypatch, where):
    """Before the operation is in the table (the journal's phase cannot be written) or as it
    goes in (torpord began to stop meanwhile): the rollback at once maps the memory back."""
    world.hold = {PID: 2}
    svc = service()
    if where == "the table":
        monkeypatch.setattr(svc.ops, "add", lambda o: (_ for _ in ()).throw(
            SidecarError("torpord is shutting down")))
    else:
        def full(self: FakeOp, name: str, **kw: Any) -> None:
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(FakeOp, "phase", full)
    with pytest.raises(Aborted):
        lock_staged(svc)
    assert ("held", PID, 2) in world.calls and world.open_held() == []
    assert world.states[PID] == ProcessState.RUNNING and svc.ops.open_ops() == []


def test_not_running_on_the_gpu_is_refused_and_nothing_stays_open(service, world):
    world.set(PID, ProcessState.LOCKED)
    svc = service()
    with pytest.raises(Aborted) as e:
        lock(svc)
    assert e.value.exit_code == ExitCode.USAGE and "LOCKED" in e.value.details
    assert svc.ops.open_ops() == [] and world.ops[0].ended == "abandoned"


def test_timeout_rolls_back(service, world):
    svc = service(op_timeout_s=30)
    r = lock(svc)
    o = svc.ops.get(r.op_id)
    assert svc.ops.reap(o.expires - 0.01) == []                       # not yet
    assert [x.id for x in svc.ops.reap(o.expires)] == [r.op_id]       # now
    assert world.states[PID] == ProcessState.RUNNING and world.ops[0].ended == "closed"
    assert svc.ops.open_ops() == []


def test_an_expired_operation_whose_dump_still_runs_waits_for_its_end(service, world,
                                                                      monkeypatch):
    """Past its deadline while CRIU still holds the processes: a rollback then would give
    them their GPU state back under the dump. It waits, and rolls back once the dump let go."""
    from torpor import procs
    svc = service(op_timeout_s=30)
    r = lock(svc)
    o = svc.ops.get(r.op_id)
    monkeypatch.setattr(procs, "traced", lambda pid: pid == PID)
    assert svc.ops.reap(o.expires + 60) == []
    assert world.states[PID] != ProcessState.RUNNING and svc.ops.get(r.op_id) is o
    monkeypatch.setattr(procs, "traced", lambda pid: False)
    assert [x.id for x in svc.ops.reap(o.expires + 60)] == [r.op_id]
    assert world.states[PID] == ProcessState.RUNNING


def test_reaper_thread_rolls_back_an_expired_operation(service, world):
    svc = service(op_timeout_s=0.3)
    svc.ops.start_reaper()
    r = lock(svc)
    deadline = time.monotonic() + 10
    # the operation leaves the table before its rollback ends: wait for both
    while (svc.ops.open_ops() or world.ops[0].ended != "closed") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert svc.ops.get(r.op_id) is None
    assert world.states[PID] == ProcessState.RUNNING and world.ops[0].ended == "closed"


def test_caller_death_rolls_back(service, world):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        svc = service()
        r = lock(svc, owner_pid=owner.pid)
        assert svc.ops.reap(time.monotonic()) == []                   # the caller lives
    finally:
        owner.kill()
        owner.wait()
    assert [x.id for x in svc.ops.reap(time.monotonic())] == [r.op_id]
    assert world.states[PID] == ProcessState.RUNNING


def test_shutdown_rolls_back_open_operations_and_refuses_new_ones(service, world):
    svc = service()
    lock(svc)
    svc.stopping()
    with pytest.raises(Aborted) as e:
        lock(svc)
    assert e.value.exit_code == ExitCode.SIDECAR
    svc.shutdown()
    assert svc.ops.open_ops() == [] and world.states[PID] == ProcessState.RUNNING
    assert world.ops[0].ended == "closed"


def test_a_failed_rollback_keeps_the_journal_entry(service, world):
    svc = service(op_timeout_s=30)
    r = lock(svc)
    world.rollback_problems = ["driver said no"]
    with pytest.raises(Aborted) as e:
        svc.Rollback(svc.pb.OperationRequest(op_id=r.op_id), Ctx())
    assert "driver said no" in e.value.details
    assert world.ops[0].ended == "released"              # not closed: recovery retries it
    assert svc.ops.open_ops() == []


def test_failure_before_the_table_rolls_back_at_once(service, world, monkeypatch):
    svc = service()

    def full(self: FakeOp, name: str, **kw: Any) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(FakeOp, "phase", full)
    with pytest.raises(Aborted) as e:
        lock(svc)
    assert e.value.exit_code == ExitCode.ROLLED_BACK and "No space" in e.value.details
    assert world.states[PID] == ProcessState.RUNNING and svc.ops.open_ops() == []


# -- request validation --------------------------------------------------------------------------

def _refused(call: Any) -> Aborted:
    with pytest.raises(Aborted) as e:
        call()
    assert e.value.status == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert e.value.exit_code == ExitCode.USAGE
    return e.value


def test_bad_checkpoint_requests(service, world):
    svc = service()
    svc.RegisterContainer(svc.pb.RegisterContainerRequest(id="c", pids=[PID]), Ctx())
    assert "not both" in _refused(lambda: lock(svc, container_id="c")).details
    assert "no PIDs" in _refused(lambda: lock(svc, pids=[])).details
    assert "positive" in _refused(lambda: lock(svc, lock_timeout_s=0)).details
    assert "absolute" in _refused(lambda: lock(svc, gpu_data_dir="rel/dir")).details
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert "not running" in _refused(lambda: lock(svc, owner_pid=gone.pid)).details
    assert world.ops == [] or all(o.ended for o in world.ops)
    assert svc.ops.open_ops() == []


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_an_agent_directory_outside_the_agents_is_refused(service, world, cfg, name):
    """agent_container_id names a directory under <run_dir>/agents: only a container's name
    (<id> or <id>@<root key>) is taken, before anything is locked or restored."""
    svc = service()
    pb = svc.pb
    e = _refused(lambda: lock(svc, agent_container_id=name, gpu_data_dir=str(cfg.run_dir / "d")))
    assert "bad container" in e.details
    e = _refused(lambda: svc.RestoreAndUnlock(pb.RestoreAndUnlockRequest(
        pids=[PID], no_descendants=True, agent_container_id=name,
        gpu_data_dir=str(cfg.run_dir / "d"), agents=[pb.AgentData(pid=PID, nspid=1, files=[1])]),
        Ctx()))
    assert "bad container" in e.details
    assert world.calls == [] and svc.ops.open_ops() == []


def test_a_containers_name_leads_to_its_own_agent_directory(service, world, cfg, monkeypatch):
    """agent_container_id <id>@<root key> (what torpor-runtime sends for a container it
    created) is that container's socket directory, and its name is the fingerprints' owner
    (as torpor-runtime packs its snapshots): one id under two roots shares none. An earlier
    torpor's container, named by its id alone, keeps container:<id>; PIDs alone, their uid."""
    from torpor.flows import container
    svc = service()
    seen: list[Any] = []
    owners: list[str] = []
    real, owner_of = container.lock_and_checkpoint, container.fingerprints.owner_of

    def spy(engine: Any, pids: Any, **kw: Any) -> Any:
        seen.append((kw["agent_dir"], kw["owner_container"]))
        return real(engine, pids, **kw)
    monkeypatch.setattr(container, "lock_and_checkpoint", spy)
    monkeypatch.setattr(container.fingerprints, "owner_of",
                        lambda *a, **kw: owners.append(owner_of(*a, **kw)) or owners[-1])
    other = "f" * 16
    for name in (f"ctr@{KEY}", f"ctr@{other}", "ctr"):
        r = lock(svc, agent_container_id=name)
        assert r.store_owner == f"container:{name}"   # what torpor-runtime packs under
        svc.Rollback(svc.pb.OperationRequest(op_id=r.op_id), Ctx())
    svc.RegisterContainer(svc.pb.RegisterContainerRequest(id=f"reg@{KEY}", pids=[PID]), Ctx())
    svc.Rollback(svc.pb.OperationRequest(op_id=lock(svc, pids=[], container_id="reg").op_id),
                 Ctx())
    svc.Rollback(svc.pb.OperationRequest(op_id=lock(svc).op_id), Ctx())
    agents = cfg.run_dir / "agents"
    names = [f"ctr@{KEY}", f"ctr@{other}", "ctr", f"reg@{KEY}"]
    assert seen[:4] == [(agents / n, n) for n in names] and seen[4][1] == ""
    assert owners[:4] == [f"container:ctr@{KEY}", f"container:ctr@{other}", "container:ctr",
                          f"container:reg@{KEY}"]
    assert owners[4].startswith("uid:")


def test_bad_restore_and_operation_requests(service, world):
    svc = service()
    pb = svc.pb
    _refused(lambda: svc.RestoreAndUnlock(pb.RestoreAndUnlockRequest(op_id="x", pids=[PID]),
                                          Ctx()))
    _refused(lambda: svc.RestoreAndUnlock(pb.RestoreAndUnlockRequest(
        pids=[PID], no_descendants=True, agents=[pb.AgentData(pid=PID, nspid=1, files=[1])]),
        Ctx()))
    _refused(lambda: svc.Rollback(pb.OperationRequest(op_id=""), Ctx()))
    _refused(lambda: svc.Status(pb.StatusRequest(), Ctx()))
    with pytest.raises(Aborted) as e:
        svc.Status(pb.StatusRequest(op_id="nope"), Ctx())
    assert e.value.exit_code == ExitCode.NOT_FOUND
    assert world.calls == []


def test_the_fingerprints_value_is_the_flows_mode(service, world, monkeypatch):
    """LockAndCheckpointRequest.fingerprints 0, 1, 2 reach the engine's flow as NONE, INDEX,
    SKIP; any other value is refused before anything is locked."""
    from torpor.flows import container
    from torpor.flows.policy import FingerprintMode
    svc = service()
    seen: list[Any] = []
    real = container.lock_and_checkpoint

    def spy(engine: Any, pids: Any, **kw: Any) -> Any:
        seen.append(kw["mode"])
        return real(engine, pids, **kw)
    monkeypatch.setattr(container, "lock_and_checkpoint", spy)
    for n in (svc.pb.FINGERPRINTS_NONE, svc.pb.FINGERPRINTS_INDEX, svc.pb.FINGERPRINTS_SKIP):
        svc.Rollback(svc.pb.OperationRequest(op_id=lock(svc, fingerprints=n).op_id), Ctx())
    assert seen == [FingerprintMode.NONE, FingerprintMode.INDEX, FingerprintMode.SKIP]
    assert "fingerprints mode 7" in _refused(lambda: lock(svc, fingerprints=7)).details
    assert len(seen) == 3 and svc.ops.open_ops() == []
