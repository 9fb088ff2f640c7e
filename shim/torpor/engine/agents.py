"""The engine's agent moves: the programs under the in-process agent (agent.py,
agent/PROTOCOL.md) have their bulk GPU memory moved out by their agent before the driver's
lock, and back after its unlock (engine/__init__.py says the order). AgentMoves is mixed into
Engine: its methods use the engine's config, progress, driver and journal."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Mapping, TypeVar

from .. import agent, agent_data, copier, gpus, procs
from ..agent import AgentClient, AgentError, NoAgentError, held_fds
from ..errors import CorruptCheckpointError, NoDriverError, TorporError
from ..files import tree_size
from ..journal import Operation
from ..progress import human_bytes, human_rate
from ..store import fingerprints, images, stream
from ..store.store import Store

log = logging.getLogger("torpor.engine")
T = TypeVar("T")
STATUS_TIMEOUT_S = 30.0   # an agent answers at once, unless a prepare or resume is running
ALREADY_RUNNING = "already_running"   # a resume's reply: its program had its memory already


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


@dataclasses.dataclass
class Copies:
    """The deferred copies of one operation (copier.py), handed from engine to engine with
    it as its held descriptors are (torpord's open operation: take_copies, give_copies): by
    pid, the copier filling the files, the program's target, the bytes its agent planned
    and, once heard, the copier's reply."""
    copiers: dict[int, copier.Copier] = dataclasses.field(default_factory=dict)
    targets: dict[int, "AgentTarget"] = dataclasses.field(default_factory=dict)
    planned: dict[int, int] = dataclasses.field(default_factory=dict)
    drains: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.targets)

    def filled(self, pid: int) -> bool:
        """pid's copier said it filled the files with every byte its agent planned."""
        return _filled(self.drains.get(pid), self.planned.get(pid))

    def release(self, held: Mapping[int, list[int]]) -> None:
        """Close held descriptors (pid -> fds); those of a deferred copy not filled are the
        only copy of the data besides the copier's: given back to the program's agent first
        (`hold N`), which keeps them for the next resume (a recovery's, or its deadline's).
        Needs no engine: an operation whose end could not make one still lets go safely."""
        for pid, fds in held.items():
            if fds and pid in self.targets and not self.filled(pid):
                give_back(self.targets[pid], fds)
            _close_all(fds)


def _filled(drain: Mapping[str, Any] | None, planned: int | None) -> bool:
    """A copier's reply says the files have the data: ok, and (where known) the bytes its
    agent planned."""
    if not drain or drain.get("ok") is not True:
        return False
    return planned is None or int(drain.get("bytes", -1)) == planned


def agent_client(t: "AgentTarget", timeout: float) -> AgentClient:
    """A client of t's agent, which must answer as t's program (its uid, its PID)."""
    try:
        uid = procs.owner_uid(t.pid)
    except FileNotFoundError:
        raise NoAgentError(f"PID {t.pid} is gone") from None
    return AgentClient(t.socket, uid, timeout, expect_pid=t.pid)


def give_back(t: "AgentTarget", fds: list[int]) -> None:
    """fds (held memory of a deferred copy not yet in the files) to t's agent to hold."""
    try:
        with agent_client(t, STATUS_TIMEOUT_S) as a:
            with held_fds(fds) as sent:
                a.call(f"hold {len(fds)}", sent)
        log.warning("PID %d: its GPU memory, not yet in its checkpoint's files, given back "
                    "to its agent to hold", t.pid)
    except TorporError as e:
        log.error("PID %d: its agent would not take back the GPU memory only it and this "
                  "torpor held (%s): that memory goes with this torpor", t.pid, e)


