"""torpord's operation table: the checkpoints left open between LockAndCheckpoint and the
Finish, Rollback or RestoreAndUnlock that ends them.

An open operation holds its journal entry and PID locks (OpenOp.op). Exactly one party ends
it: take() removes it from the table first. The reaper thread rolls back an operation not ended
within op_timeout_s (a monotonic deadline) or whose caller died (OpenOp.owner), and every
RECOVERY_PERIOD_S retries what dead torpor commands left (engine.recover()). shutdown() waits
for the calls in flight (counted by call()), stops the reaper and rolls back what is left open.
A rollback (flows/container.py's roll_back) that fails releases the journal entry without
closing it: recovery retries it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Callable, Iterator

from .. import procs
from ..engine import Copies, Engine
from ..errors import NotFoundError, SidecarError, TorporError, UsageError
from ..flows import container
from ..journal import Operation

log = logging.getLogger("torpor.sidecar")

DEFAULT_OP_TIMEOUT_S = 600.0
RECOVERY_PERIOD_S = 30.0   # how often journal orphans (dead torpor commands) are rolled back


@dataclasses.dataclass
class OpenOp:
    """One checkpoint waiting for its dump: its journal operation, the PIDs it holds and when it
    is rolled back by itself."""
    op: Operation
    pids: list[int]
    cuda_pids: list[int]
    container_id: str
    deadline: float   # wall clock, only reported to clients
    expires: float    # time.monotonic() of the automatic rollback: a clock step cannot move it
    owner: tuple[int, int | None] | None = None  # (pid, start time) of the caller, if given
    # the GPU memory its agents hold by descriptors through the dump (Engine.take_held), by
    # pid: the operation's restore maps it back; every other end closes what is left
    held: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # its deferred copies (Engine.take_copies): the copiers filling a staging beside the
    # dump, which the end of the operation waits for before it lets the memory go
    copies: Copies = dataclasses.field(default_factory=Copies)

    def release_held(self) -> None:
        """Let go of what is held (the programs get their memory from the staged files); the
        memory of a deferred copy not filled goes back to its agent (Copies.release)."""
        held, self.held = self.held, {}
        self.copies.release(held)

    @contextlib.contextmanager
    def ending(self, engine_of: Callable[[], Engine], keep: bool = True) -> Iterator[Engine]:
        """The engine of the call that ends this operation, given what it holds (keep False:
        closed first, the programs copy from the files): its resume maps the memory back,
        and whatever none took is closed at the end, as is everything should no engine be
        made."""
        try:
            engine = engine_of()
            engine.give_copies(self.copies)   # a copier still copying is never killed
            self.copies = Copies()
            if not keep:   # the memory goes: once no copier reads it (the files have it)
                engine.give_held(self.held)
                self.held = {}
                engine.wait_copiers()
                engine.release_held()
            engine.give_held(self.held)
            self.held = {}
            try:
                yield engine
            finally:
                engine.release_held()
        finally:
            self.release_held()

    def owner_gone(self) -> bool:
        """The caller died without ending the operation, and no dump holds the processes
        (a dump still running finishes or fails by itself first)."""
        if self.owner is None or procs.start_time(self.owner[0]) == self.owner[1]:
            return False
        return not self.dumping()

    def dumping(self) -> bool:
        """A dump (CRIU) holds its processes now: a rollback would give them their GPU back
        under it, and the dump would save a program half checkpointed. It ends or fails by
        itself first."""
        return any(procs.traced(p) for p in self.cuda_pids)

    @property
    def id(self) -> str:
        return self.op.entry.id


class OperationTable:
    """The open operations, their timeout and their rollback. engine() makes a fresh Engine."""

    def __init__(self, engine: Callable[[], Engine], op_timeout_s: float = DEFAULT_OP_TIMEOUT_S):
        self.engine = engine
        self.op_timeout_s = op_timeout_s
        self._ops: dict[str, OpenOp] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)   # _in_flight dropped
        self._in_flight = 0
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # -- calls in flight --------------------------------------------------------------------------
    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Count a handler in flight: shutdown() waits for it, as gRPC does not (a cancelled
        call's handler runs on after server.stop())."""
        with self._idle:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    # -- the table --------------------------------------------------------------------------------
    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def add(self, o: OpenOp) -> None:
        """Open o; SidecarError once stopping (shutdown() may have emptied the table already)."""
        with self._lock:
            if self._stop.is_set():
                raise SidecarError("torpord is shutting down")
            self._ops[o.id] = o

    def get(self, op_id: str) -> OpenOp | None:
        with self._lock:
            return self._ops.get(op_id)

    def take(self, op_id: str) -> OpenOp:
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

    # -- the reaper -------------------------------------------------------------------------------
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
            self.reap(time.monotonic())

    def reap(self, now: float) -> list[OpenOp]:
        """Roll back the operations expired at monotonic time now or whose caller died; the
        ones taken out of the table. One whose dump still runs waits for its end."""
        with self._lock:
            expired = [o for o in self._ops.values() if o.expires <= now and not o.dumping()]
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
                self.rollback(o)
            except TorporError as e:
                log.error("automatic rollback of %s: %s", o.id, e.line())
            except Exception:
                log.exception("automatic rollback of %s failed", o.id)
        return expired + orphaned

    # -- the end ----------------------------------------------------------------------------------
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
                self.rollback(o)
            except Exception as e:
                log.error("rollback of %s at shutdown: %s", o.id, e)

    def rollback(self, o: OpenOp) -> container.OperationResult:
        """Bring o's live CUDA processes (and their agents) back to RUNNING and close o
        (flows/container.py's roll_back), through the memory o holds (no copy back)."""
        with o.ending(self.engine) as engine:
            return container.roll_back(engine, o.op, o.cuda_pids)
