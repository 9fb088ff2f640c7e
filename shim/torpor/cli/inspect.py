"""torpor inspect DIR|ARCHIVE: what a checkpoint holds (GPUs, processes, timings, sizes).

Every string read from the checkpoint is printed through files.printable (a manifest can
hold terminal escapes); --json output carries the manifest as it was read. --verify holds a
directory to the trust a restore needs (flows.restore.require_trusted_checkpoint) before it
checks the files: what it calls verified, restore takes.
"""

from __future__ import annotations

import argparse

from .. import manifest
from ..archive import read_any, verify_archive
from ..files import printable as p_
from ..flows.restore import require_trusted_checkpoint
from ..progress import human_bytes, human_rate
from ..store import images
from .context import Context, path_arg, timing_lines

NEEDS_RECOVERY = False


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help=__doc__.split(":")[1].split("\n")[0].strip(),
                       description=__doc__.split("\n\n")[0])
    p.add_argument("path", type=path_arg,
                   help="checkpoint directory or archive (.tar, .tar.zst, ...)")
    p.add_argument("--verify", action="store_true",
                   help="also check every file's size and checksum")


def run(args: argparse.Namespace, ctx: Context) -> int:
    archive = args.verify and not args.path.is_dir()
    if args.verify and not archive:   # verified is what restore would take: its trust first
        require_trusted_checkpoint(args.path)
    m = verify_archive(args.path) if archive else read_any(args.path)   # one streaming pass
    verified, packed = None, args.path.is_dir() and images.is_packed(args.path)
    if args.verify and packed:
        verified = images.verify(args.path)   # the files are chunks now: each against its name
    elif args.verify and args.path.is_dir():
        manifest.verify(args.path, m, checksums=True)
        verified = True
    elif archive:
        verified = True                       # verify_archive streamed every member
    lines = [f"torpor checkpoint (schema {m['schema']}) made {p_(m['created'])} on "
             f"{p_(m['host'])}",
             f"  torpor {p_(m['torpor_version'])}, CRIU {p_(m['criu_version'])}, kernel "
             f"{p_(m['kernel'])}, driver {p_(m['driver'].get('version') or '-')}",
             f"  size {human_bytes(m['sizes']['total'])} in {len(m['files'])} files, "
             f"GPU memory {human_bytes(m['sizes'].get('gpu_memory', 0))}"]
    for g in m["gpus"]:
        lines.append(f"  GPU {p_(g.get('index', '?'))}: {p_(g['name'])} {p_(g['uuid'])} "
                     f"({human_bytes(g.get('memory_total', 0))})")
    moved = manifest.agents(m)
    for p in m["processes"]:
        a = moved.get(p["pid"])
        lines.append(f"  PID {p['pid']:>7} {p_(p.get('comm') or '', 16):<16} "
                     + (f"CUDA on {p_(', '.join(p['gpus']) or '?')}, "
                        f"{human_bytes(p['gpu_memory'])}" if p.get("cuda") else "no CUDA state")
                     + (f"; agent moved {human_bytes(a['bytes'])} into {len(a['files'])} "
                        f"file(s) in {float(a.get('seconds', 0)):.2f} s "
                        f"({human_rate(a['bytes'], float(a.get('seconds', 0)))})" if a else ""))
    if m["timings"]:
        lines.append("  timings:\n" + timing_lines(m["timings"]))
    if packed:
        lines.append(f"  packed into an image store: {images.PACKED}, {images.CHUNKS}/")
    if verified and packed:
        lines.append(f"  verified: every one of its {verified} chunks present and matching "
                     "its sha256")
    elif verified:
        lines.append("  verified: every file present with the right size and checksum")
    ctx.emit({"manifest": m, "verified": verified}, "\n".join(lines))
    return 0
