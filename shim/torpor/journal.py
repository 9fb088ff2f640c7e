"""The on-disk journal: no program is left locked or checkpointed by a torpor that died.

Every operation that changes driver state writes `journal/<id>.json` before its first driver
call and holds an flock on `journal/<id>.lock` for its whole life. Every write is whole before
it returns (files.write_json: written to a temporary name, renamed over the entry): a torpor
that dies, however it dies, leaves the last entry it wrote. Where the entry would still mean
something after the machine itself went down it is also durable (fsynced, the directory
fsynced); a suspend's and a resume's are not (CRASH_ONLY: below), and the engine reads the entry back before every driver lock and every agent prepare
(Operation.require_journalled): nothing is locked that a recovery would not find. The kernel
drops that lock when the owner dies, however it dies (SIGKILL included), so the next torpor
command (or torpord at start) finds entries whose lock it can take, and rolls their processes
back to RUNNING: CHECKPOINTED -> restore + unlock, LOCKED -> unlock.

Each process is also claimed with an flock on `locks/<pid>.lock` for the operation's life, so
a second operation on the same PIDs is refused (BusyError) instead of racing the first.

Programs under the in-process agent (agent.py) have their bulk GPU memory moved into data
files (agent_data.py) before the driver's lock: the entry names them (`agents`: PID -> its agent's
socket, its data directory and how many files) before the first `prepare`, so that recovery,
after the driver's rollback, can give each program its memory back (`resume` with the files).

A pack of a checkpoint into the image store (store_packing.py) is an operation with no PIDs: should
its torpor die, recovery fills in the GPU data the checkpoint's agents skipped, so that the
directory stands on its own.

A suspended process (`torpor suspend`) is not an operation in flight: it is recorded in
`suspended/<pid>.json` (with its agent data directory, if any) and left alone by recovery
until `torpor resume`.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import time
import uuid
from pathlib import Path
from typing import Iterable, Iterator

from . import procs
from .config import Config
from .errors import BusyError, TorporError
from .files import private_dir, write_json


# The operations whose entries (and suspended records) only a torpor's death can leave to
# recovery, never a crash of the machine: what they act on (a live process's GPU state in the
# driver's and the host's memory, its data in /dev/shm or in its own memory) does not outlive
# the kernel, and after a reboot recovery finds their PIDs gone or reused (Entry.same_process)
# and has nothing to give back. So their writes skip the fsyncs, which are on the critical path
# of every suspend: 7 entry writes, 2 fsyncs each (14 of the 22 ms a suspend spent outside its
# agent on the 2-core CI machine). A checkpoint's and a pack's entries stay durable: recovery
# seals, fills or marks damaged a checkpoint directory on the disk, which outlives the crash.
CRASH_ONLY = frozenset({"suspend", "resume"})


def _try_flock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@dataclasses.dataclass
class Entry:
    """One operation in flight."""

    id: str
    kind: str                      # checkpoint | restore | suspend | resume | ...
    pids: list[int]
    phase: str = "start"
    gpu_map: dict[str, str] = dataclasses.field(default_factory=dict)
    images_dir: str = ""           # a checkpoint's image directory, to seal it if we die
    starts: dict[str, int] = dataclasses.field(default_factory=dict)  # pid -> start time
    # pid -> {"socket", "data", "files"}: the programs whose agent moves (or moved) memory out
    agents: dict[str, dict] = dataclasses.field(default_factory=dict)
    data_root: str = ""            # the agents' data files (agent_data.DataDir) of this operation
    scratch: bool = False          # data_root is torpor's own (suspend): removed once resumed
    store_owner: str = ""          # a pack's: whose fingerprints (store/fingerprints.owner_of)
    # a restore's: CRIU's work directory (its pidfile there says CRIU finished) and every PID
    # of the image, which a CRIU that died half-way may have left half-restored
    work_dir: str = ""
    image_pids: list[int] = dataclasses.field(default_factory=list)
    # a container restore's (runtime/restore.py): id, runtime, argv, pid_file, state_argv
    container: dict = dataclasses.field(default_factory=dict)
    owner: int = dataclasses.field(default_factory=os.getpid)
    started: float = dataclasses.field(default_factory=time.time)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def note_starts(self, pids: list[int]) -> None:
        for pid in pids:
            t = procs.start_time(pid)
            if t is not None:
                self.starts[str(pid)] = t

    def same_process(self, pid: int) -> bool:
        """pid is still the process this entry claimed (not a later one reusing the PID).
        A PID first seen after CRIU restored it may have no recorded start: trust it."""
        want = self.starts.get(str(pid))
        return want is None or procs.start_time(pid) == want

    @classmethod
    def from_json(cls, d: dict) -> "Entry":
        return cls(id=str(d["id"]), kind=str(d["kind"]), pids=[int(p) for p in d["pids"]],
                   phase=str(d.get("phase", "?")), gpu_map=dict(d.get("gpu_map", {})),
                   images_dir=str(d.get("images_dir", "")),
                   starts={str(k): int(v) for k, v in d.get("starts", {}).items()},
                   agents={str(int(k)): dict(v) for k, v in d.get("agents", {}).items()},
                   data_root=str(d.get("data_root", "")), scratch=bool(d.get("scratch", False)),
                   store_owner=str(d.get("store_owner", "")),
                   work_dir=str(d.get("work_dir", "")),
                   image_pids=[int(p) for p in d.get("image_pids", [])],
                   container=dict(d.get("container") or {}),
                   owner=int(d.get("owner", 0)), started=float(d.get("started", 0)))


class Operation:
    """An Entry plus the locks that make it ours. Use as a context manager."""

    def __init__(self, journal: "Journal", entry: Entry, fds: list[int]):
        self.journal, self.entry, self._fds = journal, entry, fds

    def phase(self, name: str, *, pids: list[int] | None = None,
              gpu_map: dict[str, str] | None = None, images_dir: str | None = None,
              agents: dict[str, dict] | None = None, data_root: str | None = None,
              scratch: bool | None = None, store_owner: str | None = None,
              work_dir: str | None = None, image_pids: list[int] | None = None) -> None:
        """Record the phase about to start (and new PIDs, e.g. after CRIU restore)."""
        if pids is not None:
            self.journal._claim_more(self, pids)  # BusyError before anything is recorded
            self.entry.pids = list(pids)
            self.entry.note_starts(list(pids))
        self.entry.phase = name
        if gpu_map is not None:
            self.entry.gpu_map = dict(gpu_map)
        if images_dir is not None:
            self.entry.images_dir = images_dir
        if agents is not None:
            self.entry.agents = {str(int(k)): dict(v) for k, v in agents.items()}
        if data_root is not None:
            self.entry.data_root = data_root
        if scratch is not None:
            self.entry.scratch = scratch
        if store_owner is not None:
            self.entry.store_owner = store_owner
        if work_dir is not None:
            self.entry.work_dir = work_dir
        if image_pids is not None:
            self.entry.image_pids = [int(p) for p in image_pids]
        self.journal._save(self.entry)

    def require_journalled(self, pids: Iterable[int] = (), agents: Iterable[int] = ()) -> None:
        """Raise, before a driver lock or an agent's prepare, unless what a recovery would find
        were torpor killed now covers it: the entry on disk (phase() writes it durably: written,
        fsynced, its directory fsynced) names every pid and every agent, at the phase now
        running, and we still hold its lock (the lock's file is the one a recovery takes)."""
        path = self.journal._entry_path(self.entry.id)
        try:
            held = bool(self._fds) and \
                os.fstat(self._fds[0]).st_ino == os.stat(path.with_suffix(".lock")).st_ino
        except FileNotFoundError:
            held = False
        try:
            disk = Entry.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TorporError(f"journal entry {path} cannot be read back ({e}): nothing was "
                              "locked") from e
        missing = sorted(set(pids) - set(disk.pids))
        missing_agents = sorted({str(int(p)) for p in agents} - set(disk.agents))
        if not held or missing or missing_agents or disk.phase != self.entry.phase:
            raise TorporError(f"journal entry {path} does not cover the {self.entry.phase} "
                              f"(lock held: {held}, PIDs missing: {missing}, agents missing: "
                              f"{missing_agents}, phase on disk: {disk.phase}): nothing was "
                              "locked")

    def close(self) -> None:
        """The operation ended cleanly (or was rolled back): forget it."""
        self.journal._entry_path(self.entry.id).unlink(missing_ok=True)
        self.journal._entry_path(self.entry.id, ".lock").unlink(missing_ok=True)
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def release(self) -> None:
        """Keep the journal entry, drop our locks: recovery (torpord's or the next torpor
        command's) takes it from here."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

    def abandon(self) -> None:
        """After a failure the caller could not roll back: forget an operation that never
        touched a process, leave any other to recovery."""
        if self.entry.phase == "start":
            self.close()
        else:
            self.release()

    def __enter__(self) -> "Operation":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        elif self._fds:
            self.abandon()


class Journal:
    def __init__(self, cfg: Config):
        self.dir = private_dir(cfg.journal_dir)
        self.locks = private_dir(cfg.locks_dir)
        self.suspended_dir = private_dir(cfg.state_dir / "suspended")

    def _entry_path(self, op_id: str, suffix: str = ".json") -> Path:
        return self.dir / f"{op_id}{suffix}"

    def _save(self, entry: Entry) -> None:
        write_json(self._entry_path(entry.id), entry.to_json(),
                   durable=entry.kind not in CRASH_ONLY)

    def _claim(self, pids: list[int]) -> list[int]:
        fds: list[int] = []
        for pid in pids:
            fd = _try_flock(self.locks / f"{pid}.lock")
            if fd is None:
                for f in fds:
                    os.close(f)
                raise BusyError(f"PID {pid} is busy: another torpor operation is working on it")
            fds.append(fd)
        return fds

    def _claim_more(self, op: Operation, pids: list[int]) -> None:
        new = [p for p in pids if p not in op.entry.pids]
        op._fds += self._claim(new)

    def begin(self, kind: str, pids: list[int]) -> Operation:
        """Claim pids and record the operation; BusyError if any pid is claimed already."""
        op_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{kind}-{uuid.uuid4().hex[:8]}"
        lock_fd = _try_flock(self._entry_path(op_id, ".lock"))
        assert lock_fd is not None
        try:
            fds = [lock_fd] + self._claim(pids)
        except BusyError:
            os.close(lock_fd)
            self._entry_path(op_id, ".lock").unlink(missing_ok=True)
            raise
        entry = Entry(op_id, kind, list(pids))
        entry.note_starts(list(pids))
        self._save(entry)
        return Operation(self, entry, fds)

    def orphans(self) -> Iterator[tuple[Entry, int]]:
        """Entries whose owner is gone: yields (entry, lock fd); close the fd when handled."""
        for path in sorted(self.dir.glob("*.json")):
            fd = _try_flock(path.with_suffix(".lock"))
            if fd is None:
                continue  # its owner is alive and working
            try:
                entry = Entry.from_json(json.loads(path.read_text()))
            except FileNotFoundError:
                os.close(fd)  # its owner finished between our glob and our lock
                continue
            except (OSError, ValueError, KeyError, TypeError):
                path.rename(path.with_suffix(".unreadable"))
                os.close(fd)
                continue
            yield entry, fd

    def names_data(self, data_root: str, *, but: str) -> bool:
        """Whether an entry other than `but` (live or orphaned) names data_root: its data is
        still that operation's to give back or remove. An unreadable entry counts as one."""
        want = os.path.abspath(data_root)
        for path in self.dir.glob("*.json"):
            if path.stem == but:
                continue
            try:
                root = json.loads(path.read_text()).get("data_root") or ""
            except FileNotFoundError:
                continue        # finished between our glob and our read
            except (OSError, ValueError, AttributeError):
                return True
            if root and os.path.abspath(root) == want:
                return True
        return False

    def claim(self, pids: list[int]) -> list[int]:
        """Claim pids outside an operation (recovery); BusyError if a live one holds any."""
        return self._claim(pids)

    def keep(self, entry: Entry, fd: int) -> None:
        """An orphan's entry written again as recovery left it (its phase moved on) and let go:
        the next recovery takes it up from there."""
        self._save(entry)
        os.close(fd)

    def forget(self, entry: Entry, fd: int) -> None:
        self._entry_path(entry.id).unlink(missing_ok=True)
        self._entry_path(entry.id, ".lock").unlink(missing_ok=True)
        os.close(fd)

    # -- suspended processes ------------------------------------------------------------
    def mark_suspended(self, pid: int, info: dict) -> None:
        """A suspended program's record, for its resume; it means nothing once the machine
        went down with the program (CRASH_ONLY), so it is not fsynced."""
        write_json(self.suspended_dir / f"{pid}.json", info, durable=False)

    def suspended(self) -> dict[int, dict]:
        out = {}
        for path in self.suspended_dir.glob("*.json"):
            try:
                out[int(path.stem)] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return out

    def clear_suspended(self, pid: int) -> None:
        (self.suspended_dir / f"{pid}.json").unlink(missing_ok=True)
