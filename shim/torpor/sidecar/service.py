"""torpord's gRPC face: the Torpor service's handlers (proto/torpor.proto) and the servicer
that serves them.

Each handler checks its request (UsageError for bad input; request_args.py), acts through the
engine, the container registry (containers.py) and the operation table (operations.py), and
answers one response message built by convert.py; any error becomes a gRPC status carrying torpor's exit code (_rpc). The
orchestration inside LockAndCheckpoint, Finish, Rollback, RestoreAndUnlock and _restore_open
moves to the engine's flows (issue 17); until then it lives here as it was in server.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import grpc

from .. import __version__, bulk, config, gpus, procs
from ..config import Config
from ..oci import validate_container_id
from ..doctor import run_checks
from ..driver import ProcessState
from ..engine import Engine, restore_targets, targets_of
from ..errors import (NoDriverError, NotFoundError, SidecarError, TorporError, UsageError)
from ..files import require_trusted_location
from ..progress import Progress
from ..store import Store, fingerprints
from ..store import images as store_images
from . import grpc_status, proto
from . import convert
from .containers import Containers
from .convert import (CudaProcess, GpuProcess, Listing, OperationInfo, OperationResult,
                      ProcessStatus, Restored, to_pb)
from .operations import DEFAULT_OP_TIMEOUT_S, OpenOp, OperationTable
from .operations import timings as _timings
from .request_args import agent_dir as _agent_dir, data_dir as _data_dir
from .request_args import gpu_info as _gpu_info, resolve_pids as _resolve

log = logging.getLogger("torpor.sidecar")


def _rpc(fn: Callable) -> Callable:
    """Run a handler; turn any error into a gRPC status with torpor's exit code in the trailers.
    Counts the handlers in flight: shutdown() waits for them, as gRPC does not (a cancelled
    call's handler runs on after server.stop())."""
    @functools.wraps(fn)
    def wrapper(self: "Service", request: Any, context: grpc.ServicerContext) -> Any:
        try:
            with self.ops.call():
                return fn(self, request, context)
        except Exception as e:
            if isinstance(e, TorporError):
                log.info("%s refused: %s (exit code %s)", fn.__name__, e.line(), e.exit_code)
            else:
                log.exception("%s failed", fn.__name__)
            status, _code, details, md = grpc_status(e)
            context.set_trailing_metadata(md)
            context.abort(status, details)
    return wrapper


class Service:
    """The Torpor gRPC service: request checks and the handlers, over the container registry
    (self.containers) and the operation table (self.ops)."""

    def __init__(self, cfg: config.Config, op_timeout_s: float = DEFAULT_OP_TIMEOUT_S):
        self.cfg = cfg
        self.op_timeout_s = op_timeout_s
        self.pb, _ = proto()
        self.containers = Containers(cfg.state_dir / "containers")
        self.ops = OperationTable(self.engine, op_timeout_s)

    def engine(self, cfg: config.Config | None = None) -> Engine:
        return Engine(cfg or self.cfg, Progress(stream=None))

    def stopping(self) -> None:
        self.ops.stopping()

    def shutdown(self) -> None:
        self.ops.shutdown()

    def _cuda_process(self, pid: int, state: ProcessState, inv: gpus.Inventory | None) -> Any:
        return to_pb(self.pb, CudaProcess(
            pid=pid, state=state.name, gpu_uuids=tuple(inv.gpus_of(pid)) if inv else (),
            gpu_memory=inv.memory_of(pid) if inv else 0,
            gpu_memory_by_gpu=dict(inv.memory_by_gpu(pid)) if inv else {}))

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
        return to_pb(self.pb, convert.Container.from_record(record))

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
        if self.ops.stopped:
            raise SidecarError("torpord is shutting down")
        cfg = self.cfg
        if request.HasField("lock_timeout_s"):
            if not request.lock_timeout_s > 0:
                raise UsageError("lock_timeout_s must be positive")
            cfg = dataclasses.replace(cfg, lock_timeout_s=request.lock_timeout_s)
        pids = _resolve(self.containers, request.pids, request.container_id,
                        not request.no_descendants)
        data = _data_dir(request.gpu_data_dir)
        agent_dir = _agent_dir(self.cfg.run_dir, request.agent_container_id, request.container_id)
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
            inv = _gpu_info(cuda_pids)
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
                self.ops.add(OpenOp(op, pids, cuda_pids, request.container_id,  # or SidecarError
                                    deadline, expires, owner))                  # when stopping
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
            agents=convert.agents_to_pb(self.pb, moved))

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
        o = self.ops.take(request.op_id)
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
        return to_pb(self.pb, OperationResult(
            op_id=o.id, kind=o.op.entry.kind, pids=tuple(o.cuda_pids), outcome="finished",
            timings=_timings(engine), gone=tuple(gone), resumed=tuple(alive)))

    @_rpc
    def Rollback(self, request: Any, context: Any) -> Any:
        o = self.ops.take(request.op_id)
        live, timings = self.ops.rollback(o)
        log.info("%s rolled back (%s running again)", o.id, ",".join(map(str, live)) or "none")
        return to_pb(self.pb, OperationResult(
            op_id=o.id, kind=o.op.entry.kind, pids=tuple(o.cuda_pids), outcome="rolled-back",
            timings=timings, gone=tuple(p for p in o.cuda_pids if p not in live)))

    # -- restore ------------------------------------------------------------------------------------
    @_rpc
    def RestoreAndUnlock(self, request: Any, context: Any) -> Any:
        gpu_map = dict(request.gpu_map)
        if request.op_id:
            if request.pids or request.container_id:
                raise UsageError("give an operation id or PIDs/container, not both")
            return self._restore_open(self.ops.take(request.op_id), gpu_map)
        pids = _resolve(self.containers, request.pids, request.container_id,
                        not request.no_descendants)
        data = _data_dir(request.gpu_data_dir)
        if request.agents and data is None:
            raise UsageError("agents given without the gpu_data_dir that holds their data")
        packed = _data_dir(request.gpu_data_packed)
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
                convert.restore_entries(request.agents),
                data or Path(), _agent_dir(self.cfg.run_dir, request.agent_container_id,
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
        return self._restored(op.entry.id, sorted(done), _timings(engine), gpu_map, back)

    def _restored(self, op_id: str, pids: list[int], timings: dict[str, float],
                  gpu_map: dict[str, str], back: dict[int, dict[str, Any]]) -> Any:
        return to_pb(self.pb, Restored(op_id=op_id, pids=tuple(pids), timings=timings,
                                       gpu_map=gpu_map, agents=convert.resumed(back)))

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
        return self._restored(o.id, live, _timings(engine), gpu_map, back)

    # -- inspection ---------------------------------------------------------------------------------
    def _op_info(self, o: OpenOp) -> OperationInfo:
        e = o.op.entry
        return OperationInfo(op_id=o.id, kind=e.kind, pids=tuple(o.pids),
                             cuda_pids=tuple(o.cuda_pids), phase=e.phase, started=e.started,
                             deadline=o.deadline, container_id=o.container_id)

    @_rpc
    def Status(self, request: Any, context: Any) -> Any:
        op_info = None
        if request.op_id:
            o = self.ops.get(request.op_id)
            if o is None:
                raise NotFoundError(f"no open operation '{request.op_id}'")
            pids, op_info = o.pids, self._op_info(o)
        elif request.container_id:
            pids = [int(p) for p in self.containers.get(request.container_id).get("pids", [])]
        else:
            pids = [int(p) for p in request.pids]
            if not pids:
                raise UsageError("give an operation id, PIDs or a container id")
        holder = {p: o.id for o in self.ops.open_ops() for p in o.pids}
        engine = self.engine()
        states = engine.cuda_states([p for p in pids if procs.alive(p)])
        inv = _gpu_info(states)
        out = []
        for p in pids:
            st = states.get(p)
            out.append(ProcessStatus(
                pid=p, alive=procs.alive(p), cuda=st is not None, state=st.name if st is not None else "",
                op_id=holder.get(p, ""),
                gpu_uuids=tuple(inv.gpus_of(p)) if inv and st is not None else (),
                gpu_memory=inv.memory_of(p) if inv and st is not None else 0))
        return to_pb(self.pb, convert.Status(processes=tuple(out), operation=op_info))

    @_rpc
    def List(self, request: Any, context: Any) -> Any:
        containers = tuple(convert.Container.from_record(c) for c in self.containers.all())
        gpu_error, gpu_procs = "", ()
        try:
            inv = gpus.discover()
            gpu_procs = tuple(GpuProcess(pid=g.pid, gpu_uuid=g.gpu_uuid,
                                         used_memory=g.used_memory) for g in inv.processes)
        except NoDriverError as e:
            gpu_error = e.line()
        return to_pb(self.pb, Listing(
            version=__version__, server_pid=os.getpid(), containers=containers,
            operations=tuple(self._op_info(o) for o in self.ops.open_ops()),
            gpu_processes=gpu_procs, gpu_error=gpu_error, op_timeout_s=self.op_timeout_s))

    @_rpc
    def Doctor(self, request: Any, context: Any) -> Any:
        checks = run_checks(self.cfg)
        return self.pb.DoctorResponse(checks=[convert.check_to_pb(self.pb, c) for c in checks])



def servicer(service: Service) -> Any:
    """Adapt Service to the generated servicer base class (so unknown RPCs are UNIMPLEMENTED)."""
    _, pb_grpc = proto()

    class Servicer(pb_grpc.TorporServicer):
        pass

    s = Servicer()
    for name in ("RegisterContainer", "UnregisterContainer", "LockAndCheckpoint", "Finish",
                 "Rollback", "RestoreAndUnlock", "Status", "List", "Doctor"):
        setattr(s, name, getattr(service, name))
    return s
