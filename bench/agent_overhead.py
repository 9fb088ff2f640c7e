#!/usr/bin/env python3
"""Benchmark: what the in-process agent costs a running program (issue 20: <= 1 %).

Two PyTorch workloads, each run --reps times as a fresh process without the agent ("plain")
and --reps times under it (`torpor run --`, as GPU containers now get it by default),
interleaved (plain, agent, agent, plain, ...: drift of clocks or neighbours falls on both):

  train  a training loop: an MLP of --train-layers x --train-width, AdamW, batch --train-batch,
         eager PyTorch (every kernel launch and allocation through the driver calls the agent
         wraps); per step: forward, backward, step, torch.cuda.synchronize().
  infer  token latency: a decoder of --infer-layers x --infer-width with a KV cache, greedy,
         batch --infer-batch; per token: one forward of the new tokens, argmax, synchronize.

  cpu    no GPU: a pure-Python loop, for the harness on a machine without one (its figures
         mean nothing; tests/integration/test_agent_overhead_harness.py).

Each run warms up (--warmup steps/tokens), then times --steps steps (train) / --tokens tokens
(infer) one by one (time.perf_counter around each, synchronized), no file I/O in the loop, and
reports its median, mean and p90. A run's figure is its median; the comparison is the median of
the runs' medians each way:

    overhead_pct = (agent - plain) / plain * 100     (step time / token latency; <= 1 % target)

Each child checks /proc/self/maps: plain runs must not have libtorpor-agent.so mapped, agent runs
must (else the run is an error, not a figure). The JSON (--out) holds every run's figures, the
medians, the overhead per workload and the environment (GPU, torch, driver); it is rewritten
after every run so a run cut short keeps what it measured.

    python3 bench/agent_overhead.py --out bench/results/agent_overhead-h200.json [--reps 10]

The agent's socket directory is a private temporary one (--agent-dir to choose). torpor is
this checkout's (shim/ on PYTHONPATH) when it holds the built agent library
(shim/torpor/_agent/, as tests/gpu/run-on-gpu-host.sh puts it), else the installed one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
TARGET_PCT = 1.0
AGENT_SONAME = "libtorpor-agent.so"


# -- the child: one workload, timed -------------------------------------------------------------

def agent_mapped() -> bool:
    try:
        return AGENT_SONAME in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def summary(times: list[float]) -> dict:
    s = sorted(times)
    return {"n": len(s), "median_s": statistics.median(s), "mean_s": statistics.fmean(s),
            "p90_s": s[min(len(s) - 1, int(0.9 * len(s)))], "min_s": s[0]}


def _timed(step, warmup: int, steps: int) -> list[float]:
    """step() warmup times, then each of `steps` calls timed (seconds)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def child_train(a: argparse.Namespace) -> list[float]:
    import torch
    torch.manual_seed(a.seed)
    dev = torch.device("cuda", 0)
    layers = []
    for _ in range(a.train_layers):
        layers += [torch.nn.Linear(a.train_width, a.train_width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(a.train_width, 1)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(a.train_batch, a.train_width, device=dev)
    y = torch.randn(a.train_batch, 1, device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()

    return _timed(step, a.warmup, a.steps)


def child_infer(a: argparse.Namespace) -> list[float]:
    import torch
    torch.manual_seed(a.seed)
    dev = torch.device("cuda", 0)
    W, L, B, H = a.infer_width, a.infer_layers, a.infer_batch, a.infer_heads
    vocab, max_len = 32000, a.warmup + a.tokens + 16
    emb = torch.randn(vocab, W, device=dev) * 0.02
    head = torch.randn(W, vocab, device=dev) * 0.02
    qkv = [torch.randn(W, 3 * W, device=dev) * 0.02 for _ in range(L)]
    out = [torch.randn(W, W, device=dev) * 0.02 for _ in range(L)]
    up = [torch.randn(W, 4 * W, device=dev) * 0.02 for _ in range(L)]
    down = [torch.randn(4 * W, W, device=dev) * 0.02 for _ in range(L)]
    kc = torch.zeros(L, B, H, max_len, W // H, device=dev)
    vc = torch.zeros_like(kc)
    tokens = torch.randint(0, vocab, (B,), device=dev)

    @torch.no_grad()
    def token(pos: int) -> None:
        nonlocal tokens
        h = emb[tokens]                                          # (B, W)
        for i in range(L):
            q, k, v = (h @ qkv[i]).split(W, dim=-1)
            q, k, v = (t.view(B, H, W // H) for t in (q, k, v))
            kc[i, :, :, pos], vc[i, :, :, pos] = k, v
            att = torch.einsum("bhd,bhtd->bht", q, kc[i, :, :, :pos + 1]) / (W // H) ** 0.5
            ctx = torch.einsum("bht,bhtd->bhd", att.softmax(-1), vc[i, :, :, :pos + 1])
            h = h + ctx.reshape(B, W) @ out[i]
            h = h + torch.nn.functional.gelu(h @ up[i]) @ down[i]
        tokens = (h @ head).argmax(-1)
        torch.cuda.synchronize()

    for pos in range(a.warmup):
        token(pos)
    times = []
    for pos in range(a.warmup, a.warmup + a.tokens):
        t = time.perf_counter()
        token(pos)
        times.append(time.perf_counter() - t)
    return times


def child_cpu(a: argparse.Namespace) -> list[float]:
    def step() -> int:
        return sum(i * i for i in range(20000))
    return _timed(step, a.warmup, a.steps)


def child(a: argparse.Namespace) -> int:
    run = {"train": child_train, "infer": child_infer, "cpu": child_cpu}[a.child]
    times = run(a)
    doc = {"workload": a.child, "pid": os.getpid(), "agent_mapped": agent_mapped(),
           **summary(times), "times_s": [round(t, 7) for t in times]}
    tmp = a.child_out + ".tmp"
    Path(tmp).write_text(json.dumps(doc))
    os.replace(tmp, a.child_out)
    return 0


# -- the parent: interleaved runs ---------------------------------------------------------------

def child_argv(a: argparse.Namespace, workload: str, out: Path) -> list[str]:
    argv = [sys.executable, str(HERE), "--child", workload, "--child-out", str(out),
            "--seed", str(a.seed), "--warmup", str(a.warmup)]
    if workload == "cpu":
        argv += ["--steps", str(a.steps)]
    elif workload == "train":
        argv += ["--steps", str(a.steps), "--train-width", str(a.train_width),
                 "--train-layers", str(a.train_layers), "--train-batch", str(a.train_batch)]
    else:
        argv += ["--tokens", str(a.tokens), "--infer-width", str(a.infer_width),
                 "--infer-layers", str(a.infer_layers), "--infer-batch", str(a.infer_batch),
                 "--infer-heads", str(a.infer_heads)]
    return argv


def one_run(a: argparse.Namespace, workload: str, mode: str, rep: int, work: Path,
            env: dict) -> dict:
    out = work / f"{workload}-{mode}-{rep}.json"
    argv = child_argv(a, workload, out)
    if mode == "agent":
        argv = [sys.executable, "-m", "torpor.cli.main", "run", "--agent-dir",
                str(a.agent_dir), "--", *argv]
    t = time.monotonic()
    r = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=a.run_timeout)
    wall = time.monotonic() - t
    if r.returncode != 0 or not out.exists():
        return {"error": f"exit {r.returncode}: {(r.stderr or r.stdout)[-1500:]}", "wall_s": wall}
    doc = json.loads(out.read_text())
    if doc["agent_mapped"] != (mode == "agent"):
        doc["error"] = (f"{AGENT_SONAME} {'not ' if mode == 'agent' else ''}mapped in a "
                        f"{mode} run")
    doc["wall_s"] = wall
    if not a.keep_times:
        doc.pop("times_s", None)
    return doc


def environment() -> dict:
    info: dict = {"host": platform.node(), "python": platform.python_version(),
                  "kernel": platform.release(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                      time.gmtime())}
    try:
        import torch
        info.update(torch=torch.__version__, cuda=torch.version.cuda,
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception as e:  # the figures still stand without the record
        info["torch_error"] = str(e)
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        info["driver"] = r.stdout.strip()
    return info


def analyse(runs: list[dict]) -> dict:
    out = {}
    for workload in sorted({r["workload"] for r in runs}):
        med = {}
        for mode in ("plain", "agent"):
            good = [r["median_s"] for r in runs
                    if r["workload"] == workload and r["mode"] == mode and "error" not in r]
            med[mode] = {"runs": len(good), "median_of_medians_s":
                         statistics.median(good) if good else None}
        p, g = med["plain"]["median_of_medians_s"], med["agent"]["median_of_medians_s"]
        pct = (g - p) / p * 100 if p and g else None
        out[workload] = {**med, "overhead_pct": None if pct is None else round(pct, 3),
                         "target_pct": TARGET_PCT,
                         "meets_target": None if pct is None else pct <= TARGET_PCT}
    return out


def parent(a: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="torpor-aovh-"))
    if a.agent_dir is None:
        a.agent_dir = Path(tempfile.mkdtemp(prefix="tpao-", dir="/tmp"))
    a.agent_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    env = dict(os.environ)
    if (ROOT / "shim" / "torpor" / "_agent" / AGENT_SONAME).is_file():   # this checkout's
        parts = [str(ROOT / "shim"), *filter(None, env.get("PYTHONPATH", "").split(":"))]
        env["PYTHONPATH"] = ":".join(dict.fromkeys(parts))
    env["TORPOR_AGENT_DIR"] = str(a.agent_dir)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("LD_PRELOAD", None)
    doc: dict = {"bench": "agent_overhead", "args": {k: str(v) if isinstance(v, Path) else v
                                                      for k, v in vars(a).items()},
                 "environment": environment(), "runs": [], "result": {}}

    def save() -> None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_name(a.out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, a.out)

    try:
        for rep in range(a.reps):
            for workload in a.workloads:
                order = ("plain", "agent") if (rep + a.workloads.index(workload)) % 2 == 0 \
                    else ("agent", "plain")
                for mode in order:
                    r = one_run(a, workload, mode, rep, work, env)
                    r.update(workload=workload, mode=mode, rep=rep)
                    doc["runs"].append(r)
                    doc["result"] = analyse(doc["runs"])
                    save()
                    fig = f"{r['median_s'] * 1e3:8.3f} ms median" if "error" not in r \
                        else f"ERROR {r['error'][:200]}"
                    print(f"rep {rep:2d} {workload:5s} {mode:5s}: {fig}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for workload, res in doc["result"].items():
        print(f"{workload}: plain {res['plain']['median_of_medians_s']} s, agent "
              f"{res['agent']['median_of_medians_s']} s ({res['plain']['runs']}/"
              f"{res['agent']['runs']} runs): overhead {res['overhead_pct']} % "
              f"(target <= {TARGET_PCT} %)")
    errors = [r for r in doc["runs"] if "error" in r]
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "agent_overhead.json")
    ap.add_argument("--reps", type=int, default=10, help="runs each way per workload (>= 10)")
    ap.add_argument("--workloads", nargs="+", choices=["train", "infer", "cpu"],
                    default=["train", "infer"])
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--steps", type=int, default=400, help="timed training steps per run")
    ap.add_argument("--tokens", type=int, default=400, help="timed tokens per run")
    ap.add_argument("--train-width", type=int, default=2048)
    ap.add_argument("--train-layers", type=int, default=8)
    ap.add_argument("--train-batch", type=int, default=256)
    ap.add_argument("--infer-width", type=int, default=2048)
    ap.add_argument("--infer-layers", type=int, default=16)
    ap.add_argument("--infer-batch", type=int, default=4)
    ap.add_argument("--infer-heads", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--agent-dir", type=Path, default=None)
    ap.add_argument("--run-timeout", type=float, default=600)
    ap.add_argument("--keep-times", action="store_true", help="every step's time in the JSON")
    ap.add_argument("--child", choices=["train", "infer", "cpu"], help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a)
    if a.reps < 1:
        ap.error("--reps must be at least 1 (the target asks for >= 10)")
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
