"""The operations torpord holds open for a container's runtime, typed in and out.

A container checkpoint is lock_and_checkpoint (the CUDA state to host memory, the agents' data
into the image directory), then the runtime's CRIU dump, then finish, roll_back or
restore_open (--leave-running); a container restore is restore (the processes CRIU brought
back CHECKPOINTED under new host PIDs). torpord's handlers parse a request, call one of these
and turn the frozen result into a response (sidecar/); torpord's operation table holds the
Operation between the calls (lock_and_checkpoint hands it over through `opened`).

Every function takes an Engine (engine/ moves the GPU state) and leaves the journal entry
closed on success, or kept for recovery when a rollback failed (the error says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from .. import agent_data, gpus, oci, placement, procs
from ..config import Config
from ..driver import ProcessState
from ..engine import Engine, inventory, restore_targets, targets_of
from ..errors import NoDriverError, PreflightError, TorporError, UsageError
from ..journal import Operation
from ..store import fingerprints
from . import policy

log = logging.getLogger("torpor.sidecar")
log_runtime = logging.getLogger("torpor.runtime")
FINISH_GRACE_S = 2.0   # how long finish waits for the dump's processes to end


@dataclasses.dataclass(frozen=True)
class CudaProcess:
    """A CUDA process of a checkpoint, as the driver and NVML saw it."""
    pid: int
    state: str                     # the driver's state name
    gpu_uuids: tuple[str, ...] = ()
    gpu_memory: int = 0
    gpu_memory_by_gpu: Mapping[str, int] = dataclasses.field(default_factory=dict)


_FINGERPRINTS = (("parts", "fingerprinted"), ("skipped", "skipped"),
                 ("skipped_bytes", "skipped_bytes"))   # torpor.json's name, AgentMove's name
_MOVED = ("nspid", "bytes", "chunks", "allocations", "cache_released", "seconds", "files")


@dataclasses.dataclass(frozen=True)
class AgentMove:
    """What a program's agent moved out of the GPU at checkpoint, flat (torpor.proto's
    AgentData). The engine and torpor.json's "agent" entries hold it nested, with the
    fingerprint counts under "fingerprints": of() and to_manifest() convert between the two,
    so the shape of those entries is decided here only."""
    pid: int                       # host PID at checkpoint
    nspid: int                     # its PID in its own pid namespace
    files: tuple[int, ...]         # size of each data file
    bytes: int = 0
    chunks: int = 0
    allocations: int = 0
    cache_released: int = 0
    seconds: float = 0.0
    fingerprinted: int = 0         # parts fingerprinted on the GPU; 0: none
    skipped: int = 0
    skipped_bytes: int = 0
    zero_bytes: int = 0            # found all zero on the GPU: never moved (issue 20)
    deferred: bool = False         # its copy was left to a copier (the deferred copy): a
                                   # restored agent was dumped so and needs `resume drained`

    @classmethod
    def of(cls, pid: int, r: Mapping[str, Any]) -> "AgentMove":
        """From the engine's result for pid (Engine.lock_and_checkpoint) or torpor.json's
        entry (counts it lacks are 0)."""
        fp = r.get("fingerprints") or {}
        return cls(pid=int(pid), nspid=int(r["nspid"]), files=tuple(int(n) for n in r["files"]),
                   bytes=int(r.get("bytes", 0)), chunks=int(r.get("chunks", 0)),
                   allocations=int(r.get("allocations", 0)),
                   cache_released=int(r.get("cache_released", 0)),
                   seconds=float(r.get("seconds", 0.0)),
                   zero_bytes=int(r.get("zero_bytes", 0)), deferred=r.get("deferred") is True,
                   **{mine: int(fp.get(theirs, 0)) for theirs, mine in _FINGERPRINTS})

    from_moved = of

    def to_manifest(self) -> dict[str, Any]:
        """torpor.json's "agent" entry for this program (keyed by str(pid) there)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in _MOVED}
        out["files"] = list(self.files)
        if self.zero_bytes:
            out["zero_bytes"] = self.zero_bytes
        if self.deferred:
            out["deferred"] = True
        if self.fingerprinted:
            out["fingerprints"] = {theirs: getattr(self, mine) for theirs, mine in _FINGERPRINTS}
        return out