@dataclasses.dataclass(frozen=True)
class AgentTarget:
    """One program whose agent moves (or moved) its GPU memory: where its agent listens, and
    its data files, <data>/<name>/gpu-memory-<k>.bin for k < files (name: its PID at
    checkpoint, which a container's restore changes); files 0: none, the agent keeps the
    memory in the program (agent_data.InProcess)."""

    pid: int            # host PID now
    socket: Path
    data: Path          # the operation's agent_data.DataDir root (unused when files is 0)
    name: int
    files: int
    owner: str = ""     # whose store fingerprints its agent was handed (fingerprints.py)
    packed: str = ""    # a packed checkpoint directory: its data comes from the image store
                        # (store/stream.py), not from files
    copier: int = 0     # a deferred copy (copier.py): the copier's PID filling the files,
    copier_start: int = 0   # and its start time; nothing reads them before it is gone
    sealed: bool = False    # a restore of a checkpoint whose agent left its copy to a copier:
                            # CRIU dumped it deferred, and its sealed files are complete

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
                **({"packed": self.packed} if self.packed else {}),
                **({"copier": self.copier, "copier_start": self.copier_start}
                   if self.copier else {}), **({"sealed": True} if self.sealed else {})}

    @classmethod
    def from_json(cls, pid: int | str, d: Mapping[str, Any]) -> "AgentTarget":
        return cls(int(pid), Path(d["socket"]), Path(d["data"]), int(d.get("name", pid)),
                   int(d["files"]), str(d.get("owner", "")), str(d.get("packed", "")),
                   int(d.get("copier", 0)), int(d.get("copier_start", 0)),
                   d.get("sealed") is True)


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
                               packed=str(packed) if packed and e["files"] else "",
                               sealed=e.get("deferred") is True)
    return out


def _close_all(fds: list[int]) -> None:
    """Close fds and empty the list (a second call closes nothing)."""
    while fds:
        os.close(fds.pop())


def inventory() -> gpus.Inventory | None:
    """NVML's GPUs and compute processes now; None where NVML cannot tell."""
    try:
        return gpus.discover()
    except NoDriverError:
        return None


def _rate(nbytes: int, seconds: float) -> str:
    return f"{human_bytes(nbytes)} in {seconds:.2f} s ({human_rate(nbytes, seconds)})"



