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

Issue 20's figures, with their yardsticks measured in the same run (bench/yardsticks.py):
  --pinned-gib  pinned host<->device copies first (the PCIe bound); per size, "bounds": the
                agent's suspend against (bytes it moved / pinned d2h + the driver's residual,
                its lock and checkpoint of what is left, measured in that suspend), its resume
                likewise (h2d; gpu-restore + unlock), and the driver/agent suspend ratio
                against issue 20's 10x (and the ratio the bound would allow)
  --pause       a --leave-running checkpoint of the agent's program where its checkpoint goes,
                before it: paused_s and durable_s as torpor reports them, the longest stall of
                the program's own steps, against issue 20's 1.5 x (GPU bytes / pinned d2h) + 1 s
  --driver-max-gib  the driver's program only up to this size (its suspend of 64 GiB takes
                a minute); --no-driver-checkpoints: the driver's suspend and resume only
  --where fit   each checkpoint to the disk where it fits, else to --shm-root, which
                --shm-tmpfs-gib mounts as a tmpfs of that size (/dev/shm is half the RAM: a
                64 GiB program fits neither there nor on a 64 GB disk)
  --jax-gib     after the sizes, tests/gpu/jax_program.py with JAX's default preallocation
                (75 % of the GPU as one arena) under the agent through the same operations,
                against a reference without preallocation (skipped where jax is missing)

    python3 bench/agent_path.py --sizes 1 16 --shm-root /dev/shm/torpor-abench \\
        --disk-root /var/tmp/torpor-abench --out agent_path.json [--driver-disk-max-gib 16]

