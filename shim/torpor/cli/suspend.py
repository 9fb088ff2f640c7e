"""torpor suspend PID / torpor resume PID: release a program's GPU in place, and give it back."""

from __future__ import annotations

import argparse

from .. import procs
from ..flows.process import resume, suspend
from ..progress import human_bytes
from .context import Context, agent_line, timing_lines

NEEDS_RECOVERY = True


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("suspend", help="move a program's GPU state to host memory and "
                       "release the GPU; the program stays, paused in its CUDA calls",
                       description="Move the GPU state of the process tree rooted at PID into "
                       "host memory and release its GPUs. The program stays, paused in its "
                       "CUDA calls, until 'torpor resume PID'. Nothing is written to disk: a "
                       "reboot loses it (use 'torpor checkpoint' for that).")
    p.add_argument("pid", help="root of the process tree to suspend")
    p.set_defaults(action="suspend")
    p = sub.add_parser("resume", help="give a suspended program its GPU state back",
                       description="Give the process tree rooted at PID, suspended by 'torpor "
                       "suspend', its GPU state back; it carries on where it stopped.")
    p.add_argument("pid", help="PID given to 'torpor suspend'")
    p.set_defaults(action="resume")


def run(args: argparse.Namespace, ctx: Context) -> int:
    pid = procs.parse_pid(args.pid)
    if args.action == "suspend":
        r = suspend(ctx.engine, pid)
        ctx.emit(r, f"suspended {', '.join(map(str, r['pids']))}: "
                 f"{human_bytes(r['gpu_memory_released'])} of GPU memory released\n"
                 + agent_line(r["agent"]) + timing_lines(r["timings"]))
    else:
        r = resume(ctx.engine, pid)
        ctx.emit(r, f"resumed {', '.join(map(str, r['pids']))}\n"
                 + agent_line(r["agent"], "gave back") + timing_lines(r["timings"]))
    return 0
