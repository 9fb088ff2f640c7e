#!/usr/bin/env python3
"""Benchmark: the in-process agent (issue 4) against the driver path, side by side in one run.

For each size N (GiB of bulk tensors): one PyTorch program under the agent (`torpor run --`)
and one of the same shape without it, each through suspend, resume, checkpoint + restore to
--shm-root (host memory) and checkpoint + restore to --disk-root, timed (wall time and the
phase timings torpor.flows.process returns), each program checked bit-exact against an
uninterrupted reference run of the same seed. Then:
  cache     a program whose PyTorch cache holds --cache-gib GiB unused (--cache-gib): what the
            agent moved, what it released instead, what NVML said it used (bytes saved);
  overhead  training steps/s with and without the agent (--sleep 0, a small model: driver-call
            bound, the agent's worst case), median of --overhead-reps interleaved runs each.
Ratios are driver seconds / agent seconds (how many times faster the agent path is); targets
(issue 4): suspend >= 20x, resume >= 5x, overhead <= 1 %.

    python3 bench/agent_path.py --sizes 1 16 --shm-root /dev/shm/torpor-abench \\
        --disk-root /var/tmp/torpor-abench --out agent_path.json [--driver-disk-max-gib 16]

A checkpoint whose images would not fit (free space of the root; for /dev/shm also available
memory, which the driver path needs twice: the program's host copy plus the images) is skipped
and the reason recorded; so is the driver path's checkpoint to disk above --driver-disk-max-gib
(its dump runs at disk speed: minutes at 64 GiB). JSON is rewritten after every size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shim"), str(ROOT)]

from tests.gpu import programs  # noqa: E402
from tests.gpu.compare_steps import compare  # noqa: E402
from torpor import config, gpus, procs  # noqa: E402
from torpor.flows import process  # noqa: E402
from torpor.engine import Engine  # noqa: E402
from torpor.progress import Progress  # noqa: E402

GB, GiB = 1e9, 1 << 30
TARGETS = {"suspend": 20.0, "resume": 5.0}      # driver s / agent s at least
OVERHEAD_TARGET_PCT = 1.0


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def wait_gone(pid: int, timeout: float = 120) -> None:
    """A checkpointed (dumped) program's PID is free again (reaped by whoever is its parent)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        try:
            os.waitpid(pid, os.WNOHANG)      # in case it is ours to reap
        except ChildProcessError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"PID {pid} still exists {timeout:.0f} s after its checkpoint")
        time.sleep(0.02)


def agent_of(result: dict, pid: int) -> dict:
    a = result.get("agent") or {}
    rec = a.get(str(pid)) if isinstance(a, dict) else None
    return rec if isinstance(rec, dict) else {}


