"""Checkpoint of bare (non-container) process trees: engine + CRIU + manifest, and the pack
of the sealed checkpoint into the image store.

checkpoint: [agent-prepare -> agent-detach ->] lock -> checkpoint -> dump -> seal
            (any failure before seal: rolled back)
--leave-running: ... dump -> gpu-restore -> unlock [-> agent-resume -> writeout] -> seal

The agent phases are those of programs run under the in-process agent (`torpor run`): their
GPU memory goes into <images dir>/torpor-gpu/ (agent_data.py). Left running, they stage it in
host memory instead (writeout.py) and it is written into the directory once the program runs
again: the program is paused for the copy to host memory and the dump, not for the disk. The
manifest's "pause" says how long it was paused ({"paused_s", "staged", "held": the allocations
that stayed on the GPU through it, mapped back rather than copied; "criu": how long CRIU's dump
kept the tree frozen, from its stats-dump: criu.dump_stats}).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .. import (__version__, agent_data, criu, gpus, interrupts, manifest, procs, store_packing,
               workloads)
from ..config import Config
from ..driver import ProcessState
from ..engine import Engine, inventory, targets_of
from ..errors import (BusyError, NoDriverError, RolledBackError, TorporError, UsageError,
                      describe)
from ..files import open_trusted_dir, remove_lone_file, tree_size
from ..progress import human_bytes
from ..runtime import markers
from ..store import Store, fingerprints
from ..store.backend import check_snapshot_name
from .. import manifest_types as mt
from . import policy, writeout


def _claim_images_dir(images_dir: Path) -> int:
    """An empty private (0700) directory for the images, in a place only root can change,
    flock-ed so that two checkpoints never share it. Returns the locked directory fd."""
    if images_dir.is_symlink():
        raise UsageError(f"{images_dir} is a symbolic link: give the directory itself")
    try:  # made, and held, without following anyone's link but root's (files.py)
        fd = open_trusted_dir(images_dir, "images directory", create=True).fd
    except NotADirectoryError:
        raise UsageError(f"{images_dir} exists and is not a directory") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BusyError(f"another torpor is checkpointing into {images_dir}") from None
        # the log a failed dump left to say why (and nothing else) goes: the retry's replaces it
        remove_lone_file(fd, manifest.DUMP_LOG, unless=manifest.DUMP_OK.encode())
        if os.listdir(fd):
            raise UsageError(f"{images_dir} is not empty: give a new or empty directory")
        os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def require_running(states: dict[int, ProcessState]) -> None:
    for p, s in states.items():
        if s != ProcessState.RUNNING:
            raise UsageError(f"PID {p} is already {s.name} on the GPU, not RUNNING"
                             + (": 'torpor resume' it first" if s == ProcessState.CHECKPOINTED
                                else ""))


def gpu_view(engine: Engine, tree: list[int]
             ) -> tuple[dict[int, ProcessState], gpus.Inventory | None]:
    states = engine.cuda_states(tree)
    if not states:
        return states, None
    try:
        inv = gpus.discover()
    except NoDriverError:
        inv = None
    return states, inv


def _refuse_containers(cfg: Config, tree: list[int]) -> None:
    """A process in a container torpor-runtime runs is its engine's to checkpoint: CRIU here
    cannot dump the container's mounts, and its GPU state goes through torpord."""
    found = markers.container_of(cfg, tree)
    if found:
        pid, cid = found
        raise UsageError(f"PID {pid} runs in container {cid}, which torpor-runtime runs: "
                         "checkpoint the container with its engine (podman container "
                         "checkpoint, ctr tasks checkpoint, the kubelet's checkpoint API); "
                         "'torpor checkpoint' is for programs outside containers")


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
    _refuse_containers(cfg, tree)
    comms = {p: procs.comm(p) for p in tree}  # the dump ends them; ask now
    with contextlib.ExitStack() as stack, \
            engine.begin("checkpoint", tree) as op:  # BusyError while another op holds them
        states, inv = gpu_view(engine, tree)
        require_running(states)
        cuda_pids = sorted(states)
        workloads.refuse_unrestorable(cuda_pids, engine.agent_sockets(cuda_pids),
                                      leave_running=leave_running, warn=progress.say)
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
        try:
            manifest.write_draft(images_dir, draft)
        except OSError as e:   # a full disk, most likely: was "internal error", exit 1
            raise RolledBackError(f"cannot write into {images_dir}: {describe(e)}; nothing "
                                  "was done to the program") from e
        stage = writeout.staging(engine, cuda_pids, sum(inv.memory_of(p) for p in cuda_pids)
                                 if inv else 0) if leave_running else None
        drain = leave_running and cfg.leave_running_drain and store is None
        if leave_running and cuda_pids:   # every program's held descriptors, kept to the end
            why = procs.raise_fd_limit()
            if why:
                progress.say(f"warning: {why}")
        serve = engine.holding(engine.agent_sockets(cuda_pids)) if drain and cuda_pids else {}
        if serve:   # the copiers' contexts made while the program still runs
            stack.callback(engine.drop_copiers)
            with progress.phase("copier-ready", "torpor-copier ready to copy"):
                engine.ready_copiers(sorted(serve), inventory())   # free memory now
        paused = time.monotonic()
        stack.callback(engine.release_held)   # held GPU memory no resume took, on any path
        try:
            plan = policy.fingerprint_plan(
                cfg, store if known is not None else None, owner,
                policy.FingerprintMode.of(store is not None, leave_running), known)
            data = stage or agent_data.DataDir(images_dir / agent_data.DATA_DIR)
            moved = engine.lock_and_checkpoint(op, cuda_pids, data=data, scratch=bool(stage),
                                               known_fingerprints=plan.skip, owner=owner,
                                               stream_into=plan.stream_into,
                                               hold=leave_running,
                                               drain=drain)
            held = engine.held_counts()
        except RolledBackError:
            (images_dir / manifest.DRAFT).unlink(missing_ok=True)  # the directory is reusable
            raise
        agents = targets_of(op.entry.agents)
        staged = stage is not None and bool(moved)
        if moved:   # before the dump: a recovery seals what the draft says
            draft["agent"] = {str(p): r for p, r in moved.items()}
            try:
                manifest.write_draft(images_dir, draft)
                if staged:   # ... unless its GPU data is not written out yet
                    writeout.begin(images_dir)
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
                manifest.clear_partial(images_dir, keep=(agent_data.DATA_DIR,))  # until resumed
                engine.fail(op, cuda_pids, e, during="dump")
            dump_error = e  # the program is gone: its images are all that is left of it
        back: dict[int, dict[str, Any]] = {}
        if leave_running and cuda_pids:
            back = policy.restore_or_roll_back(engine, op, cuda_pids, agents=agents)
        if leave_running:
            # the allocations that stayed on the GPU through the pause and were mapped back
            kept = sum(n for p, n in held.items() if (back.get(p) or {}).get("held"))
            draft["pause"] = {"paused_s": round(time.monotonic() - paused, 4), "staged": staged,
                              "held": kept}
            drained = _drained(engine, moved, back, stage, images_dir, op)
            if drained:
                draft["pause"]["drained"] = drained
            stats = criu.dump_stats(images_dir) if dump_error is None else None
            if stats:   # how much of the pause was CRIU's freeze
                draft["pause"]["criu"] = stats
            progress.say(f"the program runs again, paused {draft['pause']['paused_s']:.2f} s"
                         + ("; its GPU data is written out while it runs" if staged else ""))
        if staged and stage is not None:
            _write_out(engine, op, stage, images_dir, moved, draft)
        elif leave_running:
            manifest.write_draft(images_dir, draft)
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


