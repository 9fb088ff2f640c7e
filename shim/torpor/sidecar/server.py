"""torpord: the sidecar that owns the GPU checkpoint engine for containers.

    torpord [--foreground] [--socket PATH] [--op-timeout SECONDS] [--log-level LEVEL]

gRPC (proto/torpor.proto) on <run_dir>/torpord.sock, behind a SO_PEERCRED check (peercred.py).
A container checkpoint is LockAndCheckpoint, then the runtime's CRIU dump, then Finish,
Rollback or RestoreAndUnlock; the operation stays open (journal entry and PID locks held by
torpord) in between, and is rolled back by torpord when not ended within --op-timeout.

Programs under the in-process agent: given a data directory (gpu_data_dir, torpor-runtime
names <image-path>/torpor-gpu), LockAndCheckpoint has their agents move their bulk GPU memory
there first, and every way an operation ends gives it back through the agent (engine.py has
the order). The sockets are in the container's agent directory (agent.container_dir).

At start torpord rolls back what dead torpor processes left locked or checkpointed
(engine.recover()). On SIGTERM/SIGINT it stops accepting, lets calls in flight finish, rolls
back its open operations and exits 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import fcntl
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import grpc

from .. import __version__, agent, bulk, config, gpus, logs, procs
from ..config import Config
from ..oci import validate_container_id
from ..doctor import run_checks
from ..driver import ProcessState
from ..engine import Engine, restore_targets, targets_of
from ..errors import (NoDriverError, NotFoundError, SidecarError, TorporError, UsageError)
from ..files import private_dir, require_trusted_location, write_json
from ..journal import Operation
from ..progress import Progress
from ..store import Store, fingerprints
from ..store import images as store_images
from . import grpc_status, proto
from .peercred import PeerCredProxy

log = logging.getLogger("torpor.sidecar")

DEFAULT_OP_TIMEOUT_S = 600.0
RECOVERY_PERIOD_S = 30.0   # how often journal orphans (dead torpor commands) are rolled back
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes, NUL included




# -- containers ---------------------------------------------------------------------------------

class Containers:
    """Registered containers, one <state_dir>/containers/<id>.json each (0600, dir 0700)."""

    def __init__(self, directory: Path):
        self.dir = private_dir(directory)
        self._lock = threading.Lock()

    def _path(self, cid: str) -> Path:
        return self.dir / f"{validate_container_id(cid)}.json"

    def put(self, record: dict[str, Any]) -> None:
        with self._lock:
            write_json(self._path(record["id"]), record)

    def get(self, cid: str) -> dict[str, Any]:
        path = self._path(cid)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise NotFoundError(f"no registered container '{cid}'") from None
        except (OSError, ValueError) as e:
            raise TorporError(f"container record {path} is unreadable: {e}") from e

    def remove(self, cid: str) -> bool:
        with self._lock:
            try:
                self._path(cid).unlink()
                return True
            except FileNotFoundError:
                return False

    def all(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError) as e:
                log.warning("skipping unreadable container record %s: %s", path, e)
        return out


# -- open operations ----------------------------------------------------------------------------

@dataclasses.dataclass
class OpenOp:
    op: Operation
    pids: list[int]
    cuda_pids: list[int]
    container_id: str
    deadline: float   # wall clock, only reported to clients
    expires: float    # time.monotonic() of the automatic rollback: a clock step cannot move it
    owner: tuple[int, int | None] | None = None  # (pid, start time) of the caller, if given

    def owner_gone(self) -> bool:
        """The caller died without ending the operation, and no dump holds the processes
        (a dump still running finishes or fails by itself first)."""
        if self.owner is None or procs.start_time(self.owner[0]) == self.owner[1]:
            return False
        return not any(procs.traced(p) for p in self.cuda_pids)

    @property
    def id(self) -> str:
        return self.op.entry.id


def _timings(engine: Engine) -> dict[str, float]:
    return {k: round(v, 4) for k, v in engine.progress.timings.items()}


def _rpc(fn: Callable) -> Callable:
    """Run a handler; turn any error into a gRPC status with torpor's exit code in the trailers.
    Counts the handlers in flight: shutdown() waits for them, as gRPC does not (a cancelled
    call's handler runs on after server.stop())."""
    @functools.wraps(fn)
    def wrapper(self: "Service", request: Any, context: grpc.ServicerContext) -> Any:
        with self._idle:
            self._in_flight += 1
        try:
            return fn(self, request, context)
        except Exception as e:
            if isinstance(e, TorporError):
                log.info("%s refused: %s (exit code %s)", fn.__name__, e.line(), e.exit_code)
            else:
                log.exception("%s failed", fn.__name__)
            status, _code, details, md = grpc_status(e)
            context.set_trailing_metadata(md)
            context.abort(status, details)
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()
    return wrapper


class Service:
    """The Torpor gRPC service: containers, open operations and their timeout."""

    def __init__(self, cfg: config.Config, op_timeout_s: float = DEFAULT_OP_TIMEOUT_S):
        self.cfg = cfg
        self.op_timeout_s = op_timeout_s
        self.pb, _ = proto()
        self.containers = Containers(cfg.state_dir / "containers")
        self._ops: dict[str, OpenOp] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)   # _in_flight dropped
        self._in_flight = 0
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    def engine(self, cfg: config.Config | None = None) -> Engine:
        return Engine(cfg or self.cfg, Progress(stream=None))

    # -- the op table -----------------------------------------------------------------------------
    def _take(self, op_id: str) -> OpenOp:
        """Remove an open operation from the table (so exactly one caller ends it)."""
        if not op_id:
            raise UsageError("no operation id given")
        with self._lock:
            found = self._ops.pop(op_id, None)
        if found is None:
            raise NotFoundError(f"no open operation '{op_id}' (finished, rolled back, "
                                "timed out, or torpord restarted)")
        return found

    def open_ops(self) -> list[OpenOp]:
        with self._lock:
            return list(self._ops.values())

    def start_reaper(self) -> None:
        self._reaper = threading.Thread(target=self._reap_loop, name="op-timeout", daemon=True)
        self._reaper.start()

    def _reap_loop(self) -> None:
        period = max(0.05, min(1.0, self.op_timeout_s / 10))
        next_recovery = time.monotonic() + RECOVERY_PERIOD_S
        while not self._stop.wait(period):
            if time.monotonic() >= next_recovery:
                # what a dead `torpor` left, or a rollback of ours that failed: retry it
                next_recovery = time.monotonic() + RECOVERY_PERIOD_S
                try:
                    for msg in self.engine().recover():
                        log.warning("recovery: %s", msg)
                except Exception:
                    log.exception("periodic recovery failed")
            now = time.monotonic()
            with self._lock:
                expired = [o for o in self._ops.values() if o.expires <= now]
                orphaned = [o for o in self._ops.values()
                            if o not in expired and o.owner_gone()]
                for o in expired + orphaned:
                    del self._ops[o.id]
            for o in expired + orphaned:
                if o in orphaned:
                    log.warning("operation %s (PIDs %s): its caller (PID %d) died without "
                                "ending it: rolling it back", o.id,
                                ",".join(map(str, o.pids)), o.owner[0] if o.owner else 0)
                else:
                    log.warning("operation %s (PIDs %s) not ended within %.0f s: rolling it "
                                "back", o.id, ",".join(map(str, o.pids)), self.op_timeout_s)
                try:
                    self._rollback(o)
                except TorporError as e:
                    log.error("automatic rollback of %s: %s", o.id, e.line())
                except Exception:
                    log.exception("automatic rollback of %s failed", o.id)

    def stopping(self) -> None:
        """From now on a LockAndCheckpoint rolls back instead of opening an operation."""
        self._stop.set()

    def shutdown(self) -> None:
        """Wait for the handlers in flight (one may still be checkpointing: its operation must
        be in the table, or rolled back by itself, before the table is emptied), stop the
        reaper, roll back every open operation."""
        self._stop.set()
        with self._idle:
            while self._in_flight:
                log.info("shutting down: waiting for %d call(s) in flight", self._in_flight)
                self._idle.wait(5)
        if self._reaper is not None:
            self._reaper.join()   # it may be rolling back an expired operation
        with self._lock:
            todo, self._ops = list(self._ops.values()), {}
        for o in todo:
            log.warning("shutting down: rolling back open operation %s (PIDs %s)", o.id,
                        ",".join(map(str, o.pids)))
            try:
                self._rollback(o)
            except Exception as e:
                log.error("rollback of %s at shutdown: %s", o.id, e)

    def _rollback(self, o: OpenOp) -> tuple[list[int], dict[str, float]]:
        engine = self.engine()
        live = [p for p in o.cuda_pids if procs.alive(p)]
        with engine.progress.phase("rollback"):
            problems = engine.rollback(live, agents=targets_of(o.op.entry.agents))
        if problems:
            o.op.release()
            raise TorporError(f"rollback of {o.id} failed: " + "; ".join(problems),
                              hint="the journal entry stays: restarting torpord retries it")
        o.op.close()
        return live, _timings(engine)

    # -- pids -------------------------------------------------------------------------------------
    def _resolve(self, pids: Iterable[int], container_id: str, descendants: bool) -> list[int]:
        pids = [int(p) for p in pids]
        if pids and container_id:
            raise UsageError("give PIDs or a container id, not both")
        if container_id:
            pids = [int(p) for p in self.containers.get(container_id).get("pids", [])]
            if not pids:
                raise UsageError(f"container '{container_id}' was registered without PIDs")
        if not pids:
            raise UsageError("no PIDs given")
        out: list[int] = []
        for pid in pids:
            procs.require(pid)
            for p in (procs.tree(pid) if descendants else [pid]):
                if p not in out:
                    out.append(p)
        return out

    def _gpu_info(self, pids: Iterable[int]) -> gpus.Inventory | None:
        if not list(pids):
            return None
        try:
            return gpus.discover()
        except NoDriverError as e:
            log.debug("no GPU inventory: %s", e)
            return None

    def _agent_dir(self, *container_ids: str) -> Path:
        """The agents' socket directory: the first container's given, else the bare one."""
        cid = next((c for c in container_ids if c), "")
        return agent.container_dir(self.cfg.run_dir, cid) if cid else agent.default_dir()

    @staticmethod
    def _data_dir(path: str) -> Path | None:
        if not path:
            return None
        if not os.path.isabs(path):
            raise UsageError(f"gpu_data_dir must be an absolute path, not {path!r}")
        return Path(path)

    def _cuda_process(self, pid: int, state: ProcessState, inv: gpus.Inventory | None) -> Any:
        return self.pb.CudaProcess(pid=pid, state=state.name,
                                   gpu_uuids=inv.gpus_of(pid) if inv else [],
                                   gpu_memory=inv.memory_of(pid) if inv else 0,
                                   gpu_memory_by_gpu=inv.memory_by_gpu(pid) if inv else {})

    # -- containers -------------------------------------------------------------------------------
    @_rpc
    def RegisterContainer(self, request: Any, context: Any) -> Any:
        cid = validate_container_id(request.id)
        record = {"id": cid, "bundle": request.bundle, "pids": [int(p) for p in request.pids],
                  "gpu_uuids": list(request.gpu_uuids), "annotations": dict(request.annotations),
                  "registered_at": time.time()}
        if any(p <= 1 for p in record["pids"]):
            raise UsageError("container PIDs must be > 1")
        self.containers.put(record)
        log.info("registered container %s (PIDs %s)", cid, record["pids"])
        return self.pb.Container(**record)

    @_rpc
    def UnregisterContainer(self, request: Any, context: Any) -> Any:
        cid = validate_container_id(request.id)
        existed = self.containers.remove(cid)
        if not existed and not request.missing_ok:
            raise NotFoundError(f"no registered container '{cid}'")
        if existed:
            log.info("unregistered container %s", cid)
        return self.pb.UnregisterContainerResponse(existed=existed)

    # -- checkpoint ---------------------------------------------------------------------------------
    @_rpc
    def LockAndCheckpoint(self, request: Any, context: Any) -> Any:
        if self._stop.is_set():
            raise SidecarError("torpord is shutting down")
        cfg = self.cfg
        if request.HasField("lock_timeout_s"):
            if not request.lock_timeout_s > 0:
                raise UsageError("lock_timeout_s must be positive")
            cfg = dataclasses.replace(cfg, lock_timeout_s=request.lock_timeout_s)
        pids = self._resolve(request.pids, request.container_id, not request.no_descendants)
        data = self._data_dir(request.gpu_data_dir)
        agent_dir = self._agent_dir(request.agent_container_id, request.container_id)
        owner = None
        if request.owner_pid:
            owner = (request.owner_pid, procs.start_time(request.owner_pid))
            if owner[1] is None:
                raise UsageError(f"owner PID {request.owner_pid} is not running")
        engine = self.engine(cfg)
        op = engine.begin("checkpoint", pids)        # BusyError when another op holds them
        try:
            states = engine.cuda_states(pids)
            bad = {p: s for p, s in states.items() if s != ProcessState.RUNNING}
            if bad:
                p, s = next(iter(bad.items()))
                raise UsageError(f"PID {p} is {s.name} on the GPU, not RUNNING")
            cuda_pids = sorted(states)
            inv = self._gpu_info(cuda_pids)
            cuda = [self._cuda_process(p, states[p], inv) for p in cuda_pids]
            # a container's fingerprints are its own only (store/fingerprints.py)
            fp_owner = fingerprints.owner_of(request.agent_container_id or request.container_id,
                                             procs.owner_uid(cuda_pids[0]) if cuda_pids else 0)
            known = self._known(cfg, request.fingerprints, fp_owner) if data else None
            # a checkpoint that ends the container (SKIP) streams its agents' GPU data
            # straight into the store (store/stream.py), as `torpor checkpoint --store` does
            stream_into = Store(cfg.store_dir) if known is not None and cfg.store_stream \
                and request.fingerprints == self.pb.FINGERPRINTS_SKIP else None
            moved = engine.lock_and_checkpoint(  # rolls back and closes op on failure
                op, cuda_pids, bulk.DataDir(data) if data else None, agent_dir,
                known_fingerprints=known, owner=fp_owner, stream_into=stream_into)
            try:
                # The processes are CHECKPOINTED now: until the operation is in the table (where
                # Rollback, the reaper or shutdown find it), any failure rolls back at once.
                op.phase("dump")
                deadline = time.time() + self.op_timeout_s
                expires = time.monotonic() + self.op_timeout_s
                with self._lock:
                    if self._stop.is_set():   # shutdown() may have emptied the table already
                        raise SidecarError("torpord is shutting down")
                    self._ops[op.entry.id] = OpenOp(op, pids, cuda_pids, request.container_id,
                                                    deadline, expires, owner)
            except BaseException as e:
                engine.fail(op, cuda_pids, e, during="checkpoint")  # rollback, close, raise
        except BaseException:
            op.abandon()
            raise
        log.info("%s: %d CUDA process(es) of %d checkpointed (%s); waiting for the dump",
                 op.entry.id, len(cuda_pids), len(pids), ",".join(map(str, cuda_pids)) or "-")
        return self.pb.LockAndCheckpointResponse(
            op_id=op.entry.id, pids=pids, cuda_processes=cuda, timings=_timings(engine),
            deadline=deadline, container_id=request.container_id,
            agents=[self.pb.AgentData(pid=p, nspid=r["nspid"], files=r["files"],
                                      bytes=r["bytes"], chunks=r["chunks"],
                                      allocations=r["allocations"],
                                      cache_released=r["cache_released"], seconds=r["seconds"],
                                      fingerprinted=r.get("fingerprints", {}).get("parts", 0),
                                      skipped=r.get("fingerprints", {}).get("skipped", 0),
                                      skipped_bytes=r.get("fingerprints", {}).get(
                                          "skipped_bytes", 0))
                    for p, r in sorted(moved.items())])

    def _known(self, cfg: Config, mode: int, owner: str) -> set[str] | dict[str, Any] | None:
        """The fingerprints the agents skip (LockAndCheckpointRequest.fingerprints): what
        owner's snapshots in the image store hold (SKIP), none (INDEX: fingerprinted only),
        or no fingerprints."""
        if mode == self.pb.FINGERPRINTS_NONE:
            return None
        store = Store(cfg.store_dir)
        if not fingerprints.usable(store):
            return None
        return fingerprints.known(store, owner).gpu if mode == self.pb.FINGERPRINTS_SKIP else set()

    @_rpc
    def Finish(self, request: Any, context: Any) -> Any:
        o = self._take(request.op_id)
        engine = self.engine()
        # The dump killed the processes; any CUDA process still alive a moment later would stay
        # checkpointed forever, so it is brought back (that is a --leave-running dump).
        end = time.monotonic() + 2.0
        while any(procs.alive(p) for p in o.cuda_pids) and time.monotonic() < end:
            time.sleep(0.05)
        alive = [p for p in o.cuda_pids if procs.alive(p)]
        gone = [p for p in o.cuda_pids if p not in alive]
        if alive:
            log.warning("%s finished with CUDA PIDs %s still alive: resuming them", o.id, alive)
            with engine.progress.phase("resume"):
                problems = engine.rollback(alive, agents=targets_of(o.op.entry.agents))
            if problems:
                o.op.release()
                raise TorporError(f"finish of {o.id}: " + "; ".join(problems))
        o.op.close()
        log.info("%s finished", o.id)
        return self.pb.OperationResult(op_id=o.id, kind=o.op.entry.kind, pids=o.cuda_pids,
                                       outcome="finished", timings=_timings(engine), gone=gone,
                                       resumed=alive)

    @_rpc
    def Rollback(self, request: Any, context: Any) -> Any:
        o = self._take(request.op_id)
        live, timings = self._rollback(o)
        log.info("%s rolled back (%s running again)", o.id, ",".join(map(str, live)) or "none")
        return self.pb.OperationResult(op_id=o.id, kind=o.op.entry.kind, pids=o.cuda_pids,
                                       outcome="rolled-back", timings=timings,
                                       gone=[p for p in o.cuda_pids if p not in live])

    # -- restore ------------------------------------------------------------------------------------
    @_rpc
    def RestoreAndUnlock(self, request: Any, context: Any) -> Any:
        gpu_map = dict(request.gpu_map)
        if request.op_id:
            if request.pids or request.container_id:
                raise UsageError("give an operation id or PIDs/container, not both")
            return self._restore_open(self._take(request.op_id), gpu_map)
        pids = self._resolve(request.pids, request.container_id, not request.no_descendants)
        data = self._data_dir(request.gpu_data_dir)
        if request.agents and data is None:
            raise UsageError("agents given without the gpu_data_dir that holds their data")
        packed = self._data_dir(request.gpu_data_packed)
        if packed is not None:      # its snapshot names the chunks torpord streams to them
            require_trusted_location(packed, "checkpoint")
            if not store_images.is_packed(packed):
                raise UsageError(f"gpu_data_packed {packed} is not a packed checkpoint")
        engine = self.engine()
        op = engine.begin("restore", pids)
        try:
            states = engine.cuda_states(pids)
            checkpointed = sorted(p for p, s in states.items() if s == ProcessState.CHECKPOINTED)
            locked = sorted(p for p, s in states.items() if s == ProcessState.LOCKED)
            failed = sorted(p for p, s in states.items() if s == ProcessState.FAILED)
            if failed:
                raise TorporError(f"PID {failed[0]} is in the driver's FAILED state: "
                                  "it cannot be restored")
            agents = restore_targets(
                {a.pid: {"nspid": a.nspid, "files": list(a.files)} for a in request.agents},
                data or Path(), self._agent_dir(request.agent_container_id,
                                                   request.container_id), host_pids=pids,
                packed=packed)
            op.phase("gpu-restore", agents={p: t.to_json() for p, t in agents.items()})
            back: dict[int, dict[str, Any]] = {}
            try:
                engine.restore_and_unlock(op, checkpointed, gpu_map)
                if locked:
                    op.phase("unlock")
                    with engine.progress.phase("unlock", f"{len(locked)} locked"):
                        for p in locked:
                            engine.driver.unlock(p)
                if agents:   # after every unlock: a locked program's agent cannot resume
                    back = engine.restore_and_unlock(op, [], agents=agents)
            except TorporError as e:
                problems = engine.rollback(checkpointed + locked, gpu_map, agents)  # once more
                if problems:
                    op.release()
                    raise TorporError(f"{op.entry.phase} failed: {e}; retry failed too: "
                                      + "; ".join(problems),
                                      hint="the journal keeps it: restarting torpord retries; "
                                           "or stop the container") from e
                log.warning("%s: %s failed (%s) but the retry worked", op.entry.id,
                            op.entry.phase, e)
        except BaseException:
            op.abandon()
            raise
        op.close()
        done = checkpointed + locked
        log.info("%s: %d CUDA process(es) restored and unlocked", op.entry.id, len(done))
        return self.pb.RestoreAndUnlockResponse(op_id=op.entry.id, pids=sorted(done),
                                                timings=_timings(engine), gpu_map=gpu_map,
                                                agents=self._resumed(back))

    def _resumed(self, back: dict[int, dict[str, Any]]) -> list[Any]:
        return [self.pb.AgentResumed(pid=p, bytes=r["bytes"], seconds=r["seconds"])
                for p, r in sorted(back.items())]

    def _restore_open(self, o: OpenOp, gpu_map: dict[str, str]) -> Any:
        """--leave-running: the dump is done and the processes still live; give them the GPU."""
        engine = self.engine()
        live = [p for p in o.cuda_pids if procs.alive(p)]
        agents = {p: t for p, t in targets_of(o.op.entry.agents).items() if p in live}
        back: dict[int, dict[str, Any]] = {}
        try:
            back = engine.restore_and_unlock(o.op, live, gpu_map, agents)
        except TorporError as e:
            problems = engine.rollback(live, gpu_map, agents)
            if problems:
                o.op.release()
                raise TorporError(f"restore of {o.id} failed: {e}; retry failed: "
                                  + "; ".join(problems)) from e
            log.warning("%s: restore failed (%s) but the retry worked", o.id, e)
        o.op.close()
        log.info("%s: left running, %d CUDA process(es) restored and unlocked", o.id, len(live))
        return self.pb.RestoreAndUnlockResponse(op_id=o.id, pids=live, timings=_timings(engine),
                                                gpu_map=gpu_map, agents=self._resumed(back))

    # -- inspection ---------------------------------------------------------------------------------
    def _op_info(self, o: OpenOp) -> Any:
        e = o.op.entry
        return self.pb.OperationInfo(op_id=o.id, kind=e.kind, pids=o.pids, cuda_pids=o.cuda_pids,
                                     phase=e.phase, started=e.started, deadline=o.deadline,
                                     container_id=o.container_id)

    @_rpc
    def Status(self, request: Any, context: Any) -> Any:
        op_info = None
        if request.op_id:
            with self._lock:
                o = self._ops.get(request.op_id)
            if o is None:
                raise NotFoundError(f"no open operation '{request.op_id}'")
            pids, op_info = o.pids, self._op_info(o)
        elif request.container_id:
            pids = [int(p) for p in self.containers.get(request.container_id).get("pids", [])]
        else:
            pids = [int(p) for p in request.pids]
            if not pids:
                raise UsageError("give an operation id, PIDs or a container id")
        holder = {p: o.id for o in self.open_ops() for p in o.pids}
        engine = self.engine()
        states = engine.cuda_states([p for p in pids if procs.alive(p)])
        inv = self._gpu_info(states)
        out = []
        for p in pids:
            st = states.get(p)
            out.append(self.pb.ProcessStatus(
                pid=p, alive=procs.alive(p), cuda=st is not None, state=st.name if st is not None else "",
                op_id=holder.get(p, ""), gpu_uuids=inv.gpus_of(p) if inv and st is not None else [],
                gpu_memory=inv.memory_of(p) if inv and st is not None else 0))
        return self.pb.StatusResponse(processes=out, operation=op_info)

    @_rpc
    def List(self, request: Any, context: Any) -> Any:
        containers = [self.pb.Container(
            id=c.get("id", ""), bundle=c.get("bundle", ""), pids=c.get("pids", []),
            gpu_uuids=c.get("gpu_uuids", []), annotations=c.get("annotations", {}),
            registered_at=c.get("registered_at", 0.0)) for c in self.containers.all()]
        gpu_error, gpu_procs = "", []
        try:
            inv = gpus.discover()
            gpu_procs = [self.pb.GpuProcess(pid=g.pid, gpu_uuid=g.gpu_uuid,
                                            used_memory=g.used_memory) for g in inv.processes]
        except NoDriverError as e:
            gpu_error = e.line()
        return self.pb.ListResponse(
            version=__version__, server_pid=os.getpid(), containers=containers,
            operations=[self._op_info(o) for o in self.open_ops()], gpu_processes=gpu_procs,
            gpu_error=gpu_error, op_timeout_s=self.op_timeout_s)

    @_rpc
    def Doctor(self, request: Any, context: Any) -> Any:
        checks = run_checks(self.cfg)
        return self.pb.DoctorResponse(checks=[self.pb.Check(
            name=c.name, status=c.status, detail=c.detail, fix=c.fix) for c in checks])


