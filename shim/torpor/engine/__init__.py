"""The engine: lock / checkpoint / restore / unlock of a set of host PIDs, with rollback.

Every driver phase runs inside a journal Operation (journal.py). If any phase fails, or the
operator interrupts, every process is rolled back to RUNNING before the error is raised; if
torpor itself dies, the next torpor (or torpord) finds the journal entry and rolls back.

Programs under the in-process agent (agent.py, agent/PROTOCOL.md) first have their bulk GPU
memory moved into data files (agent_data.py) by their agent, at PCIe speed; the driver's checkpoint
then moves only what is left. The order, for every caller (flows/: the CLI's and torpord's):

    checkpoint  agent-prepare -> agent-detach -> lock -> checkpoint      (then the dump)
    restore     gpu-restore -> unlock -> agent-resume                    (after CRIU restore)
    rollback    driver restore + unlock -> agent resume                  (whatever was reached)

A resume is only sent once the driver has unlocked the program (a locked program's driver
calls, the agent's included, block). Any failure of an agent step fails the operation, rolled
back: a program under the agent is never checkpointed half through it, half not. A program
with no agent socket is the normal case (driver only); `use_agent = false` in the config makes
every checkpoint driver-only.

Three files, one Engine: this one holds the driver phases (lock, checkpoint, restore, unlock,
rollback, fail) and the Engine itself; agents.py the agent moves (AgentMoves, AgentTarget);
recovery.py what the next torpor does with a dead one's operations (Recovery). The policy
that calls them, for every door, is in flows/.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping

from .. import agent, agent_data, copier, interrupts, procs, workloads
from ..config import Config
from ..driver import Driver, DriverError, ProcessState
from ..errors import ExitCode, HostMemoryError, NoDriverError, RolledBackError, TorporError
from ..journal import Journal, Operation
from ..progress import Progress, human_bytes
from ..store.store import Store
from .agents import (STATUS_TIMEOUT_S, AgentMoves, AgentTarget, Copies,  # noqa: F401
                     _parallel, inventory, restore_targets, targets_of)
from .recovery import Recovery

log = logging.getLogger("torpor.engine")

_drivers: dict[str, Driver | NoDriverError] = {}
_drivers_lock = threading.Lock()


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


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """What a suspend may put in host memory: available, the bytes the host has
    (procs.mem_available); gpu_memory, each PID's GPU memory as NVML counts it (all of it goes
    to host memory on the driver's path); subject, the refusal's first words ("suspending
    1234")."""

    available: int
    gpu_memory: Mapping[int, int]
    subject: str


class Engine(AgentMoves, Recovery):
    """The journal, the driver and one Progress (its timings). Cheap: one per operation."""

    def __init__(self, cfg: Config, progress: Progress | None = None):
        self.cfg = cfg
        self.progress = progress or Progress(stream=None)
        self.journal = Journal(cfg)
        # pid -> descriptors of its GPU memory that its agent handed over at detach (a
        # lock_and_checkpoint with hold=True): that program's resume maps them back instead
        # of copying; whatever is left when the operation ends is closed (release_held)
        self._held: dict[int, list[int]] = {}
        # pid -> the copier filling its data files (a deferred copy: copier.py), from the
        # detach until that program's resume waits for it
        self._copiers: dict[int, copier.Copier] = {}
        # pid -> a copier started before the pause, ready, not yet handed its copy
        # (ready_copiers; None: asked, not ready): the only ones a prepare may defer to
        self._ready: dict[int, copier.Copier | None] = {}
        # pid -> its deferred copy's target (where its agent listens) and, once waited for,
        # the copier's reply: asked again, the same answer (never "ended, said nothing")
        self._deferred: dict[int, AgentTarget] = {}
        self._drains: dict[int, dict[str, Any]] = {}
        self._planned: dict[int, int] = {}
        # pids whose agent holds past 200 allocations for a prepare that takes a bag of their
        # descriptors (status hold_max; holding() asks)
        self._bags: set[int] = set()

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
                            data: agent_data.DataDir | agent_data.InProcess | None = None,
                            agent_dir: Path | None = None,
                            scratch: bool = False,
                            known_fingerprints: Collection[str] | None = None,
                            owner: str = "", stream_into: Store | None = None,
                            host: HostMemory | None = None, hold: bool = False,
                            drain: bool = False) -> dict[int, dict[str, Any]]:
        """RUNNING -> CHECKPOINTED for every pid; on any failure all are rolled back first.

        data: where the agents of the pids that have one (a socket in agent_dir, default
        agent.default_dir()) put their GPU memory first (the directory is made here, when one
        has; agent_data.InProcess: the program's own memory); None: driver only. scratch: data is
        torpor's own (suspend): a recovery removes it. known_fingerprints: the agents
        fingerprint their data on the GPU and skip these parts (owner's snapshots in the image
        store have them: store/fingerprints.py; hold the store's lock until they are packed);
        None: they don't. stream_into (with known_fingerprints): the agents stream their data
        straight into this store (store/stream.py), the data files stay holes. host: the
        host memory the GPU memory may take (suspend): checked once the agents are probed
        (_host_budgets), HostMemoryError before anything is locked or moved (op closed);
        an agent whose data needs more than its share refuses its prepare before copying,
        and everything rolls back. hold: the program resumes in this operation (a
        --leave-running checkpoint): where its agent exported its GPU memory (a program
        started with TORPOR_AGENT_VMM_EXPORT=1, docs/agent.md), torpor keeps the descriptors
        through the driver's checkpoint and the dump, and the resume maps that memory back
        instead of copying the files back (never for a suspend: the memory would stay on the
        GPU). drain (with hold): where an agent can, it leaves the copy into its data files to
        a copier (copier.py) that runs beside the driver's checkpoint and the dump; the
        program's resume waits for it, and its reply's "drain" says how it went (a failed one
        leaves the files without the GPU data: the caller must not seal them).
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
            if data is not None and self.cfg.use_agent:
                container = agent_dir is not None and agent_dir != agent.default_dir()
                note = workloads.driver_path_note(pids, sockets, container)
                if note:
                    self.progress.say(note)
            if sockets:   # those whose agent answers: a stale socket is the driver's path
                op.phase("agent-prepare")
                sockets = self._probe(sockets)
            budgets = self._host_budgets(pids, sockets, host)
            if sockets and data is not None:
                moved = self._prepare_agents(op, sockets, data, scratch, known_fingerprints,
                                             owner, stream_into, budgets, hold=hold,
                                             drain=drain)
            op.phase("lock")
            op.require_journalled(pids)   # durable, on disk, before the first lock
            with self.progress.phase("lock", n):
                for pid in pids:
                    drv.lock(pid, timeout_ms)
            op.phase("checkpoint")
            before = sum(procs.rss_bytes(p) for p in pids)
            with self.progress.phase("checkpoint", f"GPU memory of {n} to host memory",
                                     measure=lambda: max(0, sum(procs.rss_bytes(p)
                                                                for p in pids) - before)):
                _parallel(drv.checkpoint, pids)
        except HostMemoryError:
            op.close()   # nothing was touched: nothing to roll back
            raise
        except BaseException as e:
            self.fail(op, pids, e, during=op.entry.phase)
        return moved

    def _host_budgets(self, pids: list[int], agents: Mapping[int, Path],
                      host: HostMemory | None) -> dict[int, int | None]:
        """The host-memory check of a suspend, once the probe has said which pids have an
        agent that moves their memory (agents): the others' GPU memory goes to host memory
        through the driver, all of it (NVML's figure), and must fit in what the host has, or
        HostMemoryError; the agents share what that leaves (_host_shares), each checking
        its data against its share once its scan knows its zero parts. Returns each agent's
        share (None: no check)."""
        if host is None:
            return {p: None for p in agents}
        driver = [p for p in pids if p not in agents]
        need = sum(host.gpu_memory.get(p, 0) for p in driver)
        if need > host.available:
            who = f"PID{'s' if len(driver) > 1 else ''} {', '.join(map(str, driver))}"
            raise HostMemoryError(f"{host.subject} needs {human_bytes(need)} of host memory for "
                                  f"its GPU memory (the driver moves all of it: {who}); "
                                  f"{human_bytes(host.available)} is available")
        return self._host_shares(agents, host.available - need)

    def restore_and_unlock(self, op: Operation, pids: list[int],
                           gpu_map: Mapping[str, str] | None = None,
                           agents: Mapping[int, AgentTarget] | None = None
                           ) -> dict[int, dict[str, Any]]:
        """CHECKPOINTED -> RUNNING for every pid, then every program in agents gets the memory
        its agent moved back (resume). Raises DriverError / AgentError; the caller decides.
        Returns pid -> {"bytes", "seconds"} of each agent's resume. Memory held through the
        checkpoint is on the GPU it was on: a gpu_map that moves any GPU lets it go first, and
        the programs copy theirs from the files on the new one."""
        if any(o != m for o, m in (gpu_map or {}).items()):
            self.release_held()
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
                 agents: Mapping[int, AgentTarget] | None = None,
                 given_back: set[int] | None = None) -> list[str]:
        """Bring every live pid back to RUNNING: driver restore + unlock, then the memory its
        agent moved (agents) back through the agent. Returns what could not be done.
        given_back: filled with the pids whose agent took memory back here (not those whose
        program ran with its memory already)."""
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
            problems += self.rollback_agents(agents, skip=stuck, given_back=given_back)
        return problems

    def fail(self, op: Operation, pids: list[int], error: BaseException, during: str) -> None:
        """A phase failed: roll every pid back to RUNNING, close op, raise RolledBackError.
        If the rollback itself fails, the journal entry stays for the next torpor to retry.
        The data files of the failed operation's agents go once the agents are resumed."""
        with interrupts.deferred():  # a second Ctrl-C must not stop the rollback
            try:
                problems = self.rollback(pids, agents=targets_of(op.entry.agents))
            finally:   # what no resume took: the next torpor resumes from the files, and
                self.release_held()   # held here too, the memory would be on the GPU twice
        if problems:
            raise TorporError(f"{during} failed ({_describe(error)}) and rollback failed: "
                              + "; ".join(problems),
                              hint="run 'torpor ps' and 'torpor resume PID'") from error
        if op.entry.data_root:
            agent_data.DataDir(Path(op.entry.data_root)).remove()
        op.close()
        code = ExitCode.INTERRUPTED if isinstance(error, KeyboardInterrupt) else None
        ended = [p for p in pids if not procs.alive(p)]   # killed by someone meanwhile
        if ended and len(ended) == len(pids) and code is None:
            code = ExitCode.NOT_FOUND   # nothing runs on: not "rolled back to running"
        raise RolledBackError(f"{during} failed: {_describe(error)}; " + (
                              f"{len(pids) - len(ended)} process(es) rolled back to running"
                              if pids else
                              "the program was left running (no GPU state to roll back)")
                              + (f"; PID(s) {', '.join(map(str, ended))} ended during it"
                                 if ended else ""),
                              exit_code=code) from error

    # -- the agents -------------------------------------------------------------------------------

def _describe(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return str(e) or type(e).__name__

