"""Checkpoint and restore of bare (non-container) process trees: engine + CRIU + manifest.

checkpoint: [agent-prepare -> agent-detach ->] lock -> checkpoint -> dump -> seal
            (any failure before seal: rolled back)
restore:    verify -> preflight -> restore -> gpu-restore -> unlock [-> agent-resume]
suspend:    [agent-prepare -> agent-detach ->] lock -> checkpoint, and the process stays, its
            GPU memory released
resume:     gpu-restore -> unlock [-> agent-resume]

The agent phases are those of programs run under the in-process agent (`torpor run`): their
GPU memory goes into <images dir>/torpor-gpu/ (bulk.py), or for a suspend into a private
directory under suspend_dir (/dev/shm: host memory), removed at resume; with
suspend_in_process the agent keeps it in the program's own memory instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Iterable

from . import (__version__, agent, bulk, criu, gpus, interrupts, manifest, packing, placement,
               procs)
from . import manifest_types as mt
from .driver import ProcessState
from .engine import Engine, restore_targets, targets_of
from .errors import (BusyError, CorruptCheckpointError, CriuError, NoDriverError, NotFoundError,
                     PreflightError, RolledBackError, TorporError, UsageError)
from .files import private_dir, require_trusted_location, tree_size
from .progress import human_bytes
from .store import Store, fingerprints, images
from .store.backend import check_snapshot_name


def _claim_images_dir(images_dir: Path) -> int:
    """An empty private (0700) directory for the images, in a place only root can change,
    flock-ed so that two checkpoints never share it. Returns the locked directory fd."""
    require_trusted_location(images_dir, "images directory")
    if images_dir.is_symlink():
        raise UsageError(f"{images_dir} is a symbolic link: give the directory itself")
    if images_dir.exists() and not images_dir.is_dir():
        raise UsageError(f"{images_dir} exists and is not a directory")
    images_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        images_dir.mkdir(mode=0o700)
    except FileExistsError:
        pass
    fd = os.open(images_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BusyError(f"another torpor is checkpointing into {images_dir}") from None
        if os.listdir(fd):
            raise UsageError(f"{images_dir} is not empty: give a new or empty directory")
        os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _require_running(states: dict[int, ProcessState]) -> None:
    for p, s in states.items():
        if s != ProcessState.RUNNING:
            raise UsageError(f"PID {p} is already {s.name} on the GPU, not RUNNING"
                             + (": 'torpor resume' it first" if s == ProcessState.CHECKPOINTED
                                else ""))


def _gpu_view(engine: Engine, tree: list[int]) -> tuple[dict[int, ProcessState], gpus.Inventory | None]:
    states = engine.cuda_states(tree)
    if not states:
        return states, None
    try:
        inv = gpus.discover()
    except NoDriverError:
        inv = None
    return states, inv


def checkpoint(engine: Engine, pid: int, images_dir: Path, *, leave_running: bool = False,
               shell_job: bool | None = None, store: Store | None = None,
               owner: str = "", known: fingerprints.Known | None = None) -> dict[str, Any]:
    """Checkpoint the process tree rooted at pid into images_dir; returns the manifest.
    store: the image store it goes into next (store_checkpoint; hold its lock, shared, from
    before this call until that one ends), known: owner's fingerprints there: agents skip
    the GPU data owner's snapshots have already (store/fingerprints.py)."""
    cfg, progress = engine.cfg, engine.progress
    procs.require(pid)
    tool = criu.find(cfg)                       # before anything touches the program
    tree = procs.tree(pid)
    comms = {p: procs.comm(p) for p in tree}  # the dump ends them; ask now
    with contextlib.ExitStack() as stack, \
            engine.begin("checkpoint", tree) as op:  # BusyError while another op holds them
        states, inv = _gpu_view(engine, tree)
        _require_running(states)
        cuda_pids = sorted(states)
        shell_job = procs.needs_shell_job(pid) if shell_job is None else shell_job
        dir_fd = _claim_images_dir(images_dir)
        stack.callback(os.close, dir_fd)
        free = shutil.disk_usage(images_dir).free
        estimate = sum(procs.rss_bytes(p) for p in tree) + (
            sum(inv.memory_of(p) for p in cuda_pids) if inv else 0)
        if estimate > free:
            progress.say(f"warning: {images_dir} has {human_bytes(free)} free; the checkpoint "
                         f"may need up to {human_bytes(estimate)}")
        if not cuda_pids:
            progress.say(f"no CUDA state in process tree {pid} ({len(tree)} processes): "
                         "GPU phases skipped")
        # The draft (all but the file table) lets the next torpor seal these images should
        # this one die after the dump, when the program is gone and the images are all of it.
        # Written before any driver call: a failure here needs no rollback.
        draft = _manifest(tool, inv, engine, comms, states, pid, shell_job, leave_running, {})
        manifest.write_draft(images_dir, draft)
        try:
            # Left running, the program needs its data back at once: its agent copies it all
            # (a skipped part would be filled from the store first, slower than the copy),
            # and the fingerprints spare the pack reading what the store has.
            skip = (set() if leave_running else known.gpu) \
                if store is not None and known is not None and owner \
                and fingerprints.usable(store) else None
            # A program that ends with its checkpoint has its GPU data streamed straight into
            # the store (store/stream.py); one left running keeps the shorter pause of data
            # files in the page cache, read back at once, and packed while it runs.
            stream_into = store if skip is not None and cfg.store_stream \
                and not leave_running else None
            moved = engine.lock_and_checkpoint(op, cuda_pids,
                                               data=bulk.DataDir(images_dir / bulk.DATA_DIR),
                                               known_fingerprints=skip, owner=owner,
                                               stream_into=stream_into)
        except RolledBackError:
            (images_dir / manifest.DRAFT).unlink(missing_ok=True)  # the directory is reusable
            raise
        agents = targets_of(op.entry.agents)
        if moved:   # before the dump: a recovery seals what the draft says
            draft["agent"] = {str(p): r for p, r in moved.items()}
            try:
                manifest.write_draft(images_dir, draft)
            except BaseException as e:
                engine.fail(op, cuda_pids, e, during="manifest")
        stack.enter_context(interrupts.deferred())  # from here on, Ctrl-C waits for the end
        dump_error: BaseException | None = None
        try:
            op.phase("dump", images_dir=str(images_dir))
            with progress.phase("dump", f"CRIU {tool.version_text}, {len(tree)} process(es) "
                                f"to {images_dir}", measure=lambda: tree_size(images_dir)):
                criu.dump(tool, cfg, pid, images_dir, leave_running=leave_running,
                          shell_job=shell_job, tcp_established=cfg.tcp_established)
        except BaseException as e:
            if not manifest.dump_succeeded(images_dir) and any(procs.alive(p) for p in tree):
                manifest.clear_partial(images_dir, keep=(bulk.DATA_DIR,))  # until resumed
                engine.fail(op, cuda_pids, e, during="dump")
            dump_error = e  # the program is gone: its images are all that is left of it
        if leave_running and cuda_pids:
            try:
                engine.restore_and_unlock(op, cuda_pids, agents=agents)
            except TorporError:
                if engine.rollback(cuda_pids, agents=agents):  # one more try, from where it got
                    raise
        op.phase("seal")
        # into the store: its sha256 names every chunk, and a pack that fails adds them
        checksums = cfg.checksums and store is None
        with progress.phase("seal", "manifest and checksums" if checksums else "manifest"):
            m = manifest.seal(images_dir, checksums, progress.timings)
        if dump_error is not None and not manifest.dump_succeeded(images_dir):
            raise TorporError(f"criu dump failed after it ended the program ({dump_error}); "
                              f"its images in {images_dir} were kept and sealed, but may be "
                              "incomplete")
    return m


