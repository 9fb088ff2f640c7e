"""torpor.json as typed values: frozen dataclasses with a strict from_json and a to_json.

from_json checks every field's type and range and raises CorruptCheckpointError (exit 9)
with one line naming the field ("manifest field 'agent.123.seconds' is not a number"); it is
the only schema check (manifest.validate goes through it). GPU UUIDs are NVML's spelling
(driver.GPU_UUID), PIDs Linux PIDs (procs.is_pid), and a process names only GPUs of "gpus".
Both of today's builders' shapes load: a bare process tree's (flows/checkpoint.py:
"tcp_established", no GPU "minor") and a container's (runtime/checkpoint.py: "container",
GPU "minor", an agent block with "fingerprints").
Keys this torpor does not know are kept (extra) and written back, so a newer torpor's
manifest survives a seal here. Optional keys that are null or absent are written absent.
draft() is the one builder of a draft (everything but the file table, manifest.seal adds it).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .driver import GPU_UUID_FORM, is_gpu_uuid
from .errors import CorruptCheckpointError
from .layout import safe_relpath
from .procs import PID_LIMIT, is_pid

SCHEMA = 1
KIND = "torpor-checkpoint"
MAX_FILES_PER_AGENT = 16
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_INT = 1 << 63


def _bad(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"manifest field '{where}' {what}")


def _obj(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _bad(where, "is missing or not an object")
    return v


def _int(v: Any, where: str, low: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v < _MAX_INT:
        raise _bad(where, f"is missing or not an integer >= {low}")
    return v


def _pid(v: Any, where: str) -> int:
    if not is_pid(v):
        raise _bad(where, f"is missing or not a PID (1 to {PID_LIMIT - 1})")
    return v


def _uuid(v: Any, where: str) -> str:
    """A GPU UUID as NVML spells it (driver.GPU_UUID): checked here, before anything runs,
    not first at the driver's restore, after CRIU's."""
    if not is_gpu_uuid(_str(v, where)):
        raise _bad(where, f"is not a GPU UUID ({GPU_UUID_FORM})")
    return v


def _num(v: Any, where: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise _bad(where, "is missing or not a number >= 0")
    return v


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise _bad(where, "is missing or not a string")
    return v


def _bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise _bad(where, "is missing or not a boolean")
    return v


def _opt(v: Any, check: Any, where: str, *args: Any) -> Any:
    return None if v is None else check(v, where, *args)


def _list(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise _bad(where, "is missing or not a list")
    return v


def _extra(d: Mapping[str, Any], known: Iterable[str]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in set(known)}


def _put(out: dict[str, Any], **kv: Any) -> dict[str, Any]:
    """out with the kv that are not None."""
    out.update({k: v for k, v in kv.items() if v is not None})
    return out


@dataclass(frozen=True)
class Driver:
    version: str | None
    cuda: int | None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Any, where: str = "driver") -> Driver:
        d = _obj(d, where)
        return cls(_opt(d.get("version"), _str, f"{where}.version"),
                   _opt(d.get("cuda"), _int, f"{where}.cuda"), _extra(d, ("version", "cuda")))

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "version": self.version, "cuda": self.cuda}


@dataclass(frozen=True)
class Gpu:
    uuid: str
    name: str
    memory_total: int
    index: int | None = None
    minor: int | None = None          # /dev/nvidia<minor>, where NVML told (containers)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Any, where: str) -> Gpu:
        d = _obj(d, where)
        return cls(_uuid(d.get("uuid"), f"{where}.uuid"), _str(d.get("name"), f"{where}.name"),
                   _int(d.get("memory_total"), f"{where}.memory_total"),
                   _opt(d.get("index"), _int, f"{where}.index"),
                   _opt(d.get("minor"), _int, f"{where}.minor"),
                   _extra(d, ("uuid", "name", "memory_total", "index", "minor")))

    def to_json(self) -> dict[str, Any]:
        return _put({**self.extra, "uuid": self.uuid, "name": self.name,
                     "memory_total": self.memory_total}, index=self.index, minor=self.minor)


@dataclass(frozen=True)
class Process:
    pid: int
    cuda: bool
    gpus: tuple[str, ...]
    gpu_memory: int
    comm: str | None = None
    state: str | None = None
    gpu_memory_by_gpu: Mapping[str, int] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Any, where: str) -> Process:
        d = _obj(d, where)
        by = d.get("gpu_memory_by_gpu")
        if by is not None:
            by = {_uuid(u, f"{where}.gpu_memory_by_gpu"): _int(n, f"{where}.gpu_memory_by_gpu.{u}")
                  for u, n in _obj(by, f"{where}.gpu_memory_by_gpu").items()}
        return cls(_pid(d.get("pid"), f"{where}.pid"), _bool(d.get("cuda"), f"{where}.cuda"),
                   tuple(_uuid(u, f"{where}.gpus") for u in _list(d.get("gpus"), f"{where}.gpus")),
                   _int(d.get("gpu_memory"), f"{where}.gpu_memory"),
                   _opt(d.get("comm"), _str, f"{where}.comm"),
                   _opt(d.get("state"), _str, f"{where}.state"), by,
                   _extra(d, ("pid", "cuda", "gpus", "gpu_memory", "comm", "state",
                              "gpu_memory_by_gpu")))

    def to_json(self) -> dict[str, Any]:
        out = {**self.extra, "pid": self.pid, "cuda": self.cuda, "gpus": list(self.gpus),
               "gpu_memory": self.gpu_memory, "state": self.state}
        return _put(out, comm=self.comm, gpu_memory_by_gpu=None if self.gpu_memory_by_gpu is None
                    else dict(self.gpu_memory_by_gpu))


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: tuple[str, ...] | None    # per 64 MiB block; None for the agents' data files

    @classmethod
    def from_json(cls, d: Any, where: str) -> FileEntry:
        d = _obj(d, where)
        sums = d.get("sha256")
        if sums is not None:
            sums = tuple(_str(s, f"{where}.sha256") for s in _list(sums, f"{where}.sha256"))
            if not all(_HEX64.fullmatch(s) for s in sums):
                raise _bad(f"{where}.sha256", "is not a list of sha256 digests")
        return cls(_int(d.get("size"), f"{where}.size"), sums)

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": None if self.sha256 is None else list(self.sha256)}


@dataclass(frozen=True)
class Sizes:
    total: int
    gpu_memory: int
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Any, where: str = "sizes") -> Sizes:
        d = _obj(d, where)
        return cls(_int(d.get("total"), f"{where}.total"),
                   _int(d.get("gpu_memory"), f"{where}.gpu_memory"),
                   _extra(d, ("total", "gpu_memory")))

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "total": self.total, "gpu_memory": self.gpu_memory}


@dataclass(frozen=True)
class Container:
    """What a container's spec named (torpor.oci.GpuUse); agent: it had the agent's mounts."""
    id: str
    minors: tuple[int, ...]
    visible: tuple[str, ...]
    cdi: tuple[str, ...]
    agent: bool | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Any, where: str = "container") -> Container:
        d = _obj(d, where)
        return cls(_str(d.get("id"), f"{where}.id"),
                   tuple(_int(x, f"{where}.minors") for x in _list(d.get("minors"), f"{where}.minors")),
                   tuple(_str(x, f"{where}.visible") for x in _list(d.get("visible"), f"{where}.visible")),
                   tuple(_str(x, f"{where}.cdi") for x in _list(d.get("cdi"), f"{where}.cdi")),
                   _opt(d.get("agent"), _bool, f"{where}.agent"),
                   _extra(d, ("id", "minors", "visible", "cdi", "agent")))

    def to_json(self) -> dict[str, Any]:
        return _put({**self.extra, "id": self.id, "minors": list(self.minors),
                     "visible": list(self.visible), "cdi": list(self.cdi)}, agent=self.agent)


@dataclass(frozen=True)
class AgentMove:
    """What one program's agent moved into torpor-gpu/<pid>/ (the agent's prepare reply).
    fingerprints: the CLI writes the agent's block as it came, the runtime {"parts",
    "skipped", "skipped_bytes"}; streamed: the store's record of a stream (store/stream.py)."""
    nspid: int
    bytes: int
    files: tuple[int, ...]
    chunks: int | None = None
    allocations: int | None = None
    cache_released: int | None = None
    seconds: float | None = None
    fingerprints: Mapping[str, Any] | None = None
    streamed: Mapping[str, Any] | bool | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _OPTIONAL_INTS = ("chunks", "allocations", "cache_released")

    @classmethod
    def from_json(cls, d: Any, where: str) -> AgentMove:
        d = _obj(d, where)
        files = tuple(_int(n, f"{where}.files") for n in _list(d.get("files"), f"{where}.files"))
        if not 1 <= len(files) <= MAX_FILES_PER_AGENT:
            raise _bad(f"{where}.files", f"does not list 1 to {MAX_FILES_PER_AGENT} files")
        streamed = d.get("streamed")
        if streamed is not None and not isinstance(streamed, bool):
            streamed = _obj(streamed, f"{where}.streamed")
        return cls(_pid(d.get("nspid"), f"{where}.nspid"), _int(d.get("bytes"), f"{where}.bytes"),
                   files, *(_opt(d.get(k), _int, f"{where}.{k}") for k in cls._OPTIONAL_INTS),
                   _opt(d.get("seconds"), _num, f"{where}.seconds"),
                   _opt(d.get("fingerprints"), _obj, f"{where}.fingerprints"), streamed,
                   _extra(d, ("nspid", "bytes", "files", *cls._OPTIONAL_INTS, "seconds",
                              "fingerprints", "streamed")))

    def to_json(self) -> dict[str, Any]:
        return _put({**self.extra, "nspid": self.nspid, "bytes": self.bytes,
                     "files": list(self.files)}, chunks=self.chunks, allocations=self.allocations,
                    cache_released=self.cache_released, seconds=self.seconds,
                    fingerprints=self.fingerprints, streamed=self.streamed)