@dataclasses.dataclass(frozen=True)
class AgentResume:
    """What a program's agent gave back to the GPU at restore."""
    pid: int
    bytes: int = 0
    seconds: float = 0.0
    held: int = 0      # allocations mapped back from held descriptors (0: copied back)


def resumed(back: Mapping[int, Mapping[str, Any]], held: Mapping[int, int] | None = None
            ) -> tuple[AgentResume, ...]:
    """The engine's agent resumes (pid -> {bytes, seconds, held}), in PID order; held: the
    allocations each had held before it (Engine.held_counts), counted where it took them."""
    return tuple(AgentResume(p, int(r["bytes"]), float(r["seconds"]),
                             (held or {}).get(p, 0) if r.get("held") else 0)
                 for p, r in sorted(back.items()))


@dataclasses.dataclass(frozen=True)
class Checkpointed:
    """A container's CUDA processes CHECKPOINTED, waiting for the runtime's dump."""
    op_id: str
    pids: tuple[int, ...]
    cuda_pids: tuple[int, ...]
    cuda: tuple[CudaProcess, ...]
    moved: tuple[AgentMove, ...]
    timings: Mapping[str, float]
    owner: str = ""   # whose store fingerprints its agents were handed (fingerprints.owner_of):
                      # the owner its pack must name, so that what they skipped resolves


@dataclasses.dataclass(frozen=True)
class OperationResult:
    """How an open operation ended: outcome "finished" or "rolled-back"."""
    op_id: str
    kind: str
    pids: tuple[int, ...]
    outcome: str
    timings: Mapping[str, float]
    gone: tuple[int, ...] = ()
    resumed: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class AgentEntry:
    """A program whose agent moved its data at the checkpoint (torpor.json's "agent")."""
    pid: int
    nspid: int
    files: tuple[int, ...]         # size of each data file
    deferred: bool = False         # AgentMove.deferred


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """Which restored processes the driver restores (CHECKPOINTED) or only unlocks (LOCKED)."""
    checkpointed: tuple[int, ...]
    locked: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Restored:
    """CUDA processes given their GPU state back and unlocked."""
    op_id: str
    pids: tuple[int, ...]
    gpu_map: Mapping[str, str]
    agents: tuple[AgentResume, ...]
    timings: Mapping[str, float]
    # the deferred copies (a staged checkpoint's, config leave_running_drain): the bytes the
    # copiers wrote into the staging beside the dump, and why they failed ("": they did not;
    # then the staging lacks the GPU data: no checkpoint, the programs run on)
    drained: int = 0
    drain_error: str = ""


def cuda_processes(pids: Sequence[int], states: Mapping[int, ProcessState]
                   ) -> tuple[CudaProcess, ...]:
    """pids with their driver state and, where NVML answers, their GPUs and memory."""
    inv: gpus.Inventory | None = None
    if pids:
        try:
            inv = gpus.discover()
        except NoDriverError as e:
            log.debug("no GPU inventory: %s", e)
    return tuple(CudaProcess(p, states[p].name, tuple(inv.gpus_of(p)) if inv else (),
                             inv.memory_of(p) if inv else 0,
                             dict(inv.memory_by_gpu(p)) if inv else {}) for p in pids)


