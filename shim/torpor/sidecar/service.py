"""torpord's gRPC face: the Torpor service's handlers (proto/torpor.proto) and the servicer
that serves them.

Each handler only translates: it checks its request (UsageError for bad input;
request_args.py), makes one call (the engine's container flows, flows/container.py, which own
the checkpoint and restore policy; the container registry, containers.py; the operation table,
operations.py), and answers one response message built by convert.py; any error becomes a
gRPC status carrying torpor's exit code (_rpc).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from typing import Any, Callable, Mapping

import grpc

from .. import __version__, config, gpus, procs
from ..doctor import run_checks
from ..engine import Engine
from ..errors import NoDriverError, NotFoundError, SidecarError, TorporError, UsageError
from ..flows import container
from ..journal import Operation
from ..oci import validate_container_name
from ..progress import Progress
from . import grpc_status, proto
from . import convert
from .containers import Containers
from .convert import GpuProcess, Listing, OperationInfo, ProcessStatus, to_pb
from .operations import DEFAULT_OP_TIMEOUT_S, OpenOp, OperationTable
from .request_args import agent_dir as _agent_dir, data_dir as _data_dir
from .request_args import fingerprint_mode as _fingerprint_mode, gpu_info as _gpu_info
from .request_args import owner as _owner, packed_dir as _packed_dir
from .request_args import resolve_pids as _resolve

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

    # -- containers -------------------------------------------------------------------------------
    @_rpc
    def RegisterContainer(self, request: Any, context: Any) -> Any:
        cid = validate_container_name(request.id)   # its name: <id>@<root key> or <id>
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
        cid = validate_container_name(request.id)
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
        name = request.agent_container_id or self._name(request.container_id)
        owner = _owner(request.owner_pid)
        deadline = 0.0    # set when the operation opens
        engine = self.engine(cfg)

        def opened(op: Operation, cuda_pids: list[int]) -> None:   # SidecarError when stopping
            nonlocal deadline
            deadline = time.time() + self.op_timeout_s
            # the memory its agents hold goes with the operation: its restore maps it back
            o = OpenOp(op, pids, cuda_pids, request.container_id, deadline,
                       time.monotonic() + self.op_timeout_s, owner, held=engine.take_held(),
                       copies=engine.take_copies())
            try:
                self.ops.add(o)
            except BaseException:
                engine.give_held(o.held)   # the rollback that follows resumes through them
                engine.give_copies(o.copies)
                raise

        try:
            ck = container.lock_and_checkpoint(
                engine, pids, data=_data_dir(request.gpu_data_dir),
                agent_dir=_agent_dir(self.cfg.run_dir, name),
                # the fingerprints' owner is the container's name, <id>@<root key> (or an
                # earlier torpor's <id>), as torpor-runtime packs its snapshots
                # (runtime/checkpoint.py): one id under two roots shares none
                owner_container=name,
                mode=_fingerprint_mode(request.fingerprints), opened=opened,
                staged=request.staged, drain=request.staged and request.drain)
        finally:
            engine.release_held()   # what no operation took (none, unless it failed)
        return to_pb(self.pb, convert.Checkpointed.of(ck, deadline, request.container_id))

    @_rpc
    def Finish(self, request: Any, context: Any) -> Any:
        o = self.ops.take(request.op_id)
        # the dump ended the programs: any still alive copies back, once the memory is gone
        with o.ending(self.engine, keep=False) as engine:
            return to_pb(self.pb, container.finish(engine, o.op, o.cuda_pids))

    @_rpc
    def Rollback(self, request: Any, context: Any) -> Any:
        return to_pb(self.pb, self.ops.rollback(self.ops.take(request.op_id)))

    # -- restore ------------------------------------------------------------------------------------
    @_rpc
    def RestoreAndUnlock(self, request: Any, context: Any) -> Any:
        gpu_map = dict(request.gpu_map)
        if request.op_id:     # --leave-running: the dump is done and the processes still live
            if request.pids or request.container_id:
                raise UsageError("give an operation id or PIDs/container, not both")
            _refuse_moving_deferred(self.ops.get(request.op_id), gpu_map)
            o = self.ops.take(request.op_id)
            with o.ending(self.engine) as engine:   # held memory mapped back, not copied
                return to_pb(self.pb, container.restore_open(engine, o.op, o.cuda_pids,
                                                             gpu_map))
        pids = _resolve(self.containers, request.pids, request.container_id,
                        not request.no_descendants)
        return to_pb(self.pb, container.restore(
            self.engine(), pids, gpu_map=gpu_map, agents=convert.restore_entries(request.agents),
            data=_data_dir(request.gpu_data_dir),
            agent_dir=_agent_dir(self.cfg.run_dir, request.agent_container_id
                                 or self._name(request.container_id)),
            packed=_packed_dir(request.gpu_data_packed)))

    def _name(self, container_id: str) -> str:
        """The registered name a request's container_id means (Containers.name_of), or ""."""
        return self.containers.name_of(container_id) if container_id else ""

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



def _refuse_moving_deferred(o: OpenOp | None, gpu_map: Mapping[str, str]) -> None:
    """A --leave-running restore that moves a GPU (gpu_map) of an operation that left its copy
    to copiers (running, or done: its programs' memory is held on the GPUs it is on until the
    restore maps it back): refused (UsageError) before the operation is taken, so it stays
    open for a restore in place, a Rollback or its timeout."""
    moves = sorted(f"{a} -> {b}" for a, b in gpu_map.items() if a != b)
    if o is not None and moves and o.copies:
        raise UsageError(f"operation {o.id}: its programs' GPU memory is being copied beside "
                         f"the dump on the GPUs it is on; a --leave-running restore cannot "
                         f"move them ({', '.join(moves)}): restore it in place (no gpu_map)")


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
