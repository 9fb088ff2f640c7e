"""The engine's recovery: what a dead torpor left (journal.py) is rolled back, finished or
cleared by the next torpor command or torpord. Recovery is mixed into Engine."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Mapping

from .. import agent_data, criu, interrupts, manifest, procs, store_packing
from ..errors import (BusyError, DamagedRecordsError)
from ..journal import Entry
from ..progress import human_bytes
from ..store import fingerprints, images
from ..store.store import Store

from .agents import targets_of

log = logging.getLogger("torpor.engine")

CRIU_WAIT_S = 10.0   # how long recovery waits for a CRIU an interrupted operation left running


# a container's staged checkpoint whose recovery is done but for its staging, which another
# operation (torpord's) still names: the entry stays until that one has ended
STAGING_LEFT = "staging-left"


class Recovery:
    """Engine's recovery of dead operations."""

    # -- recovery -------------------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Roll back what dead torpor processes left locked or checkpointed."""
        messages = []
        # a staged checkpoint's entry last: the operation of torpord that names its staging,
        # if dead too, is recovered first, and then the staging goes in this same pass
        found = sorted(self.journal.orphans(),
                       key=lambda o: o[0].phase in ("stage", STAGING_LEFT))
        for entry, fd in found:
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
        if entry.phase == STAGING_LEFT:
            return self._staging_left(entry, fd)
        if entry.kind == "restore" and entry.phase == "container-restore":
            keep, said = self._interrupted_container_restore(entry)
            if keep:
                os.close(fd)    # the runtime or torpord is still at it: look again later
                return said
        if entry.phase == "dump" and entry.images_dir:
            keep, said = self._interrupted_dump(entry)
            if keep:
                os.close(fd)    # CRIU is still dumping: the entry stays for the next look
                return said
        if entry.kind == "restore" and entry.phase == "restore" and entry.work_dir:
            keep, said = self._interrupted_restore(entry)
            if keep:
                os.close(fd)    # CRIU is still at it: the entry stays for the next look
                return said
        # suspended on purpose: not ours to resume, unless resuming them is what died
        suspended = _suspended_by_then(self.journal.suspended(), entry) \
            if entry.kind != "resume" else set()
        live = [p for p in entry.pids
                if procs.alive(p) and entry.same_process(p) and p not in suspended]
        try:
            claims = self.journal.claim(live)
        except BusyError:
            os.close(fd)  # a live operation owns these processes now; not ours to touch
            return []
        agents = {p: t for p, t in targets_of(entry.agents).items() if p in live}
        if entry.kind == "resume":
            # a resume killed before it wrote its agents: they are in the suspend records
            # (what resume itself reads), and the data must go back before the records go
            for p, r in self.journal.suspended().items():
                for t in targets_of(r.get("agents", {})).values():
                    if p in live and t.pid == p:
                        agents.setdefault(p, t)
        given_back: set[int] = set()   # the agents that took memory back here
        try:
            with interrupts.deferred():
                problems = self.rollback(live, entry.gpu_map or None, agents,
                                         given_back=given_back) if live else []
        finally:
            for c in claims:
                os.close(c)
        if problems:
            os.close(fd)
            return [f"could not recover interrupted {entry.kind} {entry.id}: " + "; ".join(problems)]
        messages = said
        for p in set(live) & set(self.journal.suspended()) - suspended:
            if entry.kind != "resume":     # a resume's records go in _finish_resume
                self.journal.clear_suspended(p)   # stale, and the program runs again
        if live:
            messages.append(f"recovered {', '.join(map(str, live))} left by an interrupted "
                            f"{entry.kind} (phase {entry.phase}): running again")
        if given_back:
            messages.append(f"gave {', '.join(map(str, sorted(given_back)))} back the GPU memory "
                            f"their agent had moved "
                            + (f"to {entry.data_root}" if entry.data_root
                               else "into the program's host memory"))
        keep = False
        if entry.scratch and entry.data_root:
            agent_data.DataDir(Path(entry.data_root)).remove()
        elif entry.phase == "stage" and entry.data_root:
            # a container's staged checkpoint (runtime/pause.py) whose torpor-runtime died
            # before its write-out: nothing but this entry removes the staging. While
            # torpord's operation still names it (its agents' data may come back from there)
            # it stays, and so does this entry, its work but that done (_staging_left)
            if self.journal.names_data(entry.data_root, but=entry.id):
                entry.phase, keep = STAGING_LEFT, True
            else:
                agent_data.DataDir(Path(entry.data_root)).remove()
        if entry.kind == "resume":
            messages += self._finish_resume(live)
        if entry.kind == "pack":
            messages += store_packing.finish_interrupted(self.cfg, entry)
        elif entry.images_dir:
            messages += self._finish_images(Path(entry.images_dir), program_alive=bool(live))
            messages += self._fill_images(Path(entry.images_dir), entry)
        if keep:
            self.journal.keep(entry, fd)
        else:
            self.journal.forget(entry, fd)
        return messages

    def _staging_left(self, entry: Entry, fd: int) -> list[str]:
        """A staged checkpoint's entry recovered but for its staging, which another
        operation still named: removed once none does, and the entry with it."""
        if entry.data_root and self.journal.names_data(entry.data_root, but=entry.id):
            os.close(fd)
            return []
        there = bool(entry.data_root) and os.path.lexists(entry.data_root)
        if there:
            agent_data.DataDir(Path(entry.data_root)).remove()
        self.journal.forget(entry, fd)
        return [f"removed the staged GPU data of interrupted {entry.kind} {entry.id}"] \
            if there else []

    def _finish_resume(self, pids: list[int]) -> list[str]:
        """A resume whose torpor died: its processes run again (the rollback above), so they
        are suspended no more: their records and the host copies of their GPU memory go."""
        records = {p: r for p, r in self.journal.suspended().items() if p in pids}
        for root in {r["data_root"] for r in records.values() if r.get("data_root")}:
            agent_data.DataDir(Path(root)).remove(background=True)
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

        def restoring() -> list[int]:   # not the tasks it forked to become the image's PIDs
            return [p for p in criu.restoring(work) if p not in entry.image_pids]
        deadline = time.monotonic() + wait_s
        while restoring() and time.monotonic() < deadline:
            time.sleep(0.1)
        running = restoring()
        if running:
            return True, [f"an interrupted restore ({entry.id}) is still being finished by "
                          f"CRIU (PID {running[0]}): look again when it ends"]
        if criu.restore_finished(work):
            shutil.rmtree(work, ignore_errors=True)
            return False, [f"finished the restore ({entry.id}) an interrupted torpor left to "
                           "CRIU"]
        frozen = self.stop_half_restored(entry)
        return False, [f"stopped {len(frozen)} half-restored process(es) "
                       f"({', '.join(map(str, frozen))}) that an interrupted restore "
                       f"({entry.id}) left frozen; the checkpoint is unchanged: restore it "
                       "again"] if frozen else []

    def stop_half_restored(self, entry: Entry) -> list[int]:
        """A restore whose CRIU ended without finishing (killed, or died with torpor): the
        processes it had made so far are frozen in its restorer for good (CRIU cleans up a
        restore that fails, not one that is killed). They are stopped, CRIU's work directory
        goes, and the checkpoint, which a restore never changes, stays as it was. Returns the
        PIDs stopped."""
        frozen = [p for p in entry.image_pids
                  if (t := procs.started_at(p)) is not None and t >= entry.started - 1.0]
        for p in frozen:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0   # gone before anyone looks (or restores those PIDs)
        while any(procs.alive(p) for p in frozen) and time.monotonic() < deadline:
            time.sleep(0.02)
        if entry.work_dir:
            shutil.rmtree(entry.work_dir, ignore_errors=True)
        entry.pids = []    # none of them is a program to give its GPU back
        return frozen

    def _interrupted_dump(self, entry: Entry) -> tuple[bool, list[str]]:
        """A checkpoint whose torpor died while CRIU dumped. CRIU outlives torpor
        (criu.run_criu): nothing may touch the tree until it has ended, and its outcome
        decides the rest (a finished dump is sealed, a failed one's tree runs on and is rolled
        back: _finish_images). A CRIU still running gets wait_s to end, else the entry is kept;
        one stopped by a signal is let go on (it holds the tree frozen while stopped). Returns
        (keep the entry, what to say)."""
        images, wait_s = Path(entry.images_dir), CRIU_WAIT_S

        def dumping() -> list[int]:
            return [p for p in criu.dumping(images)   # (started_at is good to a second)
                    if (t := procs.started_at(p)) is not None and t >= entry.started - 2.0]
        deadline = time.monotonic() + wait_s
        while (running := dumping()) and time.monotonic() < deadline:
            for p in running:
                if procs.stopped(p):
                    try:
                        os.kill(p, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            time.sleep(0.1)
        if running:
            return True, [f"an interrupted checkpoint ({entry.id}) is still being dumped by "
                          f"CRIU (PID {running[0]}) into {images}: look again when it ends"]
        criu.dump_output(images).unlink(missing_ok=True)
        return False, []

    def _interrupted_container_restore(self, entry: Entry, wait_s: float = 10.0
                                       ) -> tuple[bool, list[str]]:
        """A container restore whose torpor-runtime died (runtime/restore.py's entry). Its
        engine took the restore as failed (conmon waits for the container to end before it
        says so) and its CUDA processes would stay CHECKPOINTED for good: once the real runtime,
        which outlives torpor-runtime, has finished (given wait_s, else the entry is kept), the
        container it restored is stopped, unless torpord is restoring its GPU state right now
        (then the entry is kept for the next look). The checkpoint is unchanged: restore it
        again. Returns (keep the entry, what to say)."""
        c = entry.container
        cid, argv = str(c.get("id", "")), [str(a) for a in c.get("argv") or []]

        def runtimes() -> list[int]:
            return [p for p in procs.find_argv(*argv)
                    if (t := procs.started_at(p)) is not None and t >= entry.started - 1.0] \
                if argv else []
        deadline = time.monotonic() + wait_s
        while runtimes() and time.monotonic() < deadline:
            time.sleep(0.1)
        if runtimes():
            return True, [f"the interrupted restore of container {cid} ({entry.id}) is still "
                          f"being run by {Path(argv[0]).name} (PID {runtimes()[0]}): look "
                          "again when it ends"]
        pid = _container_pid(c)
        if pid is None or (t := procs.started_at(pid)) is None or t < entry.started - 1.0:
            entry.pids = []
            return False, []        # nothing was restored (or it is gone already)
        try:
            claims = self.journal.claim([pid])
        except BusyError:
            return True, []         # torpord's RestoreAndUnlock holds it: its own entry
        try:
            os.kill(pid, signal.SIGKILL)   # the container's init: its PID namespace goes along
            deadline = time.monotonic() + 5.0
            while procs.alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
        except ProcessLookupError:
            pass
        finally:
            for fd in claims:
                os.close(fd)
        entry.pids = []
        return False, [f"stopped container {cid} (PID {pid}), which an interrupted restore "
                       f"({entry.id}) had restored but not given its GPU state back; the "
                       "checkpoint is unchanged: restore it again"]

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
            filled = store_packing.stand_alone(Store(self.cfg.store_dir), images_dir,
                                         next(iter(owners), ""), self.cfg.checksums)
        except DamagedRecordsError as e:
            return [f"the checkpoint in {images_dir}, which an interrupted {entry.kind} left "
                    "unpacked: " + store_packing.give_up(images_dir, e)]
        return [f"filled {human_bytes(filled)} of GPU data into the checkpoint in {images_dir} "
                "from the image store: its torpor died before packing it"]

    def _finish_images(self, images_dir: Path, program_alive: bool) -> list[str]:
        """An interrupted checkpoint's images: seal them if CRIU finished (or ended the
        program after writing them whole: they are all that is left of it), else clear them;
        a --leave-running one whose GPU data was not all written out (flows/writeout.py) is
        marked damaged, and so are the half-written images of a program that died during its
        dump (never sealed: a restore of them could only fail)."""
        from ..flows import writeout   # flows build on the engine: imported when needed
        finished = manifest.dump_succeeded(images_dir)
        if (finished or not program_alive) and writeout.abandoned_by_dead(images_dir):
            return [f"marked the checkpoint in {images_dir} damaged: its torpor died before "
                    "the GPU data of the program it left running was written out"]
        if not (images_dir / manifest.DRAFT).exists():
            return []
        if finished or (not program_alive and manifest.images_whole(images_dir)):
            manifest.seal(images_dir, self.cfg.checksums)
            return [f"sealed the checkpoint in {images_dir} that an interrupted torpor had "
                    "dumped but not sealed"]
        if not program_alive:
            manifest.mark_damaged(images_dir, "the program ended during its dump, before CRIU "
                                  "had written its images whole (see dump.log); nothing can "
                                  "restore them")
            (images_dir / manifest.DRAFT).unlink(missing_ok=True)
            return [f"marked the checkpoint in {images_dir} damaged: its program ended during "
                    "an interrupted dump, before CRIU had written its images whole"]
        manifest.clear_partial(images_dir)
        return [f"removed the partial images of an interrupted dump from {images_dir}"]


def _container_pid(c: Mapping) -> int | None:
    """The host PID of a container the runtime restored: its pid file, else its state."""
    try:
        if c.get("pid_file"):
            text = Path(str(c["pid_file"])).read_text().strip()
            return int(text) if text.isdigit() and int(text) > 1 else None
        out = subprocess.run([str(a) for a in c.get("state_argv") or []], capture_output=True,
                             text=True, timeout=30)
        pid = int(json.loads(out.stdout).get("pid") or 0) if out.returncode == 0 else 0
        return pid if pid > 1 else None
    except (OSError, ValueError, AttributeError, subprocess.SubprocessError):
        return None


def _suspended_by_then(records: Mapping[int, Mapping], entry: Entry) -> set[int]:
    """The PIDs suspended on purpose as far as entry goes (a resume's, which recovery
    finishes, are not asked for): only those suspended since it began (a suspend that died after recording them). An older record is stale (a resume
    died between its unlock and clearing it): the operation found the program RUNNING, and
    a lock it left must be rolled back, not kept for a suspend nobody asked for."""
    out = set()
    for pid, r in records.items():
        try:
            since = float(r.get("since", 0))
        except (TypeError, ValueError, AttributeError):
            since = 0.0
        if since >= entry.started:
            out.add(pid)
    return out