def lock_and_checkpoint(engine: Engine, pids: Sequence[int], *, data: Path | None,
                        agent_dir: Path | None, owner_container: str,
                        mode: policy.FingerprintMode, opened: Callable[[Operation, list[int]],
                                                                       None],
                        staged: bool = False, drain: bool = False) -> Checkpointed:
    """RUNNING -> CHECKPOINTED for the CUDA processes among pids (their agents' data into
    data, their sockets in agent_dir), fingerprints as mode says for owner_container's
    snapshots (policy.fingerprint_plan; owner_container: the container's name at torpor,
    <id>@<root key> or an earlier torpor's <id>, fingerprints.owner_of; "": the programs'
    uid is the owner). opened(op, cuda_pids) takes the operation over (the caller's table);
    a failure there, or before, rolls everything back and raises.
    staged: data is a --leave-running checkpoint's staging in host memory, a new directory
    directly in config suspend_dir (made as a suspend's; a recovery removes it). Its agents
    that can hold their GPU memory by descriptors through the dump do (agent/PROTOCOL.md,
    "Held memory"): opened takes them over with the operation (Engine.take_held), and the
    restore_open or roll_back of it gives them back to its engine (Engine.give_held). With
    config leave_running_drain (and no fingerprints for the store) their copy into the
    staging is left to copiers beside the dump (agent/PROTOCOL.md "The deferred copy"),
    ready before the pause and handed over with the held descriptors (Engine.take_copies);
    restore_open says how they went (Restored.drained, drain_error); only where drain says
    the caller reads that (an older torpor-runtime would seal a staging left empty)."""
    pids = list(pids)
    where = staged_data(engine.cfg, data) if staged else \
        (agent_data.DataDir(data) if data else None)
    op = engine.begin("checkpoint", pids)        # BusyError when another op holds them
    try:
        states = engine.cuda_states(pids)
        bad = {p: s for p, s in states.items() if s != ProcessState.RUNNING}
        if bad:
            p, s = next(iter(bad.items()))
            raise UsageError(f"PID {p} is {s.name} on the GPU, not RUNNING")
        cuda_pids = sorted(states)
        cuda = cuda_processes(cuda_pids, states)
        # a container's fingerprints are its own only (store/fingerprints.py)
        owner = fingerprints.owner_of(owner_container,
                                      procs.owner_uid(cuda_pids[0]) if cuda_pids else 0)
        plan = policy.fingerprint_plan(engine.cfg, policy.open_store(engine.cfg), owner, mode) \
            if data is not None and mode is not policy.FingerprintMode.NONE \
            else policy.NO_FINGERPRINTS
        # a staging's copy left to copiers beside the dump (as a bare checkpoint's), each
        # ready before the pause; not into the store (its fingerprints are checked on the host)
        drain = drain and staged and engine.cfg.leave_running_drain and plan.skip is None
        serve = engine.holding(engine.agent_sockets(cuda_pids, agent_dir)) if drain else {}
        if serve:
            with engine.progress.phase("copier-ready", "torpor-copier ready to copy"):
                engine.ready_copiers(sorted(serve), inventory())
        try:
            moved = engine.lock_and_checkpoint(  # rolls back and closes op on failure
                op, cuda_pids, where, agent_dir, scratch=staged, known_fingerprints=plan.skip,
                owner=owner, stream_into=plan.stream_into, hold=staged, drain=drain)
        finally:
            engine.drop_copiers()
        try:
            # CHECKPOINTED now: until the operation is in the caller's table (where a rollback,
            # a timeout or a shutdown finds it), any failure rolls back at once.
            op.phase("dump")
            opened(op, cuda_pids)
        except BaseException as e:
            engine.fail(op, cuda_pids, e, during="checkpoint")  # rollback, close, raise
    except BaseException:
        op.abandon()
        raise
    log.info("%s: %d CUDA process(es) of %d checkpointed (%s); waiting for the dump",
             op.entry.id, len(cuda_pids), len(pids), ",".join(map(str, cuda_pids)) or "-")
    return Checkpointed(op.entry.id, tuple(pids), tuple(cuda_pids), cuda,
                        tuple(AgentMove.of(p, r) for p, r in sorted(moved.items())),
                        policy.timings(engine), owner)


def staged_data(cfg: Config, data: Path | None) -> agent_data.DataDir:
    """A caller's staging directory (flows/writeout.py): only a new one directly in
    suspend_dir, which torpord makes 0700 and its own (never a path elsewhere)."""
    base = Path(os.path.abspath(cfg.suspend_dir))
    if data is None or Path(os.path.abspath(data)).parent != base or data.name in ("", ".", ".."):
        raise UsageError(f"a staged gpu_data_dir must be a new directory in {base}, not {data}")
    return agent_data.DataDir(data, private_parent=True, huge_tmpfs=cfg.suspend_tmpfs)


