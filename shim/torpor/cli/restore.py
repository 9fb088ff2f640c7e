"""torpor restore -D DIR [--device-map OLD=NEW]: restore a checkpointed process tree."""

from __future__ import annotations

import argparse

from ..errors import UsageError
from ..files import printable
from ..placement import parse_device_map
from ..flows.process import restore_any
from .context import Context, agent_line, path_arg, timing_lines

NEEDS_RECOVERY = True


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("restore", help=__doc__.split(":")[1].strip(), description=__doc__)
    p.add_argument("-D", "--images-dir", required=True, type=path_arg,
                   help="directory written by 'torpor checkpoint' (packed into the image "
                        "store with --store or not)")
    p.add_argument("--device-map", action="append", default=[], metavar="OLD=NEW",
                   help="restore GPU OLD (UUID from 'torpor inspect') onto GPU NEW; repeatable "
                        "or comma-separated. Default: same UUID, else same model with room")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the checksum check (sizes are still checked)")


def run(args: argparse.Namespace, ctx: Context) -> int:
    device_map = parse_device_map(args.device_map)
    if args.images_dir.is_file():
        d = args.images_dir
        raise UsageError(f"{d} is a file (an archive?), not a checkpoint directory: restore a "
                         f"podman --export archive with 'podman container restore --import {d}'; "
                         f"unpack any other into a new directory first (mkdir DIR && tar -xf {d} "
                         "-C DIR) and 'torpor restore -D DIR'")
    r = restore_any(ctx.engine, args.images_dir, device_map=device_map,
                    verify=not args.no_verify)
    remap = printable(", ".join(f"{o} -> {n}" for o, n in r["gpu_map"].items()), 2000)
    ctx.emit(r, f"restored {len(r['pids'])} process(es), root PID {r['root_pid']}"
             + (f", {len(r['cuda_pids'])} with CUDA state" if r["cuda_pids"] else "")
             + (f"; GPUs {remap}" if remap else "") + "\n"
             + agent_line(r["agent"], "gave back") + timing_lines(r["timings"]))
    return 0
