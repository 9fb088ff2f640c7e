#!/usr/bin/env python3
"""A job of several ranks, started the way torchrun starts one: this launcher starts --ranks
copies of torch_program.py as its children (rank r: seed --seed + r, files rank<r>.steps,
rank<r>.status.json, rank<r>.log and stall file rank<r>.stall in --workdir), writes
job.json {"pids": [...]} there, waits for them and exits with the first failure. torpor
checkpoints the launcher's process tree: every rank in one operation (issue 6, item 3).
--devices 0,1 gives rank r the GPU devices[r % len] (CUDA_VISIBLE_DEVICES), as a 2-GPU job has
it; without it every rank inherits the launcher's GPUs (and uses the first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TORCH_PROGRAM = Path(__file__).resolve().parent / "torch_program.py"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--devices", default="", help="comma-separated GPUs dealt out to the ranks")
    args = p.parse_args()
    devices = [d for d in args.devices.split(",") if d]
    ranks = []
    for r in range(args.ranks):
        w = args.workdir
        with open(w / f"rank{r}.log", "ab") as log:
            ranks.append(subprocess.Popen(
                [sys.executable, str(TORCH_PROGRAM), "--gib", f"{args.gib:g}",
                 "--seed", str(args.seed + r), "--max-steps", str(args.max_steps),
                 "--steps-file", str(w / f"rank{r}.steps"),
                 "--status", str(w / f"rank{r}.status.json"),
                 "--stall-file", str(w / f"rank{r}.stall")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=w,
                env=dict(os.environ, CUDA_VISIBLE_DEVICES=devices[r % len(devices)])
                if devices else None))
    tmp = args.workdir / "job.json.tmp"
    tmp.write_text(json.dumps({"pids": [r.pid for r in ranks], "launcher": os.getpid()}))
    os.replace(tmp, args.workdir / "job.json")
    codes = [r.wait() for r in ranks]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
