#!/usr/bin/env python3
"""The GPU test programs' shape without a GPU: --gib GiB of host memory (weight-like floats,
never changed, and a working area rewritten a MiB per step), the same command line, status and
steps files (compare_steps.py). It lets the benchmarks' harness (bench/store_e2e.py --kind cpu)
run on a machine without a GPU; it measures nothing about GPUs.

Each step rewrites one MiB of the working area (the last eighth of the memory) from a generator
seeded by (seed, step), and writes `<step> <blake2b of that MiB> <blake2b of one rotating
64 MiB slice of all the memory>`: a restored run that lost or changed any byte diverges.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

from program_io import program_args, run_steps, write_status

MiB = 1 << 20
SLICE = 64 * MiB


def digest(data: memoryview) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def main(argv=None) -> int:
    args = program_args(__doc__.splitlines()[0], "GiB of host memory").parse_args(argv)
    state = {"pid": os.getpid(), "step": 0, "ready": False, "gib": args.gib, "seed": args.seed,
             "done": False, "kind": "cpu"}
    write_status(args.status, state)
    size = max(16 * MiB, int(args.gib * (1 << 30)) // MiB * MiB)
    memory = bytearray(size)
    view = memoryview(memory)
    rng = random.Random(args.seed)
    for at in range(0, size, 16 * MiB):             # randbytes takes at most 256 MiB at once
        view[at:at + 16 * MiB] = rng.randbytes(min(16 * MiB, size - at))
    work = size - size // 8 // MiB * MiB or MiB       # the working area's first byte
    slots = (size - work) // MiB
    state["ready"] = True
    write_status(args.status, state)

    def step(n: int) -> str:
        at = work + (n % slots) * MiB
        view[at:at + MiB] = random.Random(args.seed * 1_000_003 + n).randbytes(MiB)
        first = (n * SLICE) % size
        return f"{n} {digest(view[at:at + MiB])} {digest(view[first:first + SLICE])}\n"
    return run_steps(args, state, step)


if __name__ == "__main__":
    sys.exit(main())
