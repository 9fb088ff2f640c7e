#!/usr/bin/env python3
"""An inference target for the GPU tests: a randomly initialised decoder-only transformer
generating greedily with a KV cache, deterministic, in PyTorch (what `transformers`' generate
does for a random-init model, without needing that package on the GPU host).

Its GPU memory is weights (--gib GiB, float32, from a seeded CUDA generator, never changed after
start: what an inference server holds) and the KV cache of BATCH sequences of up to MAX_LEN
tokens (written every step). Each step decodes one token for every sequence; a sequence that
reaches MAX_LEN starts over from a new prompt seeded by (seed, sequence number). Each step
appends one line to --steps-file and fsyncs it, in torch_program.py's three-field format so
compare_steps.py compares two runs:

    <step> <tokens of the batch, comma-separated>:<seq 0's top logit as float.hex()> <checksum>

The checksum is the int64 sum of the raw 32-bit words of one layer's KV cache (rotating with
the step): a flipped bit in the cache shows within a few steps, and a wrong weight shows in the
tokens. --status is torch_program.py's JSON ("ready", "step", "done", "gib", ...).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from program_io import program_args, run_steps, write_status  # noqa: E402
from torch_program import memory_figures  # noqa: E402

VOCAB, WIDTH, HEADS, MLP = 32000, 2048, 16, 4 * 2048
BATCH, MAX_LEN, PROMPT = 4, 256, 16
LAYER_FLOATS = 4 * WIDTH * WIDTH + 2 * WIDTH * MLP      # q, k, v, o and the MLP's two


def layers_for(gib: float) -> int:
    left = gib * (1 << 30) / 4 - 2 * VOCAB * WIDTH       # embedding and output head
    return max(1, round(left / LAYER_FLOATS))


class Model:
    def __init__(self, gib: float, seed: int, device: torch.device):
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)

        def weight(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, generator=gen) * 0.02

        self.embed, self.head = weight(VOCAB, WIDTH), weight(WIDTH, VOCAB)
        self.layers = [{"qkv": weight(WIDTH, 3 * WIDTH), "o": weight(WIDTH, WIDTH),
                        "up": weight(WIDTH, MLP), "down": weight(MLP, WIDTH)}
                       for _ in range(layers_for(gib))]
        shape = (BATCH, HEADS, MAX_LEN, WIDTH // HEADS)
        self.k = [torch.zeros(shape, device=device) for _ in self.layers]
        self.v = [torch.zeros(shape, device=device) for _ in self.layers]

    def forward(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """Logits for the next token of each sequence, tokens (BATCH,) at position pos; the
        KV cache gains position pos."""
        x = self.embed[tokens]
        hd = WIDTH // HEADS
        for i, layer in enumerate(self.layers):
            h = torch.nn.functional.layer_norm(x, (WIDTH,))
            q, k, v = (h @ layer["qkv"]).split(WIDTH, dim=-1)
            self.k[i][:, :, pos] = k.view(BATCH, HEADS, hd)
            self.v[i][:, :, pos] = v.view(BATCH, HEADS, hd)
            keys, values = self.k[i][:, :, :pos + 1], self.v[i][:, :, :pos + 1]
            att = torch.einsum("bhd,bhtd->bht", q.view(BATCH, HEADS, hd), keys) / hd ** 0.5
            out = torch.einsum("bht,bhtd->bhd", att.softmax(-1), values).reshape(BATCH, WIDTH)
            x = x + out @ layer["o"]
            h = torch.nn.functional.layer_norm(x, (WIDTH,))
            x = x + torch.nn.functional.gelu(h @ layer["up"]) @ layer["down"]
        return torch.nn.functional.layer_norm(x, (WIDTH,)) @ self.head

    def checksum(self, step: int) -> int:
        i = step % len(self.layers)
        words = torch.cat([self.k[i].view(-1), self.v[i].view(-1)]).view(torch.int32)
        return int(words.sum(dtype=torch.int64).item()) & 0xFFFFFFFFFFFFFFFF


class Generation:
    """Greedy decoding of BATCH sequences, one token each a step; a sequence that reaches
    MAX_LEN starts over from the next prompt."""

    def __init__(self, model: Model, seed: int, device: torch.device):
        self.model, self.seed, self.device = model, seed, device
        self.sequence, self.pos, self.tokens = 0, 0, None

    @torch.no_grad()
    def step(self, n: int) -> str:
        """Step n's steps-file line."""
        if self.tokens is None or self.pos == MAX_LEN:      # a new sequence: prefill its prompt
            self.sequence, self.pos = self.sequence + 1, 0
            given = prompt(self.seed, self.sequence, self.device)
            for t in range(PROMPT - 1):
                self.model.forward(given[:, t], self.pos)
                self.pos += 1
            self.tokens = given[:, -1]
        logits = self.model.forward(self.tokens, self.pos)
        self.pos += 1
        top, self.tokens = logits.max(dim=-1)
        return (f"{n} {','.join(str(int(t)) for t in self.tokens.tolist())}:"
                f"{float(top[0].item()).hex()} {self.model.checksum(n):016x}\n")


def prompt(seed: int, sequence: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + sequence)
    return torch.randint(0, VOCAB, (BATCH, PROMPT), device=device, generator=gen)


def main(argv=None) -> int:
    args = program_args(__doc__.splitlines()[0], "GiB of weights").parse_args(argv)

    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", 0)
    state = {"pid": os.getpid(), "step": 0, "ready": False, "gib": args.gib, "seed": args.seed,
             "done": False, "kind": "infer"}
    write_status(args.status, state)
    model = Model(args.gib, args.seed, device)
    torch.cuda.synchronize()
    state.update(ready=True, layers=len(model.layers))
    memory_figures(state)
    write_status(args.status, state)
    print(f"infer_program: pid {os.getpid()} gib {args.gib} layers {len(model.layers)} seed "
          f"{args.seed} device {torch.cuda.get_device_name(0)}", flush=True)

    gen = Generation(model, args.seed, device)

    def step(n: int) -> str:
        line = gen.step(n)
        memory_figures(state)
        return line
    return run_steps(args, state, step)


if __name__ == "__main__":
    sys.exit(main())