@contextlib.contextmanager
def _ending(engine: Engine, op: Operation) -> Iterator[None]:
    """An operation taken out of torpord's table ends here: any error no step below handles
    (a full disk under the journal, no descriptors left) leaves its entry to recovery, its
    locks dropped, never held by this torpord for good (nothing else would end it)."""
    try:
        yield
    except BaseException:
        engine.release_held()   # what the programs need back, to their agents (deferred)
        op.release()
        raise


def finish(engine: Engine, op: Operation, cuda_pids: Sequence[int]) -> OperationResult:
    """The dump is done. It ended the processes; any CUDA process still alive a moment later
    would stay checkpointed forever, so it is brought back (a --leave-running dump)."""
    end = time.monotonic() + FINISH_GRACE_S
    while any(procs.alive(p) for p in cuda_pids) and time.monotonic() < end:
        time.sleep(0.05)
    alive = [p for p in cuda_pids if procs.alive(p)]
    if alive:
        log.warning("%s finished with CUDA PIDs %s still alive: resuming them", op.entry.id,
                    alive)
        with _ending(engine, op), engine.progress.phase("resume"):
            _roll_back(engine, op, alive, f"finish of {op.entry.id}")
    op.close()
    log.info("%s finished", op.entry.id)
    return OperationResult(op.entry.id, op.entry.kind, tuple(cuda_pids), "finished",
                           policy.timings(engine),
                           gone=tuple(p for p in cuda_pids if p not in alive),
                           resumed=tuple(alive))


def _roll_back(engine: Engine, op: Operation, pids: list[int], what: str) -> None:
    """pids and the operation's agents back to RUNNING; on failure the journal entry stays
    (recovery retries it) and the error names what failed."""
    problems = engine.rollback(pids, agents=targets_of(op.entry.agents))
    if problems:
        engine.release_held()   # before recovery may claim the entry and copy from the files
        op.release()
        raise TorporError(f"{what} failed: " + "; ".join(problems), hint=policy.RETRY_HINT)


def roll_back(engine: Engine, op: Operation, cuda_pids: Sequence[int]) -> OperationResult:
    """Give the live ones of cuda_pids their GPU state back (the dump failed, or nobody ended
    the operation in time) and close the operation."""
    live = [p for p in cuda_pids if procs.alive(p)]
    with _ending(engine, op), engine.progress.phase("rollback"):
        _roll_back(engine, op, live, f"rollback of {op.entry.id}")
    if op.entry.scratch and op.entry.data_root:   # a staging: the agents have their data back
        try:
            agent_data.DataDir(Path(op.entry.data_root)).remove()
        except OSError as e:
            log.warning("%s: its staging %s not removed: %s", op.entry.id,
                        op.entry.data_root, e)
    op.close()
    log.info("%s rolled back (%s running again)", op.entry.id,
             ",".join(map(str, live)) or "none")
    return OperationResult(op.entry.id, op.entry.kind, tuple(cuda_pids), "rolled-back",
                           policy.timings(engine),
                           gone=tuple(p for p in cuda_pids if p not in live))


def restore_open(engine: Engine, op: Operation, cuda_pids: Sequence[int],
                 gpu_map: Mapping[str, str]) -> Restored:
    """--leave-running: the dump is done and the processes still live; give them the GPU."""
    live = [p for p in cuda_pids if procs.alive(p)]
    agents = {p: t for p, t in targets_of(op.entry.agents).items() if p in live}
    held = engine.held_counts()
    with _ending(engine, op):
        back = policy.restore_or_roll_back(engine, op, live, gpu_map, agents)
        drained, bad = engine.drain_report(back)
    op.close()
    why = "; ".join(f"PID {p}: {w}" for p, w in sorted(bad.items()))
    if why:
        log.error("%s: the copy of the GPU memory into the staging failed (%s); the programs "
                  "run on", op.entry.id, why)
    log.info("%s: left running, %d CUDA process(es) restored and unlocked%s", op.entry.id,
             len(live), f"; {drained['bytes']} bytes copied beside the dump" if drained
             and not why else "")
    return Restored(op.entry.id, tuple(live), dict(gpu_map), resumed(back, held),
                    policy.timings(engine), drained=int(drained.get("bytes", 0)),
                    drain_error=why)