def _agents(raw: Any) -> dict[int, AgentMove]:
    out: dict[int, AgentMove] = {}
    for key, entry in _obj(raw, "agent").items():
        if not (key.isascii() and key.isdigit() and key == str(int(key)) and is_pid(int(key))):
            raise CorruptCheckpointError(f"manifest agent entry {key[:20]!r} is not a PID")
        out[int(key)] = AgentMove.from_json(entry, f"agent.{key}")
    nspids = [a.nspid for a in out.values()]
    if len(set(nspids)) != len(nspids):
        raise CorruptCheckpointError("manifest agent entries share a namespace PID")
    return out


@dataclass(frozen=True)
class Manifest:
    created: str
    torpor_version: str
    criu_version: str
    host: str
    kernel: str
    driver: Driver
    root_pid: int
    shell_job: bool
    leave_running: bool
    gpus: tuple[Gpu, ...]
    processes: tuple[Process, ...]
    timings: Mapping[str, float]
    sizes: Sizes
    files: Mapping[str, FileEntry]
    tcp_established: bool | None = None      # bare processes: CRIU took TCP connections along
    container: Container | None = None       # containers: what the spec named
    agent: Mapping[int, AgentMove] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _KNOWN = ("schema", "kind", "created", "torpor_version", "criu_version", "host", "kernel",
              "driver", "root_pid", "shell_job", "leave_running", "gpus", "processes", "timings",
              "sizes", "files", "tcp_established", "container", "agent")

    @classmethod
    def from_json(cls, m: Any) -> Manifest:
        if not isinstance(m, dict):
            raise CorruptCheckpointError("manifest is not a JSON object")
        if m.get("kind") != KIND:
            raise CorruptCheckpointError(f"not a torpor manifest (kind is not '{KIND}')")
        if m.get("schema") != SCHEMA:
            raise CorruptCheckpointError(f"manifest schema {m.get('schema')!r:.20} is not "
                                         f"supported (this torpor reads schema {SCHEMA})")
        files = {}
        for rel, info in _obj(m.get("files"), "files").items():
            safe_relpath(rel)
            files[rel] = FileEntry.from_json(info, f"files.{rel}")
        timings = {_str(k, "timings"): _num(v, f"timings.{k}")
                   for k, v in _obj(m.get("timings"), "timings").items()}
        gpus = tuple(Gpu.from_json(g, f"gpus.{i}")
                     for i, g in enumerate(_list(m.get("gpus"), "gpus")))
        processes = tuple(Process.from_json(p, f"processes.{i}")
                          for i, p in enumerate(_list(m.get("processes"), "processes")))
        known = {g.uuid for g in gpus}
        for i, p in enumerate(processes):   # a restore maps and places the listed GPUs only
            for key, uuids in (("gpus", p.gpus), ("gpu_memory_by_gpu", p.gpu_memory_by_gpu or {})):
                if not set(uuids) <= known:
                    raise _bad(f"processes.{i}.{key}", "names a GPU the manifest's 'gpus' "
                               "does not list")
        return cls(
            _str(m.get("created"), "created"), _str(m.get("torpor_version"), "torpor_version"),
            _str(m.get("criu_version"), "criu_version"), _str(m.get("host"), "host"),
            _str(m.get("kernel"), "kernel"), Driver.from_json(m.get("driver")),
            _pid(m.get("root_pid"), "root_pid"), _bool(m.get("shell_job"), "shell_job"),
            _bool(m.get("leave_running"), "leave_running"), gpus, processes, timings,
            Sizes.from_json(m.get("sizes")), files,
            _opt(m.get("tcp_established"), _bool, "tcp_established"),
            None if m.get("container") is None else Container.from_json(m["container"]),
            None if m.get("agent") is None else _agents(m["agent"]),
            _extra(m, cls._KNOWN))

    def to_json(self) -> dict[str, Any]:
        out = {**self.extra, "schema": SCHEMA, "kind": KIND, "created": self.created,
               "torpor_version": self.torpor_version, "criu_version": self.criu_version,
               "host": self.host, "kernel": self.kernel, "driver": self.driver.to_json(),
               "root_pid": self.root_pid, "shell_job": self.shell_job,
               "leave_running": self.leave_running, "gpus": [g.to_json() for g in self.gpus],
               "processes": [p.to_json() for p in self.processes], "timings": dict(self.timings),
               "sizes": self.sizes.to_json(),
               "files": {rel: f.to_json() for rel, f in self.files.items()}}
        return _put(out, tcp_established=self.tcp_established,
                    container=self.container.to_json() if self.container else None,
                    agent=None if self.agent is None
                    else {str(p): a.to_json() for p, a in self.agent.items()})

    def replace(self, **kw: Any) -> Manifest:
        return dataclasses.replace(self, **kw)


def draft(*, torpor_version: str, criu_version: str, driver: Driver, root_pid: int,
          shell_job: bool, leave_running: bool, gpus: Iterable[Gpu],
          processes: Iterable[Process], timings: Mapping[str, float] | None = None,
          tcp_established: bool | None = None, container: Container | None = None,
          agent: Mapping[int, AgentMove] | None = None) -> Manifest:
    """The one builder of a draft manifest (both doors call it): this host, now, no files."""
    procs = tuple(processes)
    return Manifest(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torpor_version=torpor_version, criu_version=criu_version, host=socket.gethostname(),
        kernel=os.uname().release, driver=driver, root_pid=root_pid, shell_job=shell_job,
        leave_running=leave_running, gpus=tuple(gpus), processes=procs,
        timings={k: round(v, 4) for k, v in (timings or {}).items()},
        sizes=Sizes(0, sum(p.gpu_memory for p in procs)), files={},
        tcp_established=tcp_established, container=container, agent=agent or None)
