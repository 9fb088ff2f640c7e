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
archive bytes, NVML's GPU memory of the container's program, whether the plugin ran (the
stand-in's call log, upstream) or the agent moved the GPU data (torpor's manifest); per size,
the ratios against the upstream leg with the same compression. JSON rewritten after each
measurement (a cut-short run keeps what it measured).

The bound (issue 20: where the machine bounds a target, measure the bound in the same run and
report torpor's ratio to it): the disk, measured first (--disk-probe-gib: a file written and
fsynced, then read back cold, bench/yardsticks.py). Per leg, disk_bound_s = its archive's
bytes at the disk's write rate plus at its read rate (what writing the archive once and reading
it once costs; podman's restore may read it from the page cache, so a restore can beat its
half), and its end to end over that; per torpor leg, the speed-up over upstream its bound
would allow.

--cache-gib N adds a row (compress none, --cache-legs): a training program holding N GiB of
live tensors whose allocator caches N GiB more (torch_program.py --cache-gib: allocated, then
freed), for issue 20's archive <= 0.5x of upstream's (the driver's checkpoint copies the cache,
the agent releases it). --sizes may be empty (that row alone).

Between legs nothing stays on the disk: each leg's archive is removed, its containers too, and
the store leg's snapshots leave the image store (then its gc); a leg whose archive and images
would not fit the free space is skipped with the reason.

Exit status 0 when every leg of the plan ran and continued bit-exact, else 1 (a leg skipped for
room included: the comparison asked for is missing; the last line names the legs).

    python3 bench/upstream_path.py --sizes 4 16 --zstd-sizes 4 --plugin-dir DIR \
        --standin bench/upstream/build/cuda-checkpoint --runc runc --out upstream_path.json
    python3 bench/upstream_path.py --sizes --cache-gib 4 ... --out upstream_cache.json
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

from bench.yardsticks import disk_gbps, ratio  # noqa: E402
from integration.containers import Podman  # noqa: E402
from integration.gpu import TorchContainer  # noqa: E402
from tests.gpu.compare_steps import compare  # noqa: E402
from torpor import archive, config, gpus  # noqa: E402
from torpor.flows import policy  # noqa: E402

GB, GiB = 1e9, 1 << 30
TARGETS = {"end_to_end_speedup_min": 5.0, "cache_archive_ratio_max": 0.5}
CONTAINERS = Path("/var/lib/containers")   # where podman's checkpoint images go
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


def room(work: Path, gib: float) -> str:
    """Why a leg of gib GiB (live + cached) cannot run on this disk ('' when it can): CRIU's
    images in podman's storage and the archive of them are on the disk at once."""
    need = 2 * (gib * GiB * 1.1 + 3 * GB)
    for d in (work, CONTAINERS):
        free = shutil.disk_usage(d).free if d.exists() else need
        if free < need:
            return f"needs ~{need / GB:.1f} GB free in {d}, {free / GB:.1f} GB free"
    return ""


def drop_from_store(owners: set[str]) -> dict:
    """The store leg's snapshots (owned by its containers) removed from the image store, and
    the chunks no other snapshot needs freed (torpor rm + gc)."""
    store = policy.open_store(config.load())
    names = [x.name for x in store.snapshots() if x.owner in owners]
    if names:
        store.remove(names)
    return {"snapshots_removed": names, "freed_bytes": store.gc().freed}


def one_leg(leg: str, podman: Podman, gib: float, compress: str, work: Path,
            cache_gib: float = 0, disk: dict | None = None, out: dict | None = None,
            save=lambda: None) -> dict:
    """One leg, its figures put into out as they come (save() after the checkpoint: a run
    killed during the restore keeps it)."""
    name = f"ub-{leg}-{gib:g}-{compress}" + (f"-c{cache_gib:g}" if cache_gib else "")
    out = {} if out is None else out
    out.update(leg=leg, gib=gib, compress=compress, cache_gib=cache_gib)
    why = room(work, gib + cache_gib)
    if why:
        out["skipped"] = why
        return out
    podman.rm(name)
    extra = ("--cache-gib", f"{cache_gib:g}") if cache_gib else ()
    tc = TorchContainer(podman, name, work, gib, seed=4321, annotations=LEGS[leg], extra=extra)
    arch = work / f"{name}.tar"
    owners: set[str] = set()
    try:
        tc.start()
        owners.add("container:" + podman.inspect(name, "{{.Id}}"))
        tc.wait_ready(900)
        tc.wait_step(5)
        st = tc.status()
        out.update(torch_reserved=st.get("reserved"), torch_allocated=st.get("allocated"))
        with contextlib.suppress(Exception):
            out["nvml_bytes"] = gpus.discover().memory_of(podman.pid(name))
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
        save()
        at = tc.step()
        podman.rm(name)
        t0 = time.perf_counter()
        podman.restore(import_=arch, timeout=3000)
        out["restore_s"] = time.perf_counter() - t0
        with contextlib.suppress(Exception):
            owners.add("container:" + podman.inspect(name, "{{.Id}}"))
        if leg == "upstream":
            out["plugin_calls"] = CALL_LOG.read_text().splitlines()
        out["end_to_end_s"] = out["checkpoint_s"] + out["restore_s"]
        if disk and "write" in disk:
            a = out["archive_bytes"]
            out["disk_bound_s"] = a / (disk["write"] * GB) + a / (disk["read"] * GB)
            out["over_disk_bound"] = ratio(out["end_to_end_s"], out["disk_bound_s"])
        tc.wait_step(at + 5, timeout=900)
        out["steps_file"] = str(tc.steps)
        return out
    finally:
        podman.rm(name)
        arch.unlink(missing_ok=True)
        if leg == "store" and owners:
            try:
                out["store_cleanup"] = drop_from_store(owners)
            except Exception as e:      # the figures stand; the disk may fill: say so
                out["store_cleanup"] = {"error": f"{type(e).__name__}: {e}"}


