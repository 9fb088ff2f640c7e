"""checkpoint of a GPU container: torpord locks and checkpoints the CUDA state, the real
runtime (runc/crun, through CRIU) dumps, torpor.json goes into the image directory.

    state ──► draft torpor.json ──► LockAndCheckpoint ──► runc checkpoint ──► Finish
                                         │                     │ fails        (or, with
                                         │                     ▼              --leave-running,
                                         └── fails: nothing ── Rollback       RestoreAndUnlock)
                                             to undo           (GPU state back, container runs)
                                                                                  ▼
                                                                          seal torpor.json
torpord is told our PID: should this process die before Finish/Rollback, torpord rolls the
operation back itself once no dump holds the processes.

Programs under the in-process agent: torpord has their agents move their GPU memory into
<image-path>/torpor-gpu/ first (agent_data.py), so the runtime's image directory, and with it
podman's --export archive and containerd's checkpoint, carries it; torpor.json lists it
("agent", and the file table's checksums). CRIU ignores the directory. Once the checkpoint is
done, its subdirectories become flat files (flat.py: containerd 2's CRI copies the directory
into the kubelet's archive as plain files only); restore.py turns them back.
--leave-running (a kubelet's CRI checkpoint too): the agents' data is staged in host memory
and written into <image-path>/torpor-gpu/ once the container runs again, before this returns
(pause.py): the container is paused for the copy to host memory and the dump only.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from .. import (__version__, agent_data, flat, gpus, interrupts, manifest, oci, procs,
               store_packing, workloads)
from .. import manifest_types as mt
from ..config import Config
from ..errors import (NoDriverError, NotFoundError, RolledBackError, SidecarError, TorporError,
                      UsageError)
from ..files import private_dir
from ..flows import policy
from ..layout import WRITING
from ..flows.checkpoint import store_checkpoint
from ..journal import Journal
from ..engine import Engine
from ..sidecar.client import Client, ensure_running, work_timeout
from ..sidecar.convert import Checkpointed
from ..store import Store, fingerprints
from ..store import images as store_images
from .argv import Invocation
from . import pause
from .lifecycle import agent_name
from .runc import Runtime

log = logging.getLogger("torpor.runtime")


def run(cfg: Config, runtime: Runtime, inv: Invocation) -> int:
    cid = inv.container_id
    st = runtime.state(cid)
    bundle = Path(st.get("bundle") or ".")
    try:
        spec = oci.load(bundle)
    except UsageError as e:
        # No readable spec: the runtime decides (CRIU refuses a process with GPU mappings, and
        # a failed dump leaves the container running).
        log.warning("checkpoint %s: %s; passing it to the runtime as is", cid, e)
        runtime.exec()
    use = oci.detect(spec)
    if not use:
        runtime.exec()   # not a GPU container: exactly what plain runc does
    if inv.flag("pre-dump"):
        raise UsageError("pre-dump of a GPU container is not supported: the GPU state is "
                         "copied whole at the checkpoint", hint="checkpoint without --pre-dump")
    if st.get("status") not in ("running", "paused"):
        runtime.exec()   # the runtime says why it cannot checkpoint it
    pid = int(st.get("pid") or 0)
    if pid <= 1:
        raise TorporError(f"container {cid} has no host PID in its state ({st.get('pid')!r})")
    images = Path(inv.opt("image-path") or "checkpoint").absolute()
    leave_running = inv.flag("leave-running")
    tree = procs.tree(pid)   # a JAX container without the agent would not restore
    workloads.refuse_unrestorable(tree, tree if oci.has_agent(spec) else [],
                                  leave_running=leave_running,
                                  warn=lambda t: print(f"torpor-runtime: {t}", file=sys.stderr))
    thawed = _Thaw(runtime, cid, st.get("status") == "paused")
    try:
        private_dir(images)
    except OSError as e:   # a file on the way, a name too long, no right: the caller's input
        raise UsageError(f"--image-path {images}: {e.strerror or e}"
                         + (f" ({e.filename})" if e.filename and str(e.filename) != str(images)
                            else "")) from None
    data = agent_data.DataDir(images / agent_data.DATA_DIR)
    data.remove()   # an earlier checkpoint's, into the same image path
    store_images.forget_packed(images)
    flat.remove_flat(images)
    name = agent_name(cfg, inv, spec)   # its agent directory's
    work = Path(inv.opt("work-path") or images).absolute()   # where CRIU writes its stats
    store = _open_store(cfg, cid) if oci.wants_store(spec, cfg.store_containers) else None
    if store is None:
        rc = _checkpoint(cfg, runtime, cid, name, spec, use, pid, images, data, thawed,
                         leave_running, None, work)
    else:
        # the store's lock, shared, from the agents' skipping of what it holds to the pack: gc
        # cannot take those chunks in between
        try:
            with store.backend.lock(False, store.lock_timeout):
                rc = _checkpoint(cfg, runtime, cid, name, spec, use, pid, images, data,
                                 thawed, leave_running, store, work)
        finally:   # a pack that failed: the chunks it added, which nothing names, go now
            store_packing.discard_unnamed(
                Journal(cfg), store, images,
                lambda t: print(f"torpor-runtime: checkpoint {cid}: {t}", file=sys.stderr))
    if rc == 0:
        _flatten(images, cid)
    return rc


def _flatten(images: Path, cid: str) -> None:
    """The image directory's subdirectories as flat files (flat.py): containerd 2's CRI
    archives it as if every entry were a file. The checkpoint is done whatever happens here:
    left with its subdirectories, podman and ctr still take it."""
    try:
        n = flat.flatten(images)
    except (OSError, TorporError) as e:
        log.error("checkpoint %s: image directory not flattened: %s", cid, e)
        print(f"torpor-runtime: warning: {images}: subdirectories kept ({e}); containerd's "
              "CRI cannot archive this checkpoint", file=sys.stderr)
        return
    if n:
        log.info("checkpoint %s: %d file(s) of its subdirectories flattened", cid, n)


def _open_store(cfg: Config, cid: str) -> Store | None:
    try:
        return policy.open_store(cfg, "the checkpoint is not packed into the store")
    except policy.StoreError as e:
        log.error("checkpoint %s: %s", cid, e)
        print(f"torpor-runtime: warning: {e}", file=sys.stderr)
        return None


def _checkpoint(cfg: Config, runtime: Runtime, cid: str, name: str, spec: dict[str, Any],
                use: Any, pid: int, images: Path, data: agent_data.DataDir, thawed: "_Thaw",
                leave_running: bool, store: Store | None, work: Path) -> int:
    t0 = time.monotonic()
    ensure_running(cfg)
    timings: dict[str, float] = {}
    fps = policy.FingerprintMode.of(store is not None, leave_running).value
    stage = None
    with Client(cfg, timeout=work_timeout(cfg)) as c, interrupts.deferred():
        paused = time.monotonic()
        try:
            with thawed:
                if leave_running:   # asks the agents what they will move: a container the
                    # engine paused (containerd's CRI does) answers only once thawed
                    stage = pause.staging(cfg, cid, name, pid)
                    paused = time.monotonic()
                ck = c.lock_and_checkpoint(pids=[pid], owner_pid=os.getpid(),
                                           gpu_data_dir=(stage or data).root,
                                           agent_container_id=name, fingerprints=fps,
                                           staged=stage is not None,
                                           drain=stage is not None)   # pause.after reads it
        finally:
            if stage is not None and _stage_done(cfg, stage, sys.exc_info()[0] is not None
                                                 or not ck.agents):
                stage.remove()
        staged = stage if stage is not None and ck.agents else None
        op_id = ck.op_id
        timings.update(ck.timings)
        # the copiers got ready while the container still ran (torpord's, before its pause)
        paused += ck.timings.get("copier-ready", 0.0)
        log.info("checkpoint %s: %s locked and checkpointed %s in %.2f s%s", cid, op_id,
                 [p.pid for p in ck.cuda_processes], time.monotonic() - t0,
                 "".join(f"; agent of {a.pid} moved {a.bytes} bytes in {a.seconds:.2f} s"
                         for a in ck.agents))
        draft = _draft(cid, spec, use, ck, pid, leave_running)
        ours = None   # our journal entry while a write-out is ahead (pause.py)
        try:
            manifest.write_draft(images, draft)
            if staged is not None:   # no checkpoint until written out (a recovery: damaged)
                ours = pause.begin(cfg, images, staged)
        except BaseException as e:
            with thawed:
                c.rollback(op_id)
            (images / manifest.DRAFT).unlink(missing_ok=True)   # no checkpoint: none of it
            (images / WRITING).unlink(missing_ok=True)
            data.remove()
            if stage is not None:
                stage.remove()
            if isinstance(e, OSError):   # a full or read-only image directory: the operator's
                raise RolledBackError(f"writing {e.filename or images} before the dump: "
                                      f"{e.strerror or e}; the container's GPU state was "
                                      "rolled back, it keeps running") from e
            raise
        t = time.monotonic()
        try:
            rc = runtime.run().wait()
        except TorporError as e:   # never started, nothing dumped: rolled back as a failure
            log.error("checkpoint %s: %s", cid, e.line())
            print(f"torpor-runtime: error: {e.line()}", flush=True, file=sys.stderr)
            rc = e.exit_code
        timings["dump"] = time.monotonic() - t
        if rc != 0:
            with thawed:
                c.rollback(op_id)   # the agents have their memory back: their files can go
            (images / manifest.DRAFT).unlink(missing_ok=True)
            (images / WRITING).unlink(missing_ok=True)
            data.remove()
            if stage is not None:
                stage.remove()   # the agents have it back
            if ours is not None:
                ours.close()
            report = f"{Path(runtime.path).name} checkpoint failed (exit {rc}); the container's " \
                     "GPU state was rolled back, it keeps running"
            log.error("checkpoint %s: %s", cid, report)
            print(f"torpor-runtime: {report}", flush=True, file=sys.stderr)
            return rc
        t = time.monotonic()
        with thawed:
            out = _end(cfg, c, cid, op_id, leave_running, staged=staged is not None)
        timings.update(out.timings if out else {})
        timings["finish"] = time.monotonic() - t
        if leave_running:
            pause.after(cfg, cid, images, draft, staged, ours, ck, out is not None, paused,
                        timings, held=sum(a.held for a in out.agents) if out else 0,
                        work=work, drained=out.drained if out else 0,
                        drain_error=out.drain_error if out else "")
    try:
        # into the store: its sha256 names every chunk, and a pack that fails adds them
        m = manifest.seal(images, cfg.checksums and store is None, timings)
    except (OSError, TorporError) as e:
        # The images are complete and the draft names the GPUs: a restore still works (it
        # warns that nothing was verified). The dump itself succeeded: not an error for podman.
        log.error("checkpoint %s: torpor.json not sealed: %s", cid, e)
        print(f"torpor-runtime: warning: {images}: GPU manifest not sealed ({e}); restore will "
              "work without checksums", file=sys.stderr)
        return 0
    log.info("checkpoint %s: done in %.2f s, %d CUDA process(es), %d bytes of images", cid,
             time.monotonic() - t0, len(ck.cuda_processes), m["sizes"]["total"])
    if store is not None:
        _store(cfg, store, images, cid, ck.store_owner, name)
    return 0


def _stage_done(cfg: Config, stage: agent_data.DataDir, failed: bool) -> bool:
    """Whether the staging is this runtime's to remove after LockAndCheckpoint: nothing was
    staged, or it failed and no journal entry names the staging. torpord rolled back and
    removed it, or never made anything, or it died or is still at work (a lost connection, a
    timeout): then its entry's recovery gives the agents their data back from there, the
    only copy of it."""
    return failed and not Journal(cfg).names_data(str(stage.root), but="")


def pack_owner(answered: str, name: str) -> str:
    """The owner a container's checkpoint is packed under: the one torpord handed its agents
    the fingerprints of (answered: LockAndCheckpoint's store_owner), so that what they skipped
    resolves. A torpord from before it answered one (left running across an upgrade) used
    container:<id>, without the root key: that, then, or the pack could not name what the
    agents skipped and the checkpoint would lack it."""
    if answered:
        return fingerprints.check_owner(answered)
    return fingerprints.owner_of(oci.split_name(name)[0])


def _end(cfg: Config, c: Client, cid: str, op_id: str, leave_running: bool,
         staged: bool = False) -> Any:
    """Finish the operation after a dump that succeeded (--leave-running: RestoreAndUnlock).
    A torpord that died meanwhile took the operation with it (the next one does not know it,
    or none answers): its recovery at start, which the journal entry is left to, gives live
    processes their GPU state back, and started here if need be. The checkpoint is complete
    then, unless its GPU data was staged (pause.py says what became of it): not a failure to
    report here. None then."""
    try:
        return c.restore_and_unlock(op_id=op_id) if leave_running else c.finish(op_id)
    except (NotFoundError, SidecarError) as e:
        note = f"torpord lost the operation {op_id} after the dump ({e.line()})" + \
               ("" if staged else "; the checkpoint is complete") + \
               ("; torpord's recovery gives the container its GPU state back"
                if leave_running else "")
        log.warning("checkpoint %s: %s", cid, note)
        print(f"torpor-runtime: warning: {note}", file=sys.stderr)
        try:
            ensure_running(cfg)   # a torpord to recover the operation (a no-op if one runs)
        except TorporError as err:
            log.error("checkpoint %s: %s", cid, err.line())
        return None


def _store(cfg: Config, store: Store, images: Path, cid: str, answered: str, name: str) -> None:
    """Pack the sealed checkpoint into the image store (store_packing.py), under pack_owner's
    owner (the one whose snapshots its agents skipped). The checkpoint is done whatever happens
    here: a failure leaves it unpacked, the GPU data its agents skipped filled in from the
    store (podman may export the directory to another host), and says why."""
    snap = f"{cid[:12]}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S%f}"
    t = time.monotonic()
    try:
        st = store_checkpoint(Engine(cfg), store, images, snap, pack_owner(answered, name))
    except (OSError, TorporError) as e:
        log.error("checkpoint %s: not packed into the store: %s", cid, e)
        print(f"torpor-runtime: warning: {e}", file=sys.stderr)
        return
    log.info("checkpoint %s: packed into %s as %s in %.2f s: %d chunks, %d new (%d bytes), %d "
             "already stored (%d known by fingerprint), %d zero, %d streamed into the store by "
             "the agents at the checkpoint", cid, store.where, snap, time.monotonic() - t,
             st["chunks"], st["new_chunks"], st["new_bytes"], st["reused_chunks"],
             st["by_fingerprint"], st["zero_chunks"], st["streamed"])


class _Thaw:
    """`with thawed:` runs its body with a paused container thawed, and pauses it again after
    (whatever the body did); nothing for a running one. A container that ended meanwhile (a
    dump without --leave-running) is not paused again."""

    def __init__(self, runtime: Runtime, cid: str, paused: bool):
        self.runtime, self.cid, self.paused = runtime, cid, paused

    def __enter__(self) -> None:
        if self.paused:
            log.info("checkpoint %s: paused; thawed for the GPU step", self.cid)
            self.runtime.call("resume", self.cid)

    def __exit__(self, *exc: object) -> None:
        if not self.paused:
            return
        try:
            if self.runtime.state(self.cid).get("status") == "running":
                self.runtime.call("pause", self.cid)
        except TorporError as e:
            log.error("checkpoint %s: could not pause it again: %s", self.cid, e)


def _draft(cid: str, spec: dict[str, Any], use: oci.GpuUse, ck: Checkpointed, pid: int,
           leave_running: bool) -> dict[str, Any]:
    """torpor.json without its file table (manifest.seal adds it)."""
    try:
        inv: gpus.Inventory | None = gpus.discover()
    except NoDriverError:
        inv = None
    cuda = ck.cuda_processes
    used = set(use.uuids(inv)) | {u for p in cuda for u in p.gpu_uuids}
    listed = [mt.Gpu(g.uuid, g.name, g.memory_total, g.index, g.minor)
              for g in (inv.gpus if inv else []) if g.uuid in used]
    # a GPU torpord saw the processes use but NVML does not answer for here: listed all the
    # same (torpor.json's processes name listed GPUs only), its model unknown ("", as the CRIU
    # plugin's manifest has it: placement puts it back onto itself, or where a map says)
    listed += [mt.Gpu(u, "", 0) for u in sorted({u for p in cuda for u in p.gpu_uuids}
                                                 - {g.uuid for g in listed})]
    return manifest.draft(
        torpor_version=__version__, criu_version="",
        driver=mt.Driver(inv.driver_version if inv else None, None),
        root_pid=pid, shell_job=False, leave_running=leave_running,
        gpus=listed,
        processes=[mt.Process(p.pid, True, tuple(p.gpu_uuids), int(p.gpu_memory),
                              comm=procs.comm(p.pid), state=p.state,
                              gpu_memory_by_gpu={u: int(n) for u, n in
                                                 p.gpu_memory_by_gpu.items()})
                   for p in cuda],
        container=mt.Container(cid, tuple(use.minors), tuple(use.visible), tuple(use.cdi),
                               oci.has_agent(spec)),
        agent={a.pid: mt.AgentMove.from_json(a.to_manifest(), f"agent.{a.pid}")
               for a in ck.agents})