class AgentMoves:
    """Engine's agent steps: probe, prepare, resume (from files, host memory or the store's
    stream), and the agents' share of a rollback."""

    _held: dict[int, list[int]]   # Engine.__init__: descriptors taken at detach, by pid
    _copiers: dict[int, copier.Copier]   # Engine.__init__: deferred copies running, by pid
    _ready: dict[int, copier.Copier | None]  # ... copiers ready for one (None: not ready)
    _deferred: dict[int, AgentTarget]     # ... their programs' targets
    _drains: dict[int, dict[str, Any]]    # ... and their copiers' replies, once waited for
    _planned: dict[int, int]              # ... and the bytes their agents planned
    _bags: set[int]                       # ... agents that take a bag of held descriptors

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
        return agent_client(t, timeout)

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
            if agent.takes_bags(status):   # its prepare may hold past 200 (a bag of them)
                self._bags.add(pid)
            live[pid] = path
        return live

    def holding(self, sockets: Mapping[int, Path]) -> dict[int, Path]:
        """The sockets whose agent may hold its memory through a leave-running pause (its
        status's "holdable" not false; older agents do not say), the only programs a copier
        can serve: no copier, no GPU context on a nearly full GPU, for the others
        (TORPOR_AGENT_VMM_EXPORT=0, a driver that refused exportable memory, the program's
        own allocations not exportable, more than 8192, or 200 for an agent before bags). An
        agent that does not answer is kept: the prepare's own probe says what is wrong with
        it."""
        out = {}
        for pid, path in sorted(sockets.items()):
            try:
                with self._client(AgentTarget(pid, path, Path(), pid, 1), STATUS_TIMEOUT_S) as a:
                    st = a.status()
                    # past HOLD_DIRECT allocations an agent holds for a prepare that takes a
                    # bag (AgentClient.prepare asks for it where the agent says hold_max)
                    holdable = st.get("holdable_bag", st.get("holdable"))
            except TorporError:
                holdable = None
            if holdable is False:
                log.info("PID %d: its agent cannot hold its memory now: no copier", pid)
                self._ready.setdefault(pid, None)   # asked: no copier (nor in the pause)
                continue
            out[pid] = path
        return out

    def ready_copiers(self, pids: Collection[int], inv: gpus.Inventory | None) -> None:
        """A copier ready for each pid's deferred copy (copier.prestart: the driver loaded, a
        context on each of its GPUs, their UUIDs from inv, NVML's), made before the pause,
        while the programs run. A pid whose copier cannot get there (no room on its GPU for
        another context, a GPU in exclusive-process mode) is said and copies in its program
        before the dump, as without one; drop_copiers lets go of those never used. Nor is
        one started on a GPU with less free memory than its context may take
        (copier.CONTEXT_ROOM): the program, still running, could run out because of it."""
        started: dict[int, copier.Copier] = {}
        todo = {p: inv.gpus_of(p) if inv else [] for p in pids if p not in self._ready}
        self._ready.update((p, None) for p in todo)   # asked once: not ready until it says so
        free, taken = (inv.free_memory() if inv else {}), {}
        for pid, uuids in sorted(todo.items()):
            why = copier.take_room(sorted(uuids), free, taken)
            if why is not None:
                del todo[pid]
                log.warning("PID %d: no torpor-copier (%s)", pid, why)
                self.progress.say(f"warning: PID {pid}: no torpor-copier: {why}; its GPU "
                                  "memory is copied before the dump, not beside it")
        try:
            try:
                for pid, uuids in sorted(todo.items()):
                    started[pid] = copier.prestart(self.cfg.libcuda, sorted(uuids),
                                                   self.cfg.copier, self._copier_deadline())
            except (OSError, TorporError) as e:
                self.progress.say(f"warning: torpor-copier cannot start ({e}): GPU memory is "
                                  "copied before the dump")
            deadline = time.monotonic() + copier.READY_TIMEOUT_S   # one wait for them all
            said_scope = False
            for pid, c in list(started.items()):
                try:
                    why = copier.ready(c, max(0.0, deadline - time.monotonic()))
                except (OSError, ValueError) as e:
                    copier.discard(c)
                    why = str(e)
                del started[pid]
                if why is not None and why.startswith(copier.SCOPE_FAILED):
                    if not said_scope:   # torpord's progress goes nowhere: its log too
                        log.warning("%s: torpor-copier runs in this process's cgroup", why)
                        self.progress.say(f"warning: {why}: torpor-copier runs in this "
                                          "process's cgroup, which a stop of its unit would "
                                          "kill with it")
                        said_scope = True
                    if deadline > time.monotonic():   # not after a systemd-run that hung
                        c, why = self._ready_unscoped(pid, todo[pid], deadline)
                if why is None:
                    self._ready[pid] = c
                else:
                    log.warning("PID %d: torpor-copier is not ready (%s)", pid, why)
                    self.progress.say(f"warning: PID {pid}: torpor-copier is not ready ({why}): "
                                      "its GPU memory is copied before the dump, not beside it")
        finally:   # an interrupt: none is left running (they hold nothing yet)
            for c in started.values():
                copier.discard(c)

    def _copier_deadline(self) -> float:
        """The copier's --deadline (copier.c): a no-progress watchdog, twice agent_timeout_s
        (20 minutes by default). The copier ends by itself only when no part has been written
        for that many seconds, far past any healthy part (a 4 MiB part takes milliseconds):
        it is for a copier stuck with no torpor left to kill it (a recovery only waits for
        another's). It does not wait for torpor: it exits as soon as its files are full,
        however long the dump or a torpord's gap between its calls, so neither makes it end
        first; only a copy that itself stalls that long is ended (the checkpoint then fails,
        the program resumed from the memory torpor still holds)."""
        return 2 * self.cfg.agent_timeout_s

    def _ready_unscoped(self, pid: int, uuids: Collection[str], deadline: float
                        ) -> tuple[copier.Copier, str | None]:
        """pid's copier again, without the systemd scope that failed (copier.scope_broken)."""
        try:
            c = copier.prestart(self.cfg.libcuda, sorted(uuids), self.cfg.copier,
                                self._copier_deadline())
        except (OSError, TorporError) as e:
            return copier.Copier(0, None), str(e)
        try:
            why = copier.ready(c, max(0.0, deadline - time.monotonic()))
        except BaseException:
            copier.discard(c)
            raise
        return c, why

    def drop_copiers(self) -> None:
        """Let go of the ready copiers never handed a copy (they hold nothing)."""
        while self._ready:
            c = self._ready.popitem()[1]
            if c is not None:
                copier.discard(c)

    def _prepare_agents(self, op: Operation, sockets: Mapping[int, Path],
                        data: agent_data.DataDir | agent_data.InProcess, scratch: bool,
                        known: Collection[str] | None = None, owner: str = "",
                        stream_into: Store | None = None,
                        budgets: Mapping[int, int | None] | None = None, hold: bool = False,
                        drain: bool = False) -> dict[int, dict[str, Any]]:
        """Each agent in sockets (probed: _probe) moves its program's memory into data;
        budgets: the host memory each one's data may take (Engine._host_budgets); hold: the
        descriptors of the memory those agents exported are taken at detach (self._held);
        drain (with hold, into files, no store): each agent that can leaves its copy to a
        copier (copier.py) that runs from the detach until the program's resume."""
        op.phase("agent-prepare")
        in_process = isinstance(data, agent_data.InProcess)
        count = 0 if in_process else agent_data.file_count(self.cfg)
        root = Path() if data.root is None else data.root
        if known is not None and not owner:
            raise ValueError("fingerprints need their owner")
        targets = {p: AgentTarget(p, s, root, p, count, owner if known is not None else "")
                   for p, s in sockets.items()}
        for p in targets:   # a reply heard from an earlier copier of one of these programs (a
            self._drains.pop(p, None)   # recovery's, in this engine) answers for that copy alone
        if in_process:
            op.phase("agent-prepare", agents={p: t.to_json() for p, t in targets.items()})
        else:
            data.make()   # first: data_root in the journal is ours to remove, never what was there
            # Journaled before the first prepare: whoever finds this entry resumes them.
            op.phase("agent-prepare", agents={p: t.to_json() for p, t in targets.items()},
                     data_root=str(root), scratch=scratch)
        op.require_journalled(agents=targets)   # durable, on disk, before the first prepare
        timeout_ms = int(self.cfg.lock_timeout_s * 1000)

        untouched: set[int] = set()   # never reached: no prepare sent, nothing to resume
        defer: set[int] = set()
        if drain and hold and not in_process and known is None:
            # only a copier ready now takes a copy over (ready_copiers, best before the pause)
            if any(p not in self._ready for p in targets):
                self.ready_copiers([p for p in targets if p not in self._ready], inventory())
            defer = {p for p in targets if self._ready.get(p) is not None}
        plans: dict[int, int] = {}    # the deferred copies' plans, until their copier starts

        def prepare(pid: int) -> dict[str, Any]:
            fds = [] if in_process else data.for_prepare(pid, count)
            fp: tuple[int, int] | None = None
            intake: stream.Intake | None = None
            if pid in defer:
                plans[pid] = copier.new_plan()
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
                                      stream=intake.agent_fds() if intake else (),
                                      host_budget=(budgets or {}).get(pid),
                                      plan=plans.get(pid),
                                      # held past 200 only where it is kept: a leave-running
                                      # pause (a suspend would export them for nothing)
                                      bag=hold and pid in self._bags)
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
            measure = lambda: tree_size(root, allocated=True)  # noqa: E731
        start = time.monotonic()
        try:
            with self.progress.phase("agent-prepare", what, measure=measure):
                moved = _parallel(prepare, sorted(targets))
        except BaseException:
            for fd in plans.values():
                os.close(fd)
            self.drop_copiers()
            raise
        finally:
            if untouched:   # a rollback does not look for what was never there
                op.phase("agent-prepare", agents={p: t.to_json() for p, t in targets.items()
                                                  if p not in untouched})
        try:
            total = sum(r["bytes"] for r in moved.values())
            # only those asked to: an agent's word alone defers nothing (no plan, no copier)
            deferred = sorted(p for p in defer if moved[p].get("deferred"))
            self.progress.say(f"  agent-prepare: {_rate(total, time.monotonic() - start)}"
                              if not deferred else
                              f"  agent-prepare: {human_bytes(total)} held for the copier in "
                              f"{time.monotonic() - start:.2f} s (copied beside the dump)")
            op.phase("agent-detach")
            for pid in sorted(targets):
                held = moved[pid].pop("held", 0)   # not the checkpoint's: this operation's
                why = moved[pid].pop("hold_error", "")
                if hold and why:
                    self.progress.say(f"  PID {pid}: its GPU memory is copied back after the "
                                      f"dump, not held on the GPU ({why})")
                try:
                    with self._client(targets[pid], STATUS_TIMEOUT_S) as a:
                        if hold and held:
                            self._held[pid] = a.detach_hold(STATUS_TIMEOUT_S)
                        else:
                            a.detach()
                        if pid in deferred:
                            # the agent keeps its own descriptors until the copier, journaled,
                            # has them too: never this process alone (its death would free
                            # the only copy of the data)
                            targets[pid] = self._start_copier(op, targets, pid, data,
                                                              plans[pid])
                            if a.release_owed:
                                a.detach_release()
                except TorporError as e:
                    raise AgentError(f"PID {pid}: {e}", exit_code=e.exit_code) from e
        finally:
            for fd in plans.values():
                os.close(fd)
            self.drop_copiers()   # those whose agent copied after all
        if self._held:
            n = sum(map(len, self._held.values()))
            self.progress.say(f"  agent-detach: {n} allocation(s) of GPU memory held on the "
                              "GPU through the dump (mapped back, not copied, at resume)"
                              + (f"; {len(deferred)} copier(s) copying it into the data "
                                 "files meanwhile" if deferred else ""))
        for pid in deferred:
            moved[pid]["deferred"] = True
            self._planned[pid] = int(moved[pid].get("bytes", 0))
        return moved

    def _start_copier(self, op: Operation, targets: dict[int, AgentTarget], pid: int,
                      data: agent_data.DataDir, plan: int) -> AgentTarget:
        """pid's deferred copy under way (its ready copier handed it), journaled before this returns: a
        recovery waits for that copier before it reads the files. Its memory is held here
        (self._held): a copier that cannot start is a failure the rollback undoes."""
        t = targets[pid]
        held = self._held.get(pid) or []
        if not held:
            raise AgentError("its agent deferred its copy but handed over no memory")
        c = self._ready.get(pid)   # only a pid with a ready copier defers (_prepare_agents)
        if c is None:
            raise AgentError("its agent deferred a copy torpor did not ask it to defer")
        try:
            files = data.for_fill(pid, t.files)
        except OSError as e:   # the copier stays ready: drop_copiers lets it go
            raise AgentError(f"the data files for torpor-copier: {e}") from e
        del self._ready[pid]
        try:
            copier.hand(c, plan, files, held)
        except OSError as e:
            copier.discard(c)
            raise AgentError(f"handing torpor-copier its copy: {e}") from e
        finally:
            for fd in files:
                os.close(fd)
        self._copiers[pid] = c
        t = dataclasses.replace(t, copier=c.pid, copier_start=c.start or 0)
        targets[pid] = self._deferred[pid] = t
        op.phase("agent-detach", agents={p: x.to_json() for p, x in targets.items()})
        return t

    def wait_copier(self, t: AgentTarget) -> dict[str, Any] | None:
        """_wait_copier for a caller that has no resume to wait for it (its program's resume
        failed or never came): the copier's own reply, or {"ok": None} for one that ended
        without this torpor hearing it; None when there was none."""
        return self._wait_copier(t)

    def _wait_copier(self, t: AgentTarget) -> dict[str, Any] | None:
        """The deferred copy of t's program done (copier.wait), or None when it had none. Its
        reply, {"ok": False, "error"} when it failed: the files lack the GPU data then."""
        if t.pid in self._drains:
            return self._drains[t.pid]
        c = self._copiers.pop(t.pid, None)
        if c is None and t.copier:
            c = copier.Copier(t.copier, t.copier_start or None)
        if c is None:
            return None
        with self.progress.phase("agent-drain", f"the copy of PID {t.pid}'s GPU memory into "
                                 "its data files"):
            reply = copier.wait(c, self.cfg.agent_timeout_s)
        self._drains[t.pid] = reply
        return reply

    def take_copies(self) -> Copies:
        """The deferred copies, handed over with the held descriptors (take_held): this
        engine keeps none."""
        out = Copies(self._copiers, self._deferred, self._planned, self._drains)
        self._copiers, self._deferred, self._planned, self._drains = {}, {}, {}, {}
        return out

    def give_copies(self, c: Copies) -> None:
        """Take over another engine's deferred copies (take_copies): this engine's resume
        of their programs waits for their copiers, and drain_report says how they went."""
        self._copiers.update(c.copiers)
        self._deferred.update(c.targets)
        self._planned.update(c.planned)
        self._drains.update(c.drains)

    def wait_copiers(self) -> None:
        """Every deferred copy done (its copier's reply heard, or it gone): before the held
        descriptors of programs that will not resume are let go (release_held)."""
        for t in list(self._deferred.values()):
            try:
                self._wait_copier(t)
            except TorporError as e:   # StillCopying: it holds its own copies until done
                log.warning("PID %d: %s", t.pid, e)

    def drain_report(self, back: Mapping[int, Mapping[str, Any]]
                     ) -> tuple[dict[str, Any], dict[int, str]]:
        """How the deferred copies went, once their programs resumed (back: the resumes'
        replies, whose "drain" is the copier's): {"programs", "bytes", "seconds"} (the
        slowest, with its "setup_seconds" (the driver's imports and its buffers) and
        "copy_seconds" where it said them), {} when there were none; and pid -> why, for each that failed or copied
        other than the bytes its agent planned (its files lack the GPU data). One no resume
        waited for (the resume failed and its retry brought the program back, or the
        program ended) is waited for here."""
        if not self._deferred:
            return {}, {}
        drains: dict[int, dict[str, Any]] = {}
        for p, t in sorted(self._deferred.items()):
            d = (back.get(p) or {}).get("drain")
            drains[p] = dict(d) if d is not None else (self._wait_copier(t) or {})
        bad = {}
        for p, d in drains.items():
            if d.get("ok") is not True:
                bad[p] = str(d.get("error") or "its copier ended and said nothing")
            elif not _filled(d, self._planned.get(p, -2)):
                bad[p] = (f"it copied {d.get('bytes')} bytes where its agent planned "
                          f"{self._planned.get(p)}")
        slowest = max(drains.values(), key=lambda d: float(d.get("seconds", 0)))
        summary = {"programs": len(drains),
                   "bytes": sum(int(d.get("bytes", 0)) for d in drains.values()),
                   "seconds": round(float(slowest.get("seconds", 0)), 4)}
        for k in ("setup_seconds", "copy_seconds"):   # where the slowest one's time went
            if isinstance(slowest.get(k), (int, float)):
                summary[k] = round(float(slowest[k]), 4)
        return summary, bad

    def held_counts(self) -> dict[int, int]:
        """pid -> the allocations of its GPU memory held now (taken at detach, not yet resumed)."""
        return {p: len(fds) for p, fds in self._held.items() if fds}

    def take_held(self) -> dict[int, list[int]]:
        """The held descriptors, handed over: this engine keeps none. torpord keeps them with
        the open operation between its calls (sidecar/operations.py's OpenOp)."""
        held = {p: fds for p, fds in self._held.items() if fds}
        self._held = {}
        return held

    def give_held(self, held: Mapping[int, list[int]]) -> None:
        """Take over descriptors another engine held (take_held): this engine's resume of
        their programs maps them back, and release_held closes what none took."""
        for pid, fds in held.items():
            if fds:
                _close_all(self._held.pop(pid, []))   # never two sets for one program
                self._held[pid] = list(fds)

    def release_held(self, pids: Iterable[int] | None = None) -> None:
        """Close the held descriptors of pids (all: None): the memory they kept on the GPU is
        freed unless its program mapped it back. Those of a deferred copy whose copier did not
        say it filled the files are the only copy of the data: given back to its agent first
        (`hold N`), which keeps them for the next resume (a recovery's, or its deadline's)."""
        pids = list(self._held) if pids is None else list(pids)
        Copies(self._copiers, self._deferred, self._planned, self._drains).release(
            {p: self._held.pop(p, []) for p in pids})

    def _host_shares(self, sockets: Mapping[int, Path], budget: int | None
                     ) -> dict[int, int | None]:
        """Each agent's share of budget (the host memory their data may take): one agent has
        it all; several share it by how much each could move (their status), since none
        knows its zero parts before its prepare has scanned them."""
        if budget is None:
            return {p: None for p in sockets}
        budget = max(1, budget)
        if len(sockets) == 1:
            return {p: budget for p in sockets}
        movable = {}
        for pid, path in sockets.items():
            try:
                with self._client(AgentTarget(pid, path, Path(), pid, 1), STATUS_TIMEOUT_S) as a:
                    movable[pid] = max(0, int(a.status().get("movable_bytes", 0) or 0))
            except (TorporError, ValueError, TypeError):
                movable[pid] = 0   # its prepare says what is wrong with it
        total = sum(movable.values())
        return {p: max(1, budget * movable[p] // total if total else budget // len(sockets))
                for p in sockets}

    def _resume_one(self, t: AgentTarget, fill: bool = False) -> dict[str, Any]:
        """Give t's program the memory its agent moved; nothing when the agent holds none
        (never prepared, or resumed already: a rollback or recovery may come twice). fill:
        the parts its agent skipped are filled from the image store first (a rollback of the
        checkpoint that skipped them); otherwise data with skipped parts is refused: an index
        from an archive must not make this host's store hand out what it holds."""
        # first: the program must not write the memory a copier still reads, and the files
        # are the way back only once it is done
        drain = self._wait_copier(t)
        # None: another torpor's, ended (the agent checks every part it reads)
        ready = drain is None or drain.get("ok") is None or \
            _filled(drain, self._planned.get(t.pid))
        held = self._held.pop(t.pid, [])
        try:
            reply = self._resume_one_with(t, fill, held,
                                          drained=(drain is not None and ready) or t.sealed)
        except BaseException:
            if held and not ready:   # the files lack the data: the held memory is all there is
                self._held[t.pid], held = held, []
            raise
        finally:
            _close_all(held)   # mapped back by the agent's own import, or no longer wanted
        return reply if drain is None else {**reply, "drain": drain}

    def _resume_one_with(self, t: AgentTarget, fill: bool, held: list[int],
                         drained: bool = False) -> dict[str, Any]:
        with self._client(t, STATUS_TIMEOUT_S) as a:
            if a.state() == "running":
                return {"bytes": 0, "seconds": 0.0, ALREADY_RUNNING: True}
            if not t.files or t.packed:
                _close_all(held)   # before a resume that copies: never the memory twice
            if t.in_process:
                return a.resume(None, self.cfg.agent_timeout_s)
            if t.packed:
                return self._resume_streamed(a, t, self._packed_sources(t))
            data = agent_data.DataDir(t.data)
            if fill and (data.path(t.name) / agent_data.STREAMED).exists():
                _close_all(held)
                return self._resume_streamed(a, t, self._own_sources(t))
            if fill:
                self._fill_skipped(t)
            elif fingerprints.has_skipped(data.path(t.name)):
                raise CorruptCheckpointError(
                    f"the GPU data in {t.data}/{t.name} lacks parts its agent skipped because "
                    "the image store had them, and only the checkpoint that skipped them fills "
                    "them in (its pack, or its rollback): refused")
            fds = agent_data.DataDir(t.data).for_resume(t.name, t.files)
            try:
                return a.resume(fds, self.cfg.agent_timeout_s, held=held, drained=drained)
            finally:
                for fd in fds:
                    os.close(fd)

    def _resume_streamed(self, a: AgentClient, t: AgentTarget,
                         sources: tuple[Store, list[stream.Source]]) -> dict[str, Any]:
        """t's memory back through the image store's stream: its agent's `resume stream`
        while torpor feeds it the parts from the store."""
        store, parts = sources
        ring = stream.Ring()
        stats = stream.FeedStats()
        try:
            with concurrent.futures.ThreadPoolExecutor(1, "torpor-feed") as ex:
                fed = ex.submit(stream.feed, store, ring, parts, f"GPU data of PID {t.pid}",
                                stats)
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
        return {**reply, "streamed": True, "fed": dataclasses.asdict(stats)}

    def _packed_sources(self, t: AgentTarget) -> tuple[Store, list[stream.Source]]:
        """The parts of t's data files in the packed checkpoint t.packed names (its chunks
        are in this host's store: the restore's unpack brought in any it lacked). The packed
        doc is the directory's (untrusted): the chunks it names verify by sha256, but those
        the store's own snapshot of that checkpoint holds with the fingerprint this host
        recorded when it streamed them in (fingerprints.own_fingerprints says when, and why
        the owner need not be the restoring program's)."""
        doc = images.packed_doc(Path(t.packed))
        prog = f"{agent_data.DATA_DIR}/{t.name}"
        store = Store(self.cfg.store_dir)
        trusted = fingerprints.own_fingerprints(store, doc, stream.data_rels(prog, t.files))
        return store, stream.sources(doc, prog, t.files, trusted)

    def _own_sources(self, t: AgentTarget) -> tuple[Store, list[stream.Source]]:
        """The parts of t's data that this operation's own prepare streamed into the store
        (its stream record), and those its agent skipped (its owner's fingerprints). A
        rollback: the stream record is this operation's own, written by its Intake in the
        operation's data directory (0700, made by torpor: agent_data.DataDir; the agent only
        ever gets fds of the data files), so a streamed part verifies by the fingerprint the
        record holds (the intake's, of the bytes it named). A record the program could have
        written would gain it nothing by that either: it names the chunks fed, so it could
        name any chunk anyway, and a fingerprint only decides whether the bytes stored under
        a name are accepted. Skipped parts verify by sha256 (the agent's fold is no check)."""
        store = Store(self.cfg.store_dir)
        prog = agent_data.DataDir(t.data).path(t.name)
        sizes = [os.path.getsize(prog / agent_data.file_name(k)) for k in range(t.files)]
        with store.backend.lock(False, store.lock_timeout):
            return store, [stream.Source(p.file, p.offset, ref,
                                         p.fp if isinstance(p, fingerprints.Streamed) else None)
                           for p, ref in fingerprints.holes(store, prog, sizes, t.owner)]

    def _fill_skipped(self, t: AgentTarget) -> None:
        """The parts t's agent skipped (the image store had them) written into its data files
        from the store (config store_dir), before anything reads them back."""
        data = agent_data.DataDir(t.data)
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
                        skip: Iterable[int] = (), given_back: set[int] | None = None
                        ) -> list[str]:
        """Every live program in targets (but skip) gets the memory its agent moved back;
        returns what failed. given_back: filled with the pids that took memory back (not
        those already running with it)."""
        skipped = set(skip)
        problems: list[str] = []

        def resume(pid: int) -> None:
            try:
                if not self._resume_one(targets[pid], fill=True).get(ALREADY_RUNNING) and \
                        given_back is not None:
                    given_back.add(pid)
            except (TorporError, OSError) as e:
                problems.append(f"PID {pid}: agent resume failed ({e}); its GPU memory stays "
                                f"{targets[pid].where()}")
        _parallel(resume, sorted(p for p in targets if p not in skipped and procs.alive(p)))
        return problems