def _drained(engine: Engine, moved: dict[int, dict[str, Any]], back: dict[int, dict[str, Any]],
             stage: agent_data.DataDir | None, images_dir: Path, op: Any) -> dict[str, Any]:
    """The deferred copies (a copier filled the data files beside the dump: copier.py): how
    they went, {"programs", "bytes", "seconds"} (the slowest), or {} when there were none.
    A copy no resume waited for (the resume failed and its retry brought the program back, or
    the program ended) is waited for here. One that failed, or copied other than the bytes
    its agent planned, leaves the files without GPU data: the directory is abandoned (marked
    damaged, nothing staged left), the operation closed, said, exit 8."""
    deferred = [p for p, r in moved.items() if r.get("deferred")]
    if not deferred:
        return {}
    summary, bad = engine.drain_report(back)
    if bad:
        e = TorporError("the copy of the GPU memory into the data files failed ("
                        + "; ".join(f"PID {p}: {why}" for p, why in sorted(bad.items())) + ")")
        alive = any(procs.alive(p) for p in deferred)
        if stage is not None and alive:
            raise writeout.failed(e, stage, images_dir, op)
        if stage is not None:
            stage.remove()
        why = writeout.abandon(images_dir, e)
        op.close()
        raise RolledBackError(f"{e}; " + ("the program runs on" if alive else
                                          "the program ended meanwhile")
                              + f", and {images_dir} is no checkpoint ({why.split(':')[0]}, "
                              "marked damaged)")
    return summary


