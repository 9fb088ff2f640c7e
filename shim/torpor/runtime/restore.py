"""restore of a GPU container: pre-flight, move the bundle to this host's GPUs, let the real
runtime restore, then torpord restores the GPU state on the new host PIDs and unlocks.

    torpor.json ──► verify ──► place GPUs ──► rewrite config.json ──► runc restore
    (none: plain      (sizes,    (same UUIDs,    (devices, cgroup,         │
     runc restore)    sha256)    same model,     NVIDIA_VISIBLE_DEVICES,   ▼
                                 device map)     CDI annotations)    new host PID (CHECKPOINTED
                                                                     in the driver) ──► device
                                                                     nodes ──► RestoreAndUnlock
Everything before runc restore only reads and plans: a refusal starts nothing. A failure after
it kills the half-restored container and says why; so does a torpord whose reply names fewer
restored CUDA processes than torpor.json lists (one left out would stay frozen in the driver).
RestoreAndUnlock also gives programs under the agent the GPU memory their agent moved into
<image-path>/torpor-gpu/ (torpor.json's "agent"), found by their PID in the container's
namespace. A checkpoint packed into the image
store (config store_containers) first gets its files back, its chunks imported into this host's
store and verified (store/images.py); chunks in neither the directory nor the store (the
layer of a checkpoint image containerd 2 restores from names them only) are first fetched from
the image's chunk artifact, each verified, within restore_fetch_timeout_s (registry/chunks.py).
A checkpoint whose subdirectories were flattened
(flat.py: containerd 2's CRI archive) gets them back first, every name checked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .. import agent, agent_data, flat, layout, manifest, oci, procs
from ..config import Config
from ..driver import ProcessState
from ..errors import CorruptCheckpointError, ExitCode, TorporError
from ..files import read_untrusted
from ..flows import container, policy
from ..engine import Engine
from ..journal import Journal, Operation
from ..layout import MAX_MANIFEST
from ..registry import chunks
from ..sidecar.client import Client, ensure_running, work_timeout
from ..sidecar.convert import AgentData
from ..store import images as store_images
from . import markers
from .argv import Invocation
from .lifecycle import agent_dir, agent_name
from .runc import Runtime

log = logging.getLogger("torpor.runtime")
PID_WAIT_S = 600.0
# a restored process in these driver states has GPU state no one gave back yet
FROZEN = frozenset({ProcessState.CHECKPOINTED.name, ProcessState.LOCKED.name})


def read_manifest(images: Path) -> tuple[dict[str, Any], bool]:
    """torpor.json, or the draft a checkpoint left when it could not seal (no file table:
    nothing to verify). Returns (manifest, sealed)."""
    if os.path.lexists(images / manifest.MANIFEST):   # a link there is refused, not skipped
        return manifest.read(images), True
    data = read_untrusted(images, manifest.DRAFT, MAX_MANIFEST)
    return manifest.parse(data, str(images / manifest.DRAFT)), False


def torpors_own(images: Path) -> str:
    """The first name in images that only torpor writes (its agents' data, flat or not, its
    packed snapshot, its damage and write-out marks), or "" when there is none."""
    own = (agent_data.DATA_DIR, layout.DAMAGED, layout.WRITING, layout.PACKED, layout.CHUNKS)
    try:
        names = sorted(os.listdir(images))
    except OSError:
        return ""   # no directory: runc says so
    for n in names:
        if n in own or n.startswith(agent_data.DATA_DIR + flat.SEP):
            return n
    return ""


def run(cfg: Config, runtime: Runtime, inv: Invocation) -> int:
    with contextlib.ExitStack() as held:
        return _run(cfg, runtime, inv, held)


def _run(cfg: Config, runtime: Runtime, inv: Invocation, held: contextlib.ExitStack) -> int:
    """run(); held keeps the store's lock of a packed checkpoint's restore until it ends."""
    cid = inv.container_id
    images = Path(inv.opt("image-path") or "checkpoint").absolute()
    if not any(os.path.lexists(images / n) for n in (manifest.MANIFEST, manifest.DRAFT)):
        left = torpors_own(images)
        if left:   # torpor's checkpoint without its manifest: runc alone would leave it frozen
            raise CorruptCheckpointError(
                f"checkpoint {images} holds torpor's {left} but no {manifest.MANIFEST}: "
                "damaged (its manifest removed), refused")
        if not _names_gpus(Path(inv.opt("bundle", "b") or ".").absolute()):
            runtime.exec()   # not a torpor checkpoint: exactly what plain runc does
        markers.write(cfg, inv)   # a GPU container: its delete and checkpoint come back here
        return _in_journal(cfg, runtime, inv,
                           lambda op: _foreign_gpu(cfg, runtime, inv, op, images))
    moved_back = flat.unflatten(images)   # checked name by name (flat.py): refused, nothing ran
    if moved_back:
        log.info("restore %s: %d flat file(s) back in their subdirectories", cid, moved_back)
    bundle = Path(inv.opt("bundle", "b") or ".").absolute()
    t0 = time.monotonic()
    # packed at checkpoint (store_containers): the files back, every chunk's sha256 checked on
    # the way, so the manifest's checksums need not be computed a second time (sizes are)
    unpacked = store_images.is_packed(images)
    in_store: dict[str, int] = {}   # the agents' GPU data: streamed from the store to the GPU
    if unpacked:
        store = policy.open_store(cfg)
        # shared, to the end of the restore: the chunks fetched or imported here are in no
        # snapshot, and torpord streams the GPU data from them after runc's restore; gc
        # (exclusive) would take them in between
        held.enter_context(store.backend.lock(False, store.lock_timeout))
        got = chunks.for_restore(cfg, images, store,
                                 oci.load(bundle).get("annotations") or {})
        if got:
            log.info("restore %s: %d of %d chunk(s) fetched from %s (%d bytes) in %.2f s", cid,
                     got.fetched, got.chunks, got.reference, got.bytes_received, got.seconds)
        if cfg.store_stream:
            in_store = store_images.gpu_data_files(store_images.packed_doc(images))
        store_images.unpack_in_place(store, images, leave_out=in_store)
        log.info("restore %s: unpacked through %s in %.2f s%s", cid, cfg.store_dir,
                 time.monotonic() - t0,
                 f" (not its {len(in_store)} GPU data file(s): they stream from the store)"
                 if in_store else "")
    m, sealed = read_manifest(images)
    if sealed:
        manifest.verify(images, m, checksums=cfg.checksums and not unpacked, elsewhere=in_store)
    else:
        print(f"torpor-runtime: warning: {images} holds an unsealed GPU manifest (the "
              "checkpoint could not finish it): image files not verified", file=sys.stderr)
    _respec(cfg, bundle, inv, bool((m.get("container") or {}).get("agent")))
    cuda = [p for p in m["processes"] if p["cuda"]]
    moved = [AgentData(pid=p, nspid=e["nspid"], files=tuple(e["files"]),   # checked there
                       deferred=e.get("deferred") is True)
             for p, e in manifest.agents(m).items()]
    placed = container.NOT_PLACED
    if cuda:
        placed = container.place(cfg, m, bundle)
        ensure_running(cfg)   # a sidecar that cannot start is a refusal, before anything runs
    log.info("restore %s: pre-flight done in %.2f s; GPU map %s%s", cid, time.monotonic() - t0,
             dict(placed.gpu_map) or "none", " (explicit)" if placed.explicit else "")
    markers.write(cfg, inv)   # delete of the restored container comes back here
    if not cuda:
        proc = runtime.run()
        if not inv.flag("detach", "d"):   # runc runs the restored container in the foreground
            _wait_for_pid(runtime, inv, proc)
        held.close()   # restored: the store's chunks are read (gc may go on for its whole life)
        return proc.wait()
    return _in_journal(cfg, runtime, inv, lambda op: _restore(
        cfg, runtime, inv, op, images, placed, moved, in_store, len(cuda), held))


def _in_journal(cfg: Config, runtime: Runtime, inv: Invocation,
                restore: Callable[[Operation], int]) -> int:
    """restore(op) under a journal entry (_journalled) that it closes once the container's
    GPU state is back (before a foreground runtime's wait). A TorporError has stopped the
    restored container: nothing left to recover; any other end (a signal, a bug) leaves the
    entry to recovery, which stops what the runtime restored (engine/recovery.py)."""
    op = _journalled(cfg, runtime, inv)
    try:
        rc = restore(op)
    except TorporError:
        op.close()
        raise
    except BaseException:
        op.release()
        raise
    op.close()
    return rc


def _names_gpus(bundle: Path) -> bool:
    """Does the bundle's spec name a GPU (oci.detect)? False for one that cannot be read:
    the real runtime says what is wrong with it."""
    try:
        return bool(oci.detect(oci.load(bundle)))
    except (TorporError, OSError, ValueError):
        return False


def _foreign_gpu(cfg: Config, runtime: Runtime, inv: Invocation, op: Operation,
                 images: Path) -> int:
    """A GPU container's checkpoint without torpor's manifest: another tool's (CRIU's own cuda
    plugin gives the GPU state back during the restore), or torpor's driver-path checkpoint
    whose torpor.json was removed, which holds nothing else of torpor's. The real runtime
    restores it; then, where torpord finds any of its processes CHECKPOINTED or LOCKED in the
    driver (runc alone would leave them frozen for good), it gives them their GPU state back
    on the GPUs they were on, with a warning; a failure there stops the container (the
    checkpoint unchanged). torpord not started or not answering the question: a warning, the
    container as the runtime left it. op (_in_journal) is closed once that is settled."""
    cid = inv.container_id
    proc, pid = _runtime_restored(runtime, inv)
    if pid is None:
        return proc.wait()
    try:
        ensure_running(cfg)
        with Client(cfg) as c:
            states = c.status(pids=procs.tree(pid)).processes
    except TorporError as e:
        print(f"torpor-runtime: warning: checkpoint {images} has no {manifest.MANIFEST}; its "
              f"processes' GPU state was not checked ({e.line()})", file=sys.stderr)
        op.close()
        return proc.wait()   # --detach: its 0, already read
    frozen = sorted(s.pid for s in states if s.state in FROZEN)
    log.info("restore %s: no manifest (%s); runc restored host PID %d; frozen in the driver: "
             "%s", cid, images, pid, frozen or "none")
    if frozen:
        try:
            with Client(cfg, timeout=work_timeout(cfg)) as c:
                c.restore_and_unlock(pids=[pid], gpu_map={})
        except TorporError as e:
            runtime.kill(cid)
            raise TorporError(f"container {cid} restored from {images}, which has no "
                              f"{manifest.MANIFEST}, holds PID(s) {', '.join(map(str, frozen))} "
                              f"checkpointed in the driver whose GPU state could not be given "
                              f"back ({e.line()}): the restored container was stopped, the "
                              "checkpoint is unchanged", exit_code=ExitCode.CORRUPT
                              if e.exit_code == ExitCode.CORRUPT else None) from e
        print(f"torpor-runtime: warning: checkpoint {images} has no {manifest.MANIFEST} (its "
              f"files were not verified), yet the driver held PID(s) "
              f"{', '.join(map(str, frozen))} checkpointed: their GPU state was given back on "
              "the GPUs they were on", file=sys.stderr)
        log.warning("restore %s: no manifest; GPU state of PIDs %s given back", cid, frozen)
    op.close()   # settled: a runtime that dies from now on leaves nothing to recover
    return proc.wait()   # --detach: its 0, already read


def _journalled(cfg: Config, runtime: Runtime, inv: Invocation) -> Operation:
    """A journal entry for the runtime's restore, with what a recovery needs should this process
    die before it ends: the engine (conmon, containerd's shim) then takes the restore as failed
    and waits for the container to end, whose CUDA processes nobody would give their GPU state
    back. Recovery (engine/recovery.py) lets the real runtime finish, then stops the container
    it restored; the checkpoint, which a restore never changes, is intact."""
    for msg in Engine(cfg).recover():   # an earlier restore's first: its pid file is not ours
        log.warning("restore %s: recovery: %s", inv.container_id, msg)
    op = Journal(cfg).begin("restore", [])
    cid = inv.container_id
    op.entry.container = {"id": cid, "runtime": runtime.path, "argv": [runtime.path, *inv.argv],
                          "pid_file": str(Path(inv.opt("pid-file")).absolute())
                          if inv.opt("pid-file") else "",
                          "state_argv": runtime.argv("state", cid)}
    op.phase("container-restore")
    return op


def _restore(cfg: Config, runtime: Runtime, inv: Invocation, op: Operation, images: Path,
             placed: container.Placement, moved: list[AgentData], in_store: dict[str, int],
             cuda: int, held: contextlib.ExitStack) -> int:
    """The real runtime's restore, then torpord's RestoreAndUnlock of the container's CUDA
    processes (op closed once done; cuda: how many the manifest holds); a failure of the
    latter, or a reply naming fewer than cuda restored (_require_all), stops the
    container."""
    cid = inv.container_id
    proc, pid = _runtime_restored(runtime, inv)
    if pid is None:
        return proc.wait()
    t = time.monotonic()
    try:
        if placed.moves:
            _device_nodes(pid, list(placed.moves))
        with Client(cfg, timeout=work_timeout(cfg)) as c:
            out = c.restore_and_unlock(pids=[pid], gpu_map=placed.driver_map, agents=moved,
                                       gpu_data_dir=images / agent_data.DATA_DIR if moved else "",
                                       agent_container_id=agent_name(cfg, inv),
                                       gpu_data_packed=images if moved and in_store else "")
        _require_all(out.pids, cuda)
    except TorporError as e:
        runtime.kill(cid)
        raise TorporError(f"GPU restore of container {cid} failed: {e.line()}; the restored "
                          f"container was stopped, the checkpoint in {images} is unchanged",
                          exit_code=ExitCode.CORRUPT if e.exit_code == ExitCode.CORRUPT
                          else None) from e
    log.info("restore %s: host PID %d, CUDA PIDs %s restored and unlocked in %.2f s", cid, pid,
             list(out.pids), time.monotonic() - t)
    op.close()   # restored: a runtime that dies from now on leaves nothing to recover
    held.close()   # and the GPU data is streamed: the store's lock goes before a foreground wait
    return proc.wait()   # --detach: its 0, already read


def _require_all(restored: Any, cuda: int) -> None:
    """torpord's reply must name at least as many restored CUDA processes as the checkpoint's
    manifest holds: one it left out stays CHECKPOINTED in the driver, frozen for good, while
    the engine would report the container restored (a torpord restarted mid-restore restored
    none). A reply without the list counts as none."""
    try:
        n = len({int(p) for p in restored or () if int(p) > 0})
    except (TypeError, ValueError):
        n = 0
    if n < cuda:
        raise TorporError(f"torpord restored {n} of the checkpoint's {cuda} CUDA process(es)")


def _respec(cfg: Config, bundle: Path, inv: Invocation, had_agent: bool) -> None:
    """The spec for this host and root: the agent's mounts (if the container had the agent)
    to this host's library and the socket directory of this (root, id) (agent_name: delete
    removed the old one, and the checkpoint may come from another root or host), and the
    root's key for torpor-hook (oci.set_root_key). A spec without the mounts (containerd
    makes the restored container's spec from its own record, which never saw what create
    added) gets them back: CRIU maps every mount it dumped onto one of the new spec's."""
    spec = oci.load(bundle)
    changed = oci.set_root_key(spec, markers.key(inv))
    if oci.has_agent(spec):
        changed |= oci.repoint_agent(spec, agent.library(),
                                     agent_dir(cfg, agent_name(cfg, inv), spec))
    elif had_agent:
        changed |= oci.add_agent(spec, agent.library(), agent_dir(cfg, agent_name(cfg, inv), spec))
        log.info("restore %s: the agent's mounts added back to the spec", inv.container_id)
    if changed:
        oci.save(bundle, spec)


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 1 else None


