"""The engine: lock / checkpoint / restore / unlock of a set of host PIDs, with rollback.

Every driver phase runs inside a journal Operation (journal.py). If any phase fails, or the
operator interrupts, every process is rolled back to RUNNING before the error is raised; if
torpor itself dies, the next torpor (or torpord) finds the journal entry and rolls back.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from pathlib import Path
from typing import Callable, Iterable, Mapping

from . import interrupts, manifest, procs
from .config import Config
from .driver import Driver, DriverError, ProcessState
from .errors import BusyError, ExitCode, NoDriverError, RolledBackError, TorporError
from .journal import Entry, Journal, Operation
from .progress import Progress

log = logging.getLogger(__name__)

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


def _parallel(fn: Callable[[int], None], pids: list[int]) -> None:
    """Run fn on every pid at once (ctypes drops the GIL); raise the first failure after all end."""
    if len(pids) <= 1:
        for pid in pids:
            fn(pid)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(pids)) as pool:
        futures = [pool.submit(fn, pid) for pid in pids]
        errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]  # type: ignore[misc]


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

    def lock_and_checkpoint(self, op: Operation, pids: list[int]) -> None:
        """RUNNING -> CHECKPOINTED for every pid; on any failure all are rolled back first."""
        if not pids:
            return
        drv = self.driver
        timeout_ms = int(self.cfg.lock_timeout_s * 1000)
        n = f"{len(pids)} CUDA process{'es' if len(pids) > 1 else ''} ({', '.join(map(str, pids))})"
        try:
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

    def restore_and_unlock(self, op: Operation, pids: list[int],
                           gpu_map: Mapping[str, str] | None = None) -> None:
        """CHECKPOINTED -> RUNNING for every pid. Raises DriverError; the caller decides."""
        if not pids:
            return
        drv = self.driver
        n = f"{len(pids)} CUDA process{'es' if len(pids) > 1 else ''}"
        op.phase("gpu-restore", gpu_map=dict(gpu_map or {}))
        remap = ", ".join(f"{o} -> {m}" for o, m in (gpu_map or {}).items() if o != m)
        with self.progress.phase("gpu-restore", n + (f", remapped {remap}" if remap else "")):
            _parallel(lambda pid: drv.restore(pid, gpu_map), pids)
        op.phase("unlock")
        with self.progress.phase("unlock", n):
            for pid in pids:
                drv.unlock(pid)

    def rollback(self, pids: Iterable[int], gpu_map: Mapping[str, str] | None = None) -> list[str]:
        """Bring every live pid back to RUNNING; returns what could not be done."""
        problems = []
        drv = self.driver_or_none()
        if drv is None:
            return []  # no driver: nothing can be locked or checkpointed
        for pid in pids:
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
        return problems

    def fail(self, op: Operation, pids: list[int], error: BaseException, during: str) -> None:
        """A phase failed: roll every pid back to RUNNING, close op, raise RolledBackError.
        If the rollback itself fails, the journal entry stays for the next torpor to retry."""
        with interrupts.deferred():  # a second Ctrl-C must not stop the rollback
            problems = self.rollback(pids)
        if problems:
            raise TorporError(f"{during} failed ({_describe(error)}) and rollback failed: "
                              + "; ".join(problems),
                              hint="run 'torpor ps' and 'torpor resume PID'") from error
        op.close()
        code = ExitCode.INTERRUPTED if isinstance(error, KeyboardInterrupt) else None
        raise RolledBackError(f"{during} failed: {_describe(error)}; "
                              f"{len(pids)} process(es) rolled back to running",
                              exit_code=code) from error

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
        suspended = self.journal.suspended()  # suspended on purpose: not ours to resume
        live = [p for p in entry.pids
                if procs.alive(p) and entry.same_process(p) and p not in suspended]
        try:
            claims = self.journal.claim(live)
        except BusyError:
            os.close(fd)  # a live operation owns these processes now; not ours to touch
            return []
        try:
            with interrupts.deferred():
                problems = self.rollback(live, entry.gpu_map or None) if live else []
        finally:
            for c in claims:
                os.close(c)
        if problems:
            os.close(fd)
            return [f"could not recover interrupted {entry.kind} {entry.id}: " + "; ".join(problems)]
        messages = []
        if live:
            messages.append(f"recovered {', '.join(map(str, live))} left by an interrupted "
                            f"{entry.kind} (phase {entry.phase}): running again")
        if entry.images_dir:
            messages += self._finish_images(Path(entry.images_dir), program_alive=bool(live))
        self.journal.forget(entry, fd)
        return messages

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