def _manifest(tool: criu.Criu, inv: gpus.Inventory | None, engine: Engine, comms: dict[int, str],
              states: dict[int, ProcessState], root: int, shell_job: bool, leave_running: bool,
              timings: dict[str, float]) -> dict[str, Any]:
    """torpor.json without its file table (manifest.seal adds it)."""
    drv = engine.driver_or_none()
    used = sorted({u for p in states for u in (inv.gpus_of(p) if inv else [])})
    has = lambda p: inv is not None and p in states  # noqa: E731
    return manifest.draft(
        torpor_version=__version__, criu_version=tool.version_text,
        driver=mt.Driver(inv.driver_version if inv else None,
                         drv.cuda_version if drv and states else None),
        root_pid=root, shell_job=shell_job, leave_running=leave_running,
        tcp_established=engine.cfg.tcp_established, timings=timings,
        gpus=[mt.Gpu(g.uuid, g.name, g.memory_total, g.index)
              for g in (inv.gpus if inv else []) if g.uuid in used],
        processes=[mt.Process(p, p in states, tuple(inv.gpus_of(p)) if has(p) else (),
                              inv.memory_of(p) if has(p) else 0, comm=comm,
                              state=states[p].name if p in states else None,
                              gpu_memory_by_gpu=inv.memory_by_gpu(p) if has(p) else {})
                   for p, comm in comms.items()])


