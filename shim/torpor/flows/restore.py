"""Restore of checkpoints of bare process trees, also of those packed into the image store.

restore:    verify -> preflight -> restore -> gpu-restore -> unlock [-> agent-resume]

The agents' data of a checkpoint packed into the store streams from the store onto the GPU.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Iterable

from .. import agent, agent_data, criu, gpus, interrupts, manifest, placement, procs
from ..driver import ProcessState
from ..engine import Engine, restore_targets
from ..errors import (CorruptCheckpointError, CriuError, ExitCode, NoDriverError, PreflightError,
                      TorporError, UsageError)
from ..files import private_dir, require_trusted_location
from ..store import images
from . import policy


def require_trusted_checkpoint(images_dir: Path) -> None:
    """The trust a restore needs in a checkpoint directory, and `inspect --verify` checks
    alike (one rule, so the two never disagree): a location that only root (or we) can
    change, reached through no one else's link (files.require_trusted_location, exit 2); a
    packed one's records (torpor.json, torpor-store.json) as strictly trusted as its images
    (exit 9). An unpacked one's torpor.json and images: manifest.verify."""
    require_trusted_location(images_dir, "checkpoint")
    if images.is_packed(images_dir):
        manifest.require_trusted_records(images_dir)


def restore(engine: Engine, images_dir: Path, *, device_map: dict[str, str] | None = None,
            verify: bool = True, packed: Path | None = None,
            in_store: dict[str, int] | None = None) -> dict[str, Any]:
    """Restore a checkpoint made by checkpoint(); returns {root_pid, pids, gpu_map, timings}.
    packed, in_store (restore_any): images_dir was unpacked from the checkpoint packed in
    packed but for the agents' data files in_store (-> their sizes), which stream from the
    image store onto the GPU."""
    cfg, progress = engine.cfg, engine.progress
    require_trusted_checkpoint(images_dir)
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
    agents = restore_targets(moved, images_dir.absolute() / agent_data.DATA_DIR, agent.default_dir(),
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
            gpu_map = placement.driver_map(placement.plan(m, inv, device_map or {}),
                                           device_map or {}) or None
        elif device_map:
            raise UsageError("--device-map given but the checkpoint holds no GPU state")
    work_dir = private_dir(cfg.state_dir / "work" / f"restore-{int(time.time() * 1000)}")
    with engine.begin("restore", []) as op:
        # CRIU brings the CUDA processes back CHECKPOINTED under their old PIDs: journal them
        # first, so that a torpor dying right after CRIU leaves them for recovery to finish.
        # Every PID of the image too, and CRIU's work directory: a CRIU killed half-way
        # leaves a frozen tree that recovery must stop (engine: _interrupted_restore).
        op.phase("restore", pids=cuda_pids, gpu_map=gpu_map or {},
                 agents={p: t.to_json() for p, t in agents.items()},
                 work_dir=str(work_dir), image_pids=pids)
        try:
            with interrupts.deferred():  # a CRIU killed half-way would leave half a tree
                with progress.phase("restore", f"CRIU {tool.version_text}, "
                                    f"{len(pids)} process(es)"):
                    root = criu.restore(tool, cfg, images_dir, work_dir, shell_job=m["shell_job"],
                                        tcp_established=m.get("tcp_established", False))
                _require_listed_gpu_state(engine, pids, cuda_pids)
                back = engine.restore_and_unlock(op, cuda_pids, gpu_map, agents)
        except CriuError as e:
            if criu.restore_finished(work_dir):
                raise
            # CRIU cleans up a restore that fails, not one that is killed half-way; what a
            # failing CRIU is still ending goes too, so that the PIDs are free for the next try
            frozen = engine.stop_half_restored(op.entry)
            op.close()
            if e.cut_short and frozen:
                raise CriuError(f"{e}; stopped the {len(frozen)} process(es) it had restored so "
                                f"far ({', '.join(map(str, frozen))}); the checkpoint is "
                                "unchanged: restore it again") from e
            raise
        except BaseException as e:
            for p in reversed(pids):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            op.close()
            raise TorporError(f"restore failed in {op.entry.phase}: {e}; the restored processes "
                              f"were stopped, the checkpoint in {images_dir} is unchanged",
                              exit_code=ExitCode.CORRUPT if isinstance(e, TorporError) and
                              e.exit_code == ExitCode.CORRUPT else None) from e
    shutil.rmtree(work_dir, ignore_errors=True)
    return {"root_pid": root, "pids": pids, "cuda_pids": cuda_pids, "gpu_map": gpu_map or {},
            "agent": {str(p): r for p, r in back.items()}, "timings": policy.timings(engine)}


def _require_listed_gpu_state(engine: Engine, pids: list[int], cuda_pids: list[int]) -> None:
    """Every process CRIU brought back with GPU state is one the manifest lists as a CUDA
    process (cuda_pids, which alone get their GPU state back): the manifest is untrusted, and
    one that left a CUDA process out would have the restore end well with that process
    frozen for good, CHECKPOINTED. CorruptCheckpointError names it."""
    others = [p for p in pids if p not in set(cuda_pids)]
    frozen = {p: st for p, st in engine.cuda_states(others).items()
              if st != ProcessState.RUNNING}
    if frozen:
        p, st = next(iter(frozen.items()))
        raise CorruptCheckpointError(
            f"PID {p} came back with GPU state ({st.name}) that the checkpoint's manifest does "
            "not list (processes[].cuda): the manifest is wrong")


def restore_any(engine: Engine, images_dir: Path, **kw: Any) -> dict[str, Any]:
    """restore(), also of a checkpoint directory packed into the image store: its files are
    written back (each chunk verified against its sha256, so the manifest's checksums are not
    computed again) into a private directory inside it first, and removed after, whatever
    happened."""
    if not images.is_packed(images_dir):
        return restore(engine, images_dir, **kw)
    require_trusted_checkpoint(images_dir)   # the unpacked copy is ours: its records checked here
    store = policy.open_store(engine.cfg)
    # the agents' GPU data goes from the store straight onto the GPU (store/stream.py)
    in_store = images.gpu_data_files(images.packed_doc(images_dir)) \
        if engine.cfg.store_stream else {}
    into = _unpack_in_memory(engine, images_dir, in_store)
    where = f", into host memory ({into})" if into else ""
    left = "; its GPU data streams from there" if in_store else ""
    # The store's lock, shared, from the unpack to the end: the chunks it imports from the
    # directory (one from another host) are in no snapshot, and the GPU data streams from them
    # after CRIU's restore; gc (exclusive) would take them in between.
    with store.backend.lock(False, store.lock_timeout):
        with engine.progress.phase("unpack", f"{images_dir} through {store.where}{where}{left}"):
            unpacked = images.unpack(store, images_dir, into, leave_out=in_store)
        try:   # every chunk's sha256 was checked as it was read: the manifest's sizes suffice
            return restore(engine, unpacked, **{**kw, "verify": False, "packed": images_dir,
                                               "in_store": in_store})
        except TorporError as e:   # name the directory the operator gave, not the one removed
            raise type(e)(str(e).replace(str(unpacked), str(images_dir)),
                          exit_code=e.exit_code, hint=e.hint) from e
        finally:
            shutil.rmtree(unpacked, ignore_errors=True)


def _unpack_in_memory(engine: Engine, images_dir: Path, leave_out: Iterable[str] = ()
                      ) -> Path | None:
    """Where a packed checkpoint is unpacked for its restore: host memory (suspend_dir, a
    tmpfs) when it fits in half of what is available, so a restore neither writes it all to
    the disk again nor needs the disk space twice; else None (inside images_dir)."""
    try:
        need = images.unpacked_size(images_dir, leave_out)
        base = agent_data.claim_suspend_dir(Path(os.path.abspath(engine.cfg.suspend_dir)))
        vfs = os.statvfs(base)
    except (TorporError, OSError):
        return None
    available = procs.mem_available()
    room = min(vfs.f_bavail * vfs.f_frsize, available if available is not None else 0)
    return base if need <= room // 2 and agent_data.in_memory(base) else None


