"""torpor checkpoint PID -D DIR [--leave-running] [--store NAME]: checkpoint a process tree, GPU state included."""

from __future__ import annotations

import argparse
import time

from .. import procs
from ..flows.process import checkpoint, checkpoint_into_store
from ..progress import human_bytes
from .context import Context, agent_line, path_arg, timing_lines

NEEDS_RECOVERY = True


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help=__doc__.split(":")[1].strip(), description=__doc__)
    p.add_argument("pid", help="root of the process tree to checkpoint")
    p.add_argument("-D", "--images-dir", required=True, type=path_arg,
                   help="new or empty directory for the checkpoint (created 0700)")
    p.add_argument("--leave-running", action="store_true",
                   help="the program keeps running after the dump")
    p.add_argument("--shell-job", action=argparse.BooleanOptionalAction, default=None,
                   help="CRIU --shell-job (default: when the tree's session or tty lies outside it)")
    p.add_argument("--store", metavar="NAME",
                   help="then keep it in the image store (config store_dir) as NAME: DIR is "
                        "left holding the manifest and the store's chunks (hard links), each "
                        "stored once however many checkpoints hold it ('torpor ls')")


def run(args: argparse.Namespace, ctx: Context) -> int:
    pid = procs.parse_pid(args.pid)
    kw = {"leave_running": args.leave_running, "shell_job": args.shell_job}
    start = time.monotonic()
    if args.store is not None:   # "" too: a bad name (as 'torpor rm ""'), never no store
        m, stored = checkpoint_into_store(ctx.engine, pid, args.images_dir, args.store, **kw)
    else:
        m, stored = checkpoint(ctx.engine, pid, args.images_dir, **kw), None
    durable = round(time.monotonic() - start, 4)   # sealed (and stored): on disk, fsynced
    pause = m.get("pause") if isinstance(m.get("pause"), dict) else {}
    cuda = [p for p in m["processes"] if p["cuda"]]
    out = {"images_dir": str(args.images_dir), "manifest": m, "stored": stored,
           "durable_s": durable}
    if pause:
        out.update(paused_s=pause.get("paused_s"), staged=bool(pause.get("staged")),
                   held=int(pause.get("held") or 0),
                   drained_bytes=int((pause.get("drained") or {}).get("bytes") or 0),
                   criu_frozen_s=(pause.get("criu") or {}).get("frozen_s"))
    ctx.emit(out,
             f"checkpointed PID {pid} ({len(m['processes'])} process(es), {len(cuda)} with CUDA "
             f"state, {human_bytes(m['sizes']['gpu_memory'])} GPU memory) into {args.images_dir}: "
             f"{human_bytes(m['sizes']['total'])}\n"
             + agent_line(m.get("agent", {}))
             + (store_line(stored) if stored else "")
             + (pause_line(pause, durable) if args.leave_running else "")
             + timing_lines(ctx.engine.progress.timings))  # torpor.json's, plus the seal
    return 0


def store_line(s: dict) -> str:
    return (f"kept in store {s['store']} as {s['name']}: {s['chunks']} chunk(s) of "
            f"{human_bytes(s['logical'])}: {s['new_chunks']} new ({human_bytes(s['new_bytes'])} "
            f"written), {s['reused_chunks']} already stored ({s['by_fingerprint']} known by "
            f"fingerprint), {s['zero_chunks']} zero"
            + (f"; {s['streamed']} streamed by the agents straight into the store"
               if s.get("streamed") else "") + "\n")


def pause_line(pause: dict, durable: float) -> str:
    """--leave-running: how long the program was paused, and when the checkpoint was durable."""
    if not pause:
        return "the program is still running\n"
    return (f"the program is still running: paused {float(pause.get('paused_s', 0)):.2f} s"
            + (", its GPU data written out while it ran" if pause.get("staged") else "")
            + (f", {pause['held']} allocation(s) of GPU memory kept on the GPU (not copied "
               "back)" if isinstance(pause.get("held"), int) and pause["held"] > 0 else "")
            + (f", {human_bytes(int(pause['drained'].get('bytes') or 0))} of it copied into "
               "the checkpoint beside the dump" if isinstance(pause.get("drained"), dict)
               and pause["drained"].get("bytes") else "")
            + f"; the checkpoint durable after {durable:.2f} s\n")
