"""Every conversion between torpor.proto's messages and Python values, both directions.

What crosses the socket is a frozen dataclass, with the message's field names: to_pb(pb, value)
builds the message, from_pb(cls, msg) reads one back (repeated fields as tuples, maps as dicts,
an unset message field as None). torpord's handlers answer with to_pb; the client returns
from_pb's values.

The values the engine's container flows return (flows/container.py) are the contract: their
types travel as they are (CudaProcess, AgentData = AgentMove, AgentResumed = AgentResume,
OperationResult, Restored; message_of names their messages), and the answers that add
what only torpord knows (Checkpointed: the operation's deadline) are built from them here.
Agent moves travel flat; torpor.json holds them nested (AgentMove.of / to_manifest).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable, Mapping, TypeVar

from ..doctor import Check
from ..flows import container

T = TypeVar("T")

CudaProcess = container.CudaProcess
AgentData = container.AgentMove
AgentResumed = container.AgentResume
OperationResult = container.OperationResult
Restored = container.Restored

# the flows' types: (message, nested message fields)
_FLOWS: dict[type, tuple[str, dict[str, type]]] = {
    CudaProcess: ("CudaProcess", {}),
    AgentData: ("AgentData", {}),
    AgentResumed: ("AgentResumed", {}),
    OperationResult: ("OperationResult", {}),
    Restored: ("RestoreAndUnlockResponse", {"agents": AgentResumed}),
}


@dataclasses.dataclass(frozen=True)
class Checkpointed:
    """LockAndCheckpoint's answer: the operation left open."""
    op_id: str
    pids: tuple[int, ...]
    cuda_processes: tuple[CudaProcess, ...]
    timings: dict[str, float]
    deadline: float
    container_id: str = ""
    agents: tuple[AgentData, ...] = ()
    store_owner: str = ""   # the owner to pack under (flows/container.Checkpointed.owner)
    _message: ClassVar[str] = "LockAndCheckpointResponse"
    _nested: ClassVar[dict[str, type]] = {"cuda_processes": CudaProcess, "agents": AgentData}

    @classmethod
    def of(cls, c: container.Checkpointed, deadline: float,
           container_id: str = "") -> "Checkpointed":
        """The answer for the engine's checkpoint c, open until deadline (wall clock)."""
        return cls(op_id=c.op_id, pids=c.pids, cuda_processes=c.cuda, timings=dict(c.timings),
                   deadline=deadline, container_id=container_id, agents=c.moved,
                   store_owner=c.owner)


@dataclasses.dataclass(frozen=True)
class Container:
    """A registered container (its registry record)."""
    id: str
    bundle: str = ""
    pids: tuple[int, ...] = ()
    gpu_uuids: tuple[str, ...] = ()
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)
    registered_at: float = 0.0
    _message: ClassVar[str] = "Container"

    @classmethod
    def from_record(cls, r: Mapping[str, Any]) -> "Container":
        return cls(id=r.get("id", ""), bundle=r.get("bundle", ""), pids=tuple(r.get("pids", [])),
                   gpu_uuids=tuple(r.get("gpu_uuids", [])),
                   annotations=dict(r.get("annotations", {})),
                   registered_at=r.get("registered_at", 0.0))


@dataclasses.dataclass(frozen=True)
class ProcessStatus:
    pid: int
    alive: bool
    cuda: bool
    state: str = ""
    op_id: str = ""
    gpu_uuids: tuple[str, ...] = ()
    gpu_memory: int = 0
    _message: ClassVar[str] = "ProcessStatus"


@dataclasses.dataclass(frozen=True)
class OperationInfo:
    op_id: str
    kind: str
    pids: tuple[int, ...]
    cuda_pids: tuple[int, ...]
    phase: str
    started: float
    deadline: float
    container_id: str = ""
    _message: ClassVar[str] = "OperationInfo"


@dataclasses.dataclass(frozen=True)
class Status:
    processes: tuple[ProcessStatus, ...]
    operation: OperationInfo | None = None
    _message: ClassVar[str] = "StatusResponse"
    _nested: ClassVar[dict[str, type]] = {"processes": ProcessStatus, "operation": OperationInfo}


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu_uuid: str
    used_memory: int = 0
    _message: ClassVar[str] = "GpuProcess"


@dataclasses.dataclass(frozen=True)
class Listing:
    """List's answer: torpord, its containers, open operations and the GPUs' processes."""
    version: str
    server_pid: int
    containers: tuple[Container, ...] = ()
    operations: tuple[OperationInfo, ...] = ()
    gpu_processes: tuple[GpuProcess, ...] = ()
    gpu_error: str = ""
    op_timeout_s: float = 0.0
    _message: ClassVar[str] = "ListResponse"
    _nested: ClassVar[dict[str, type]] = {"containers": Container, "operations": OperationInfo,
                                          "gpu_processes": GpuProcess}


# -- both directions ----------------------------------------------------------------------------

def message_of(cls: type) -> tuple[str, dict[str, type]]:
    """cls's message name and its fields that are messages (and their types)."""
    if cls in _FLOWS:
        return _FLOWS[cls]
    return cls._message, getattr(cls, "_nested", {})  # type: ignore[attr-defined]


def to_pb(pb: Any, value: Any) -> Any:
    """The message for a dataclass above (None fields left unset)."""
    name, nested = message_of(type(value))
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if v is None:
            continue
        if f.name in nested:
            v = [to_pb(pb, x) for x in v] if isinstance(v, tuple) else to_pb(pb, v)
        elif isinstance(v, tuple):
            v = list(v)
        elif isinstance(v, Mapping):
            v = dict(v)
        kw[f.name] = v
    return getattr(pb, name)(**kw)


def from_pb(cls: type[T], msg: Any) -> T:
    """The dataclass cls for a message: repeated fields as tuples, maps as dicts."""
    nested = message_of(cls)[1]
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        field = msg.DESCRIPTOR.fields_by_name[f.name]
        v = getattr(msg, f.name)
        sub = nested.get(f.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            kw[f.name] = dict(v)
        elif _repeated(field):
            kw[f.name] = tuple(from_pb(sub, x) if sub else x for x in v)
        elif sub is not None:
            kw[f.name] = from_pb(sub, v) if msg.HasField(f.name) else None
        else:
            kw[f.name] = v
    return cls(**kw)


def _repeated(field: Any) -> bool:
    flag = getattr(field, "is_repeated", None)
    if flag is not None:
        return bool(flag)
    return field.label == field.LABEL_REPEATED  # protobuf < 5.28


def restore_entries(msgs: Iterable[Any]) -> tuple[container.AgentEntry, ...]:
    """RestoreAndUnlockRequest.agents as the engine's restore takes them."""
    return tuple(container.AgentEntry(int(a.pid), int(a.nspid), tuple(a.files),
                                      bool(a.deferred)) for a in msgs)


def check_to_pb(pb: Any, c: Check) -> Any:
    return pb.Check(name=c.name, status=c.status, detail=c.detail, fix=c.fix)


def check_from_pb(msg: Any) -> Check:
    return Check(msg.name, msg.status, msg.detail, msg.fix)
