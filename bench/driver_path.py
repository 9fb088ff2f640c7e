#!/usr/bin/env python3
"""Benchmark: the driver path (lock / checkpoint / dump / restore / gpu-restore / unlock) of
PyTorch processes holding N GiB, with pinned host<->device copies measured in the same run as
the yardstick. Writes JSON (--out) and prints a table.

    python3 bench/driver_path.py --sizes 1 8 32 --images-root /tmp/torpor-bench --out r.json

Each size: start tests/gpu/torch_program.py holding N GiB, wait until it is training, then
torpor.flows.process.checkpoint + torpor.flows.process.restore (CRIU to --images-root), check the
restored program keeps training with the same loss sequence as an uninterrupted reference
run of the same seed (bit_exact), and record per-phase seconds and GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shim"), str(ROOT)]

from tests.gpu.compare_steps import compare  # noqa: E402
from torpor import config, gpus  # noqa: E402
from torpor.flows import process  # noqa: E402
from torpor.engine import Engine  # noqa: E402
from torpor.progress import Progress  # noqa: E402

GB = 1e9


def pinned_copy_gbps(gib: float = 4.0) -> dict[str, float]:
    import torch
    n = int(gib * (1 << 30))
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[name] = n / min(times) / GB
    del dev, host
    torch.cuda.empty_cache()
    return out


def start(tmp: Path, name: str, gib: float, max_steps: int = 0) -> tuple[subprocess.Popen, Path, Path]:
    steps, status = tmp / f"{name}.steps", tmp / f"{name}.status.json"
    log = open(tmp / f"{name}.log", "wb")
    p = subprocess.Popen([sys.executable, str(ROOT / "tests/gpu/torch_program.py"), "--gib", str(gib),
                          "--steps-file", str(steps), "--status", str(status),
                          "--max-steps", str(max_steps)],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    return p, steps, status


def status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def wait(path: Path, pred, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = status(path)
        if s and pred(s):
            return s
        time.sleep(0.05)
    raise TimeoutError(f"{path}: {status(path)}")


def one_size(gib: float, images_root: Path, tmp: Path) -> dict:
    cfg = config.load()
    ref, ref_steps, ref_status = start(tmp, f"ref{gib:g}", gib, max_steps=40)
    prog, steps, st = start(tmp, f"prog{gib:g}", gib)
    try:
        wait(st, lambda s: s.get("ready") and s.get("step", 0) >= 5, 600)
        images = images_root / f"ck-{gib:g}g"
        shutil.rmtree(images, ignore_errors=True)
        inv = gpus.discover()
        used = inv.memory_of(prog.pid)
        ck = Engine(cfg, Progress(None))
        m = process.checkpoint(ck, prog.pid, images)
        prog.wait(timeout=60)
        at = status(st).get("step", 0)
        rs = Engine(cfg, Progress(None))
        r = process.restore(rs, images)
        wait(st, lambda s: s.get("step", 0) >= at + 10, 300)
        wait(ref_status, lambda s: s.get("done") or s.get("step", 0) >= 39, 600)
        n, mismatch = compare(str(ref_steps), str(steps))
        # ck.progress has the seal too (torpor.json cannot hold its own seal time)
        phases = {**ck.progress.timings, **{f"restore:{k}": v for k, v in r["timings"].items()}}
        rates = {}
        for ph, b in (("checkpoint", used), ("dump", m["sizes"]["total"]),
                      ("restore:restore", m["sizes"]["total"]), ("restore:gpu-restore", used)):
            if phases.get(ph):
                rates[ph] = round(b / phases[ph] / GB, 3)
        return {"gib": gib, "gpu_memory_bytes": used, "image_bytes": m["sizes"]["total"],
                "seconds": {k: round(v, 3) for k, v in phases.items()}, "gb_per_s": rates,
                "bit_exact": mismatch is None and n >= 10, "steps_compared": n,
                "mismatch": mismatch}
    finally:
        for p in (prog, ref):
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
        try:
            os.killpg(status(st).get("pid", prog.pid), 9)
        except (ProcessLookupError, PermissionError):
            pass
        shutil.rmtree(images_root / f"ck-{gib:g}g", ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 8, 32])
    ap.add_argument("--images-root", type=Path, default=Path("/tmp/torpor-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/driver_path.json"))
    args = ap.parse_args()
    args.images_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = args.images_root / "programs"
    tmp.mkdir(exist_ok=True)
    inv = gpus.discover()
    result = {"benchmark": "driver_path", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "host": {"gpu": inv.gpus[0].name, "driver": inv.driver_version,
                       "kernel": platform.release(), "cpus": os.cpu_count()},
              "images_root": str(args.images_root), "pinned_copy_gb_per_s": pinned_copy_gbps(),
              "runs": []}
    for gib in args.sizes:
        run = one_size(gib, args.images_root, tmp)
        pin = result["pinned_copy_gb_per_s"]
        run["ratio_vs_pinned"] = {
            "checkpoint": round(run["gb_per_s"].get("checkpoint", 0) / pin["d2h"], 4),
            "gpu-restore": round(run["gb_per_s"].get("restore:gpu-restore", 0) / pin["h2d"], 4)}
        result["runs"].append(run)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        s, g = run["seconds"], run["gb_per_s"]
        print(f"{gib:>5g} GiB  lock {s.get('lock', 0):6.2f}s  checkpoint {s.get('checkpoint', 0):6.2f}s "
              f"({g.get('checkpoint', 0):.2f} GB/s)  dump {s.get('dump', 0):6.2f}s  "
              f"restore {s.get('restore:restore', 0):6.2f}s  gpu-restore "
              f"{s.get('restore:gpu-restore', 0):6.2f}s ({g.get('restore:gpu-restore', 0):.2f} GB/s)  "
              f"unlock {s.get('restore:unlock', 0):5.2f}s  bit_exact={run['bit_exact']}", flush=True)
    print(f"pinned copies: d2h {result['pinned_copy_gb_per_s']['d2h']:.1f} GB/s, "
          f"h2d {result['pinned_copy_gb_per_s']['h2d']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
