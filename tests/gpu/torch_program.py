#!/usr/bin/env python3
"""A PyTorch target for the GPU tests and benchmarks: deterministic training plus bulk GPU memory.

It holds --gib GiB of device memory in a few large float32 tensors filled from a seeded CUDA
generator, and trains a small MLP with SGD (momentum) on seeded synthetic data with
deterministic algorithms. Each step appends one line to --steps-file and fsyncs it:

    <step> <loss as float.hex()> <bulk checksum, 16 hex digits>

The bulk checksum is the exact int64 sum of the raw 32-bit words of one rotating 256 MiB slice
of the bulk tensors (so a single flipped bit anywhere is eventually seen, and the sum does not
depend on reduction order). Two runs with the same seed write bit-identical lines step by step,
so a checkpointed and restored run can be compared with an uninterrupted one
(tests/gpu/compare_steps.py).

--status is JSON, replaced atomically: {"pid", "step", "ready", "gib", "seed", "done", "updated"};
"ready" turns true once the memory is allocated and filled.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Must be set before torch initializes cuBLAS: deterministic GEMMs need a fixed workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

CHUNK_BYTES = 1 << 30   # each bulk tensor holds at most 1 GiB
SLICE_BYTES = 256 << 20  # one checksum covers 256 MiB
WIDTH, BATCH = 1024, 256


def write_status(path: str, state: dict) -> None:
    state["pid"], state["updated"] = os.getpid(), time.time()
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.write("\n")
    os.replace(tmp, path)


def make_bulk(gib: float, seed: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    left, bulk = int(gib * (1 << 30)) // 4 * 4, []
    while left > 0:
        n = min(left, CHUNK_BYTES)
        t = torch.empty(n // 4, dtype=torch.float32, device=device)
        t.uniform_(-1.0, 1.0, generator=gen)
        bulk.append(t)
        left -= n
    return bulk


def slices(bulk: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(tensor index, first element, end element) of every 256 MiB window."""
    per = SLICE_BYTES // 4
    return [(k, a, min(a + per, t.numel()))
            for k, t in enumerate(bulk) for a in range(0, t.numel(), per)]


def bulk_checksum(bulk: list[torch.Tensor], windows, step: int) -> int:
    if not windows:
        return 0
    k, a, b = windows[step % len(windows)]
    words = bulk[k][a:b].view(torch.int32)
    return int(words.sum(dtype=torch.int64).item()) & 0xFFFFFFFFFFFFFFFF


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB of bulk GPU memory to hold")
    p.add_argument("--steps-file", required=True)
    p.add_argument("--status", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-steps", type=int, default=0, help="exit after N steps (0: forever)")
    p.add_argument("--sleep", type=float, default=0.05, help="seconds between steps")
    args = p.parse_args(argv)

    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda", 0)
    state = {"pid": os.getpid(), "step": 0, "ready": False, "gib": args.gib, "seed": args.seed,
             "done": False}
    write_status(args.status, state)

    bulk = make_bulk(args.gib, args.seed, device)
    windows = slices(bulk)
    torch.manual_seed(args.seed)  # model init on the CPU generator, then moved
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH)).to(device)
    teacher = torch.nn.Linear(WIDTH, WIDTH, bias=False).to(device).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data_gen = torch.Generator(device=device)
    torch.cuda.synchronize()
    state["ready"] = True
    write_status(args.status, state)
    print(f"torch_program: pid {os.getpid()} gib {args.gib} seed {args.seed} "
          f"device {torch.cuda.get_device_name(0)}", flush=True)

    step = 0
    with open(args.steps_file, "a"):  # create it up front; each step reopens it (see append)
        pass
    while not args.max_steps or step < args.max_steps:
        step += 1
        data_gen.manual_seed(args.seed * 1_000_003 + step)  # data depends on (seed, step) only
        x = torch.randn(BATCH, WIDTH, device=device, generator=data_gen)
        y = torch.tanh(teacher(x))
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        line = f"{step} {float(loss.item()).hex()} {bulk_checksum(bulk, windows, step):016x}\n"
        # Open, append, fsync, close: no descriptor on the file stays open across a checkpoint,
        # so CRIU need not match its size at restore.
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
