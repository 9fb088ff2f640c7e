#!/usr/bin/env python3
"""A data-parallel training target for the GPU tests: torch.distributed with the NCCL backend
and DistributedDataParallel, the code path of a torchrun job, at world size --world-size with
this process as --rank (one rank a GPU: --rank r uses GPU r). Ranks meet through a file
(--init-file, torch's FileStore), so no TCP connection stays open between them for CRIU.

Each step trains the model on this rank's seeded batch; DDP all-reduces the gradients over
NCCL. Each step appends one line to --steps-file, in torch_program.py's three-field format:

    <step> <loss as float.hex()> <sum of the parameters' raw 32-bit words, 16 hex digits>

Every rank holds the same parameters after each step, so a rank's lines depend on every
rank's data: a restored job must go on exactly as an uninterrupted one. --status is
torch_program.py's JSON; "nccl" records NCCL's version.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")      # issue 6: no NVLink multicast
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from program_io import program_args, run_steps, write_status  # noqa: E402
from torch_program import make_bulk, memory_figures  # noqa: E402

WIDTH, BATCH = 1024, 256


def main() -> int:
    p = program_args(__doc__.splitlines()[0], "GiB of bulk GPU memory to hold besides the model")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--init-file", required=True, help="the ranks' rendezvous file (FileStore)")
    args = p.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", args.rank)
    torch.cuda.set_device(device)
    state = {"ready": False, "step": 0, "done": False, "gib": args.gib, "seed": args.seed,
             "rank": args.rank, "world_size": args.world_size,
             "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    write_status(args.status, state)
    dist.init_process_group("nccl", init_method=f"file://{args.init_file}",
                            world_size=args.world_size, rank=args.rank)
    bulk = make_bulk(args.gib, args.seed, device) if args.gib > 0 else []
    torch.manual_seed(args.seed)                   # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    data_gen = torch.Generator(device=device)
    dist.barrier()
    torch.cuda.synchronize()
    state["ready"] = True
    state["bulk_tensors"] = len(bulk)
    memory_figures(state)
    write_status(args.status, state)

    def step(n: int) -> str:
        data_gen.manual_seed((args.seed * 1_000_003 + n) * 131 + args.rank)
        x = torch.randn(BATCH, WIDTH, device=device, generator=data_gen)
        y = torch.tanh(x.flip(1))
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()                            # DDP: an NCCL all-reduce of the gradients
        opt.step()
        words = sum(int(q.detach().view(torch.int32).to(torch.int64).sum()) for q in
                    model.parameters()) & (2**64 - 1)
        return f"{n} {float(loss.item()).hex()} {words:016x}\n"

    try:
        return run_steps(args, state, step)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
