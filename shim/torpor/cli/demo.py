"""torpor demo: checkpoint and restore a self-verifying demo program (GPU when present)."""

from __future__ import annotations

import argparse

from .. import procs
from ..demo import scenario
from ..errors import UsageError
from ..progress import human_bytes
from .context import Context, path_arg, timing_lines

NEEDS_RECOVERY = True


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help=__doc__.split(":")[1].strip(), description=__doc__)
    p.add_argument("--cpu", action="store_true", help="CPU program even when a GPU is present")
    p.add_argument("--mib", type=int, default=256, help="memory the program holds (default 256)")
    p.add_argument("--keep", type=path_arg, metavar="DIR", help="keep the checkpoint in DIR")


def run(args: argparse.Namespace, ctx: Context) -> int:
    if args.mib < 1:
        raise UsageError("--mib must be at least 1")
    free = procs.mem_available()   # the checkpoint holds it in host memory, GPU or not
    if free is not None and args.mib > free >> 20:
        raise UsageError(f"--mib {args.mib} is more than the {free >> 20} MiB of memory this "
                         "host has available")
    r = scenario.run(ctx.engine, cpu=args.cpu, mib=args.mib, keep=args.keep)
    where = r["device"] or "the CPU"
    ctx.emit(r, f"demo passed: a program holding {r['mib']} MiB on {where} was checkpointed "
             f"({human_bytes(r['checkpoint']['size'])}), restored as PID {r['restored_pid']}, "
             f"and verified its data\ncheckpoint:\n{timing_lines(r['checkpoint']['timings'])}\n"
             f"restore:\n{timing_lines(r['restore']['timings'])}")
    return 0
