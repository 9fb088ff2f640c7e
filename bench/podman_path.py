#!/usr/bin/env python3
"""Benchmark: podman `container checkpoint --export` / `container restore --import` of a GPU
container (PyTorch holding N GiB), end to end through torpor-runtime, against the hand-run
baseline on the same host in the same run:

  baseline  runtime runc; driver lock+checkpoint of the container's PID by hand, podman
            checkpoint --export, podman rm, podman restore --import, driver restore+unlock
            on the new host PID (the steps the README of ../shared/gpu-host measured)
  torpor    runtime torpor-runtime; the same two podman commands, nothing by hand

Both containers run the same seed, so their steps files must agree line by line after the
restore (bit_exact: the GPU data came back intact). Per-phase seconds, archive bytes and the
ratio torpor/baseline per size and compression go to --out (JSON, rewritten after each
measurement, so a cut-short run keeps what it measured).

    python3 bench/podman_path.py --sizes 1 4 16 --workdir /tmp/pbench --out podman_path.json
        [--compress none] [--extra-compress zstd gzip] [--runc runc] [--runtime torpor-runtime]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shim"), str(ROOT)]

from integration.containers import Podman  # noqa: E402
from integration.gpu import TorchContainer  # noqa: E402
from tests.gpu.compare_steps import compare  # noqa: E402
from torpor import archive, config  # noqa: E402
from torpor.driver import Driver  # noqa: E402

GB = 1e9


def timed(fn, *a, **kw) -> float:
    t = time.perf_counter()
    fn(*a, **kw)
    return time.perf_counter() - t


def run_one(path: str, podman: Podman, drv: Driver, gib: float, compress: str, work: Path,
            lock_timeout_ms: int) -> dict:
    """One container through checkpoint --export / restore --import; returns its figures."""
    name = f"pb-{path}-{int(gib)}-{compress}"
    podman.rm(name)
    tc = TorchContainer(podman, name, work, gib, seed=4321)
    tc.start()
    tc.wait_ready(600)
    tc.wait_step(5)
    pid = podman.pid(name)
    out: dict = {"path": path, "gib": gib, "compress": compress}
    arch = work / f"{name}.tar"
    t0 = time.perf_counter()
    if path == "baseline":
        t = time.perf_counter()
        drv.lock(pid, lock_timeout_ms)
        drv.checkpoint(pid)
        out["lock_checkpoint_s"] = time.perf_counter() - t
    out["export_s"] = timed(podman.checkpoint, name, export=arch, compress=compress, timeout=3000)
    out["checkpoint_total_s"] = time.perf_counter() - t0
    out["archive_bytes"] = arch.stat().st_size
    if path == "torpor":
        m = archive.manifest_from_archive(arch)
        out["torpor_timings"] = m["timings"]
        out["gpu_memory"] = m["sizes"]["gpu_memory"]
    at = tc.step()
    podman.rm(name)
    t0 = time.perf_counter()
    out["import_s"] = timed(podman.restore, import_=arch, timeout=3000)
    new_pid = podman.pid(name)
    if path == "baseline":
        t = time.perf_counter()
        drv.restore(new_pid)
        drv.unlock(new_pid)
        out["restore_unlock_s"] = time.perf_counter() - t
    out["restore_total_s"] = time.perf_counter() - t0
    out["new_pid_differs"] = new_pid != pid
    tc.wait_step(at + 5, timeout=600)
    out["steps_file"] = str(tc.steps)
    out["end_to_end_s"] = out["checkpoint_total_s"] + out["restore_total_s"]
    podman.rm(name)
    arch.unlink(missing_ok=True)
    return out


def pair(results: list, podman_b: Podman, podman_t: Podman, drv: Driver, gib: float,
         compress: str, work: Path, cfg, with_baseline: bool = True) -> dict:
    row: dict = {"gib": gib, "compress": compress}
    runs = [("baseline", podman_b)] if with_baseline else []
    runs.append(("torpor", podman_t))
    for path, pm in runs:
        print(f"== {gib:g} GiB, compress {compress}: {path}", flush=True)
        r = run_one(path, pm, drv, gib, compress, work, int(cfg.lock_timeout_s * 1000))
        row[path] = r
        print(json.dumps(r), flush=True)
    if with_baseline:
        n, mismatch = compare(row["baseline"]["steps_file"], row["torpor"]["steps_file"])
        row["bit_exact"] = mismatch is None and n > 5
        row["common_steps"] = n
        for k in ("checkpoint_total_s", "restore_total_s", "end_to_end_s"):
            row[f"ratio_{k}"] = row["torpor"][k] / row["baseline"][k]
    results.append(row)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16])
    ap.add_argument("--compress", default="none", help="podman --compress for the main rows")
    ap.add_argument("--extra-compress", nargs="*", default=["zstd", "gzip"],
                    help="also measured at the first size (torpor path; zstd with baseline)")
    ap.add_argument("--runc", default=os.environ.get("TORPOR_OCI_RUNTIME", "runc"))
    ap.add_argument("--runtime", default="/usr/local/bin/torpor-runtime")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/torpor-pbench"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cfg = config.load()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    drv = Driver.load(cfg.libcuda)
    pb, pt = Podman(args.runc, timeout=3000), Podman(args.runtime, timeout=3000)
    pb.ensure_image()
    doc = {"benchmark": "podman_path", "host": platform.node(), "kernel": platform.release(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": []}

    def save() -> None:
        args.out.write_text(json.dumps(doc, indent=1))

    for gib in args.sizes:
        pair(doc["rows"], pb, pt, drv, gib, args.compress, args.workdir, cfg)
        save()
    for comp in args.extra_compress:
        pair(doc["rows"], pb, pt, drv, args.sizes[0], comp, args.workdir, cfg,
             with_baseline=(comp == "zstd"))
        save()
    print(f"\n{'GiB':>4} {'compress':>8} {'path':>8} {'ckpt s':>8} {'restore s':>9} "
          f"{'archive GB':>10} {'ratio e2e':>9} bit-exact")
    for row in doc["rows"]:
        for path in ("baseline", "torpor"):
            r = row.get(path)
            if r:
                print(f"{row['gib']:>4g} {row['compress']:>8} {path:>8} "
                      f"{r['checkpoint_total_s']:>8.2f} {r['restore_total_s']:>9.2f} "
                      f"{r['archive_bytes'] / GB:>10.2f} "
                      f"{row.get('ratio_end_to_end_s', float('nan')):>9.2f} "
                      f"{row.get('bit_exact', '-')}")
    save()
    return 0 if all(r.get("bit_exact", True) for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
