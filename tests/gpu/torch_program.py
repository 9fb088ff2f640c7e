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

--status is JSON, replaced atomically: {"pid", "step", "ready", "gib", "seed", "done", "updated",
"graphs", "cache_gib", "alloc_conf", "allocator_backend", "reserved", "allocated",
"steps_per_s"}; "ready" turns true once the memory is allocated and filled. "reserved" and
"allocated" are torch.cuda's figures, refreshed every step; "steps_per_s" is the rate since
step RATE_FROM (for overhead measurements, with --sleep 0).

--graphs: the training step is captured in a torch.cuda.CUDAGraph once warmed up (the first
GRAPH_WARMUP steps run eagerly on a side stream, as torch.cuda.graphs asks) and replayed every
step after, with static input and target tensors the step's data is copied into.

--cache-gib N: N GiB more are allocated in tensors once the model is built, then freed: the
caching allocator keeps them reserved but unused (a program whose allocator caches as much as
it uses). The allocator's configuration (PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True)
comes from the environment and is recorded in the status.

--zeros-gib N: N GiB more held in torch.zeros tensors (written once, with zeros: memory the
program reserved and never used, as a JAX arena is), covered by the rotating checksum like the
bulk (their windows sum to 0 while intact).

--stall-file PATH: while PATH exists, each step first keeps the GPU busy for about STALL_S
seconds (torch.cuda._sleep, a kernel that only spins; the results do not change), counted in
the status's "stalls": a program whose work in flight outlasts a driver lock's timeout.
"""

from __future__ import annotations

import os
import sys
import time

# Must be set before torch initializes cuBLAS: deterministic GEMMs need a fixed workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from program_io import after_step, append_step, program_args, write_status  # noqa: E402

CHUNK_BYTES = 1 << 30   # each bulk tensor holds at most 1 GiB
SLICE_BYTES = 256 << 20  # one checksum covers 256 MiB
WIDTH, BATCH = 1024, 256
GRAPH_WARMUP = 3         # eager steps before --graphs captures the step
RATE_FROM = 20           # steps_per_s counts from this step on
STALL_S = 4.0            # --stall-file: the GPU kept busy this long a step


def allocator_backend() -> str:
    try:
        return str(torch.cuda.get_allocator_backend())
    except Exception as e:  # older or newer torch: only for the record
        return f"unknown ({type(e).__name__})"


def memory_figures(state: dict) -> None:
    state["reserved"] = int(torch.cuda.memory_reserved())
    state["allocated"] = int(torch.cuda.memory_allocated())


def chunk_sizes(gib: float) -> list[int]:
    """Byte sizes (multiples of 4, each at most CHUNK_BYTES) adding up to gib GiB."""
    left, out = int(gib * (1 << 30)) // 4 * 4, []
    while left > 0:
        out.append(min(left, CHUNK_BYTES))
        left -= out[-1]
    return out


def make_bulk(gib: float, seed: int, device: torch.device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    bulk = []
    for n in chunk_sizes(gib):
        t = torch.empty(n // 4, dtype=torch.float32, device=device)
        t.uniform_(-1.0, 1.0, generator=gen)
        bulk.append(t)
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
    p = program_args(__doc__.splitlines()[0], "GiB of bulk GPU memory to hold")
    p.add_argument("--graphs", action="store_true",
                   help="capture the training step in a CUDA graph and replay it")
    p.add_argument("--cache-gib", type=float, default=0.0,
                   help="GiB allocated and freed at start: left reserved in the allocator cache")
    p.add_argument("--zeros-gib", type=float, default=0.0,
                   help="GiB more held in torch.zeros tensors (checked, never written again)")
    p.add_argument("--stall-file", help="while this file exists, each step first keeps the GPU "
                   f"busy for about {STALL_S:g} s")
    args = p.parse_args(argv)

    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    device = torch.device("cuda", 0)
    state = {"pid": os.getpid(), "step": 0, "ready": False, "gib": args.gib, "seed": args.seed,
             "done": False, "graphs": args.graphs, "cache_gib": args.cache_gib,
             "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
             "allocator_backend": allocator_backend()}
    write_status(args.status, state)

    bulk = make_bulk(args.gib, args.seed, device)
    bulk += [torch.zeros(n // 4, dtype=torch.float32, device=device)
             for n in chunk_sizes(args.zeros_gib)]
    windows = slices(bulk)
    torch.manual_seed(args.seed)  # model init on the CPU generator, then moved
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH)).to(device)
    teacher = torch.nn.Linear(WIDTH, WIDTH, bias=False).to(device).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data_gen = torch.Generator(device=device)
    if args.cache_gib > 0:  # after the model: its tensors must not be carved out of the cache
        cache = [torch.ones(n // 4, dtype=torch.float32, device=device)
                 for n in chunk_sizes(args.cache_gib)]
        torch.cuda.synchronize()
        del cache                        # reserved, unused: the allocator keeps it
    static_x = torch.zeros(BATCH, WIDTH, device=device)
    static_y = torch.zeros(BATCH, WIDTH, device=device)
    side = torch.cuda.Stream(device) if args.graphs else None
    graph: torch.cuda.CUDAGraph | None = None
    static_loss: torch.Tensor | None = None

    def eager_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    def capture() -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The step on static_x/static_y, captured (torch.cuda.graphs' whole-network capture)."""
        g = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)  # the graph's backward allocates the grads in its pool
        with torch.cuda.graph(g):
            out = torch.nn.functional.mse_loss(model(static_x), static_y)
            out.backward()
            opt.step()
        return g, out

    torch.cuda.synchronize()
    state["ready"] = True
    memory_figures(state)
    write_status(args.status, state)
    print(f"torch_program: pid {os.getpid()} gib {args.gib} seed {args.seed} "
          f"device {torch.cuda.get_device_name(0)}", flush=True)

    step, rate_t0 = 0, time.perf_counter()
    with open(args.steps_file, "a"):  # create it up front; each step reopens it (see append)
        pass
    state["stalls"] = 0
    while not args.max_steps or step < args.max_steps:
        step += 1
        if args.stall_file and os.path.exists(args.stall_file):
            state["stalls"] += 1
            torch.cuda._sleep(int(STALL_S * 2e9))   # cycles (~2 GHz); in flight till .item()
            write_status(args.status, state)
        data_gen.manual_seed(args.seed * 1_000_003 + step)  # data depends on (seed, step) only
        x = torch.randn(BATCH, WIDTH, device=device, generator=data_gen)
        y = torch.tanh(teacher(x))
        if args.graphs and graph is None and step > GRAPH_WARMUP:
            graph, static_loss = capture()   # captured, not run: the replay below runs it
        if graph is not None:
            static_x.copy_(x)
            static_y.copy_(y)
            graph.replay()
            loss = static_loss
        elif side is not None:  # warm-up before the capture, on a side stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = eager_step(x, y)
            torch.cuda.current_stream().wait_stream(side)
        else:
            loss = eager_step(x, y)
        line = f"{step} {float(loss.item()).hex()} {bulk_checksum(bulk, windows, step):016x}\n"
        append_step(args.steps_file, line)
        state["step"] = step
        now = time.perf_counter()
        if step == RATE_FROM:
            rate_t0 = now
        elif step > RATE_FROM:
            state["steps_per_s"] = (step - RATE_FROM) / max(now - rate_t0, 1e-9)
        memory_figures(state)
        after_step(args, state)
    state["done"] = True
    write_status(args.status, state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
