"""torpor ls / rm NAME... / gc [--verify]: the checkpoints in the image store (config store_dir),
removing some, collecting the chunks none of them needs any more, and (--verify) finding the
damaged ones."""

from __future__ import annotations

import argparse
import dataclasses

from .. import oci, store_packing
from ..progress import human_bytes
from ..errors import ExitCode
from ..flows import policy
from ..store import Store, VerifyResult
from .context import Context

# A pack that a dead torpor left is finished first (store_packing.py): its directory's holes are
# filled from chunks that rm and gc could otherwise take away.
NEEDS_RECOVERY = True


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ls", help="list the checkpoints in the store with their sizes",
                       description="List the checkpoints kept in the image store (config "
                       "store_dir) by 'torpor checkpoint --store NAME': name, creation time, "
                       "files, size, bytes stored and bytes no other checkpoint shares.")
    p.set_defaults(action=list_snapshots)
    p = sub.add_parser("rm", help="remove checkpoints from the store (their chunks go at gc)",
                       description="Remove checkpoints from the image store by NAME ('torpor "
                       "ls' lists them). Their chunks stay until 'torpor gc' frees those no "
                       "other checkpoint needs.")
    p.add_argument("names", nargs="+", metavar="NAME", help="checkpoint name, as 'torpor ls' shows")
    p.set_defaults(action=remove)
    p = sub.add_parser("gc", help="remove the chunks no checkpoint needs, and leftovers of "
                       "interrupted checkpoints",
                       description="Free the image store's space: remove the chunks no "
                       "checkpoint in it needs any more, and what interrupted checkpoints left "
                       "behind. Chunks that checkpoint directories link to are kept. With "
                       "--verify, first read and check every chunk, and remove the damaged ones "
                       "(a new checkpoint stores them again); exit 9 when one was damaged, or a "
                       "checkpoint names one that is missing.")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.add_argument("--verify", action="store_true", help="read and check every chunk first, "
                   "removing the damaged ones; exit 9 when one was damaged or missing")
    p.set_defaults(action=collect)


def open_store(ctx: Context) -> Store:
    return policy.open_store(ctx.cfg)


def list_snapshots(args: argparse.Namespace, ctx: Context) -> None:
    rows = open_store(ctx).snapshots()
    lines = [f"{'NAME':<32} {'CREATED':<25} {'FILES':>5} {'SIZE':>11} {'STORED':>11} "
             f"{'UNIQUE':>11}  OWNER"]
    lines += [f"{r.name:<32} {r.created:<25} {r.files:>5} {human_bytes(r.logical):>11} "
              f"{human_bytes(r.stored):>11} {human_bytes(r.unique):>11}  {_short(r.owner)}"
              for r in rows]
    if not rows:
        lines.append(f"(no checkpoints in {ctx.cfg.store_dir})")
    ctx.emit({"store": str(ctx.cfg.store_dir),
              "snapshots": [dataclasses.asdict(r) for r in rows]}, "\n".join(lines))


def _short(owner: str) -> str:
    """A container's owner (fingerprints.owner_of) as podman shows a container, its ID's
    first 12 digits, then its runtime root's key whole: container:<12>@<root key> (one ID
    under two roots is two owners), container:<12> for an earlier torpor's container (no
    key). --json has it whole."""
    kind, _, name = owner.partition(":")
    if kind != "container":
        return owner or "-"
    cid, sep, key = name.partition(oci.NAME_SEP)
    return f"{kind}:{cid[:12]}{sep}{key}"


def _refuse_while_a_pack_is_unfinished(ctx: Context) -> None:
    """rm and gc could take chunks that the directory of a pack a dead torpor left still
    needs. Recovery ran first (NEEDS_RECOVERY): a pack entry left now is one it could not
    finish (its reason was printed above)."""
    busy = store_packing.unfinished(ctx.engine.journal)
    if busy is not None:
        raise busy


def remove(args: argparse.Namespace, ctx: Context) -> None:
    _refuse_while_a_pack_is_unfinished(ctx)
    removed = open_store(ctx).remove(args.names)
    ctx.emit({"removed": removed}, f"removed {', '.join(removed)} "
             "(`torpor gc` frees the chunks no other checkpoint needs)")


def collect(args: argparse.Namespace, ctx: Context) -> int:
    if not args.dry_run:
        _refuse_while_a_pack_is_unfinished(ctx)
    store = open_store(ctx)
    v = None
    if args.verify:
        read = [0]

        def seen(n: int) -> None:
            read[0] += n

        with ctx.progress.phase("verify", f"every chunk of {store.where}",
                                measure=lambda: read[0]):
            v = store.verify(dry_run=args.dry_run, seen=seen)
    r = store.gc(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    kept = f"; kept {r.kept_linked} linked from checkpoint directories" if r.kept_linked else ""
    line = (f"{verb} {len(r.removed)} chunk(s) and {human_bytes(r.temp_freed)} of leftovers: "
            f"{human_bytes(r.freed)} freed{kept}")
    obj = {**dataclasses.asdict(r), "dry_run": args.dry_run}
    if v is None:
        ctx.emit(obj, line)
        return ExitCode.OK
    ctx.emit({**obj, "verify": dataclasses.asdict(v)}, f"{_verify_line(v, args.dry_run)}\n{line}")
    return ExitCode.CORRUPT if v.damaged or v.missing else ExitCode.OK


def _verify_line(v: VerifyResult, dry_run: bool) -> str:
    text = f"verified {v.checked} chunk(s) ({human_bytes(v.bytes)}): "
    if not v.damaged and not v.missing:
        return text + "none damaged"
    parts = []
    if v.damaged:
        parts.append(f"{len(v.damaged)} damaged, " + ("would be removed" if dry_run else
                                                       "removed"))
    if v.missing:
        parts.append(f"{len(v.missing)} named but missing")
    text += "; ".join(parts)
    if v.snapshots:
        text += (f"; checkpoints that named them (they no longer restore): "
                 f"{', '.join(v.snapshots)}")
    if v.damaged and not dry_run:
        text += "; a new checkpoint stores those chunks again"
    return text


def run(args: argparse.Namespace, ctx: Context) -> int:
    return int(args.action(args, ctx) or 0)