def _runtime_restored(runtime: Runtime, inv: Invocation) -> tuple[Any, int | None]:
    """The real runtime's restore, started: (its process, the restored container's host PID).
    None for the PID when it failed (proc.wait() is its exit status). With --detach the
    runtime has exited, with 0, by then; without, it runs the container in the foreground."""
    proc = runtime.run()
    if inv.flag("detach", "d") and proc.wait() != 0:
        return proc, None
    return proc, _wait_for_pid(runtime, inv, proc)


def _wait_for_pid(runtime: Runtime, inv: Invocation, proc: Any) -> int | None:
    """The restored container's host PID: from --pid-file once the runtime writes it, else
    from its state. None when the runtime exits without one (it failed)."""
    pid_file = Path(inv.opt("pid-file") or "") if inv.opt("pid-file") else None
    deadline = time.monotonic() + PID_WAIT_S
    while time.monotonic() < deadline:
        if pid_file:
            pid = _read_pid(pid_file)
            if pid:
                return pid
        else:
            try:
                st = runtime.state(inv.container_id)
            except TorporError:
                st = {}
            if st.get("status") in ("running", "paused") and int(st.get("pid") or 0) > 1:
                return int(st["pid"])
        if proc.poll() is not None:
            return _read_pid(pid_file) if pid_file else None
        time.sleep(0.02 if pid_file else 0.2)
    runtime.kill(inv.container_id)
    raise TorporError(f"the runtime gave no PID for {inv.container_id} within {PID_WAIT_S:.0f} s")


def _device_nodes(pid: int, moves: list[oci.Move]) -> None:
    """CRIU brought back the container's /dev as it was (old GPU nodes): add the new GPUs'
    nodes, which the driver opens in the container when it restores. Made through a handle on
    the container's /dev opened without following symlinks, so a container cannot point us
    at the host's files."""
    try:
        fd = os.open(f"/proc/{pid}/root/dev", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise TorporError(f"cannot open the restored container's /dev: {e}") from e
    try:
        for mv in moves:
            name = f"nvidia{mv.new_minor}"
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(oci.NVIDIA_MAJOR,
                                                                        mv.new_minor):
                    continue
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            old_umask = os.umask(0)  # device nodes are 0666, as the driver makes them
            try:
                os.mknod(name, 0o666 | stat.S_IFCHR,
                         os.makedev(oci.NVIDIA_MAJOR, mv.new_minor), dir_fd=fd)
            finally:
                os.umask(old_umask)
            log.info("restore: /dev/%s made in the container (PID %d)", name, pid)
    finally:
        os.close(fd)