A checkpoint whose images would not fit (free space of the root; for /dev/shm also available
memory, which the driver path needs twice: the program's host copy plus the images) is skipped
and the reason recorded; so is the driver path's checkpoint to disk above --driver-disk-max-gib
(its dump runs at disk speed: minutes at 64 GiB). JSON is rewritten after every size.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shim"), str(ROOT)]

from bench.yardsticks import StallWatch, pinned_copy_gbps, ratio, tmpfs  # noqa: E402
from tests.gpu import programs  # noqa: E402
from tests.gpu.compare_steps import compare  # noqa: E402
from torpor import config, gpus, procs  # noqa: E402
from torpor.flows import process  # noqa: E402
from torpor.engine import Engine  # noqa: E402
from torpor.progress import Progress  # noqa: E402

GB, GiB = 1e9, 1 << 30
TARGETS = {"suspend": 20.0, "resume": 5.0}      # driver s / agent s at least
OVERHEAD_TARGET_PCT = 1.0
ISSUE20 = {"suspend_speedup_min": 10.0, "pause_copy_factor": 1.5, "pause_plus_s": 1.0,
           "suspend_resume_over_bound_max": 1.3}
JAX_ENV = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"}


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
        self.pinned: dict = {}          # the yardstick (main measures it first)
        self.save: Callable[[], None] = lambda: None   # the JSON rewritten (main's)

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
              sleep: float = 0.02, kind: str = "torch", env=None) -> programs.Program:
        argv = programs.command(kind, gib, seed=self.args.seed, max_steps=max_steps,
                                sleep=sleep, extra=extra)
        p = programs.Program(self.work, name, argv, env={**self.env, **(env or {})},
                             agent=agent)
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

    def operations(self, prog: programs.Program, path: str, gib: float,
                   out: dict | None = None) -> dict:
        """Every operation on prog, its figures put into out (the caller's: the JSON is
        rewritten after each, so a run cut short keeps what it measured)."""
        out = {} if out is None else out
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
            self.save()
            print(f"  {path:>6} {gib:g} GiB: suspend {sus['wall_s']:.2f} s, "
                  f"resume {res['wall_s']:.2f} s ({via})", flush=True)
        first = next(iter(out["suspend_via"].values()))
        out["suspend"], out["resume"] = first["suspend"], first["resume"]
        if path == "driver" and not self.args.driver_checkpoints:
            return out
        # the agent's data files hold what its suspend moved (zeros are holes), not all NVML says
        need = int(out["suspend"]["agent"].get("bytes") or used) if path == "agent" else used
        fit = "fit" in self.args.where
        # checkpoint + restore, to host memory and to disk (fit: the first with room)
        places = (("disk", self.args.disk_root), ("shm", self.args.shm_root)) if fit else \
            (("shm", self.args.shm_root), ("disk", self.args.disk_root))
        for where, root in places:
            if where not in self.args.where and not fit:
                continue
            if fit and any("checkpoint_wall_s" in out.get(f"checkpoint_{w}", {})
                           for w in ("disk", "shm")):
                break
            key = f"checkpoint_{where}"
            rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGESIZE")
            why = self.room(where, root, path, need, rss)
            if why:
                out[key] = {"skipped": why}
                print(f"  {path:>6} {gib:g} GiB: {key} skipped: {why}", flush=True)
                continue
            if self.args.pause and path == "agent":
                out[f"pause_{where}"] = self.pause(prog, root, gib)
                self.save()
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
            self.save()
            print(f"  {path:>6} {gib:g} GiB: {key} {ck_s:.2f} s + restore {rs_s:.2f} s, "
                  f"images {size / GB:.2f} GB ({agent_data / GB:.2f} GB agent data)", flush=True)
        return out

    def pause(self, prog: programs.Program, root: Path, gib: float) -> dict:
        """A --leave-running checkpoint into root, timed as torpor reports it and as the
        program's steps saw it; the images are removed after, the program runs on."""
        images = root / f"lr-{prog.name}"
        shutil.rmtree(images, ignore_errors=True)
        try:
            with StallWatch(prog.step) as watch:
                t = time.perf_counter()
                m = process.checkpoint(self.engine(), prog.pid, images, leave_running=True)
                durable = time.perf_counter() - t
            size = tree_bytes(images)
        finally:
            shutil.rmtree(images, ignore_errors=True)
        prog.wait_step(prog.step() + 5)
        p, rec = m.get("pause") or {}, agent_of(m, prog.pid)
        out = {"paused_s": p.get("paused_s"), "staged": p.get("staged"), "durable_s": durable,
               "longest_stall_s": watch.longest_s, "watch_samples": watch.samples,
               "gpu_bytes": rec.get("bytes"), "zero_bytes": rec.get("zero_bytes"),
               "image_bytes": size, "timings": m.get("timings", {}), "agent": rec}
        print(f"  {prog.name}: leave-running pause {p.get('paused_s')} s (staged "
              f"{p.get('staged')}), durable {durable:.2f} s, longest stall "
              f"{watch.longest_s:.2f} s", flush=True)
        return out

    def one_size(self, gib: float, row: dict | None = None) -> dict:
        self.gib_now = gib
        row = {"gib": gib} if row is None else row
        ref = self.start(f"ref{gib:g}", gib, agent=False)
        paths = ("agent", "driver") if gib <= self.args.driver_max_gib else ("agent",)
        if len(paths) == 1:
            row["driver"] = {"skipped": f"above --driver-max-gib {self.args.driver_max_gib:g}"}
        try:
            for path in paths:                      # one at a time: 64 GiB twice still fits
                prog = self.start(f"{path}{gib:g}", gib, agent=(path == "agent"))
                try:
                    prog.wait_ready(900)
                    prog.wait_step(5)
                    row[path] = {}
                    self.operations(prog, path, gib, row[path])
                    row[path].update(bit_exact(ref, prog))
                    row[path]["via_agent"] = bool(row[path]["suspend"]["agent"])
                finally:
                    self.stop(prog)
        finally:
            self.stop(ref)
        row["bounds"] = bounds(row, self.pinned)
        a, d = row["agent"], row["driver"]
        if "suspend" not in d:
            row["ratio_driver_over_agent"] = {}
            return row
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

    # -- JAX with its default preallocation, agent paths only ---------------------------------
    def jax(self, gib: float, out: dict | None = None) -> dict:
        """jax_program.py holding gib GiB of state, JAX's arena preallocated (75 % of the GPU)
        under the agent, through the same operations as a size; its reference runs without
        preallocation beside it (two arenas would not fit). The driver path cannot restore
        JAX (jax_driver_path.py), so it has no row here."""
        self.gib_now = gib
        ref = self.start("jax-ref", gib, agent=False, kind="jax", sleep=0.05,
                         env={**JAX_ENV, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
        prog = self.start("jax", gib, agent=True, kind="jax", sleep=0.05, env=JAX_ENV)
        try:
            ref.wait_ready(600)
            prog.wait_ready(600)
            prog.wait_step(5)
            out = {} if out is None else out
            out.update(gib=gib, agent={})
            self.operations(prog, "agent", gib, out["agent"])
            out["agent"].update(bit_exact(ref, prog))
            out["agent"]["via_agent"] = bool(out["agent"]["suspend"]["agent"])
            out["bounds"] = bounds(out, self.pinned)
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


def bounds(row: dict, pinned: dict) -> dict:
    """Issue 20's figures of one size against the machine's bounds measured in the same run
    (pinned: the yardstick's GB/s; none where it failed): suspend and resume against their
    copy at the pinned rate plus the driver's residual measured in the same operation, and
    every leave-running pause against 1.5 x (GPU bytes / pinned d2h) + 1 s, and against what
    its own flow cannot go below on this machine (flow_bound_s): the agent's bytes out at the
    pinned d2h rate and back at the h2d rate (the GPU memory is released for the driver's
    checkpoint, so it comes back inside the pause), plus the driver's and CRIU's phases as
    they took in that pause (lock, checkpoint, dump, gpu-restore, unlock)."""
    a, d = row["agent"], row.get("driver", {})
    d2h, h2d = pinned.get("d2h"), pinned.get("h2d")
    moved = a["suspend"]["agent"].get("bytes")
    out: dict = {"pinned_gb_per_s": {"d2h": d2h, "h2d": h2d}}
    for op, rate, residual in (("suspend", d2h, ("lock", "checkpoint")),
                               ("resume", h2d, ("gpu-restore", "unlock"))):
        t = a[op]["timings"]
        copy = moved / (rate * GB) if moved and rate else None
        rest = sum(float(t.get(k, 0)) for k in residual)
        bound = None if copy is None else copy + rest
        out[op] = {"wall_s": a[op]["wall_s"], "moved_bytes": moved, "copy_s": copy,
                   "driver_residual_s": rest, "bound_s": bound,
                   "over_bound": ratio(a[op]["wall_s"], bound),
                   "target_over_bound_max": ISSUE20["suspend_resume_over_bound_max"]}
        if op in d:
            out[op].update(driver_s=d[op]["wall_s"],
                           speedup=ratio(d[op]["wall_s"], a[op]["wall_s"]),
                           speedup_bound_allows=ratio(d[op]["wall_s"], bound))
    out["suspend"]["target_speedup_min"] = ISSUE20["suspend_speedup_min"]
    for key, p in a.items():
        if not key.startswith("pause_"):
            continue
        gpu = p.get("gpu_bytes")
        copy = gpu / (d2h * GB) if gpu and d2h else None
        target = None if copy is None else \
            ISSUE20["pause_copy_factor"] * copy + ISSUE20["pause_plus_s"]
        moved_p = (p.get("agent") or {}).get("bytes")
        t = p.get("timings") or {}
        flow = None if not (moved_p and d2h and h2d) else \
            moved_p / (d2h * GB) + moved_p / (h2d * GB) + sum(
                float(t.get(k, 0)) for k in ("lock", "checkpoint", "dump", "gpu-restore", "unlock"))
        out[key] = {"paused_s": p.get("paused_s"), "durable_s": p.get("durable_s"),
                    "gpu_bytes": gpu, "copy_s": copy, "target_s": target,
                    "flow_bound_s": flow, "over_flow_bound": ratio(p.get("paused_s"), flow),
                    "over_target": ratio(p.get("paused_s"), target),
                    "over_copy": ratio(p.get("paused_s"), copy),
                    "met": None if target is None or p.get("paused_s") is None
                    else p["paused_s"] <= target}
    return out


def bound_lines(label: str, b: dict) -> list[str]:
    """The bounds of one size (or the JAX program) as table lines."""
    def f(v, spec=".2f"):
        return "-" if v is None else format(v, spec)
    out = []
    for op in ("suspend", "resume"):
        r = b.get(op, {})
        line = (f"{label:>5} {op} {f(r.get('wall_s'))} s; bound {f(r.get('bound_s'))} s "
                f"(copy {f(r.get('copy_s'))} + driver residual {f(r.get('driver_residual_s'))})"
                f": {f(r.get('over_bound'))}x the bound (issue 20: <= "
                f"{r.get('target_over_bound_max')})")
        if r.get("speedup") is not None:
            line += (f"; driver {f(r.get('driver_s'))} s: {f(r.get('speedup'), '.1f')}x faster, "
                     f"the bound allows {f(r.get('speedup_bound_allows'), '.1f')}x")
            if op == "suspend":
                ok = r["speedup"] >= ISSUE20["suspend_speedup_min"]
                line += f" (>= {ISSUE20['suspend_speedup_min']:g}x {'ok' if ok else 'MISSED'})"
        out.append(line)
    for key, p in b.items():
        if key.startswith("pause_"):
            out.append(f"{label:>5} {key}: paused {f(p['paused_s'])} s, durable "
                       f"{f(p['durable_s'])} s; target {f(p['target_s'])} s (copy "
                       f"{f(p['copy_s'])} s): {'-' if p['met'] is None else 'ok' if p['met'] else 'MISSED'}"
                       f"; its flow's bound {f(p.get('flow_bound_s'))} s (out and back at the "
                       f"pinned rates + driver and dump): {f(p.get('over_flow_bound'))}x")
    return out


def fmt(v) -> str:
    return f"{v:9.2f}" if isinstance(v, (int, float)) else f"{'skipped':>9}"


def table(doc: dict) -> str:
    lines = [f"{'GiB':>5} {'operation':<18} {'driver s':>9} {'agent s':>9} {'ratio':>8}  target"]
    for row in doc["runs"]:
        a, d, r = row["agent"], row["driver"], row["ratio_driver_over_agent"]
        ops = [(k, d.get(k, {}).get("wall_s"), a[k]["wall_s"]) for k in ("suspend", "resume")]
        for where in ("shm", "disk"):
            ca, cd = a.get(f"checkpoint_{where}", {}), d.get(f"checkpoint_{where}", {})
            for k in ("checkpoint", "restore"):
                ops.append((f"{k}_{where}", cd.get(f"{k}_wall_s"), ca.get(f"{k}_wall_s")))
        for name, ds, as_ in ops:
            if ds is None and as_ is None:       # not measured (--where) or skipped on both
                continue
            ratio = r.get(name)
            target = TARGETS.get(name)
            verdict = "" if target is None or ratio is None else \
                f">= {target:g}x {'ok' if ratio >= target else 'MISSED'}"
            lines.append(f"{row['gib']:>5g} {name:<18} {fmt(ds)} {fmt(as_)} "
                         f"{(f'{ratio:7.1f}x' if ratio else '      -'):>8}  {verdict}")
        for via, sr in a.get("suspend_via", {}).items():
            lines.append(f"{row['gib']:>5g} agent suspend/resume via {via}: "
                         f"{sr['suspend']['wall_s']:.2f} / {sr['resume']['wall_s']:.2f} s"
                         + (f", {r[f'suspend_via_{via}']:.1f}x / {r[f'resume_via_{via}']:.1f}x"
                            if f"suspend_via_{via}" in r else ""))
        lines.append(f"{row['gib']:>5g} bit-exact: agent {a['bit_exact']} "
                     f"(via agent: {a['via_agent']}), driver {d.get('bit_exact', d.get('skipped'))}")
        lines += bound_lines(f"{row['gib']:g}", row.get("bounds", {}))
        for p, res in (("driver", d), ("agent", a)):
            for where in ("shm", "disk"):
                why = res.get(f"checkpoint_{where}", {}).get("skipped")
                if why:
                    lines.append(f"{row['gib']:>5g} {p} checkpoint_{where}: skipped ({why})")
    j = doc.get("jax")
    if j and "bounds" in j:
        a = j["agent"]
        lines.append(f"jax {j['gib']:g} GiB (default preallocation, agent): suspend "
                     f"{a['suspend']['wall_s']:.2f} s moving {(a['suspend']['agent'].get('bytes') or 0) / GB:.2f}"
                     f" GB of {a['gpu_memory_bytes'] / GB:.1f} GB, resume {a['resume']['wall_s']:.2f} s, "
                     f"bit-exact {a['bit_exact']}")
        for where in ("shm", "disk"):
            c = a.get(f"checkpoint_{where}", {})
            if "checkpoint_wall_s" in c:
                lines.append(f"jax checkpoint_{where} {c['checkpoint_wall_s']:.2f} s + restore "
                             f"{c['restore_wall_s']:.2f} s, images {c['image_bytes'] / GB:.2f} GB")
        lines += bound_lines("jax", j.get("bounds", {}))
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
    ap.add_argument("--where", nargs="*", choices=["shm", "disk", "fit"],
                    default=["shm", "disk"],
                    help="where checkpoints go (default both; none: suspend/resume only; fit: "
                         "the disk where it fits, else --shm-root)")
    ap.add_argument("--shm-tmpfs-gib", type=float, default=0,
                    help="mount a tmpfs of this size at --shm-root for the run (0: use it as "
                         "it is)")
    ap.add_argument("--driver-max-gib", type=float, default=float("inf"),
                    help="the driver path's program only at sizes up to this")
    ap.add_argument("--driver-checkpoints", action=argparse.BooleanOptionalAction, default=True,
                    help="the driver path's checkpoints too (--no-driver-checkpoints: its "
                         "suspend and resume only)")
    ap.add_argument("--pause", action="store_true",
                    help="a --leave-running checkpoint of the agent's program before its "
                         "checkpoint, where that goes: pause against issue 20's target")
    ap.add_argument("--pinned-gib", type=float, default=4,
                    help="GiB of the pinned-copy yardstick measured first (0: none)")
    ap.add_argument("--jax-gib", type=float, default=0,
                    help="GiB of state of a JAX program with default preallocation, agent "
                         "paths only (0: none; skipped where jax is not importable)")
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
    ap.add_argument("--dry-run", action="store_true", help="print what would run and stop")
    args = ap.parse_args()
    if args.dry_run:
        for gib in args.sizes:
            paths = "agent, driver" if gib <= args.driver_max_gib else "agent"
            print(f"{gib:g} GiB: {paths}; checkpoints {' '.join(args.where) or 'none'}"
                  + (" (driver: suspend/resume only)" if not args.driver_checkpoints else "")
                  + ("; leave-running pause" if args.pause else ""))
        print(f"pinned yardstick {args.pinned_gib:g} GiB; jax {args.jax_gib:g} GiB; cache "
              f"{args.cache_gib:g} GiB; overhead reps {args.overhead_reps}; tmpfs "
              f"{args.shm_tmpfs_gib:g} GiB at {args.shm_root}")
        return 0
    for root in (args.shm_root, args.disk_root):
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.ExitStack() as stack:
        if args.shm_tmpfs_gib > 0:
            stack.enter_context(tmpfs(args.shm_root, args.shm_tmpfs_gib))
        return measure(args)


def measure(args: argparse.Namespace) -> int:
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
                 "issue20_targets": ISSUE20, "runs": [], "errors": []}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        os.replace(tmp, args.out)               # a run killed mid-write leaves the last whole

    b.save = save
    started = time.monotonic()
    try:
        if args.pinned_gib > 0:
            b.pinned = doc["pinned_copy_gb_per_s"] = pinned_copy_gbps(args.pinned_gib)
            print(f"== pinned copies: {b.pinned}", flush=True)
            save()
        for gib in args.sizes:
            print(f"== {gib:g} GiB", flush=True)
            row: dict = {"gib": gib}
            doc["runs"].append(row)             # filled in as it is measured
            try:
                b.one_size(gib, row)
            except Exception as e:   # keep what the other sizes measured
                doc["runs"].remove(row)
                doc.setdefault("partial", []).append(row)
                doc["errors"].append({"gib": gib, "error": f"{type(e).__name__}: {e}"})
                print(f"  {gib:g} GiB failed: {e}", flush=True)
                b.stop_all()
            save()
        if args.jax_gib > 0 and importlib.util.find_spec("jax") is None:
            doc["jax"] = {"skipped": "jax is not importable"}
        elif args.jax_gib > 0:
            print(f"== JAX, {args.jax_gib:g} GiB of state, default preallocation", flush=True)
            try:
                b.jax(args.jax_gib, doc.setdefault("jax", {}))
            except Exception as e:
                doc["errors"].append({"jax": f"{type(e).__name__}: {e}"})
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
                                   for p in ("agent", "driver") if "skipped" not in r[p])
    ok = ok and doc.get("jax", {}).get("agent", {}).get("bit_exact", True)
    ok = ok and doc.get("cache", {}).get("bit_exact", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
