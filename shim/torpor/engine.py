"""The engine: lock / checkpoint / restore / unlock of a set of host PIDs, with rollback.

Every driver phase runs inside a journal Operation (journal.py). If any phase fails, or the
operator interrupts, every process is rolled back to RUNNING before the error is raised; if
torpor itself dies, the next torpor (or torpord) finds the journal entry and rolls back.

Programs under the in-process agent (agent.py, agent/PROTOCOL.md) first have their bulk GPU
memory moved into data files (bulk.py) by their agent, at PCIe speed; the driver's checkpoint
then moves only what is left. The order, for every caller (flows/: the CLI's and torpord's):

    checkpoint  agent-prepare -> agent-detach -> lock -> checkpoint      (then the dump)
    restore     gpu-restore -> unlock -> agent-resume                    (after CRIU restore)
    rollback    driver restore + unlock -> agent resume                  (whatever was reached)

A resume is only sent once the driver has unlocked the program (a locked program's driver
calls, the agent's included, block). Any failure of an agent step fails the operation, rolled
back: a program under the agent is never checkpointed half through it, half not. A program
with no agent socket is the normal case (driver only); `use_agent = false` in the config makes
every checkpoint driver-only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Mapping, TypeVar

from . import agent, bulk, criu, interrupts, manifest, packing, procs
from .agent import AgentClient, AgentError, NoAgentError
from .config import Config
from .driver import Driver, DriverError, ProcessState
from .errors import (BusyError, CorruptCheckpointError, DamagedRecordsError, ExitCode,
                     NoDriverError, RolledBackError, TorporError)
from .files import tree_size
from .journal import Entry, Journal, Operation
from .progress import Progress, human_bytes, human_rate
from .store import fingerprints, images, stream
from .store.store import Store

log = logging.getLogger(__name__)

_drivers: dict[str, Driver | NoDriverError] = {}
_drivers_lock = threading.Lock()
T = TypeVar("T")
STATUS_TIMEOUT_S = 30.0   # an agent answers at once, unless a prepare or resume is running


def load_driver(path: str) -> Driver:
    """One Driver per library path and process (engines are cheap, cuInit is not)."""
    with _drivers_lock:
        if path not in _drivers:
            try:
                _drivers[path] = Driver.load(path)
            except NoDriverError as e:
                _drivers[path] = e
        found = _drivers[path]
    if isinstance(found, NoDriverError):
        raise found
    return found


def _parallel(fn: Callable[[int], T], pids: list[int]) -> dict[int, T]:
    """Run fn on every pid at once (ctypes drops the GIL, agents work in their own processes);
    raise the first failure after all end. Returns pid -> result."""
    if len(pids) <= 1:
        return {pid: fn(pid) for pid in pids}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(pids)) as pool:
        futures = {pid: pool.submit(fn, pid) for pid in pids}
        errors = [f.exception() for f in futures.values() if f.exception() is not None]
    if errors:
        raise errors[0]  # type: ignore[misc]
    return {pid: f.result() for pid, f in futures.items()}


@dataclasses.dataclass(frozen=True)
class AgentTarget:
    """One program whose agent moves (or moved) its GPU memory: where its agent listens, and
    its data files, <data>/<name>/gpu-memory-<k>.bin for k < files (name: its PID at
    checkpoint, which a container's restore changes); files 0: none, the agent keeps the
    memory in the program (bulk.InProcess)."""

    pid: int            # host PID now
    socket: Path
    data: Path          # the operation's bulk.DataDir root (unused when files is 0)
    name: int
    files: int
    owner: str = ""     # whose store fingerprints its agent was handed (fingerprints.py)
    packed: str = ""    # a packed checkpoint directory: its data comes from the image store
                        # (store/stream.py), not from files

    @property
    def in_process(self) -> bool:
        return self.files == 0

    def where(self) -> str:
        if self.packed:
            return f"in the image store (the checkpoint packed in {self.packed})"
        return "in the program's host memory (its agent holds it)" if self.in_process \
            else f"in {self.data}/{self.name}"

    def to_json(self) -> dict[str, Any]:
        return {"socket": str(self.socket), "data": str(self.data), "name": self.name,
                "files": self.files, **({"owner": self.owner} if self.owner else {}),
                **({"packed": self.packed} if self.packed else {})}

    @classmethod
    def from_json(cls, pid: int | str, d: Mapping[str, Any]) -> "AgentTarget":
        return cls(int(pid), Path(d["socket"]), Path(d["data"]), int(d.get("name", pid)),
                   int(d["files"]), str(d.get("owner", "")), str(d.get("packed", "")))


def targets_of(agents: Mapping[str, Mapping[str, Any]]) -> dict[int, AgentTarget]:
    """The AgentTargets a journal entry's (or a suspended record's) "agents" names."""
    return {int(p): AgentTarget.from_json(p, d) for p, d in agents.items()}


def restore_targets(entries: Mapping[int, Mapping[str, Any]], data: Path,
                    agent_dir: Path | None, host_pids: Iterable[int] | None = None,
                    packed: Path | None = None) -> dict[int, AgentTarget]:
    """The programs of a checkpoint whose memory their agents moved (torpor.json's "agent",
    by PID at checkpoint), by host PID now: the same PID (CRIU restores PIDs), or, given
    host_pids (a container's new host PIDs), the one with the same PID in its namespace.
    packed: the checkpoint is packed there: the data files come from the image store."""
    by_nspid: dict[int, int] | None = None
    if host_pids is not None:
        by_nspid = {}
        for p in host_pids:
            n = procs.nspid(p)
            if n is not None:
                by_nspid[n] = p
    out = {}
    for old, e in entries.items():
        nspid = int(e["nspid"])
        pid = old if by_nspid is None else by_nspid.get(nspid)
        if pid is None:
            raise TorporError(f"the checkpoint's PID {old} (PID {nspid} in its namespace), "
                              "whose GPU memory its agent moved, is not among the restored "
                              "processes")
        out[pid] = AgentTarget(pid, agent.socket_path(nspid, agent_dir), data, old,
                               len(e["files"]),
                               packed=str(packed) if packed and e["files"] else "")
    return out


def _rate(nbytes: int, seconds: float) -> str:
    return f"{human_bytes(nbytes)} in {seconds:.2f} s ({human_rate(nbytes, seconds)})"


class Engine:
    """The journal, the driver and one Progress (its timings). Cheap: one per operation."""

    def __init__(self, cfg: Config, progress: Progress | None = None):
        self.cfg = cfg
        self.progress = progress or Progress(stream=None)
        self.journal = Journal(cfg)

    # -- the driver -------------------------------------------------------------------------
    @property
    def driver(self) -> Driver:
        """The driver; NoDriverError (with its reason) when there is none."""
        return load_driver(self.cfg.libcuda)

    def driver_or_none(self) -> Driver | None:
        try:
            return self.driver
        except NoDriverError:
            return None

    def cuda_states(self, pids: Iterable[int]) -> dict[int, ProcessState]:
        """Driver state of each pid that is a CUDA process; {} without a driver."""
        drv = self.driver_or_none()
        if drv is None:
            return {}
        states = {}
        for pid in pids:
            st = drv.try_state(pid)
            if st is not None:
                states[pid] = st
        return states

    # -- phases -------------------------------------------------------------------------------
    def begin(self, kind: str, pids: list[int]) -> Operation:
        return self.journal.begin(kind, pids)

    def lock_and_checkpoint(self, op: Operation, pids: list[int],
                            data: bulk.DataDir | bulk.InProcess | None = None,
                            agent_dir: Path | None = None,
                            scratch: bool = False,
                            known_fingerprints: Collection[str] | None = None,
                            owner: str = "", stream_into: Store | None = None
                            ) -> dict[int, dict[str, Any]]:
        """RUNNING -> CHECKPOINTED for every pid; on any failure all are rolled back first.

        data: where the agents of the pids that have one (a socket in agent_dir, default
        agent.default_dir()) put their GPU memory first (the directory is made here, when one
        has; bulk.InProcess: the program's own memory); None: driver only. scratch: data is
        torpor's own (suspend): a recovery removes it. known_fingerprints: the agents
        fingerprint their data on the GPU and skip these parts (owner's snapshots in the image
        store have them: store/fingerprints.py; hold the store's lock until they are packed);
        None: they don't. stream_into (with known_fingerprints): the agents stream their data
        straight into this store (store/stream.py), the data files stay holes.
        Returns what each agent moved: pid -> {"nspid", "bytes", "chunks", "allocations",
        "cache_released", "seconds", "files"} (torpor.json's "agent")."""
        if not pids:
            return {}
        drv = self.driver
        timeout_ms = int(self.cfg.lock_timeout_s * 1000)
        n = f"{len(pids)} CUDA process{'es' if len(pids) > 1 else ''} ({', '.join(map(str, pids))})"
        moved: dict[int, dict[str, Any]] = {}
        try:
            sockets = self.agent_sockets(pids, agent_dir) if data is not None else {}
            if sockets and data is not None:
                moved = self._prepare_agents(op, sockets, data, scratch, known_fingerprints,
                                             owner, stream_into)
            op.phase("lock")
            with self.progress.phase("lock", n):
                for pid in pids:
                    drv.lock(pid, timeout_ms)
            op.phase("checkpoint")
            before = sum(procs.rss_bytes(p) for p in pids)
            with self.progress.phase("checkpoint", f"GPU memory of {n} to host memory",
                                     measure=lambda: sum(procs.rss_bytes(p) for p in pids) - before):
                _parallel(drv.checkpoint, pids)
        except BaseException as e:
            self.fail(op, pids, e, during=op.entry.phase)
        return moved

    def restore_and_unlock(self, op: Operation, pids: list[int],
                           gpu_map: Mapping[str, str] | None = None,
                           agents: Mapping[int, AgentTarget] | None = None
                           ) -> dict[int, dict[str, Any]]:
        """CHECKPOINTED -> RUNNING for every pid, then every program in agents gets the memory
        its agent moved back (resume). Raises DriverError / AgentError; the caller decides.
        Returns pid -> {"bytes", "seconds"} of each agent's resume."""
        if not pids and not agents:
            return {}
        op.phase("gpu-restore", gpu_map=dict(gpu_map or {}),   # agents first: a recovery resumes
                 agents=None if agents is None else {p: t.to_json() for p, t in agents.items()})
        if pids:
            drv = self.driver
            n = f"{len(pids)} CUDA process{'es' if len(pids) > 1 else ''}"
            remap = ", ".join(f"{o} -> {m}" for o, m in (gpu_map or {}).items() if o != m)
            with self.progress.phase("gpu-restore", n + (f", remapped {remap}" if remap else "")):
                _parallel(lambda pid: drv.restore(pid, gpu_map), pids)
            op.phase("unlock")
            with self.progress.phase("unlock", n):
                for pid in pids:
                    drv.unlock(pid)
        if not agents:
            return {}
        op.phase("agent-resume")
        return self._resume_agents(dict(agents))

    def rollback(self, pids: Iterable[int], gpu_map: Mapping[str, str] | None = None,
                 agents: Mapping[int, AgentTarget] | None = None) -> list[str]:
        """Bring every live pid back to RUNNING: driver restore + unlock, then the memory its
        agent moved (agents) back through the agent. Returns what could not be done."""
        problems = []
        stuck = []   # still locked or checkpointed: their agent would block, no resume for them
        drv = self.driver_or_none()
        for pid in pids if drv is not None else ():  # no driver: nothing locked or checkpointed
            if not procs.alive(pid):
                continue
            try:
                st = drv.try_state(pid)
                if st == ProcessState.CHECKPOINTED:
                    drv.restore(pid, gpu_map)
                    st = drv.get_state(pid)
                if st == ProcessState.LOCKED:
                    drv.unlock(pid)
            except DriverError as e:
                problems.append(f"PID {pid}: {e}")
                stuck.append(pid)
        if agents:
            problems += self.rollback_agents(agents, skip=stuck)
        return problems

    def fail(self, op: Operation, pids: list[int], error: BaseException, during: str) -> None:
        """A phase failed: roll every pid back to RUNNING, close op, raise RolledBackError.
        If the rollback itself fails, the journal entry stays for the next torpor to retry.
        The data files of the failed operation's agents go once the agents are resumed."""
        with interrupts.deferred():  # a second Ctrl-C must not stop the rollback
            problems = self.rollback(pids, agents=targets_of(op.entry.agents))
        if problems:
            raise TorporError(f"{during} failed ({_describe(error)}) and rollback failed: "
                              + "; ".join(problems),
                              hint="run 'torpor ps' and 'torpor resume PID'") from error
        if op.entry.data_root:
            bulk.DataDir(Path(op.entry.data_root)).remove()
        op.close()
        code = ExitCode.INTERRUPTED if isinstance(error, KeyboardInterrupt) else None
        raise RolledBackError(f"{during} failed: {_describe(error)}; " + (
                              f"{len(pids)} process(es) rolled back to running" if pids else
                              "the program was left running (no GPU state to roll back)"),
                              exit_code=code) from error

    # -- the agents -------------------------------------------------------------------------------
    def agent_sockets(self, pids: Iterable[int], agent_dir: Path | None = None) -> dict[int, Path]:
        """pid -> its agent's socket, for the pids whose program runs under the agent."""
        if not self.cfg.use_agent:
            return {}
        found = {}
        for pid in pids:
            path = agent.socket_of(pid, agent_dir)
            if path is not None:
                found[pid] = path
        return found

    def _client(self, t: AgentTarget, timeout: float) -> AgentClient:
        try:
            uid = procs.owner_uid(t.pid)
        except FileNotFoundError:
            raise NoAgentError(f"PID {t.pid} is gone") from None
        return AgentClient(t.socket, uid, timeout, expect_pid=t.pid)

    def _probe(self, sockets: Mapping[int, Path]) -> dict[int, Path]:
        """The sockets whose agent answers, can move memory and holds none out. A socket nobody
        listens on (its program ended without removing it; the PID is another program's now)
        is no agent, and an agent older than `prepare` (no "state" in its status) cannot move
        memory: the driver's path for those, said. An agent that does not answer, or holds
        memory out already (an earlier operation did not finish), fails the operation."""
        live = {}
        for pid, path in sorted(sockets.items()):
            why = ""
            try:
                with self._client(AgentTarget(pid, path, Path(), pid, 1), STATUS_TIMEOUT_S) as a:
                    status = a.status()
                state = status.get("state")
                if state is None:
                    why = f"its agent ({path}) cannot move memory (no prepare)"
            except NoAgentError as e:
                why = str(e)
            except TorporError as e:
                raise AgentError(f"PID {pid}: {e}", exit_code=e.exit_code) from e
            if why:
                log.info("PID %d: %s: driver path", pid, why)
                self.progress.say(f"PID {pid}: {why}: the driver moves all its GPU memory")
                continue
            if state != "running":
                raise AgentError(f"PID {pid}: its agent is {state}, holding GPU memory out of "
                                 "an operation that did not finish",
                                 hint=f"'torpor resume {pid}' or 'torpor ps'")
            live[pid] = path
        return live

    def _prepare_agents(self, op: Operation, sockets: Mapping[int, Path],
                        data: bulk.DataDir | bulk.InProcess, scratch: bool,
                        known: Collection[str] | None = None, owner: str = "",
                        stream_into: Store | None = None) -> dict[int, dict[str, Any]]:
        op.phase("agent-prepare")
        sockets = self._probe(sockets)
        if not sockets:
            return {}
        in_process = isinstance(data, bulk.InProcess)
        count = 0 if in_process else bulk.file_count(self.cfg)
        root = Path() if data.root is None else data.root
        if known is not None and not owner:
            raise ValueError("fingerprints need their owner")
        targets = {p: AgentTarget(p, s, root, p, count, owner if known is not None else "")
                   for p, s in sockets.items()}
        if in_process:
            op.phase("agent-prepare", agents={p: t.to_json() for p, t in targets.items()})
        else:
            data.make()   # first: data_root in the journal is ours to remove, never what was there
            # Journaled before the first prepare: whoever finds this entry resumes them.
            op.phase("agent-prepare", agents={p: t.to_json() for p, t in targets.items()},
                     data_root=str(root), scratch=scratch)
        timeout_ms = int(self.cfg.lock_timeout_s * 1000)

        untouched: set[int] = set()   # never reached: no prepare sent, nothing to resume

        def prepare(pid: int) -> dict[str, Any]:
            fds = [] if in_process else data.for_prepare(pid, count)
            fp: tuple[int, int] | None = None
            intake: stream.Intake | None = None
            try:
                if known is not None and not in_process:
                    fds.append(data.new_index(pid))
                    fds.append(fingerprints.known_fd(known))
                    fp = (fds[-1], fds[-2])
                    if stream_into is not None:
                        intake = stream.Intake(stream_into, data.path(pid), count)
                        intake.start()
                try:
                    client = self._client(targets[pid], self.cfg.agent_timeout_s)
                except TorporError:
                    untouched.add(pid)
                    raise
                with client as a:
                    reply = a.prepare(fds[:count], timeout_ms, fingerprints=fp,
                                      stream=intake.agent_fds() if intake else ())
                if intake is not None:   # answered ok: the store committed every part
                    reply["streamed"] = intake.finish().to_json()
                    intake = None
            except TorporError as e:
                why = intake.abandon() if intake is not None else ""
                intake = None
                raise AgentError(f"PID {pid}: {e}" + (f" (the image store: {why})" if why
                                                      else ""), exit_code=e.exit_code) from e
            finally:
                if intake is not None:
                    intake.abandon()
                for fd in fds:   # the agent has its own copies, kept until detach
                    os.close(fd)
            return {"nspid": procs.nspid(pid) or pid, **reply}

        progs = (f"GPU memory of {len(targets)} program(s) under the agent "
                 f"({', '.join(map(str, sorted(targets)))})")
        if in_process:
            what = progs + " to their own host memory"
            before = {p: procs.rss_bytes(p) for p in targets}
            measure = lambda: sum(procs.rss_bytes(p) - before[p] for p in targets)  # noqa: E731
        else:
            what = progs + f" to {count} file(s) each in {root}"
            measure = lambda: tree_size(root)  # noqa: E731
        start = time.monotonic()
        try:
            with self.progress.phase("agent-prepare", what, measure=measure):
                moved = _parallel(prepare, sorted(targets))
        finally:
            if untouched:   # a rollback does not look for what was never there
                op.phase("agent-prepare", agents={p: t.to_json() for p, t in targets.items()
                                                  if p not in untouched})
        total = sum(r["bytes"] for r in moved.values())
        self.progress.say(f"  agent-prepare: {_rate(total, time.monotonic() - start)}")
        op.phase("agent-detach")
        for pid in sorted(targets):
            try:
                with self._client(targets[pid], STATUS_TIMEOUT_S) as a:
                    a.detach()
            except TorporError as e:
                raise AgentError(f"PID {pid}: {e}", exit_code=e.exit_code) from e
        return moved

    def _resume_one(self, t: AgentTarget, fill: bool = False) -> dict[str, Any]:
        """Give t's program the memory its agent moved; nothing when the agent holds none
        (never prepared, or resumed already: a rollback or recovery may come twice). fill:
        the parts its agent skipped are filled from the image store first (a rollback of the
        checkpoint that skipped them); otherwise data with skipped parts is refused: an index
        from an archive must not make this host's store hand out what it holds."""
        with self._client(t, STATUS_TIMEOUT_S) as a:
            if a.state() == "running":
                return {"bytes": 0, "seconds": 0.0}
            if t.in_process:
                return a.resume(None, self.cfg.agent_timeout_s)
            if t.packed:
                return self._resume_streamed(a, t, self._packed_sources(t))
            data = bulk.DataDir(t.data)
            if fill and (data.path(t.name) / bulk.STREAMED).exists():
                return self._resume_streamed(a, t, self._own_sources(t))
            if fill:
                self._fill_skipped(t)
            elif fingerprints.has_skipped(data.path(t.name)):
                raise CorruptCheckpointError(
                    f"the GPU data in {t.data}/{t.name} lacks parts its agent skipped because "
                    "the image store had them, and only the checkpoint that skipped them fills "
                    "them in (its pack, or its rollback): refused")
            fds = bulk.DataDir(t.data).for_resume(t.name, t.files)
            try:
                return a.resume(fds, self.cfg.agent_timeout_s)
            finally:
                for fd in fds:
                    os.close(fd)

    def _resume_streamed(self, a: AgentClient, t: AgentTarget,
                         sources: tuple[Store, list[stream.Source]]) -> dict[str, Any]:
        """t's memory back through the image store's stream: its agent's `resume stream`
        while torpor feeds it the parts from the store."""
        store, parts = sources
        ring = stream.Ring()
        try:
            with concurrent.futures.ThreadPoolExecutor(1, "torpor-feed") as ex:
                fed = ex.submit(stream.feed, store, ring, parts, f"GPU data of PID {t.pid}")
                try:
                    reply = a.resume_stream(ring.agent_fds(), self.cfg.agent_timeout_s)
                except TorporError as e:
                    ring.handed()
                    ring.sock.shutdown(socket.SHUT_RDWR)   # the feed ends now, agent or not
                    why = fed.exception()   # the feed's own failure says more than the agent's
                    if isinstance(why, stream.StreamError):
                        why = None          # it stopped because the agent did
                    raise AgentError(f"{e}" + (f" (the image store: {why})" if why else ""),
                                     exit_code=e.exit_code) from e
                ring.handed()
                fed.result()
        finally:
            ring.close()
        return {**reply, "streamed": True}

    def _packed_sources(self, t: AgentTarget) -> tuple[Store, list[stream.Source]]:
        """The parts of t's data files in the packed checkpoint t.packed names (its chunks
        are in this host's store: the restore's unpack brought in any it lacked)."""
        doc = images.packed_doc(Path(t.packed))
        prog = f"{bulk.DATA_DIR}/{t.name}"
        return Store(self.cfg.store_dir), stream.sources(doc, prog, t.files)

    def _own_sources(self, t: AgentTarget) -> tuple[Store, list[stream.Source]]:
        """The parts of t's data that this operation's own prepare streamed into the store
        (its stream record), and those its agent skipped (its owner's fingerprints)."""
        store = Store(self.cfg.store_dir)
        prog = bulk.DataDir(t.data).path(t.name)
        sizes = [os.path.getsize(prog / bulk.file_name(k)) for k in range(t.files)]
        with store.backend.lock(False, store.lock_timeout):
            return store, [stream.Source(p.file, p.offset, ref)
                           for p, ref in fingerprints.holes(store, prog, sizes, t.owner)]

    def _fill_skipped(self, t: AgentTarget) -> None:
        """The parts t's agent skipped (the image store had them) written into its data files
        from the store (config store_dir), before anything reads them back."""
        data = bulk.DataDir(t.data)
        if not fingerprints.has_skipped(data.path(t.name)):
            return
        if not t.owner:
            raise CorruptCheckpointError(f"the GPU data in {t.data}/{t.name} lacks parts its "
                                         "agent skipped, and no owner is on record to fill "
                                         "them from the store")
        fds = data.for_fill(t.name, t.files)
        try:
            sizes = [os.fstat(fd).st_size for fd in fds]
            store = Store(self.cfg.store_dir)
            with self.progress.phase("fill", f"GPU data of PID {t.pid} that the agent left in "
                                     f"store {store.where}"):
                fingerprints.fill(store, data.path(t.name), fds, sizes, t.owner)
        finally:
            for fd in fds:
                os.close(fd)

    def _resume_agents(self, targets: dict[int, AgentTarget]) -> dict[int, dict[str, Any]]:
        def resume(pid: int) -> dict[str, Any]:
            try:
                return self._resume_one(targets[pid])
            except TorporError as e:
                raise AgentError(f"PID {pid}: agent resume failed ({e}); its GPU memory stays "
                                 f"{targets[pid].where()}", exit_code=e.exit_code) from e

        start = time.monotonic()
        with self.progress.phase("agent-resume", f"GPU memory of {len(targets)} program(s) "
                                 f"under the agent ({', '.join(map(str, sorted(targets)))})"):
            back = _parallel(resume, sorted(targets))
        total = sum(r["bytes"] for r in back.values())
        self.progress.say(f"  agent-resume: {_rate(total, time.monotonic() - start)}")
        return back

    def rollback_agents(self, targets: Mapping[int, AgentTarget],
                        skip: Iterable[int] = ()) -> list[str]:
        """Every live program in targets (but skip) gets the memory its agent moved back;
        returns what failed."""
        skipped = set(skip)
        problems: list[str] = []

        def resume(pid: int) -> None:
            try:
                self._resume_one(targets[pid], fill=True)
            except (TorporError, OSError) as e:
                problems.append(f"PID {pid}: agent resume failed ({e}); its GPU memory stays "
                                f"{targets[pid].where()}")
        _parallel(resume, sorted(p for p in targets if p not in skipped and procs.alive(p)))
        return problems

    # -- recovery -------------------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Roll back what dead torpor processes left locked or checkpointed."""
        messages = []
        for entry, fd in self.journal.orphans():
            try:
                messages += self._recover_one(entry, fd)
            except Exception as e:  # one bad entry must not stop the others, nor the caller
                log.exception("recovering %s", entry.id)
                messages.append(f"could not recover interrupted {entry.kind} {entry.id}: {e}")
                os.close(fd)
        for msg in messages:
            log.warning(msg)
        return messages

    def _recover_one(self, entry: Entry, fd: int) -> list[str]:
        """Roll back one dead operation's processes, finish its images, then forget it. On
        any failure the entry stays for the next try."""
        said: list[str] = []
        if entry.kind == "restore" and entry.phase == "restore" and entry.work_dir:
            keep, said = self._interrupted_restore(entry)
            if keep:
                os.close(fd)    # CRIU is still at it: the entry stays for the next look
                return said
        # suspended on purpose: not ours to resume, unless resuming them is what died
        suspended = self.journal.suspended() if entry.kind != "resume" else {}
        live = [p for p in entry.pids
                if procs.alive(p) and entry.same_process(p) and p not in suspended]
        try:
            claims = self.journal.claim(live)
        except BusyError:
            os.close(fd)  # a live operation owns these processes now; not ours to touch
            return []
        agents = {p: t for p, t in targets_of(entry.agents).items() if p in live}
        try:
            with interrupts.deferred():
                problems = self.rollback(live, entry.gpu_map or None, agents) if live else []
        finally:
            for c in claims:
                os.close(c)
        if problems:
            os.close(fd)
            return [f"could not recover interrupted {entry.kind} {entry.id}: " + "; ".join(problems)]
        messages = said
        if live:
            messages.append(f"recovered {', '.join(map(str, live))} left by an interrupted "
                            f"{entry.kind} (phase {entry.phase}): running again")
        if agents:
            messages.append(f"gave {', '.join(map(str, sorted(agents)))} back the GPU memory "
                            f"their agent had moved "
                            + (f"to {entry.data_root}" if entry.data_root
                               else "into the program's host memory"))
        if entry.scratch and entry.data_root:
            bulk.DataDir(Path(entry.data_root)).remove()
        if entry.kind == "resume":
            messages += self._finish_resume(live)
        if entry.kind == "pack":
            messages += packing.finish_interrupted(self.cfg, entry)
        elif entry.images_dir:
            messages += self._finish_images(Path(entry.images_dir), program_alive=bool(live))
            messages += self._fill_images(Path(entry.images_dir), entry)
        self.journal.forget(entry, fd)
        return messages

    def _finish_resume(self, pids: list[int]) -> list[str]:
        """A resume whose torpor died: its processes run again (the rollback above), so they
        are suspended no more: their records and the host copies of their GPU memory go."""
        records = {p: r for p, r in self.journal.suspended().items() if p in pids}
        for root in {r["data_root"] for r in records.values() if r.get("data_root")}:
            bulk.DataDir(Path(root)).remove(background=True)
        for p in records:
            self.journal.clear_suspended(p)
        return [f"finished resuming {', '.join(map(str, sorted(records)))}"] if records else []

    def _interrupted_restore(self, entry: Entry, wait_s: float = 10.0
                             ) -> tuple[bool, list[str]]:
        """A restore whose torpor died while CRIU ran. CRIU outlives torpor (criu.run_criu):
        once it has finished, its processes are restored and the usual rollback brings their
        GPU state back (None: go on). A CRIU that died half-way (killed with torpor's process
        group, say) left its processes frozen in its restorer for good: they are stopped, and
        the checkpoint, which a restore never changes, is intact. A CRIU still running gets
        wait_s to end, else the entry is kept. Returns (keep the entry, what to say)."""
        work = Path(entry.work_dir)
        deadline = time.monotonic() + wait_s
        while criu.restoring(work) and time.monotonic() < deadline:
            time.sleep(0.1)
        running = criu.restoring(work)
        if running:
            return True, [f"an interrupted restore ({entry.id}) is still being finished by "
                          f"CRIU (PID {running[0]}): look again when it ends"]
        if criu.restore_finished(work):
            shutil.rmtree(work, ignore_errors=True)
            return False, [f"finished the restore ({entry.id}) an interrupted torpor left to "
                           "CRIU"]
        frozen = [p for p in entry.image_pids
                  if (t := procs.started_at(p)) is not None and t >= entry.started - 1.0]
        for p in frozen:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(work, ignore_errors=True)
        entry.pids = []    # none of them is a program to give its GPU back
        return False, [] if not frozen else [
            f"stopped {len(frozen)} half-restored process(es) ({', '.join(map(str, frozen))}) "
            f"that an interrupted restore ({entry.id}) left frozen; the checkpoint is "
            "unchanged: restore it again"]

    def _fill_images(self, images_dir: Path, entry: Entry) -> list[str]:
        """A sealed checkpoint into the store whose torpor died before its pack began: what
        its agents skipped or streamed into the store is written into its data files, so the
        directory stands on its own (else it could never be restored, and gc could take the
        streamed chunks no snapshot names)."""
        if not (images_dir / manifest.MANIFEST).is_file() \
                or not fingerprints.any_skipped(images_dir) or images.is_packed(images_dir):
            return []
        owners = {t.owner for t in targets_of(entry.agents).values() if t.owner}
        try:
            filled = packing.stand_alone(Store(self.cfg.store_dir), images_dir,
                                         next(iter(owners), ""), self.cfg.checksums)
        except DamagedRecordsError as e:
            return [f"the checkpoint in {images_dir}, which an interrupted {entry.kind} left "
                    "unpacked: " + packing.give_up(images_dir, e)]
        return [f"filled {human_bytes(filled)} of GPU data into the checkpoint in {images_dir} "
                "from the image store: its torpor died before packing it"]

    def _finish_images(self, images_dir: Path, program_alive: bool) -> list[str]:
        """An interrupted checkpoint's images: seal them if CRIU finished (or ended the
        program: they are all that is left of it), else clear them."""
        if not (images_dir / manifest.DRAFT).exists():
            return []
        if manifest.dump_succeeded(images_dir) or not program_alive:
            manifest.seal(images_dir, self.cfg.checksums)
            return [f"sealed the checkpoint in {images_dir} that an interrupted torpor had "
                    "dumped but not sealed"]
        manifest.clear_partial(images_dir)
        return [f"removed the partial images of an interrupted dump from {images_dir}"]


def _describe(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return str(e) or type(e).__name__