def restore(engine: Engine, images_dir: Path, *, device_map: dict[str, str] | None = None,
            verify: bool = True, packed: Path | None = None,
            in_store: dict[str, int] | None = None) -> dict[str, Any]:
    """Restore a checkpoint made by checkpoint(); returns {root_pid, pids, gpu_map, timings}.
    packed, in_store (restore_any): images_dir was unpacked from the checkpoint packed in
    packed but for the agents' data files in_store (-> their sizes), which stream from the
    image store onto the GPU."""
    cfg, progress = engine.cfg, engine.progress
    require_trusted_location(images_dir, "checkpoint")
    m = manifest.read(images_dir)
    with progress.phase("verify", "sizes and checksums" if verify and cfg.checksums else "sizes"):
        manifest.verify(images_dir, m, checksums=verify and cfg.checksums, elsewhere=in_store)
    tool = criu.find(cfg)
    entries = criu.pstree(images_dir)
    pids = [int(e["pid"]) for e in entries]
    cuda_pids = sorted(p["pid"] for p in m["processes"] if p["cuda"])
    if not set(cuda_pids) <= set(pids):
        raise CorruptCheckpointError(f"{images_dir}: the manifest's CUDA processes "
                                     f"{sorted(set(cuda_pids) - set(pids))} are not in the image")
    moved = manifest.agents(m)
    if not set(moved) <= set(cuda_pids):
        raise CorruptCheckpointError(f"{images_dir}: the manifest's agent entries "
                                     f"{sorted(set(moved) - set(cuda_pids))} are not CUDA "
                                     "processes of the image")
    agents = restore_targets(moved, images_dir.absolute() / bulk.DATA_DIR, agent.default_dir(),
                             packed=packed if in_store else None)
    with progress.phase("preflight", "PIDs, driver, GPU model and memory"):
        busy = [p for p in pids if procs.pid_taken(p)]
        if busy:
            raise PreflightError(f"PID {busy[0]} of the checkpoint is in use by another process "
                                 f"({procs.comm(busy[0])}); CRIU restores the same PIDs",
                                 hint="stop that process first (is the original still running?)")
        gpu_map: dict[str, str] | None = None
        if cuda_pids:
            try:
                engine.driver
                inv = gpus.discover()
            except NoDriverError as e:
                raise PreflightError(f"the checkpoint holds GPU state but {e}") from e
            gpu_map = placement.plan(m, inv, device_map or {})
            if not device_map and all(o == n for o, n in gpu_map.items()):
                gpu_map = None  # same GPUs: let the driver restore without pairs
        elif device_map:
            raise UsageError("--device-map given but the checkpoint holds no GPU state")
    work_dir = private_dir(cfg.state_dir / "work" / f"restore-{int(time.time() * 1000)}")
    with engine.begin("restore", []) as op:
        # CRIU brings the CUDA processes back CHECKPOINTED under their old PIDs: journal them
        # first, so that a torpor dying right after CRIU leaves them for recovery to finish.
        op.phase("restore", pids=cuda_pids, gpu_map=gpu_map or {},
                 agents={p: t.to_json() for p, t in agents.items()})
        try:
            with interrupts.deferred():  # a CRIU killed half-way would leave half a tree
                with progress.phase("restore", f"CRIU {tool.version_text}, "
                                    f"{len(pids)} process(es)"):
                    root = criu.restore(tool, cfg, images_dir, work_dir, shell_job=m["shell_job"],
                                        tcp_established=m.get("tcp_established", False))
                back = engine.restore_and_unlock(op, cuda_pids, gpu_map, agents)
        except CriuError:
            raise  # CRIU cleans up a failed restore itself
        except BaseException as e:
            for p in reversed(pids):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            op.close()
            raise TorporError(f"restore failed in {op.entry.phase}: {e}; the restored processes "
                              f"were stopped, the checkpoint in {images_dir} is unchanged") from e
    shutil.rmtree(work_dir, ignore_errors=True)
    return {"root_pid": root, "pids": pids, "cuda_pids": cuda_pids, "gpu_map": gpu_map or {},
            "agent": {str(p): r for p, r in back.items()},
            "timings": {k: round(v, 4) for k, v in progress.timings.items()}}