# -- the daemon ---------------------------------------------------------------------------------

def _servicer(service: Service) -> Any:
    """Adapt Service to the generated servicer base class (so unknown RPCs are UNIMPLEMENTED)."""
    _, pb_grpc = proto()

    class Servicer(pb_grpc.TorporServicer):
        pass

    s = Servicer()
    for name in ("RegisterContainer", "UnregisterContainer", "LockAndCheckpoint", "Finish",
                 "Rollback", "RestoreAndUnlock", "Status", "List", "Doctor"):
        setattr(s, name, getattr(service, name))
    return s


def _daemonize() -> None:
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    fd = os.open(os.devnull, os.O_RDWR)
    for n in (0, 1, 2):
        os.dup2(fd, n)
    if fd > 2:
        os.close(fd)


def _setup_logging(cfg: config.Config, level: str, foreground: bool) -> None:
    logs.setup(cfg.state_dir, None if foreground else "torpord.log", stderr=foreground,
               level=getattr(logging, level.upper(), logging.INFO), stderr_formatted=True,
               fmt="%(asctime)s torpord[%(process)d] %(levelname)s %(message)s", must=True)


def _run_dir(cfg: config.Config) -> Path:
    """run_dir: 0700, or 0711 when a non-root socket owner must reach the socket inside."""
    d = cfg.run_dir
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    want = 0o711 if cfg.socket_owner_uid else 0o700
    st = d.stat()
    if st.st_uid == os.geteuid() and st.st_mode & 0o777 != want:
        os.chmod(d, want)
    return d