def compare_legs(row: dict) -> None:
    """bit_exact per leg against the row's first, and the ratios against upstream (legs that
    finished: a leg that failed after its restore, e.g. never stepping on, has no figure)."""
    legs = {k: v for k, v in row["legs"].items() if "steps_file" in v and "error" not in v}
    if not legs:
        return
    first = next(iter(legs.values()))
    for k, v in legs.items():
        n, mismatch = compare(first["steps_file"], v["steps_file"])
        v["bit_exact"] = mismatch is None and n > 5
    up = legs.get("upstream")
    if up:
        row["ratios_vs_upstream"] = {
            k: {"end_to_end_speedup": ratio(up["end_to_end_s"], v["end_to_end_s"]),
                "checkpoint_speedup": ratio(up["checkpoint_s"], v["checkpoint_s"]),
                "restore_speedup": ratio(up["restore_s"], v["restore_s"]),
                "archive_ratio": ratio(v["archive_bytes"], up["archive_bytes"]),
                "speedup_disk_bound_allows": ratio(up["end_to_end_s"], v.get("disk_bound_s"))}
            for k, v in legs.items() if k != "upstream"}


def table(doc: dict) -> str:
    def f(v, spec=".2f"):
        return "-" if v is None else format(v, spec)
    out = io.StringIO()
    d = doc.get("disk") or {}
    if "write" in d:
        print(f"disk (same run): write {d['write']:.2f} GB/s (fsynced), read {d['read']:.2f} "
              f"GB/s (O_DIRECT)", file=out)
    print(f"{'GiB':>6} {'compress':>8} {'leg':>8} {'ckpt s':>7} {'rest s':>7} {'e2e s':>7} "
          f"{'archive GB':>10} {'speedup':>7} {'arch/up':>7} {'disk s':>7} {'e2e/disk':>8} "
          "bit-exact", file=out)
    for row in doc["rows"]:
        label = f"{row['gib']:g}" + (f"+{row['cache_gib']:g}c" if row.get("cache_gib") else "")
        for leg, r in row["legs"].items():
            if "end_to_end_s" not in r or "error" in r:
                what = r.get("error") or r.get("skipped") or "not finished"
                print(f"{label:>6} {row['compress']:>8} {leg:>8} {what[:100]}", file=out)
                continue
            rv = row.get("ratios_vs_upstream", {}).get(leg, {})
            print(f"{label:>6} {row['compress']:>8} {leg:>8} {r['checkpoint_s']:>7.2f} "
                  f"{r['restore_s']:>7.2f} {r['end_to_end_s']:>7.2f} "
                  f"{r['archive_bytes'] / GB:>10.2f} {f(rv.get('end_to_end_speedup')):>7} "
                  f"{f(rv.get('archive_ratio')):>7} {f(r.get('disk_bound_s')):>7} "
                  f"{f(r.get('over_disk_bound')):>8} {r.get('bit_exact')}", file=out)
        for leg, rv in row.get("ratios_vs_upstream", {}).items():
            if leg == "driver":
                continue
            if row.get("cache_gib"):
                a = rv.get("archive_ratio")
                ok = a is not None and a <= TARGETS["cache_archive_ratio_max"]
                print(f"{label:>6} {leg}: archive {f(a)} of upstream's (issue 20: <= "
                      f"{TARGETS['cache_archive_ratio_max']}: {'ok' if ok else 'MISSED'})",
                      file=out)
            elif row["compress"] == "none":
                sp = rv.get("end_to_end_speedup")
                ok = sp is not None and sp >= TARGETS["end_to_end_speedup_min"]
                print(f"{label:>6} {leg}: end to end {f(sp)}x upstream (issue 20: >= "
                      f"{TARGETS['end_to_end_speedup_min']:g}x: {'ok' if ok else 'MISSED'}); "
                      f"its archive at this disk's rates allows {f(rv.get('speedup_disk_bound_allows'))}x",
                      file=out)
    return out.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="*", default=[4, 16],
                    help="GiB of live tensors, one row each (none: only --cache-gib's row)")
    ap.add_argument("--zstd-sizes", type=float, nargs="*", default=[4],
                    help="sizes also measured with podman's default zstd (slow: 75 s at 4 GiB)")
    ap.add_argument("--compressions", nargs="+", default=["none", "zstd"],
                    choices=["none", "zstd"],
                    help="which rows of --sizes: --compress none, zstd (at --zstd-sizes)")
    ap.add_argument("--legs", nargs="+", default=list(LEGS), choices=list(LEGS))
    ap.add_argument("--cache-gib", type=float, default=0,
                    help="a row of a program holding this many GiB live and as many cached "
                         "(0: none)")
    ap.add_argument("--cache-legs", nargs="+", default=["upstream", "agent", "store"],
                    choices=list(LEGS))
    ap.add_argument("--disk-probe-gib", type=float, default=4,
                    help="GiB written and read back first: the disk's rates (0: none)")
    ap.add_argument("--plugin-dir", type=Path, default=Path("/usr/local/lib/torpor/criu-upstream"))
    ap.add_argument("--standin", type=Path, default=ROOT / "bench/upstream/build/cuda-checkpoint")
    ap.add_argument("--runc", default=os.environ.get("TORPOR_OCI_RUNTIME", "runc"))
    ap.add_argument("--runtime", default="/usr/local/bin/torpor-runtime")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/torpor-ubench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="print the rows and legs and stop")
    args = ap.parse_args()
    plan = [(gib, c, 0.0, args.legs) for gib in args.sizes
            for c in ["none"] + (["zstd"] if gib in args.zstd_sizes else [])
            if c in args.compressions]
    if args.cache_gib > 0:
        plan.append((args.cache_gib, "none", args.cache_gib, args.cache_legs))
    if not plan:
        ap.error("nothing to measure: give --sizes or --cache-gib")
    if args.dry_run:
        for gib, compress, cache_gib, legs in plan:
            print(f"{gib:g} GiB live + {cache_gib:g} cached, --compress {compress}: "
                  + " ".join(g for g in legs if not (compress == "zstd" and g == "store")))
        return 0
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    plain, torpor = Podman(args.runc, timeout=3000), Podman(args.runtime, timeout=3000)
    doc = {"benchmark": "upstream_path", "host": platform.node(), "kernel": platform.release(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "standin": "bench/upstream/cuda-checkpoint.c stands in for NVIDIA's cuda-checkpoint "
                      "r555+ (same driver calls; the public build is toggle-only)",
           "targets": TARGETS, "rows": []}

    def save() -> None:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, args.out)           # a run killed mid-write leaves the last whole one

    if args.disk_probe_gib > 0:
        try:
            doc["disk"] = disk_gbps(args.workdir, args.disk_probe_gib)
        except OSError as e:                # the figures without their bound, and why
            doc["disk"] = {"error": f"{type(e).__name__}: {e}"}
        print(f"== disk: {doc['disk']}", flush=True)
        save()
    plain.ensure_image()
    for gib, compress, cache_gib, legs in plan:
        row: dict = {"gib": gib, "compress": compress, "legs": {}}
        if cache_gib:
            row["cache_gib"] = cache_gib
        doc["rows"].append(row)
        for leg in legs:
            if compress == "zstd" and leg == "store":
                continue            # the store's archive is mostly references: nothing to gain
            print(f"== {gib:g} GiB (+{cache_gib:g} cached), --compress {compress}: {leg}",
                  flush=True)
            ctx = upstream_plugin(args.plugin_dir, args.standin) if leg == "upstream" \
                else contextlib.nullcontext()
            r = row["legs"][leg] = {"leg": leg}
            try:
                with ctx:
                    one_leg(leg, plain if leg == "upstream" else torpor, gib, compress,
                            args.workdir, cache_gib, doc.get("disk"), r, save)
            except Exception as e:          # one leg failing is a figure too
                r["error"] = f"{type(e).__name__}: {e}"[:2000]
            print(json.dumps(r), flush=True)
            save()
        compare_legs(row)
        save()
    doc["table"] = table(doc)
    print(doc["table"])
    save()
    return verdict(doc)


def verdict(doc: dict) -> int:
    """0 when every leg of the plan ran and continued bit-exact; 1 otherwise, a leg skipped
    for room included: the comparison asked for is then missing from the figures (unlike
    agent_path.py's --where fit, there is no other place to measure it), and a script running
    the bench must not take a partial run for a whole one. The last line says which legs."""
    skipped = [(row, leg) for row in doc["rows"] for leg, r in row["legs"].items()
               if "skipped" in r]
    bad = [(row, leg) for row in doc["rows"] for leg, r in row["legs"].items()
           if "skipped" not in r and ("error" in r or not r.get("bit_exact"))]
    if not skipped and not bad:
        return 0

    def names(pairs):
        return ", ".join(f"{row['gib']:g}" + (f"+{row['cache_gib']:g}c" if row.get("cache_gib")
                                               else "") + f" {row['compress']} {leg}"
                         for row, leg in pairs) or "none"
    print(f"incomplete (exit 1): skipped for room: {names(skipped)}; failed or not bit-exact: "
          f"{names(bad)}", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