def _write_out(engine: Engine, op: Any, stage: agent_data.DataDir, images_dir: Path,
               moved: dict[int, dict[str, Any]], draft: dict[str, Any]) -> None:
    """The staged GPU data into images_dir while the program runs (writeout.py). A failure
    leaves the program running, the directory marked damaged and nothing staged: it says so
    (exit 8, as a rolled-back checkpoint)."""
    op.phase("writeout")
    try:
        manifest.write_draft(images_dir, draft)
        writeout.write_out(engine, stage, images_dir, moved)
    except BaseException as e:
        raise writeout.failed(e, stage, images_dir, op, advice=": remove it") from e


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


def checkpoint_into_store(engine: Engine, pid: int, images_dir: Path, name: str, **kw: Any
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """checkpoint() then store_checkpoint() under the store's lock (shared: other checkpoints
    may run, gc waits): the GPU data the agents skip because the store has it stays there
    until this checkpoint's snapshot names it. Returns (manifest, what was stored). A
    failure takes back the chunks it added that no snapshot names, once the lock is given
    up (store_packing.discard_unnamed): a full store is not left full until gc."""
    check_snapshot_name(name)     # refused before the program is touched
    store = policy.open_store(engine.cfg, "the program was not touched")
    store.require_new(name)       # so is a name taken: once dumped, it could not be stored
    owner = fingerprints.owner_of(uid=procs.owner_uid(pid))   # the program's own only
    try:
        with store.backend.lock(False, store.lock_timeout):
            known = fingerprints.known(store, owner)   # once, for the agents and the pack
            m = checkpoint(engine, pid, images_dir, store=store, owner=owner, known=known, **kw)
            return m, store_checkpoint(engine, store, images_dir, name, owner, known)
    except BaseException:
        store_packing.discard_unnamed(engine.journal, store, images_dir, engine.progress.say)
        raise


def store_checkpoint(engine: Engine, store: Store, images_dir: Path, name: str,
                     owner: str = "", known: fingerprints.Known | None = None
                     ) -> dict[str, Any]:
    """Pack the sealed checkpoint in images_dir into store (config store_dir) as
    snapshot name (store/images.py), its fingerprints owner's (fingerprints.owner_of; known:
    theirs, when the store's lock was held since they were read). A failure, or Ctrl-C,
    leaves images_dir the complete, unpacked checkpoint it was (what its agents skipped
    filled in from the store; should torpor die, its recovery does that: store_packing.py).
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
        _doc, st = store_packing.pack(engine.journal, store, images_dir, name, owner, known,
                                engine.cfg.checksums)
    return {"name": name, "store": store.where, "chunks": st.chunks,
            "new_chunks": st.new_chunks + by_stream("new_chunks"),
            "new_bytes": st.new_bytes + by_stream("new_bytes"),
            "reused_chunks": st.reused_chunks + by_stream("reused_chunks"),
            "by_fingerprint": st.by_fingerprint,
            "zero_chunks": st.zero_chunks + by_stream("zero_chunks"), "logical": st.logical,
            "streamed": st.streamed}


