#!/usr/bin/env python3
"""Benchmark (issue 20 item 6): podman `container checkpoint --export` / `container restore
--import` of a PyTorch GPU container, side by side in one run, along four legs:

  upstream  what users run today: podman + plain runc + CRIU's own cuda plugin (plugins/cuda)
            + cuda-checkpoint. NVIDIA's public cuda-checkpoint is the toggle-only build the
            plugin refuses, so bench/upstream/cuda-checkpoint.c stands in for r555+'s command
            line (same driver calls). The plugin reaches CRIU only while this leg runs: `libdir`
            in /etc/criu/runc.conf and the stand-in in /usr/local/bin are put there for the
            leg and taken away after it, so torpor's runs never load the plugin.
  driver    podman + torpor-runtime, the driver path (org.torpor.agent=off)
  agent     podman + torpor-runtime with its defaults (the agent, for GPU containers)
  store     podman + torpor-runtime, agent + image store (org.torpor.store=on)

Every container runs the same seed: each leg's steps file must agree line by line with the
first leg's after its restore (bit_exact). Per leg: checkpoint and restore seconds, end to end,
archive bytes, whether the plugin ran (the stand-in's call log, upstream) or the
agent moved the GPU data (torpor's manifest); per size, the ratios against the upstream leg
with the same compression. JSON rewritten after each measurement (a cut-short run keeps what
it measured).

    python3 bench/upstream_path.py --sizes 4 16 --zstd-sizes 4 --plugin-dir DIR \
        --standin bench/upstream/build/cuda-checkpoint --runc runc --out upstream_path.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
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
from torpor import archive  # noqa: E402

GB = 1e9
RUNC_CONF = Path("/etc/criu/runc.conf")
STANDIN_AT = Path("/usr/local/bin/cuda-checkpoint")
CALL_LOG = Path("/run/torpor-cuda-checkpoint-standin.log")   # the stand-in's calls (its Makefile)
LEGS = {"upstream": {}, "driver": {"org.torpor.agent": "off"}, "agent": {},
        "store": {"org.torpor.store": "on"}}


@contextlib.contextmanager
def upstream_plugin(plugin_dir: Path, standin: Path):
    """CRIU's cuda plugin and the stand-in, for the upstream leg only; always taken away."""
    if not (plugin_dir / "cuda_plugin.so").is_file():
        raise SystemExit(f"no cuda_plugin.so in {plugin_dir} (packaging/criu/install-criu.sh)")
    before = RUNC_CONF.read_text() if RUNC_CONF.exists() else None
    if STANDIN_AT.exists():
        raise SystemExit(f"{STANDIN_AT} exists: not overwriting a cuda-checkpoint")
    RUNC_CONF.parent.mkdir(parents=True, exist_ok=True)
    RUNC_CONF.write_text((before or "") + f"libdir {plugin_dir.resolve()}\n")
    shutil.copy2(standin, STANDIN_AT)
    CALL_LOG.write_text("")
    try:
        yield
    finally:
        STANDIN_AT.unlink(missing_ok=True)
        CALL_LOG.unlink(missing_ok=True)
        if before is None:
            RUNC_CONF.unlink(missing_ok=True)
        else:
            RUNC_CONF.write_text(before)


