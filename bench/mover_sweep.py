#!/usr/bin/env python3
"""Benchmark: the agent's mover tuning (agent/src/mover_tune.c; issue 20 item 4, "close to the
copy limit") swept on a GPU host, against the pinned-copy limit measured in the same run.

Each variant is a set of TORPOR_AGENT_MOVER_* variables in the program's environment (the agent
reads them once at its start, so each variant is a fresh program): a PyTorch program
(tests/gpu/torch_program.py) under the agent (`torpor run --`) holding N GiB of random tensors
goes through --rounds suspends and resumes (torpor's own flows, as `torpor suspend`/`resume`
run them: files on suspend_dir's huge-page tmpfs), and optionally one --leave-running
checkpoint into /dev/shm (its pause staged in suspend_dir). Per phase: wall seconds, torpor's
phase timings, the agent's reply (bytes moved, its staging / copy / release phases), and GB/s
three ways (the agent's copy phase, the agent's whole reply, the wall), each also as a ratio
of the pinned limit of its direction.

Stage 1 runs every variant at the first size; stage 2 runs the fastest other variant of stage 1
(by the suspend's copy GB/s), the default, then the next --top - 1 at the other sizes, with the
leave-running checkpoint when --leave-running. --budget-s stops starting programs once spent
(what was skipped is recorded). The pinned limit: a torch pinned tensor copied to and from the
GPU (one stream, and two streams of half each), best of --pinned-reps, in a child process
before any program starts.

Correctness, for every program: the agent's own checks on each resume (chunk sums or, with
TORPOR_AGENT_MOVER_CHECK=gpu, GPU fingerprints: a mismatch fails the resume), every 256 MiB
slice's checksum the program writes after the last resume equal to the same slice's before the
first suspend, and every step's loss equal to an uninterrupted reference run's (the loss does
not depend on the bulk's size: one small reference at the end serves every program).

    python3 bench/mover_sweep.py --sizes 8 16 --out $OUT/mover_sweep.json
    MOVER_SWEEP=1 TESTS=0 tests/gpu/run-on-gpu-host.sh        # on the GPU host
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shim"), str(ROOT)]

GB, GiB, SLICE = 1e9, 1 << 30, 256 << 20

# name -> the program's environment (mover_tune.c) and config changes (engine side: keys
# "cfg:<Config field>") (in the order stage 1 runs them: the budget cuts the last)
VARIANTS: dict[str, dict] = {
    "default": {},
    # staging a part (4 MiB) at a time is the default since the sweep of 2026-12-05 (resume
    # 47-49 GB/s against 31-34 with chunks at 16 GiB); a chunk (32 MiB) at a time was before
    # neither held nor drained: the copy out and back inside a --leave-running pause (the
    # default until 2026-12-06)
    "plain": {"TORPOR_AGENT_VMM_EXPORT": "0", "cfg:leave_running_drain": False},
    # held memory: a --leave-running checkpoint maps the memory back instead of copying it
    # (agent/PROTOCOL.md "Held memory"); suspends and resumes as default's
    "hold": {"TORPOR_AGENT_VMM_EXPORT": "1", "cfg:leave_running_drain": False},
    # held, and the copy out left to torpor-copier beside the driver's checkpoint and the dump
    # (agent/PROTOCOL.md "The deferred copy"; config leave_running_drain): with hold, the
    # default since 2026-12-06
    "drain": {"TORPOR_AGENT_VMM_EXPORT": "1", "cfg:leave_running_drain": True},
    # each saved part in one pwrite is the default since 2026-12-05 (whole huge pages of the
    # tmpfs: the kernel zeroes what a 1 MiB write leaves of a new 2 MiB page); 1 MiB writes were
    "write-block": {"TORPOR_AGENT_MOVER_WRITE": "block"},
    "stage-chunk": {"TORPOR_AGENT_MOVER_STAGE": "chunk"},
    "stage-part": {"TORPOR_AGENT_MOVER_STAGE": "part"},
    "stage-part-buffers4": {"TORPOR_AGENT_MOVER_STAGE": "part", "TORPOR_AGENT_MOVER_BUFFERS": "4"},
    "no-presize": {"TORPOR_AGENT_MOVER_PRESIZE": "0"},
    "hostcheck": {"TORPOR_AGENT_MOVER_CHECK": "host"},   # the default before 2026-12-04
    "direct-gpucheck": {"TORPOR_AGENT_MOVER_SINK": "direct", "TORPOR_AGENT_MOVER_CHECK": "gpu"},
    "buffers4": {"TORPOR_AGENT_MOVER_BUFFERS": "4"},
    "gpucheck-buffers4": {"TORPOR_AGENT_MOVER_CHECK": "gpu", "TORPOR_AGENT_MOVER_BUFFERS": "4"},
    "direct": {"TORPOR_AGENT_MOVER_SINK": "direct"},
    "direct-whole-gpucheck": {"TORPOR_AGENT_MOVER_SINK": "direct-whole",
                              "TORPOR_AGENT_MOVER_CHECK": "gpu"},
}


def pinned_limit(gib: float, reps: int) -> dict:
    """The child's side of --pinned: a pinned host tensor to and from the GPU."""
    import torch
    n = int(gib * GiB)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.fill_(7)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    half = n // 2

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return n / (time.perf_counter() - t) / GB

    def two(d2h: bool):
        for k, s in enumerate(streams):
            with torch.cuda.stream(s):
                a, b = (host[k * half:(k + 1) * half], dev[k * half:(k + 1) * half])
                (a.copy_(b, non_blocking=True) if d2h else b.copy_(a, non_blocking=True))

    out: dict = {"bytes": n}
    for name, fn in (("d2h", lambda: host.copy_(dev, non_blocking=True)),
                     ("h2d", lambda: dev.copy_(host, non_blocking=True)),
                     ("d2h_2streams", lambda: two(True)), ("h2d_2streams", lambda: two(False))):
        fn()   # warm
        out[f"{name}_gbps"] = max(timed(fn) for _ in range(reps))
    out["d2h_gbps_best"] = max(out["d2h_gbps"], out["d2h_2streams_gbps"])
    out["h2d_gbps_best"] = max(out["h2d_gbps"], out["h2d_2streams_gbps"])
    return out