def bit_exact(ref: programs.Program, prog: programs.Program) -> dict:
    """prog 5 steps on, the reference there too, every step both wrote compared."""
    last = prog.step() + 5
    prog.wait_step(last)
    ref.wait_step(last)
    n, mismatch = compare(str(ref.steps), str(prog.steps))
    return {"bit_exact": mismatch is None and n >= last, "steps_compared": n,
            "mismatch": mismatch}


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.cfg = config.load()
        self.work = Path(tempfile.mkdtemp(prefix="torpor-abench-", dir="/dev/shm"))
        self.agent_dir = Path(args.agent_dir or tempfile.mkdtemp(prefix="tpab-", dir="/tmp"))
        self.agent_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.agent_dir, 0o700)
        os.environ["TORPOR_AGENT_DIR"] = str(self.agent_dir)   # where process.* looks
        env = programs.with_torpor_path(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        self.env = env
        self.started: list[programs.Program] = []
        self.gib_now = 0.0

    def engine(self, via: str = "") -> Engine:
        """An engine whose suspends go the way `via` names (--suspend-via): "memory" (the
        program's own memory), a directory (files under it, on the huge-page tmpfs torpor
        mounts there unless suspend_tmpfs is off), "plain:DIR" (files under DIR as it is),
        else the configured way."""
        cfg = self.cfg
        if via == "memory":
            cfg = dataclasses.replace(cfg, suspend_in_process=True)
        elif via.startswith(("/", "plain:/")):
            plain = via.startswith("plain:")
            cfg = dataclasses.replace(cfg, suspend_in_process=False,
                                      suspend_dir=Path(via.removeprefix("plain:")),
                                      suspend_tmpfs=cfg.suspend_tmpfs and not plain)
        return Engine(cfg, Progress(None))

    def start(self, name: str, gib: float, *, agent: bool, extra=(), max_steps: int = 0,
              sleep: float = 0.02) -> programs.Program:
        argv = programs.command("torch", gib, seed=self.args.seed, max_steps=max_steps,
                                sleep=sleep, extra=extra)
        p = programs.Program(self.work, name, argv, env=self.env, agent=agent)
        self.started.append(p)
        return p

    def stop(self, *progs: programs.Program) -> None:
        for p in progs:
            p.kill()
            if p in self.started:
                self.started.remove(p)

    def stop_all(self) -> None:
        self.stop(*list(self.started))

    # -- one program through every operation --------------------------------------------------
    def room(self, where: str, root: Path, path: str, gpu_bytes: int, rss: int) -> str:
        """Why a checkpoint of this program to root cannot be measured ('' when it can)."""
        if path == "driver" and where == "disk" and \
                self.gib_now > self.args.driver_disk_max_gib:
            return f"driver path to disk skipped above --driver-disk-max-gib " \
                   f"{self.args.driver_disk_max_gib:g} (its dump runs at disk speed)"
        need = gpu_bytes + rss + 2 * GiB
        free = shutil.disk_usage(root).free
        if need > free:
            return f"needs ~{need / GB:.1f} GB in {root}, {free / GB:.1f} GB free"
        if where == "shm":
            ram = need + (gpu_bytes if path == "driver" else 0)   # + the driver's host copy
            avail = procs.mem_available() or 0
            if ram > avail:
                return f"needs ~{ram / GB:.1f} GB of memory, {avail / GB:.1f} GB " \
                       "available"
        return ""

    def operations(self, prog: programs.Program, path: str, gib: float) -> dict:
        out: dict = {}
        pid = prog.pid
        used = gpus.discover().memory_of(pid)
        out["gpu_memory_bytes"] = used
        # suspend / resume: the agent's program once per --suspend-via (the first is the one the
        # ratios use), the driver's once
        vias = self.args.suspend_via if path == "agent" else ["driver"]
        out["suspend_via"] = {}
        for n, via in enumerate(vias):
            eng = self.engine(via)
            t = time.perf_counter()
            r = process.suspend(eng, pid)
            sus = {"wall_s": time.perf_counter() - t, "timings": r.get("timings", {}),
                   "gpu_memory_released": r.get("gpu_memory_released"),
                   "agent": agent_of(r, pid)}
            time.sleep(0.5)
            at = prog.step()
            t = time.perf_counter()
            r = process.resume(eng, pid)
            res = {"wall_s": time.perf_counter() - t, "timings": r.get("timings", {}),
                   "agent": agent_of(r, pid)}
            prog.wait_step(at + 5)
            # a target named twice (interleaved runs) keeps every run: "DIR", "DIR#3", ...
            key = via if via not in out["suspend_via"] else f"{via}#{n + 1}"
            out["suspend_via"][key] = {"suspend": sus, "resume": res}
            print(f"  {path:>6} {gib:g} GiB: suspend {sus['wall_s']:.2f} s, "
                  f"resume {res['wall_s']:.2f} s ({via})", flush=True)
        first = next(iter(out["suspend_via"].values()))
        out["suspend"], out["resume"] = first["suspend"], first["resume"]
        # checkpoint + restore, to host memory and to disk
        for where, root in (("shm", self.args.shm_root), ("disk", self.args.disk_root)):
            if where not in self.args.where:
                continue
            key = f"checkpoint_{where}"
            rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGESIZE")
            why = self.room(where, root, path, used, rss)
            if why:
                out[key] = {"skipped": why}
                print(f"  {path:>6} {gib:g} GiB: {key} skipped: {why}", flush=True)
                continue
            images = root / f"ck-{path}-{gib:g}g"
            shutil.rmtree(images, ignore_errors=True)
            try:
                t = time.perf_counter()
                m = process.checkpoint(self.engine(), pid, images)
                ck_s = time.perf_counter() - t
                prog.reap()
                wait_gone(pid)
                size = tree_bytes(images)
                data = images / "torpor-gpu"
                agent_data = tree_bytes(data) if data.is_dir() else 0
                at = prog.step()
                t = time.perf_counter()
                r = process.restore(self.engine(), images)
                rs_s = time.perf_counter() - t
                prog.wait_step(at + 5)
            finally:
                shutil.rmtree(images, ignore_errors=True)
            out[key] = {"checkpoint_wall_s": ck_s, "restore_wall_s": rs_s,
                        "checkpoint_timings": m.get("timings", {}),
                        "restore_timings": r.get("timings", {}),
                        "image_bytes": size, "agent_data_bytes": agent_data,
                        "criu_and_driver_bytes": size - agent_data,
                        "agent": agent_of(m, pid), "agent_resume": agent_of(r, pid)}
            print(f"  {path:>6} {gib:g} GiB: {key} {ck_s:.2f} s + restore {rs_s:.2f} s, "
                  f"images {size / GB:.2f} GB ({agent_data / GB:.2f} GB agent data)", flush=True)
        return out

    def one_size(self, gib: float) -> dict:
        self.gib_now = gib
        row: dict = {"gib": gib}
        ref = self.start(f"ref{gib:g}", gib, agent=False)
        try:
            for path in ("agent", "driver"):        # one at a time: 64 GiB twice still fits
                prog = self.start(f"{path}{gib:g}", gib, agent=(path == "agent"))
                try:
                    prog.wait_ready(900)
                    prog.wait_step(5)
                    row[path] = self.operations(prog, path, gib)
                    row[path].update(bit_exact(ref, prog))
                    row[path]["via_agent"] = bool(row[path]["suspend"]["agent"])
                finally:
                    self.stop(prog)
        finally:
            self.stop(ref)
        a, d = row["agent"], row["driver"]
        ratios = {"suspend": d["suspend"]["wall_s"] / a["suspend"]["wall_s"],
                  "resume": d["resume"]["wall_s"] / a["resume"]["wall_s"]}
        for where in ("shm", "disk"):
            ca, cd = a.get(f"checkpoint_{where}", {}), d.get(f"checkpoint_{where}", {})
            for k in ("checkpoint", "restore"):
                if f"{k}_wall_s" in ca and f"{k}_wall_s" in cd:
                    ratios[f"{k}_{where}"] = cd[f"{k}_wall_s"] / ca[f"{k}_wall_s"]
        for via, sr in a["suspend_via"].items():
            for k in ("suspend", "resume"):
                ratios[f"{k}_via_{via}"] = d[k]["wall_s"] / sr[k]["wall_s"]
        row["ratio_driver_over_agent"] = {k: round(v, 3) for k, v in ratios.items()}
        return row

    # -- the cache program ---------------------------------------------------------------------
    def cache(self, gib: float, cache_gib: float) -> dict:
        extra = ["--cache-gib", f"{cache_gib:g}"]
        ref = self.start("cache-ref", gib, agent=False, extra=extra)
        prog = self.start("cache", gib, agent=True, extra=extra)
        try:
            prog.wait_ready(600)
            prog.wait_step(5)
            before = prog.status()
            used = gpus.discover().memory_of(prog.pid)
            t = time.perf_counter()
            r = process.suspend(self.engine(), prog.pid)
            sus = time.perf_counter() - t
            rec = agent_of(r, prog.pid)
            at = prog.step()
            t = time.perf_counter()
            process.resume(self.engine(), prog.pid)
            res = time.perf_counter() - t
            prog.wait_step(at + 5)
            out = {"gib": gib, "cache_gib": cache_gib, "nvml_bytes_before": used,
                   "torch_reserved_before": before.get("reserved"),
                   "torch_allocated_before": before.get("allocated"),
                   "torch_reserved_after": prog.status().get("reserved"),
                   "agent_moved_bytes": rec.get("bytes"),
                   "cache_released": rec.get("cache_released"),
                   "bytes_saved": (used - rec["bytes"]) if "bytes" in rec else None,
                   "suspend_wall_s": sus, "resume_wall_s": res, "agent": rec}
            out.update(bit_exact(ref, prog))
            return out
        finally:
            self.stop(prog, ref)

    # -- overhead --------------------------------------------------------------------------------
    def overhead(self, reps: int, steps: int, gib: float) -> dict:
        rates: dict[str, list[float]] = {"agent": [], "plain": []}
        for rep in range(reps):
            order = ("agent", "plain") if rep % 2 == 0 else ("plain", "agent")
            for mode in order:
                p = self.start(f"ovh-{mode}-{rep}", gib, agent=(mode == "agent"),
                               max_steps=steps, sleep=0)
                try:
                    p.wait_ready(300)
                    s = p.wait_done(600)
                    rates[mode].append(float(s["steps_per_s"]))
                finally:
                    self.stop(p)
                print(f"  overhead rep {rep} {mode}: {rates[mode][-1]:.1f} steps/s", flush=True)
        med = {m: statistics.median(v) for m, v in rates.items()}
        pct = (med["plain"] - med["agent"]) / med["plain"] * 100
        return {"gib": gib, "steps": steps, "reps": reps, "steps_per_s": rates,
                "median_steps_per_s": med, "overhead_pct": round(pct, 3)}


def fmt(v) -> str:
    return f"{v:9.2f}" if isinstance(v, (int, float)) else f"{'skipped':>9}"


def table(doc: dict) -> str:
    lines = [f"{'GiB':>5} {'operation':<18} {'driver s':>9} {'agent s':>9} {'ratio':>8}  target"]
    for row in doc["runs"]:
        a, d, r = row["agent"], row["driver"], row["ratio_driver_over_agent"]
        ops = [("suspend", d["suspend"]["wall_s"], a["suspend"]["wall_s"]),
               ("resume", d["resume"]["wall_s"], a["resume"]["wall_s"])]
        for where in ("shm", "disk"):
            ca, cd = a.get(f"checkpoint_{where}", {}), d.get(f"checkpoint_{where}", {})
            for k in ("checkpoint", "restore"):
                ops.append((f"{k}_{where}", cd.get(f"{k}_wall_s"), ca.get(f"{k}_wall_s")))
        for name, ds, as_ in ops:
            ratio = r.get(name)
            target = TARGETS.get(name)
            verdict = "" if target is None or ratio is None else \
                f">= {target:g}x {'ok' if ratio >= target else 'MISSED'}"
            lines.append(f"{row['gib']:>5g} {name:<18} {fmt(ds)} {fmt(as_)} "
                         f"{(f'{ratio:7.1f}x' if ratio else '      -'):>8}  {verdict}")
        for via, sr in a.get("suspend_via", {}).items():
            lines.append(f"{row['gib']:>5g} agent suspend/resume via {via}: "
                         f"{sr['suspend']['wall_s']:.2f} / {sr['resume']['wall_s']:.2f} s, "
                         f"{r.get(f'suspend_via_{via}', 0):.1f}x / "
                         f"{r.get(f'resume_via_{via}', 0):.1f}x")
        lines.append(f"{row['gib']:>5g} bit-exact: agent {a['bit_exact']} "
                     f"(via agent: {a['via_agent']}), driver {d['bit_exact']}")
        for p, res in (("driver", d), ("agent", a)):
            for where in ("shm", "disk"):
                why = res.get(f"checkpoint_{where}", {}).get("skipped")
                if why:
                    lines.append(f"{row['gib']:>5g} {p} checkpoint_{where}: skipped ({why})")
    c = doc.get("cache")
    if c:
        lines.append(f"cache: {c['gib']:g} GiB used + {c['cache_gib']:g} GiB cached: NVML "
                     f"{c['nvml_bytes_before'] / GB:.2f} GB, agent moved "
                     f"{(c['agent_moved_bytes'] or 0) / GB:.2f} GB, cache released "
                     f"{(c['cache_released'] or 0) / GB:.2f} GB, saved "
                     f"{(c['bytes_saved'] or 0) / GB:.2f} GB, bit_exact={c['bit_exact']}")
    o = doc.get("overhead")
    if o:
        m = o["median_steps_per_s"]
        lines.append(f"overhead: {m['plain']:.1f} steps/s without, {m['agent']:.1f} with the "
                     f"agent: {o['overhead_pct']:.2f} % (target <= {OVERHEAD_TARGET_PCT:g} % "
                     f"{'ok' if o['overhead_pct'] <= OVERHEAD_TARGET_PCT else 'MISSED'})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 16])
    ap.add_argument("--shm-root", type=Path, default=Path("/dev/shm/torpor-abench"))
    ap.add_argument("--disk-root", type=Path, default=Path("/var/tmp/torpor-abench"))
    ap.add_argument("--driver-disk-max-gib", type=float, default=16,
                    help="skip the driver path's checkpoint to disk above this size")
    ap.add_argument("--where", nargs="*", choices=["shm", "disk"], default=["shm", "disk"],
                    help="where checkpoints go (default both; none: suspend/resume only)")
    ap.add_argument("--suspend-via", nargs="+", default=["config"],
                    help="the agent's suspends, each measured: 'memory' (the program's own "
                         "memory), a directory (files under it, huge-page tmpfs mounted as "
                         "configured), 'plain:DIR' (no mount), 'config' (as configured)")
    ap.add_argument("--cache-gib", type=float, default=8, help="0: no cache program")
    ap.add_argument("--overhead-reps", type=int, default=5, help="0: no overhead runs")
    ap.add_argument("--overhead-steps", type=int, default=3000)
    ap.add_argument("--overhead-gib", type=float, default=0.25)
    ap.add_argument("--agent-dir", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", type=Path, default=Path("bench/results/agent_path.json"))
    args = ap.parse_args()
    for root in (args.shm_root, args.disk_root):
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    b = Bench(args)
    inv = gpus.discover()
    doc: dict = {"benchmark": "agent_path",
                 "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "host": {"gpu": inv.gpus[0].name, "driver": inv.driver_version,
                          "kernel": platform.release(), "cpus": os.cpu_count(),
                          "node": platform.node()},
                 "shm_root": str(args.shm_root), "disk_root": str(args.disk_root),
                 "targets": {**{f"{k}_ratio_min": v for k, v in TARGETS.items()},
                             "overhead_pct_max": OVERHEAD_TARGET_PCT},
                 "runs": [], "errors": []}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    started = time.monotonic()
    try:
        for gib in args.sizes:
            print(f"== {gib:g} GiB", flush=True)
            try:
                doc["runs"].append(b.one_size(gib))
            except Exception as e:   # keep what the other sizes measured
                doc["errors"].append({"gib": gib, "error": f"{type(e).__name__}: {e}"})
                print(f"  {gib:g} GiB failed: {e}", flush=True)
                b.stop_all()
            save()
        if args.cache_gib > 0:
            print(f"== cache program: 1 GiB used, {args.cache_gib:g} GiB cached", flush=True)
            try:
                doc["cache"] = b.cache(1.0, args.cache_gib)
            except Exception as e:
                doc["errors"].append({"cache": f"{type(e).__name__}: {e}"})
                b.stop_all()
            save()
        if args.overhead_reps > 0:
            print(f"== overhead: {args.overhead_reps} interleaved runs each", flush=True)
            try:
                doc["overhead"] = b.overhead(args.overhead_reps, args.overhead_steps,
                                             args.overhead_gib)
            except Exception as e:
                doc["errors"].append({"overhead": f"{type(e).__name__}: {e}"})
                b.stop_all()
            save()
    finally:
        b.stop_all()
        doc["total_s"] = round(time.monotonic() - started, 1)
        save()
        shutil.rmtree(b.work, ignore_errors=True)
    print()
    print(table(doc))
    for e in doc["errors"]:
        print(f"error: {e}")
    ok = not doc["errors"] and all(r[p]["bit_exact"] for r in doc["runs"]
                                   for p in ("agent", "driver"))
    ok = ok and doc.get("cache", {}).get("bit_exact", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