def plan_restore(states: Mapping[int, ProcessState]) -> RestorePlan:
    """What restoring processes in these driver states takes; one in the driver's FAILED state
    cannot be restored."""
    failed = sorted(p for p, s in states.items() if s == ProcessState.FAILED)
    if failed:
        raise TorporError(f"PID {failed[0]} is in the driver's FAILED state: it cannot be "
                          "restored")
    return RestorePlan(
        tuple(sorted(p for p, s in states.items() if s == ProcessState.CHECKPOINTED)),
        tuple(sorted(p for p, s in states.items() if s == ProcessState.LOCKED)))


def restore(engine: Engine, pids: Sequence[int], *, gpu_map: Mapping[str, str],
            agents: Sequence[AgentEntry] = (), data: Path | None = None,
            agent_dir: Path | None = None, packed: Path | None = None) -> Restored:
    """The processes a runtime restored (host pids, CHECKPOINTED or LOCKED in the driver) get
    their GPU state back (gpu_map: the driver's pairs, placement.driver_map) and are unlocked;
    then the programs in agents get the data their agent moved into data (or, packed: the
    checkpoint packed into the image store whose chunks stream to them)."""
    if agents and data is None:
        raise UsageError("agents given without the gpu_data_dir that holds their data")
    pids = list(pids)
    op = engine.begin("restore", pids)
    try:
        plan = plan_restore(engine.cuda_states(pids))
        targets = restore_targets({a.pid: {"nspid": a.nspid, "files": list(a.files),
                                           "deferred": a.deferred} for a in agents}, data or Path(), agent_dir, host_pids=pids,
                                  packed=packed)
        back = policy.restore_or_roll_back(engine, op, list(plan.checkpointed), gpu_map,
                                           targets, locked=plan.locked)
    except BaseException:
        op.abandon()
        raise
    op.close()
    done = sorted(plan.checkpointed + plan.locked)
    log.info("%s: %d CUDA process(es) restored and unlocked", op.entry.id, len(done))
    return Restored(op.entry.id, tuple(done), dict(gpu_map), resumed(back),
                    policy.timings(engine))


# -- a container's restore: placement ----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Placement:
    """A container checkpoint's GPUs on this host: old UUID -> new UUID, the device moves
    that makes, and whether an explicit map (annotation or config device_map) was given."""
    gpu_map: Mapping[str, str]
    moves: tuple[oci.Move, ...] = ()
    explicit: bool = False

    @property
    def driver_map(self) -> dict[str, str]:
        """The pairs the driver restores with (placement.driver_map: none for the same GPUs)."""
        return placement.driver_map(self.gpu_map, self.gpu_map if self.explicit else {})


NOT_PLACED = Placement({})


def place(cfg: Config, m: Mapping[str, Any], bundle: Path) -> Placement:
    """Where a container checkpoint's GPUs go on this host (placement.plan, share=False),
    and its bundle's spec rewritten for them (devices, cgroup, visible devices, CDI)."""
    try:
        inv = gpus.discover()
    except NoDriverError as e:
        raise PreflightError(f"the checkpoint holds GPU state but {e.line()}") from e
    spec = oci.load(bundle)
    explicit = placement.parse_device_map(oci.device_map_annotation(spec)
                                          or ([cfg.device_map] if cfg.device_map else []))
    if not explicit:     # CRI: the GPUs the new container was given (placement.given_map)
        explicit = placement.given_map(m, oci.detect(spec).uuids(inv))
    gpu_map = placement.plan(m, inv, explicit, share=False)
    moves = oci.moves(gpu_map, m["gpus"], inv)
    unknown = [mv for mv in moves if mv.new_minor is None or mv.old_minor is None]
    if unknown and (oci.detect(spec).minors or (m.get("container") or {}).get("minors")):
        raise PreflightError(f"cannot move the container's /dev/nvidia devices from "
                             f"{unknown[0].old_uuid} to {unknown[0].new_uuid}: minor number "
                             "unknown (NVML did not report it)")
    if moves:
        changes = oci.rewrite(spec, moves)
        oci.save(bundle, spec)
        for line in changes:
            log_runtime.info("restore: %s", line)
    return Placement(gpu_map, tuple(moves), bool(explicit))