def windows(gib: float) -> int:
    """How many 256 MiB slices torch_program.py's bulk checksum rotates through (its
    chunk_sizes: tensors of at most 1 GiB adding up to gib GiB, each cut into slices)."""
    left, n = int(gib * GiB) // 4 * 4, 0
    while left > 0:
        n += math.ceil(min(left, GiB) / SLICE)
        left -= min(left, GiB)
    return n


def warm_host_memory(gib: float) -> dict:
    """Touch gib GiB of host memory once and give it back (4 tmpfs files fallocated at once):
    on these VMs the first use of host memory is slower (their RAM grows as it is used), which
    would otherwise count against whichever variant comes first."""
    if gib <= 0:
        return {}
    t = time.perf_counter()
    paths = [Path(f"/dev/shm/torpor-msweep-warm-{os.getpid()}-{k}") for k in range(4)]
    try:
        procs = [subprocess.Popen(["fallocate", "-l", str(int(gib * GiB / 4)), str(p)])
                 for p in paths]
        rcs = [p.wait(timeout=300) for p in procs]
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
    return {"gib": gib, "seconds": round(time.perf_counter() - t, 2), "rcs": rcs}


def read_steps(path: Path) -> dict[int, tuple[str, str]]:
    out: dict[int, tuple[str, str]] = {}
    lines = path.read_text().split("\n")
    lines.pop()                              # "" or a torn last line
    for line in lines:
        parts = line.split()
        if len(parts) == 3 and parts[0].isdigit():
            out.setdefault(int(parts[0]), (parts[1], parts[2]))
    return out


def slices_consistent(steps: dict[int, tuple[str, str]], nwin: int) -> dict:
    """Every slice's checksum the same at every step that summed it (the bulk never changes)."""
    seen: dict[int, str] = {}
    bad = []
    for step in sorted(steps):
        k, sum_ = step % nwin, steps[step][1]
        if seen.setdefault(k, sum_) != sum_:
            bad.append(step)
    return {"slices_seen": len(seen), "slices_expected": nwin,
            "slices_ok": not bad and len(seen) == nwin, "slice_mismatch_steps": bad[:10]}


def gbps(n: int | None, s: float | None) -> float | None:
    return round(n / s / GB, 3) if n and s else None