def checkpoint_into_store(engine: Engine, pid: int, images_dir: Path, name: str, **kw: Any
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """checkpoint() then store_checkpoint() under the store's lock (shared: other checkpoints
    may run, gc waits): the GPU data the agents skip because the store has it stays there
    until this checkpoint's snapshot names it. Returns (manifest, what was stored)."""
    check_snapshot_name(name)     # refused before the program is touched
    try:
        store = Store(engine.cfg.store_dir)
    except OSError as e:
        raise TorporError(f"cannot open the image store {engine.cfg.store_dir}: "
                          f"{e.strerror or e}; the program was not touched") from e
    owner = fingerprints.owner_of(uid=procs.owner_uid(pid))   # the program's own only
    with store.backend.lock(False, store.lock_timeout):
        known = fingerprints.known(store, owner)   # once, for the agents and the pack
        m = checkpoint(engine, pid, images_dir, store=store, owner=owner, known=known, **kw)
        return m, store_checkpoint(engine, store, images_dir, name, owner, known)


def store_checkpoint(engine: Engine, store: Store, images_dir: Path, name: str,
                     owner: str = "", known: fingerprints.Known | None = None
                     ) -> dict[str, Any]:
    """Pack the sealed checkpoint in images_dir into store (config store_dir) as
    snapshot name (store/images.py), its fingerprints owner's (fingerprints.owner_of; known:
    theirs, when the store's lock was held since they were read). A failure, or Ctrl-C,
    leaves images_dir the complete, unpacked checkpoint it was (what its agents skipped
    filled in from the store; should torpor die, its recovery does that: packing.py).
    Returns what was written: {"name", "store", "chunks",
    "new_chunks", "new_bytes", "reused_chunks", "by_fingerprint", "zero_chunks", "logical"}."""
    size = tree_size(images_dir)
    # what the agents streamed into the store at the checkpoint (store/stream.py) was counted
    # there: the pack takes those chunks as given
    streamed = [e["streamed"] for e in manifest.agents(manifest.read(images_dir)).values()
                if isinstance(e.get("streamed"), dict)]

    def by_stream(key: str) -> int:
        return sum(int(s.get(key, 0)) for s in streamed)
    with engine.progress.phase("store", f"{human_bytes(size)} into {store.where} as {name}"):
        _doc, st = packing.pack(engine.journal, store, images_dir, name, owner, known,
                                engine.cfg.checksums)
    return {"name": name, "store": store.where, "chunks": st.chunks,
            "new_chunks": st.new_chunks + by_stream("new_chunks"),
            "new_bytes": st.new_bytes + by_stream("new_bytes"),
            "reused_chunks": st.reused_chunks + by_stream("reused_chunks"),
            "by_fingerprint": st.by_fingerprint,
            "zero_chunks": st.zero_chunks + by_stream("zero_chunks"), "logical": st.logical,
            "streamed": st.streamed}


def restore_any(engine: Engine, images_dir: Path, **kw: Any) -> dict[str, Any]:
    """restore(), also of a checkpoint directory packed into the image store: its files are
    written back (each chunk verified against its sha256, so the manifest's checksums are not
    computed again) into a private directory inside it first, and removed after, whatever
    happened."""
    if not images.is_packed(images_dir):
        return restore(engine, images_dir, **kw)
    require_trusted_location(images_dir, "checkpoint")
    manifest.require_trusted_records(images_dir)   # the unpacked copy is ours: check these here
    store = Store(engine.cfg.store_dir)
    # the agents' GPU data goes from the store straight onto the GPU (store/stream.py)
    in_store = images.gpu_data_files(images.packed_doc(images_dir)) \
        if engine.cfg.store_stream else {}
    into = _unpack_in_memory(engine, images_dir, in_store)
    where = f", into host memory ({into})" if into else ""
    left = "; its GPU data streams from there" if in_store else ""
    with engine.progress.phase("unpack", f"{images_dir} through {store.where}{where}{left}"):
        unpacked = images.unpack(store, images_dir, into, leave_out=in_store)
    try:   # every chunk's sha256 was checked as it was read: the manifest's sizes suffice
        return restore(engine, unpacked, **{**kw, "verify": False, "packed": images_dir,
                                           "in_store": in_store})
    except TorporError as e:   # name the directory the operator gave, not the one removed here
        raise type(e)(str(e).replace(str(unpacked), str(images_dir)), exit_code=e.exit_code,
                      hint=e.hint) from e
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)


