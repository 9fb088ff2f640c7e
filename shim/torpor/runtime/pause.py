"""Short pauses for a container's --leave-running checkpoint (a kubelet's CRI checkpoint is
always one): the agents' GPU data is staged in host memory and written into the image
directory once the container runs again, as a bare checkpoint's (flows/writeout.py: the one
implementation, its memory check, fallback and failure rules).

    staging(cfg, cid, name, pid)  where the agents put their data: a new directory in suspend_dir
                             (torpord makes it: LockAndCheckpoint's `staged`), or None (the
                             data then goes into <image-path>/torpor-gpu/ while the container
                             waits, as before): not under the agent, not enough host memory,
                             config leave_running_staging off
    begin(cfg, images)       before the dump: the image directory marked WRITING and a journal
                             entry of ours naming it
    after(...)               once runc's dump is done and torpord gave the container its GPU
                             back: the staged data written into the image directory while the
                             container runs (the image directory is complete when
                             torpor-runtime returns), torpor.json's "pause" ({"paused_s",
                             "staged", "durable_s"}) and the runtime's log say how long it was
                             paused and when its checkpoint was durable

Should torpor-runtime die after begin(), its journal entry (no PIDs: torpord's operation holds
the container's) makes the next recovery (torpord's, periodically) mark the image directory
damaged, and remove the staging once no other entry names it (torpord's operation ended: the
agents had their data back);
should torpord die (or lose the operation) before it gave the container its GPU back, its own
entry gives the agents their data back from the staging and
removes it. A write-out that fails leaves the container running, nothing staged, the image
directory marked damaged and torpor-runtime exits 8 (RolledBackError) with one line.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from .. import agent, agent_data, criu, gpus, manifest, procs
from ..config import Config
from ..engine import Engine
from ..errors import NoDriverError, RolledBackError, TorporError, describe
from ..flows import writeout
from ..journal import Operation
from ..progress import Progress
from ..sidecar.convert import Checkpointed

log = logging.getLogger("torpor.runtime")


class _LogStream:
    """Progress lines into the runtime's log (podman shows a runtime's stderr as an error)."""

    def write(self, text: str) -> int:
        if text.strip():
            log.info("%s", text.strip())
        return len(text)

    def flush(self) -> None:
        pass


def _engine(cfg: Config) -> Engine:
    return Engine(cfg, Progress(stream=_LogStream()))  # type: ignore[arg-type]


def staging(cfg: Config, cid: str, name: str, pid: int) -> agent_data.DataDir | None:
    """A staging directory (not made yet) for the agents of container cid (root pid; name:
    its agent directory's, lifecycle.agent_name), or None when their data goes straight into
    the image directory (the reason is logged)."""
    try:
        tree = procs.tree(pid)
        try:
            inv = gpus.discover()
            nvml = sum(inv.memory_of(p) for p in tree)
        except NoDriverError:
            nvml = 0
        return writeout.staging(_engine(cfg), tree, nvml, agent.container_dir(cfg.run_dir, name))
    except (OSError, TorporError) as e:
        log.warning("checkpoint %s: not staged in host memory: %s", cid, describe(e))
        return None


def begin(cfg: Config, images: Path, stage: agent_data.DataDir) -> Operation:
    """Before the dump of a staged checkpoint: images marked WRITING (no checkpoint until
    written out) and our journal entry naming it and the staging (no PIDs: torpord's
    operation holds the container's), so that a recovery marks it damaged should
    torpor-runtime die first, and removes the staging once no other entry (torpord's, which
    gives the agents their data back from it) names it."""
    writeout.begin(images)
    op = _engine(cfg).begin("checkpoint", [])
    try:
        op.phase("stage", images_dir=str(images), data_root=str(stage.root))
    except BaseException:
        op.close()
        raise
    return op


def after(cfg: Config, cid: str, images: Path, draft: dict[str, Any],
          stage: agent_data.DataDir | None, op: Operation | None, ck: Checkpointed,
          resumed: bool, t0: float, timings: dict[str, float], held: int = 0,
          work: Path | None = None, drained: int = 0, drain_error: str = "") -> None:
    """The dump is done and the container runs again (resumed: torpord gave it its GPU back;
    t0: when the pause began; held: its allocations that stayed on the GPU through the pause
    and were mapped back; work: where CRIU wrote its stats-dump, the runtime's --work-path
    or the images; drained, drain_error: torpord's deferred copies, RestoreAndUnlock's).
    Writes the staged data out (op: begin()'s) and the draft with its "pause" (as a bare
    checkpoint's, flows/checkpoint.py); raises RolledBackError (the container runs on, images
    marked damaged, nothing staged)."""
    paused = round(time.monotonic() - t0, 4)
    draft["pause"] = {"paused_s": paused, "staged": stage is not None, "held": held}
    if drained or drain_error:
        draft["pause"]["drained"] = {"bytes": drained}
    stats = criu.dump_stats(work or images, since=time.time() - paused)
    if stats:   # how much of the pause was CRIU's freeze
        draft["pause"]["criu"] = stats
    log.info("checkpoint %s: the container runs again, paused %.2f s%s", cid, paused,
             "; its GPU data is written out while it runs" if stage is not None else "")
    if stage is not None and not resumed:
        # torpord's recovery gives the agents their data back from the staging (and removes
        # it): it cannot be written out meanwhile
        why = writeout.abandon(images, TorporError("torpord lost the operation"))
        if op is not None:
            op.close()
        raise RolledBackError(f"checkpoint {cid}: torpord lost the operation before the "
                              f"staged GPU data was written out; the container runs on, and "
                              f"{images} is no checkpoint ({why.split(':')[0]}, marked damaged)")
    if stage is not None and op is not None and drain_error:
        # the copiers did not fill the staging: it lacks the GPU data (the agents' memory
        # is back in the programs, which run on), as a bare checkpoint's (flows/checkpoint.py)
        raise writeout.failed(TorporError(f"the copy of the GPU memory into the data files "
                                          f"failed ({drain_error})"), stage, images, op,
                              "the container", prefix=f"checkpoint {cid}: ")
    if stage is not None and op is not None:
        _write_out(cfg, cid, images, draft, stage, op, ck, timings)
    draft["pause"]["durable_s"] = round(time.monotonic() - t0, 4)
    manifest.write_draft(images, draft)
    log.info("checkpoint %s: paused %.2f s, durable after %.2f s", cid, paused,
             draft["pause"]["durable_s"])


def _write_out(cfg: Config, cid: str, images: Path, draft: dict[str, Any],
               stage: agent_data.DataDir, op: Operation, ck: Checkpointed,
               timings: dict[str, float]) -> None:
    engine = _engine(cfg)
    try:
        # the agents have their data back: from here a recovery removes the staging
        op.phase("writeout", images_dir=str(images), data_root=str(stage.root), scratch=True)
        manifest.write_draft(images, draft)
        moved = {a.pid: a.to_manifest() for a in ck.agents}
        t = time.monotonic()
        writeout.write_out(engine, stage, images, moved)
        timings["writeout"] = time.monotonic() - t
    except BaseException as e:
        raise writeout.failed(e, stage, images, op, "the container",
                              prefix=f"checkpoint {cid}: ") from e
    op.close()