class Sweep:
    def __init__(self, args: argparse.Namespace):
        from tests.gpu import programs
        from torpor import config
        self.args, self.programs = args, programs
        self.cfg = config.load()
        self.work = Path(tempfile.mkdtemp(prefix="torpor-msweep-", dir="/dev/shm"))
        self.agent_dir = Path(tempfile.mkdtemp(prefix="tpms-", dir="/tmp"))
        os.chmod(self.agent_dir, 0o700)
        os.environ["TORPOR_AGENT_DIR"] = str(self.agent_dir)
        env = programs.with_torpor_path(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        for k in [k for k in env if k.startswith("TORPOR_AGENT_MOVER_")]:
            env.pop(k)                       # each variant sets its own, nothing inherited
        env["TORPOR_AGENT_LOG_LEVEL"] = "info"  # the "tuned:" line and the agent's timings
        self.env = env
        self.started: list = []
        self.t0 = time.monotonic()
        self.max_step = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def engine(self, overrides: dict | None = None):
        from torpor.engine import Engine
        from torpor.progress import Progress
        return Engine(dataclasses.replace(self.cfg, **(overrides or {})), Progress(None))

    def start(self, name: str, gib: float, env: dict, *, agent: bool = True, max_steps: int = 0,
              sleep: float = 0.01):
        argv = self.programs.command("torch", gib, seed=self.args.seed, max_steps=max_steps,
                                     sleep=sleep)
        p = self.programs.Program(self.work, name, argv, env={**self.env, **env}, agent=agent)
        self.started.append(p)
        return p

    def stop(self, p) -> None:
        p.kill()
        if p in self.started:
            self.started.remove(p)

    @staticmethod
    def agent_of(result: dict, pid: int) -> dict:
        a = result.get("agent") or {}
        rec = a.get(str(pid)) if isinstance(a, dict) else None
        return rec if isinstance(rec, dict) else {}

    def phase(self, what: str, wall: float, result: dict, pid: int, limit: float | None) -> dict:
        rec = self.agent_of(result, pid)
        moved = rec.get("bytes")
        copy_s = (rec.get("phases") or {}).get("copy")
        out = {"wall_s": round(wall, 4), "timings": result.get("timings", {}), "agent": rec,
               "bytes": moved, "zero_bytes": (rec.get("zero") or {}).get("bytes",
                                                                      rec.get("zero_bytes")),
               "copy_gbps": gbps(moved, copy_s), "agent_gbps": gbps(moved, rec.get("seconds")),
               "wall_gbps": gbps(moved, wall)}
        if limit:
            for k in ("copy_gbps", "agent_gbps", "wall_gbps"):
                out[k.replace("gbps", "of_limit")] = round(out[k] / limit, 3) if out[k] else None
        print(f"    {what}: {wall:.3f} s wall, agent copy {out['copy_gbps']} GB/s "
              f"({out.get('copy_of_limit')} of the limit), agent {rec.get('seconds')} s",
              flush=True)
        return out

    def one(self, variant: str, gib: float, leave_running: bool, limits: dict) -> dict:
        from torpor.flows import process
        env = {k: v for k, v in VARIANTS[variant].items() if not k.startswith("cfg:")}
        cfg = {k[4:]: v for k, v in VARIANTS[variant].items() if k.startswith("cfg:")}
        row: dict = {"variant": variant, "gib": gib, "env": env, **({"cfg": cfg} if cfg else {})}
        nwin = windows(gib)
        prog = self.start(f"{variant}-{gib:g}", gib, env)
        try:
            t = time.perf_counter()
            prog.wait_ready(600)
            row["ready_s"] = round(time.perf_counter() - t, 2)
            prog.wait_step(nwin + 1)         # every slice summed once before anything moves
            log = prog.log.read_text(errors="replace")
            row["agent_tuned_line"] = next((ln for ln in log.splitlines() if "tuned:" in ln
                                            or "created exportable" in ln), "")
            if env and not row["agent_tuned_line"]:
                row["warning"] = "no 'tuned:' line in the program's log: the agent did not " \
                                 "take the variant"
            eng = self.engine(cfg)
            row["rounds"] = []
            for n in range(self.args.rounds):
                t = time.perf_counter()
                r = process.suspend(eng, prog.pid)
                sus = self.phase(f"{variant} {gib:g} GiB round {n + 1} suspend",
                                 time.perf_counter() - t, r, prog.pid, limits.get("d2h_gbps_best"))
                time.sleep(0.3)
                at = prog.step()
                t = time.perf_counter()
                r = process.resume(eng, prog.pid)
                res = self.phase(f"{variant} {gib:g} GiB round {n + 1} resume",
                                 time.perf_counter() - t, r, prog.pid, limits.get("h2d_gbps_best"))
                prog.wait_step(at + 3)
                row["rounds"].append({"suspend": sus, "resume": res})
            if leave_running:
                images = Path(self.args.ck_root) / f"ck-{variant}-{gib:g}"
                shutil.rmtree(images, ignore_errors=True)
                try:
                    t = time.perf_counter()
                    m = process.checkpoint(eng, prog.pid, images, leave_running=True)
                    lr = self.phase(f"{variant} {gib:g} GiB leave-running checkpoint",
                                    time.perf_counter() - t, m, prog.pid,
                                    limits.get("d2h_gbps_best"))
                    lr["pause"] = m.get("pause")
                    lr["writeout"] = (m.get("timings") or {}).get("writeout")
                    row["leave_running"] = lr
                    print(f"    paused {(m.get('pause') or {}).get('paused_s')} s, "
                          f"{(m.get('pause') or {}).get('held', 0)} allocation(s) held on the GPU"
                          + (f", copied beside the dump: {m['pause']['drained']}"
                             if (m.get("pause") or {}).get("drained") else ""), flush=True)
                finally:
                    shutil.rmtree(images, ignore_errors=True)
            last = prog.step()
            prog.wait_step(last + nwin + 1)  # every slice summed again after the last resume
            steps_copy = self.work / f"{variant}-{gib:g}.steps.kept"
            shutil.copyfile(prog.steps, steps_copy)
            row["steps_file"] = str(steps_copy)
            steps = read_steps(steps_copy)
            row.update(slices_consistent(steps, nwin))
            self.max_step = max(self.max_step, max(steps) if steps else 0)
            rss = [x["suspend"]["copy_gbps"] for x in row["rounds"] if x["suspend"]["copy_gbps"]]
            row["best_suspend_copy_gbps"] = max(rss) if rss else None
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            row["log_tail"] = prog.tail(3000)
            print(f"    {variant} {gib:g} GiB failed: {e}", flush=True)
        finally:
            self.stop(prog)
        return row

    def reference_losses(self, upto: int) -> dict[int, str]:
        """An uninterrupted run without the agent to step upto: every step's loss."""
        ref = self.start("reference", 0.25, {}, agent=False, max_steps=upto, sleep=0)
        try:
            ref.wait_ready(600)
            ref.wait_done(900)
            return {s: v[0] for s, v in read_steps(ref.steps).items()}
        finally:
            self.stop(ref)


def host_facts() -> dict:
    def read(p: str) -> str:
        try:
            return Path(p).read_text().strip()
        except OSError:
            return ""
    mounts = [ln for ln in read("/proc/mounts").splitlines() if "/dev/shm" in ln]
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "node": platform.node(),
            "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "thp_shmem": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
            "shm_mounts": mounts,
            "mem_available": next((ln for ln in read("/proc/meminfo").splitlines()
                                   if ln.startswith("MemAvailable")), "")}


