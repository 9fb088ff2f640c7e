#!/usr/bin/env python3
"""A CuPy target for the GPU tests: deterministic updates of bulk GPU memory plus a small model.

The CuPy counterpart of torch_program.py, with the same command line (--gib, --seed,
--steps-file, --status, --max-steps, --sleep), the same steps-file format and the same status
file, so tests/gpu/compare_steps.py compares a run with a reference of the same seed:

    <step> <loss as float.hex()> <bulk checksum, 16 hex digits>

It holds --gib GiB in float32 arrays of at most 1 GiB filled from cupy.random.RandomState(seed)
(so CuPy's memory pool holds them), and each step:
  - draws its batch from RandomState(seed * 1000003 + step) (data depends on (seed, step) only),
  - fits a linear model to a fixed teacher (tanh(x @ T)) with one SGD-with-momentum step, the
    update an ElementwiseKernel (loss: the mean squared error, float32, as float.hex()),
  - updates one rotating 256 MiB window of the bulk arrays in place with an elementwise kernel
    and writes the exact int64 sum of that window's raw 32-bit words as the checksum: every
    window is both changed and read back over the run, so lost or stale GPU memory after a
    restore shows.
No TF32 (CuPy's default), one stream, no atomics on floats: two runs agree bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import cupy as cp

from program_io import write_status

CHUNK_BYTES = 1 << 30
SLICE_BYTES = 256 << 20
WIDTH, BATCH = 1024, 256
LR, MOMENTUM = 0.01, 0.9

SGD = cp.ElementwiseKernel("float32 g, float32 mu, float32 lr", "float32 w, float32 v",
                           "v = mu * v + g; w = w - lr * v;", "torpor_sgd_momentum")
DECAY = cp.ElementwiseKernel("float32 s", "float32 x", "x = x * 0.99951171875f + s",
                             "torpor_bulk_decay")


def make_bulk(gib: float, seed: int) -> list:
    rs = cp.random.RandomState(seed)
    left, bulk = int(gib * (1 << 30)) // 4 * 4, []
    while left > 0:
        n = min(left, CHUNK_BYTES)
        bulk.append(rs.uniform(-1.0, 1.0, size=n // 4, dtype=cp.float32))
        left -= n
    return bulk


def slices(bulk: list) -> list[tuple[int, int, int]]:
    per = SLICE_BYTES // 4
    return [(k, a, min(a + per, t.size)) for k, t in enumerate(bulk) for a in range(0, t.size, per)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--steps-file", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-steps", type=int, default=0, help="exit after N steps (0: forever)")
    p.add_argument("--sleep", type=float, default=0.05)
    args = p.parse_args(argv)

    state = {"pid": os.getpid(), "step": 0, "ready": False, "gib": args.gib, "seed": args.seed,
             "done": False, "cupy": cp.__version__}
    write_status(args.status, state)
    cp.cuda.Device(0).use()
    bulk = make_bulk(args.gib, args.seed)
    windows = slices(bulk)
    rs = cp.random.RandomState(args.seed + 1)
    scale = cp.float32(1.0 / WIDTH ** 0.5)
    w = rs.standard_normal((WIDTH, WIDTH), dtype=cp.float32) * scale
    teacher = rs.standard_normal((WIDTH, WIDTH), dtype=cp.float32) * scale
    v = cp.zeros_like(w)
    cp.cuda.Device(0).synchronize()
    state["ready"] = True
    pool = cp.get_default_memory_pool()
    state["pool_total"], state["pool_used"] = int(pool.total_bytes()), int(pool.used_bytes())
    write_status(args.status, state)
    print(f"cupy_program: pid {os.getpid()} gib {args.gib} seed {args.seed} cupy {cp.__version__}",
          flush=True)

    step = 0
    with open(args.steps_file, "a"):
        pass
    while not args.max_steps or step < args.max_steps:
        step += 1
        drs = cp.random.RandomState(args.seed * 1_000_003 + step)
        x = drs.standard_normal((BATCH, WIDTH), dtype=cp.float32)
        y = cp.tanh(x @ teacher)
        diff = x @ w - y
        loss = float((diff * diff).mean())
        grad = (x.T @ diff) * cp.float32(2.0 / (BATCH * WIDTH))
        SGD(grad, cp.float32(MOMENTUM), cp.float32(LR), w, v)
        checksum = 0
        if windows:
            k, a, b = windows[step % len(windows)]
            window = bulk[k][a:b]
            DECAY(cp.float32(((step % 7) - 3) * 1e-6), window)
            checksum = int(window.view(cp.int32).sum(dtype=cp.int64)) & 0xFFFFFFFFFFFFFFFF
        line = f"{step} {loss.hex()} {checksum:016x}\n"
        fd = os.open(args.steps_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        state["step"] = step
        write_status(args.status, state)
        if args.sleep > 0:
            time.sleep(args.sleep)
    state["done"] = True
    write_status(args.status, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
