"""Every conversion between torpor.proto's messages and Python values, both directions.

What crosses the socket is a frozen dataclass here, each named after (or mapped to, by
_message) its message, with the message's field names: to_pb(pb, value) builds the message,
from_pb(cls, msg) reads one back (repeated fields as tuples, maps as dicts, an unset message
field as None). torpord's handlers answer with to_pb; the client returns from_pb's values.

Agent moves travel flat (AgentData); the engine and torpor.json hold them nested, with the
fingerprint counts under "fingerprints": AgentData.from_moved and AgentData.to_manifest convert
between the two, so the shape of torpor.json's "agent" entries is decided here only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Iterable, Mapping, TypeVar

from ..doctor import Check

T = TypeVar("T")

_FINGERPRINTS = (("parts", "fingerprinted"), ("skipped", "skipped"),
                 ("skipped_bytes", "skipped_bytes"))   # torpor.json's name, AgentData's name
_MOVED = ("nspid", "bytes", "chunks", "allocations", "cache_released", "seconds", "files")


@dataclasses.dataclass(frozen=True)
class AgentData:
    """What one program's agent moved out of its GPU at checkpoint (AgentData)."""
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
    _message: ClassVar[str] = "AgentData"

    @classmethod
    def from_moved(cls, pid: int, r: Mapping[str, Any]) -> "AgentData":
        """From the engine's result for pid (lock_and_checkpoint) or torpor.json's entry."""
        fp = r.get("fingerprints") or {}
        return cls(pid=int(pid), nspid=int(r["nspid"]), files=tuple(int(n) for n in r["files"]),
                   bytes=int(r.get("bytes", 0)), chunks=int(r.get("chunks", 0)),
                   allocations=int(r.get("allocations", 0)),
                   cache_released=int(r.get("cache_released", 0)),
                   seconds=float(r.get("seconds", 0.0)),
                   **{mine: int(fp.get(theirs, 0)) for theirs, mine in _FINGERPRINTS})

    def to_manifest(self) -> dict[str, Any]:
        """torpor.json's "agent" entry for this program (keyed by str(pid) there)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in _MOVED}
        out["files"] = list(self.files)
        if self.fingerprinted:
            out["fingerprints"] = {theirs: getattr(self, mine) for theirs, mine in _FINGERPRINTS}
        return out


@dataclasses.dataclass(frozen=True)
class AgentResumed:
    """What one program's agent gave back to its GPU at restore."""
    pid: int
    bytes: int = 0
    seconds: float = 0.0
    _message: ClassVar[str] = "AgentResumed"


@dataclasses.dataclass(frozen=True)
class CudaProcess:
    pid: int
    state: str                     # the driver's state name
    gpu_uuids: tuple[str, ...] = ()
    gpu_memory: int = 0
    gpu_memory_by_gpu: dict[str, int] = dataclasses.field(default_factory=dict)
    _message: ClassVar[str] = "CudaProcess"


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
    _message: ClassVar[str] = "LockAndCheckpointResponse"
    _nested: ClassVar[dict[str, type]] = {"cuda_processes": CudaProcess, "agents": AgentData}


@dataclasses.dataclass(frozen=True)
class OperationResult:
    """How Finish or Rollback ended an open operation."""
    op_id: str
    kind: str
    pids: tuple[int, ...]
    outcome: str                   # finished | rolled-back
    timings: dict[str, float]
    gone: tuple[int, ...] = ()
    resumed: tuple[int, ...] = ()
    _message: ClassVar[str] = "OperationResult"


@dataclasses.dataclass(frozen=True)
class Restored:
    """RestoreAndUnlock's answer."""
    op_id: str
    pids: tuple[int, ...]
    timings: dict[str, float]
    gpu_map: dict[str, str]
    agents: tuple[AgentResumed, ...] = ()
    _message: ClassVar[str] = "RestoreAndUnlockResponse"
    _nested: ClassVar[dict[str, type]] = {"agents": AgentResumed}


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

def to_pb(pb: Any, value: Any) -> Any:
    """The message for a dataclass above (None fields left unset)."""
    nested = getattr(type(value), "_nested", {})
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
    return getattr(pb, value._message)(**kw)


def from_pb(cls: type[T], msg: Any) -> T:
    """The dataclass cls for a message: repeated fields as tuples, maps as dicts."""
    nested: dict[str, type] = getattr(cls, "_nested", {})
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


def agents_to_pb(pb: Any, moved: Mapping[int, Mapping[str, Any]]) -> list[Any]:
    """The engine's agent moves (pid -> nested result), flat, in PID order."""
    return [to_pb(pb, AgentData.from_moved(p, r)) for p, r in sorted(moved.items())]


def resumed(back: Mapping[int, Mapping[str, Any]]) -> tuple[AgentResumed, ...]:
    """The engine's agent resumes (pid -> {bytes, seconds}), in PID order."""
    return tuple(AgentResumed(pid=p, bytes=r["bytes"], seconds=r["seconds"])
                 for p, r in sorted(back.items()))


def restore_entries(msgs: Iterable[Any]) -> dict[int, dict[str, Any]]:
    """RestoreAndUnlockRequest.agents as the engine's restore_targets takes them."""
    return {a.pid: {"nspid": a.nspid, "files": list(a.files)} for a in msgs}


def check_to_pb(pb: Any, c: Check) -> Any:
    return pb.Check(name=c.name, status=c.status, detail=c.detail, fix=c.fix)


def check_from_pb(msg: Any) -> Check:
    return Check(msg.name, msg.status, msg.detail, msg.fix)