def table(doc: dict) -> str:
    lim = doc.get("pinned") or {}
    lines = [f"pinned limit: D2H {lim.get('d2h_gbps_best')} GB/s, H2D {lim.get('h2d_gbps_best')}"
             " GB/s (best of one and two streams)",
             f"{'variant':<24}{'GiB':>5}{'suspend s':>11}{'copy GB/s':>11}{'of lim':>8}"
             f"{'resume s':>10}{'copy GB/s':>11}{'of lim':>8}{'pause s':>9}  ok"]
    for r in doc["runs"]:
        if "rounds" not in r or not r["rounds"]:
            lines.append(f"{r['variant']:<24}{r['gib']:>5g}  {r.get('error') or r.get('skipped')}")
            continue
        best = min(r["rounds"], key=lambda x: x["suspend"]["wall_s"])
        s, b = best["suspend"], min((x["resume"] for x in r["rounds"]), key=lambda x: x["wall_s"])
        pause = ((r.get("leave_running") or {}).get("pause") or {}).get("paused_s")
        ok = r.get("slices_ok") and r.get("losses_ok") and "error" not in r
        lines.append(f"{r['variant']:<24}{r['gib']:>5g}{s['wall_s']:>11.3f}"
                     f"{s['copy_gbps'] or 0:>11.2f}{s.get('copy_of_limit') or 0:>8.2f}"
                     f"{b['wall_s']:>10.3f}{b['copy_gbps'] or 0:>11.2f}"
                     f"{b.get('copy_of_limit') or 0:>8.2f}{pause or 0:>9.3f}  "
                     f"{'yes' if ok else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[8, 16])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--top", type=int, default=2, help="variants besides the default in stage 2")
    ap.add_argument("--rounds", type=int, default=2, help="suspend/resume rounds a program")
    ap.add_argument("--leave-running", action="store_true",
                    help="one --leave-running checkpoint a program in stage 2 (CRIU needed)")
    ap.add_argument("--ck-root", default="/dev/shm/torpor-msweep-ck")
    ap.add_argument("--budget-s", type=float, default=150,
                    help="no program is started after this many seconds")
    ap.add_argument("--warm-gib", type=float, default=36,
                    help="host memory touched once before any program (0: none)")
    ap.add_argument("--pinned-gib", type=float, default=4)
    ap.add_argument("--pinned-reps", type=int, default=3)
    ap.add_argument("--pinned", action="store_true", help=argparse.SUPPRESS)  # the child
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", type=Path, default=Path("bench/results/mover_sweep.json"))
    args = ap.parse_args(argv)
    if args.pinned:
        print(json.dumps(pinned_limit(args.pinned_gib, args.pinned_reps)))
        return 0
    doc: dict = {"benchmark": "mover_sweep",
                 "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "host": host_facts(), "variants": VARIANTS, "args": vars(args) | {
                     "out": str(args.out)}, "runs": [], "skipped": [], "errors": []}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    t = time.perf_counter()
    child = subprocess.run([sys.executable, __file__, "--pinned", "--pinned-gib",
                            str(args.pinned_gib), "--pinned-reps", str(args.pinned_reps)],
                           capture_output=True, text=True, timeout=300)
    try:
        doc["pinned"] = json.loads(child.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        doc["errors"].append({"pinned": child.stderr[-2000:]})
        doc["pinned"] = {}
    doc["pinned"]["seconds"] = round(time.perf_counter() - t, 2)
    print(f"pinned limit: {doc['pinned']}", flush=True)
    save()
    doc["warm"] = warm_host_memory(args.warm_gib)
    print(f"host memory warmed: {doc['warm']}", flush=True)
    Path(args.ck_root).mkdir(parents=True, exist_ok=True, mode=0o700)
    sw = Sweep(args)
    plan = [(v, args.sizes[0], False) for v in args.variants]
    try:
        for stage in (1, 2):
            for variant, gib, lr in plan:
                if sw.elapsed() > args.budget_s:
                    doc["skipped"].append({"variant": variant, "gib": gib,
                                           "why": f"budget {args.budget_s:g} s spent"})
                    print(f"  skipped {variant} {gib:g} GiB: budget spent", flush=True)
                    continue
                print(f"== stage {stage}: {variant} at {gib:g} GiB ({sw.elapsed():.0f} s in)",
                      flush=True)
                doc["runs"].append(sw.one(variant, gib, lr, doc["pinned"]))
                save()
            if stage == 1:
                ranked = sorted((r for r in doc["runs"] if r.get("best_suspend_copy_gbps")
                                 and r["variant"] != "default" and r.get("slices_ok")),
                                key=lambda r: -r["best_suspend_copy_gbps"])
                # the fastest first (the budget may cut the last), then the default
                top = [r["variant"] for r in ranked[:args.top]]
                chosen = top[:1] + ["default"] + top[1:]
                doc["stage2_variants"] = chosen
                plan = [(v, g, args.leave_running) for g in args.sizes[1:] for v in chosen]
                if not args.sizes[1:] and args.leave_running:   # one size: leave-running there
                    plan = [(v, args.sizes[0], True) for v in chosen]
        # every program's loss at each step against the others' (the same seed: the same
        # losses, whatever the bulk's size), whether or not the reference below runs
        kept = {id(r): read_steps(Path(r["steps_file"])) for r in doc["runs"]
                if r.get("steps_file")}
        first: dict[int, str] = {}
        for steps in kept.values():
            for step, v in steps.items():
                first.setdefault(step, v[0])
        for r in doc["runs"]:
            if id(r) in kept:
                r["losses_agree_across_programs"] = all(
                    first[s] == v[0] for s, v in kept[id(r)].items())
        upto = sw.max_step
        if upto and sw.elapsed() < args.budget_s + 60:
            print(f"== reference to step {upto}", flush=True)
            ref = sw.reference_losses(upto)
            for r in doc["runs"]:
                if r.get("steps_file"):
                    steps = read_steps(Path(r["steps_file"]))
                    bad = [s for s, v in steps.items() if s in ref and ref[s] != v[0]]
                    r["losses_compared"] = sum(1 for s in steps if s in ref)
                    r["losses_ok"] = not bad and r["losses_compared"] == len(steps)
                    r["loss_mismatch_steps"] = sorted(bad)[:10]
        else:
            doc["skipped"].append({"reference": "budget spent: losses not compared"})
    except Exception as e:
        doc["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        for p in list(sw.started):
            sw.stop(p)
        doc["total_s"] = round(sw.elapsed(), 1)
        save()
        shutil.rmtree(sw.work, ignore_errors=True)
        shutil.rmtree(args.ck_root, ignore_errors=True)
    print()
    print(table(doc))
    for e in doc["errors"]:
        print(f"error: {e}")
    ok = not doc["errors"] and all(r.get("slices_ok") and r.get("losses_ok", True)
                                   and "error" not in r for r in doc["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
