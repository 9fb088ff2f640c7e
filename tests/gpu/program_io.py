"""What every GPU test program shares, without importing a GPU library: its arguments, its
status file (JSON, replaced atomically) and its steps file (one fsynced line a step, in
compare_steps.py's format). The programs run as scripts, so this directory is on their path."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable


def write_status(path: str, state: dict) -> None:
    state["pid"], state["updated"] = os.getpid(), time.time()
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.write("\n")
    os.replace(tmp, path)


def program_args(description: str, gib_help: str) -> argparse.ArgumentParser:
    """The arguments every GPU test program takes (programs.py passes them)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--gib", type=float, default=1.0, help=gib_help)
    p.add_argument("--steps-file", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-steps", type=int, default=0, help="exit after N steps (0: forever)")
    p.add_argument("--sleep", type=float, default=0.05, help="seconds between steps")
    return p


def append_step(path: str, line: str) -> None:
    """Open, append, fsync, close: no descriptor on the file stays open across a checkpoint,
    so CRIU need not match its size at restore."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def after_step(args: argparse.Namespace, state: dict) -> None:
    """The status with this step in it, then the pause between steps."""
    write_status(args.status, state)
    if args.sleep > 0:
        time.sleep(args.sleep)


def run_steps(args: argparse.Namespace, state: dict, step: Callable[[int], str]) -> int:
    """Steps 1, 2, ... until --max-steps (0: forever): each line step(n) returns appended to
    the steps file, then the status (step n in it) and the pause; at the end "done"."""
    with open(args.steps_file, "a"):    # there from the start, even before the first step
        pass
    n = 0
    while not args.max_steps or n < args.max_steps:
        n += 1
        append_step(args.steps_file, step(n))
        state["step"] = n
        after_step(args, state)
    state["done"] = True
    write_status(args.status, state)
    return 0