def _single_instance(run_dir: Path) -> int:
    fd = os.open(run_dir / "torpord.pid", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SidecarError(f"torpord is already running (pid {other}) for {run_dir}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torpord", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"torpord {__version__}")
    p.add_argument("--config", type=Path, help="config file (default /etc/torpor/config.toml)")
    p.add_argument("--socket", type=Path, help="public socket (default <run_dir>/torpord.sock)")
    p.add_argument("--op-timeout", type=float, default=DEFAULT_OP_TIMEOUT_S, metavar="SECONDS",
                   help="roll back an open operation not ended within this (default 600)")
    p.add_argument("--foreground", action="store_true",
                   help="stay in the foreground and log to stderr (systemd); otherwise detach "
                        "and log to <state_dir>/torpord.log")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config.load(args.config)
        if args.op_timeout <= 0:
            raise UsageError("--op-timeout must be positive")
        public = (args.socket or cfg.socket_path).absolute()
        private = cfg.run_dir.absolute() / "private" / "grpc.sock"
        for path in (public, private):
            if len(str(path).encode()) > _SUN_PATH_MAX:
                raise UsageError(f"socket path too long for a Unix socket: {path}")
        proto()
    except TorporError as e:
        print(f"torpord: {e.line()}", file=sys.stderr)
        return e.exit_code
    if not args.foreground:
        _daemonize()
    _setup_logging(cfg, args.log_level, args.foreground)
    try:
        return _serve(cfg, args, public, private)
    except TorporError as e:
        log.error("%s", e.line())
        return e.exit_code


def _serve(cfg: config.Config, args: argparse.Namespace, public: Path, private: Path) -> int:
    _, pb_grpc = proto()
    run_dir = _run_dir(cfg)
    lock_fd = _single_instance(run_dir)
    public.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    private_dir(private.parent)
    if private.is_socket():
        private.unlink()

    try:
        messages = Engine(cfg, Progress(stream=None)).recover()
        for msg in messages:
            log.warning("recovery: %s", msg)
        log.info("recovery: %s",
                 f"{len(messages)} message(s)" if messages else "nothing to recover")
    except Exception:   # torpord must come up: the reaper retries every RECOVERY_PERIOD_S
        log.exception("recovery at start failed")

    service = Service(cfg, args.op_timeout)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=16,
                                                               thread_name_prefix="rpc"))
    pb_grpc.add_TorporServicer_to_server(_servicer(service), server)
    if server.add_insecure_port(f"unix://{private}") == 0:
        raise SidecarError(f"cannot listen on {private}")
    server.start()
    os.chmod(private, 0o600)
    allowed = {0, cfg.socket_owner_uid}
    proxy = PeerCredProxy(public, private, allowed, mode=0o660, owner_uid=cfg.socket_owner_uid)
    proxy.start()
    service.start_reaper()

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    log.info("torpord %s (pid %d) listening on %s (uids %s), op timeout %.0f s", __version__,
             os.getpid(), public, ",".join(map(str, sorted(allowed))), args.op_timeout)

    while not stop.wait(1.0):
        pass

    proxy.stop_accepting()
    service.stopping()
    server.stop(grace=5).wait(10)
    service.shutdown()   # waits for the handlers gRPC stopped waiting for
    proxy.close()
    try:
        private.unlink()
    except FileNotFoundError:
        pass
    os.close(lock_fd)
    log.info("torpord stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
