#!/usr/bin/env python3
"""Benchmark: what torpor-runtime costs a CPU container, against plain runc, in one run.

Legs (each the OCI runtime podman and containerd's runc shim are given):
  runc     runc itself
  front    torpor-runtime, the native front (shim/front): it execs runc for CPU containers
  python   torpor-runtime-py, the Python side alone (what torpor-runtime was before the front)

Measured, interleaved (each round runs every leg once, the order rotating from round to
round, so drift on a shared machine falls on all legs alike), after --warmup rounds not kept:
  podman   `podman run --rm` of a CPU container (/usr/bin/true, host /usr bound read-only)
  ctr      `ctr run --rm` of the same image through a private containerd (io.containerd.runc.v2,
           --runc-binary)
  call     one runtime call alone: `<runtime> state <no such container>` (runc answers),
           --call-repeat times per leg and round (a few ms each: more samples for the median)
Medians, means, spreads, the ratios leg/runc of the medians and the paired figures (median of
each round's difference and ratio to that round's runc) go to --out (JSON). The target of
issue 20: front/runc within 1.05 for podman and ctr.

    python3 bench/runtime_front.py --runs 15 --out bench/results/runtime_front-cpu-DATE.json
        [--front /usr/local/bin/torpor-runtime] [--python <venv>/bin/torpor-runtime-py]
        [--runc runc] [--legs runc front python] [--tools podman ctr call]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shim"), str(ROOT)]

from integration.containers import Containerd, Podman  # noqa: E402

TOOLS = ("podman", "ctr", "call")


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    t = time.perf_counter()
    out = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         timeout=120, env=env)
    dt = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return dt


class Bench:
    def __init__(self, runtimes: dict[str, str], tools: list[str]):
        self.runtimes = runtimes
        self.tools = tools
        self.n = 0
        self.podman = Podman("runc") if "podman" in tools else None
        self.image = self.podman.ensure_image() if self.podman else ""
        self.ctrd = Containerd("runc") if "ctr" in tools else None
        self.ctr_image = self.ctrd.ensure_image() if self.ctrd else ""

    def podman_run(self, runtime: str) -> float:
        assert self.podman is not None
        base = [a if a != "runc" else runtime for a in self.podman.base]
        return timed([*base, "run", "--rm", *Podman.RUN_ARGS, "--mount",
                      "type=bind,src=/usr,dst=/usr,ro=true", self.image, "/usr/bin/true"])

    def ctr_run(self, runtime: str) -> float:
        assert self.ctrd is not None
        self.n += 1
        name = f"rf-{os.getpid()}-{self.n}"
        return timed([self.ctrd.ctr, "--address", str(self.ctrd.address), "--namespace",
                      self.ctrd.namespace, "run", "--rm", "--null-io", "--runtime",
                      Containerd.RUNTIME, "--runc-binary", runtime, "--mount",
                      "type=bind,src=/usr,dst=/usr,options=bind:ro", self.ctr_image, name,
                      "/usr/bin/true"])

    def call(self, runtime: str) -> float:
        t = time.perf_counter()
        out = subprocess.run([runtime, "state", "torpor-bench-no-such-container"],
                             capture_output=True, timeout=60)
        dt = time.perf_counter() - t
        if out.returncode == 0 or b"does not exist" not in out.stderr:
            raise SystemExit(f"{runtime} state: unexpected answer {out.stderr!r}")
        return dt

    def one(self, tool: str, runtime: str) -> float:
        return {"podman": self.podman_run, "ctr": self.ctr_run, "call": self.call}[tool](runtime)

    def close(self) -> None:
        if self.ctrd:
            self.ctrd.stop()


def summary(xs: list[float]) -> dict:
    return {"runs": len(xs), "median_s": statistics.median(xs), "mean_s": statistics.fmean(xs),
            "min_s": min(xs), "max_s": max(xs),
            "stdev_s": statistics.stdev(xs) if len(xs) > 1 else 0.0, "samples_s": xs}


def version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--call-repeat", type=int, default=10)
    ap.add_argument("--runc", default="runc")
    ap.add_argument("--front", default="/usr/local/bin/torpor-runtime")
    ap.add_argument("--python", default=str(Path(sys.prefix) / "bin" / "torpor-runtime-py"))
    ap.add_argument("--legs", nargs="+", default=["runc", "front", "python"])
    ap.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (podman, containerd)")
    runtimes = {"runc": shutil.which(a.runc) or a.runc, "front": a.front, "python": a.python}
    runtimes = {leg: runtimes[leg] for leg in a.legs}
    for leg, path in runtimes.items():
        if not os.access(path, os.X_OK):
            raise SystemExit(f"{leg}: {path} is not executable")
    bench = Bench(runtimes, a.tools)
    samples: dict[str, dict[str, list[float]]] = {t: {leg: [] for leg in runtimes}
                                                  for t in a.tools}
    legs = list(runtimes)
    t0, load0 = time.monotonic(), os.getloadavg()
    try:
        for r in range(a.warmup + a.runs):
            order = legs[r % len(legs):] + legs[:r % len(legs)]
            for tool in a.tools:
                for _ in range(a.call_repeat if tool == "call" else 1):
                    for leg in order:
                        dt = bench.one(tool, runtimes[leg])
                        if r >= a.warmup:
                            samples[tool][leg].append(dt)
            print(f"round {r + 1}/{a.warmup + a.runs}"
                  f"{' (warm-up)' if r < a.warmup else ''}: " +
                  "  ".join(f"{t} " + " ".join(f"{leg}={samples[t][leg][-1]:.3f}"
                                                for leg in legs if samples[t][leg])
                            for t in a.tools), flush=True)
    finally:
        bench.close()
    results = {}
    for tool in a.tools:
        legs_out = {leg: summary(xs) for leg, xs in samples[tool].items()}
        base = legs_out.get("runc", {}).get("median_s")
        ratios = {f"{leg}/runc": legs_out[leg]["median_s"] / base
                  for leg in legs_out if leg != "runc" and base}
        # paired: each round's leg against that round's runc, so drift of the shared
        # machine between rounds cancels (the estimate that counts under load)
        paired = {f"{leg}/runc": {
            "median_diff_s": statistics.median(y - x for x, y in zip(samples[tool]["runc"], xs)),
            "median_ratio": statistics.median(y / x for x, y in zip(samples[tool]["runc"], xs))}
            for leg, xs in samples[tool].items() if leg != "runc" and "runc" in samples[tool]}
        results[tool] = {"legs": legs_out, "median_ratio": ratios, "paired": paired,
                         "median_overhead_s": {f"{leg}-runc": legs_out[leg]["median_s"] - base
                                               for leg in legs_out if leg != "runc" and base}}
    doc = {
        "benchmark": "runtime_front",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
        "load_avg_at_start": load0, "load_avg_at_end": os.getloadavg(),
        "runtimes": runtimes,
        "versions": {"runc": version([runtimes.get("runc", a.runc), "--version"]),
                     "podman": version(["podman", "--version"]),
                     "ctr": version(["ctr", "--version"])},
        "runs": a.runs, "warmup": a.warmup, "call_repeat": a.call_repeat, "interleaved": True,
        "seconds": time.monotonic() - t0,
        "target": "front/runc median ratio <= 1.05 for podman and ctr (issue 20, item 5)",
        "results": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    for tool in a.tools:
        print(f"{tool}: " + "  ".join(
            f"{leg} {v['median_s'] * 1000:.1f} ms" for leg, v in results[tool]["legs"].items())
            + "  " + "  ".join(f"{k} {v:.3f}" for k, v in results[tool]["median_ratio"].items())
            + "  paired " + "  ".join(
                f"{k} {v['median_ratio']:.3f} ({v['median_diff_s'] * 1000:+.1f} ms)"
                for k, v in results[tool]["paired"].items()))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
