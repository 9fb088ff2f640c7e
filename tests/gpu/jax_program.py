#!/usr/bin/env python3
"""A JAX target for the GPU tests and bench/jax_driver_path.py: a jitted matmul loop whose
state (a matrix of --gib GiB in float32, from a fixed PRNG key) lives on the GPU, one line a
step in compare_steps.py's format (its loss is the state's mean as float.hex(), its checksum
the int64 sum of the state's raw words).

JAX reserves XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU (default 0.75) as one arena at start
unless XLA_PYTHON_CLIENT_PREALLOCATE=false; bit-exact comparison needs
XLA_FLAGS="--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0" (programs.py and the
benchmark set them).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from program_io import program_args, run_steps, write_status  # noqa: E402


def main(argv=None) -> int:
    args = program_args(__doc__.splitlines()[0], "GiB of state").parse_args(argv)
    n = max(256, int((args.gib * (1 << 30) / 4) ** 0.5) // 256 * 256)
    key = jax.random.PRNGKey(args.seed)
    x = jax.random.normal(key, (n, n), dtype=jnp.float32) / n ** 0.5
    w = jax.random.normal(jax.random.fold_in(key, 1), (n, n), dtype=jnp.float32) / n ** 0.5

    @jax.jit
    def step(x):
        y = jnp.tanh(x @ w) + 0.5 * x
        return y / (jnp.abs(y).max() + 1e-6)

    state = {"pid": os.getpid(), "step": 0, "ready": False, "gib": args.gib, "seed": args.seed,
             "done": False, "kind": "jax", "n": n}
    x = step(x).block_until_ready()
    state["ready"] = True
    write_status(args.status, state)
    print(f"jax_program: pid {os.getpid()} n {n} devices {jax.devices()}", flush=True)
    box = {"x": x}

    def one(i: int) -> str:
        box["x"] = step(box["x"]).block_until_ready()
        mean = float(box["x"].mean())
        words = jax.lax.bitcast_convert_type(box["x"], jnp.int32).astype(jnp.int64).sum()
        return f"{i} {mean.hex()} {int(words) & 0xFFFFFFFFFFFFFFFF:016x}\n"
    return run_steps(args, state, one)


if __name__ == "__main__":
    sys.exit(main())
