"""torpor doctor: check CRIU, the kernel, the driver, GPUs and torpord, each with a fix."""

from __future__ import annotations

import argparse
import dataclasses

from ..doctor import FAIL, Check, run_checks
from .context import Context

NEEDS_RECOVERY = False
MARK = {"ok": "\u2713", "fail": "\u2717", "warn": "!"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("doctor", help=__doc__.split(":")[1].strip(), description=__doc__)


def _sidecar_check(ctx: Context) -> Check:
    from ..sidecar.client import ping
    return ping(ctx.cfg)


def run(args: argparse.Namespace, ctx: Context) -> int:
    checks = run_checks(ctx.cfg, sidecar=lambda: _sidecar_check(ctx))
    lines = []
    for c in checks:
        lines.append(f"{MARK[c.status]} {c.name:<11} {c.detail}")
        if c.status != "ok" and c.fix:
            lines.append(f"  {'':<11} fix: {c.fix}")
    failed = [c for c in checks if c.status == FAIL]
    lines.append("all required checks passed" if not failed
                 else f"{len(failed)} required check(s) failed")
    ctx.emit({"checks": [dataclasses.asdict(c) for c in checks], "ok": not failed},
             "\n".join(lines))
    return 1 if failed else 0