def one_leg(leg: str, podman: Podman, gib: float, compress: str, work: Path) -> dict:
    name = f"ub-{leg}-{gib:g}-{compress}"
    podman.rm(name)
    tc = TorchContainer(podman, name, work, gib, seed=4321, annotations=LEGS[leg])
    tc.start()
    tc.wait_ready(900)
    tc.wait_step(5)
    out: dict = {"leg": leg, "gib": gib, "compress": compress}
    arch = work / f"{name}.tar"
    t0 = time.perf_counter()
    podman.checkpoint(name, export=arch, compress=compress, timeout=3000)
    out["checkpoint_s"] = time.perf_counter() - t0
    out["archive_bytes"] = arch.stat().st_size
    if leg == "upstream":   # the plugin ran the stand-in: lock and checkpoint, both done
        calls = CALL_LOG.read_text().split()
        out["plugin_calls_checkpoint"] = " ".join(calls)
        out["plugin_ran"] = "lock" in calls and "checkpoint" in calls
    else:
        m = archive.manifest_from_archive(arch)
        out["agent_moved"] = bool(m.get("agent"))
        out["gpu_memory"] = m["sizes"]["gpu_memory"]
        out["torpor_timings"] = m["timings"]
    at = tc.step()
    podman.rm(name)
    t0 = time.perf_counter()
    podman.restore(import_=arch, timeout=3000)
    out["restore_s"] = time.perf_counter() - t0
    if leg == "upstream":
        out["plugin_calls"] = CALL_LOG.read_text().splitlines()
    out["end_to_end_s"] = out["checkpoint_s"] + out["restore_s"]
    tc.wait_step(at + 5, timeout=900)
    out["steps_file"] = str(tc.steps)
    podman.rm(name)
    arch.unlink(missing_ok=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[4, 16])
    ap.add_argument("--zstd-sizes", type=float, nargs="*", default=[4],
                    help="sizes also measured with podman's default zstd (slow: 75 s at 4 GiB)")
    ap.add_argument("--legs", nargs="+", default=list(LEGS), choices=list(LEGS))
    ap.add_argument("--plugin-dir", type=Path, default=Path("/usr/local/lib/torpor/criu-upstream"))
    ap.add_argument("--standin", type=Path, default=ROOT / "bench/upstream/build/cuda-checkpoint")
    ap.add_argument("--runc", default=os.environ.get("TORPOR_OCI_RUNTIME", "runc"))
    ap.add_argument("--runtime", default="/usr/local/bin/torpor-runtime")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/torpor-ubench"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    plain, torpor = Podman(args.runc, timeout=3000), Podman(args.runtime, timeout=3000)
    plain.ensure_image()
    doc = {"benchmark": "upstream_path", "host": platform.node(), "kernel": platform.release(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "standin": "bench/upstream/cuda-checkpoint.c stands in for NVIDIA's cuda-checkpoint "
                      "r555+ (same driver calls; the public build is toggle-only)",
           "rows": []}

    def save() -> None:
        args.out.write_text(json.dumps(doc, indent=1))

    for gib in args.sizes:
        for compress in ["none"] + (["zstd"] if gib in args.zstd_sizes else []):
            row: dict = {"gib": gib, "compress": compress, "legs": {}}
            doc["rows"].append(row)
            for leg in args.legs:
                if compress == "zstd" and leg == "store":
                    continue            # the store's archive is mostly references: nothing to gain
                print(f"== {gib:g} GiB, --compress {compress}: {leg}", flush=True)
                ctx = upstream_plugin(args.plugin_dir, args.standin) if leg == "upstream" \
                    else contextlib.nullcontext()
                try:
                    with ctx:
                        r = one_leg(leg, plain if leg == "upstream" else torpor, gib, compress,
                                    args.workdir)
                except Exception as e:          # one leg failing is a figure too
                    r = {"leg": leg, "error": f"{type(e).__name__}: {e}"[:2000]}
                row["legs"][leg] = r
                print(json.dumps(r), flush=True)
                save()
            legs = {k: v for k, v in row["legs"].items() if "error" not in v}
            if legs:
                first = next(iter(legs.values()))
                for k, v in legs.items():
                    n, mismatch = compare(first["steps_file"], v["steps_file"])
                    v["bit_exact"] = mismatch is None and n > 5
            up = legs.get("upstream")
            if up:
                row["ratios_vs_upstream"] = {
                    k: {"end_to_end_speedup": up["end_to_end_s"] / v["end_to_end_s"],
                        "checkpoint_speedup": up["checkpoint_s"] / v["checkpoint_s"],
                        "restore_speedup": up["restore_s"] / v["restore_s"],
                        "archive_ratio": v["archive_bytes"] / up["archive_bytes"]}
                    for k, v in legs.items() if k != "upstream"}
            save()
    out = io.StringIO()
    print(f"{'GiB':>4} {'compress':>8} {'leg':>8} {'ckpt s':>7} {'rest s':>7} {'e2e s':>7} "
          f"{'archive GB':>10} {'speedup':>7} bit-exact", file=out)
    for row in doc["rows"]:
        for leg, r in row["legs"].items():
            if "error" in r:
                print(f"{row['gib']:>4g} {row['compress']:>8} {leg:>8} error: {r['error'][:80]}",
                      file=out)
                continue
            sp = row.get("ratios_vs_upstream", {}).get(leg, {}).get("end_to_end_speedup")
            print(f"{row['gib']:>4g} {row['compress']:>8} {leg:>8} {r['checkpoint_s']:>7.2f} "
                  f"{r['restore_s']:>7.2f} {r['end_to_end_s']:>7.2f} "
                  f"{r['archive_bytes'] / GB:>10.2f} {sp if sp is None else round(sp, 2)!s:>7} "
                  f"{r.get('bit_exact')}", file=out)
    print(out.getvalue())
    doc["table"] = out.getvalue()
    save()
    ok = all("error" not in r and r.get("bit_exact") for row in doc["rows"]
             for r in row["legs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