def _unpack_in_memory(engine: Engine, images_dir: Path, leave_out: Iterable[str] = ()
                      ) -> Path | None:
    """Where a packed checkpoint is unpacked for its restore: host memory (suspend_dir, a
    tmpfs) when it fits in half of what is available, so a restore neither writes it all to
    the disk again nor needs the disk space twice; else None (inside images_dir)."""
    try:
        need = images.unpacked_size(images_dir, leave_out)
        base = bulk.claim_suspend_dir(Path(os.path.abspath(engine.cfg.suspend_dir)))
        vfs = os.statvfs(base)
    except (TorporError, OSError):
        return None
    available = procs.mem_available()
    room = min(vfs.f_bavail * vfs.f_frsize, available if available is not None else 0)
    return base if need <= room // 2 and bulk.in_memory(base) else None


def suspend(engine: Engine, pid: int) -> dict[str, Any]:
    """Move the GPU state of pid's tree to host memory and release the GPU; it stays alive."""
    procs.require(pid)
    tree = procs.tree(pid)
    with engine.begin("suspend", tree) as op:
        states, inv = _gpu_view(engine, tree)
        if not states:
            engine.driver  # a missing driver is the better message
            raise UsageError(f"process tree {pid} has no CUDA state: nothing to suspend")
        _require_running(states)
        cuda_pids = sorted(states)
        freed = sum(inv.memory_of(p) for p in cuda_pids) if inv else 0
        # Its GPU memory goes to host memory (the program's, or /dev/shm): refused up front
        # rather than leaving the kernel to kill the program half-way.
        available = procs.mem_available()
        if available is not None and freed > available:
            raise UsageError(f"suspending {pid} needs {human_bytes(freed)} of host memory for "
                             f"its GPU memory; {human_bytes(available)} is available")
        data = bulk.InProcess() if engine.cfg.suspend_in_process \
            else bulk.DataDir.scratch(engine.cfg, pid)
        moved = engine.lock_and_checkpoint(op, cuda_pids, data=data, scratch=True)
        try:
            for p in cuda_pids:
                record = {"root": pid, "since": time.time(),
                          "gpus": inv.gpus_of(p) if inv else [],
                          "gpu_memory": inv.memory_of(p) if inv else 0}
                if str(p) in op.entry.agents:   # where its agent's data is, for resume
                    record["agents"] = {str(p): op.entry.agents[str(p)]}
                    record["data_root"] = op.entry.data_root
                    record["agent"] = moved[p]
                engine.journal.mark_suspended(p, record)
        except BaseException as e:  # e.g. a full disk: suspended unrecorded is suspended lost
            for p in cuda_pids:
                engine.journal.clear_suspended(p)
            engine.fail(op, cuda_pids, e, during="suspend")
    return {"pids": cuda_pids, "gpu_memory_released": freed,
            "agent": {str(p): r for p, r in moved.items()},
            "timings": {k: round(v, 4) for k, v in engine.progress.timings.items()}}


def resume(engine: Engine, pid: int) -> dict[str, Any]:
    """Give a suspended tree its GPU state back and let it run."""
    procs.require(pid)
    states = engine.cuda_states(procs.tree(pid))
    if not states:
        engine.driver
        raise NotFoundError(f"process tree {pid} has no CUDA state")
    locked = sorted(p for p, s in states.items()
                    if s in (ProcessState.CHECKPOINTED, ProcessState.LOCKED))
    records = {p: r for p, r in engine.journal.suspended().items() if p in states}
    # A program whose agent moved its memory: also when a resume died after the driver's part
    agents = {p: t for p, r in records.items() for t in targets_of(r.get("agents", {})).values()
              if t.pid == p}
    todo = sorted(set(locked) | set(agents))
    if not todo:
        raise UsageError(f"process tree {pid} is not suspended (all RUNNING)")
    with engine.begin("resume", todo) as op:
        try:
            back = engine.restore_and_unlock(op, locked, agents=agents)
        except TorporError:
            back = {}
            if engine.rollback(todo, agents=agents):  # one more try from whatever state it reached
                raise
    for root in {r["data_root"] for p, r in records.items() if p in todo and r.get("data_root")}:
        bulk.DataDir(Path(root)).remove(background=True)
    for p in todo:
        engine.journal.clear_suspended(p)
    return {"pids": todo, "agent": {str(p): r for p, r in back.items()},
            "timings": {k: round(v, 4) for k, v in engine.progress.timings.items()}}
