#!/usr/bin/env python3
"""Benchmark: issue 5 end to end. A checkpoint through the agent and the image store, against the
driver path + CRIU, of the same program, side by side in one run.

For each --kind and size (GiB), beside an uninterrupted reference run of the same seed:
  driver  the program without the agent: `torpor checkpoint -D DIR` (the driver's checkpoint,
          then CRIU; images on --root), then restore, bit-exact.
  store   the program under the agent (`torpor run --`): checkpoint --leave-running packed into
          the store as "one", --steps-between steps on, checkpoint packed as "two" (this one
          ends it), restore from "two", bit-exact.
  ends    (unless --no-ends) the program under the agent checkpointed once into a new store,
          ending it, then restored, two ways: through data files (config store_stream off:
          the agent writes files, the pack reads them, the restore unpacks them), and its GPU
          data streamed straight into the store and back out onto the GPU (store/stream.py,
          the default); each bit-exact.
Kinds: torch (training, tests/gpu/torch_program.py), infer (inference: weights + KV cache,
infer_program.py), cpu (no GPU, no agent: cpu_program.py; checks this harness on a machine
without a GPU, its figures say nothing about GPUs).

Ratios, with issue 5's targets:
  checkpoint   driver checkpoint s / store's first checkpoint s, pack included   (>= 10)
  image        store's first new bytes / driver's image bytes                   (<= 0.5)
  incremental  store's second new bytes / its first new bytes                    (<= 0.05)
  restore      driver restore s / store restore s, unpack included
  ends         driver checkpoint s / streamed first checkpoint s (ends the program), and
               the same for the restore; stream_vs_files: files s / streamed s, both ways
The store and both image directories are on --root (a disk), made fresh for every program.

    python3 bench/store_e2e.py --kinds torch infer --sizes 16 --root /var/tmp/torpor-sbench \\
        --out bench/results/store_e2e-h200-DATE.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shim"), str(ROOT), str(ROOT / "bench")]

from agent_path import Bench, agent_of, bit_exact, tree_bytes, wait_gone  # noqa: E402

from tests.gpu import programs  # noqa: E402
from torpor.flows import process  # noqa: E402
from torpor.engine import Engine  # noqa: E402
from torpor.progress import Progress  # noqa: E402
from torpor.store import Store, snapshot  # noqa: E402

GB = 1e9
TARGETS = {"checkpoint": (">=", 10.0), "image": ("<=", 0.5), "incremental": ("<=", 0.05)}


class StoreBench(Bench):
    """agent_path.Bench's set-up (program files, agent sockets, environment) and its stop."""

    def store_engine(self, store: Path) -> Engine:
        return Engine(dataclasses.replace(self.cfg, store_dir=store), Progress(None))

    def launch(self, kind: str, name: str, gib: float, agent: bool) -> programs.Program:
        argv = programs.command(kind, gib, seed=self.args.seed, sleep=0.02)
        p = programs.Program(self.work, name, argv, env=self.env, agent=agent)
        self.started.append(p)
        p.wait_ready(900)
        p.wait_step(5)
        return p

    def fresh(self, name: str) -> Path:
        d = self.args.root / name
        shutil.rmtree(d, ignore_errors=True)
        return d

    def driver(self, kind: str, gib: float, ref: programs.Program) -> dict:
        prog = self.launch(kind, f"{kind}{gib:g}-driver", gib, agent=False)
        images = self.fresh("driver")
        unused = self.fresh("store-unused")
        try:
            t = time.perf_counter()
            m = process.checkpoint(self.store_engine(unused), prog.pid, images)
            ck = time.perf_counter() - t
            prog.reap()
            wait_gone(prog.pid)
            size = tree_bytes(images)
            at = prog.step()
            t = time.perf_counter()
            r = process.restore(self.store_engine(unused), images)
            rs = time.perf_counter() - t
            prog.wait_step(at + 5)
            out = {"checkpoint_s": ck, "restore_s": rs, "image_bytes": size,
                   "checkpoint_timings": m.get("timings", {}),
                   "restore_timings": r.get("timings", {})}
            out.update(bit_exact(ref, prog))
            return out
        finally:
            self.stop(prog)
            shutil.rmtree(images, ignore_errors=True)

    def store(self, kind: str, gib: float, ref: programs.Program) -> dict:
        prog = self.launch(kind, f"{kind}{gib:g}-store", gib, agent=kind != "cpu")
        store = self.fresh("store")
        ck1, ck2 = self.fresh("ck1"), self.fresh("ck2")
        def eng() -> Engine:      # one an operation, as Engine says: its timings are its own
            return self.store_engine(store)
        try:
            t = time.perf_counter()
            e = eng()
            m1, s1 = process.checkpoint_into_store(e, prog.pid, ck1, "one", leave_running=True)
            first_s = time.perf_counter() - t
            ck1_s = first_s - e.progress.timings.get("store", 0.0)     # before the pack
            prog.wait_step(prog.step() + self.args.steps_between)
            t = time.perf_counter()
            e = eng()
            m2, s2 = process.checkpoint_into_store(e, prog.pid, ck2, "two")
            second_s = time.perf_counter() - t
            ck2_s = second_s - e.progress.timings.get("store", 0.0)
            rs, r = self.restore_ended(prog, ck2, eng())
            out = {"first": {"seconds": first_s, "checkpoint_s": ck1_s, "stored": s1,
                             "timings": m1.get("timings", {}), "agent": agent_of(m1, prog.pid)},
                   "second": {"seconds": second_s, "checkpoint_s": ck2_s, "stored": s2,
                              "timings": m2.get("timings", {}),
                              "agent": agent_of(m2, prog.pid)},
                   "restore_s": rs, "restore_timings": r.get("timings", {}),
                   "store_chunk_bytes": tree_bytes(store / "chunks"),
                   "second_new_by_file": new_by_file(store, "two", "one"),
                   "steps_between": self.args.steps_between}
            out.update(bit_exact(ref, prog))
            return out
        finally:
            self.stop(prog)
            for d in (store, ck1, ck2):
                shutil.rmtree(d, ignore_errors=True)

    @staticmethod
    def restore_ended(prog: programs.Program, ck: Path, engine: Engine) -> tuple[float, dict]:
        """prog, which its checkpoint into ck ended, restored from there: (seconds, result)
        once it has gone 5 steps on."""
        prog.reap()
        wait_gone(prog.pid)
        at = prog.step()
        t = time.perf_counter()
        r = process.restore_any(engine, ck)
        rs = time.perf_counter() - t
        prog.wait_step(at + 5)
        return rs, r

    def ends(self, kind: str, gib: float, ref: programs.Program, how: str) -> dict:
        """A first checkpoint into a new store that ends the program, then its restore; how:
        files or stream."""
        prog = self.launch(kind, f"{kind}{gib:g}-ends-{how}", gib, agent=kind != "cpu")
        store, ck = self.fresh(f"store-{how}"), self.fresh(f"ck-{how}")

        def eng() -> Engine:
            return Engine(dataclasses.replace(self.cfg, store_dir=store,
                                              store_stream=how == "stream"), Progress(None))
        try:
            t = time.perf_counter()
            m, stored = process.checkpoint_into_store(eng(), prog.pid, ck, "one")
            ck_s = time.perf_counter() - t
            rs, r = self.restore_ended(prog, ck, eng())
            out = {"checkpoint_s": ck_s, "stored": stored, "timings": m.get("timings", {}),
                   "agent": agent_of(m, prog.pid), "restore_s": rs,
                   "restore_timings": r.get("timings", {})}
            out.update(bit_exact(ref, prog))
            return out
        finally:
            self.stop(prog)
            for d in (store, ck):
                shutil.rmtree(d, ignore_errors=True)

    def one(self, kind: str, gib: float) -> dict:
        ref = programs.Program(self.work, f"{kind}{gib:g}-ref",
                               programs.command(kind, gib, seed=self.args.seed, sleep=0.02),
                               env=self.env)
        self.started.append(ref)
        try:
            row = {"kind": kind, "gib": gib, "driver": self.driver(kind, gib, ref),
                   "store": self.store(kind, gib, ref)}
            if self.args.ends:   # files first: the streamed runs get no warmer a machine
                row["ends"] = {how: self.ends(kind, gib, ref, how)
                               for how in ("files", "stream")}
        finally:
            self.stop(ref)
        d, s = row["driver"], row["store"]
        first, second = s["first"]["stored"], s["second"]["stored"]
        row["ratios"] = {
            "checkpoint": d["checkpoint_s"] / s["first"]["seconds"],
            "second_checkpoint": d["checkpoint_s"] / s["second"]["seconds"],
            "image": first["new_bytes"] / d["image_bytes"],
            "incremental": second["new_bytes"] / max(1, first["new_bytes"]),
            "restore": d["restore_s"] / s["restore_s"]}
        if "ends" in row:
            st, fi = row["ends"]["stream"], row["ends"]["files"]
            row["ratios"].update({
                "ends_checkpoint": d["checkpoint_s"] / st["checkpoint_s"],
                "ends_restore": d["restore_s"] / st["restore_s"],
                "stream_vs_files_checkpoint": fi["checkpoint_s"] / st["checkpoint_s"],
                "stream_vs_files_restore": fi["restore_s"] / st["restore_s"]})
        row["targets_met"] = {k: (row["ratios"][k] >= v if op == ">=" else row["ratios"][k] <= v)
                              for k, (op, v) in TARGETS.items()}
        return row


def new_by_file(store: Path, name: str, base: str, top: int = 12) -> dict[str, int]:
    """Where a checkpoint's new bytes lie: the files with the most, largest first."""
    st = Store(store)
    by = snapshot.new_bytes_by_file(st.load(name), st.load(base))
    return dict(sorted(by.items(), key=lambda kv: -kv[1])[:top])


def line(row: dict) -> str:
    d, s, r = row["driver"], row["store"], row["ratios"]
    return (f"{row['kind']:>5} {row['gib']:g} GiB: driver {d['checkpoint_s']:.2f} s "
            f"{d['image_bytes'] / GB:.2f} GB, restore {d['restore_s']:.2f} s | store first "
            f"{s['first']['seconds']:.2f} s {s['first']['stored']['new_bytes'] / GB:.2f} GB, "
            f"second {s['second']['seconds']:.2f} s "
            f"{s['second']['stored']['new_bytes'] / GB:.3f} GB, restore {s['restore_s']:.2f} s "
            f"| checkpoint {r['checkpoint']:.1f}x, image {r['image']:.2f}, incremental "
            f"{r['incremental']:.3f}, restore {r['restore']:.1f}x | bit-exact "
            f"{d['bit_exact']}/{s['bit_exact']}"
            + ("" if "ends" not in row else
               f"\n      ending the program: streamed {row['ends']['stream']['checkpoint_s']:.2f} s"
               f" / restore {row['ends']['stream']['restore_s']:.2f} s, through files "
               f"{row['ends']['files']['checkpoint_s']:.2f} s / restore "
               f"{row['ends']['files']['restore_s']:.2f} s | driver/streamed "
               f"{r['ends_checkpoint']:.1f}x / {r['ends_restore']:.1f}x, files/streamed "
               f"{r['stream_vs_files_checkpoint']:.2f}x / {r['stream_vs_files_restore']:.2f}x"
               f" | bit-exact {row['ends']['stream']['bit_exact']}/"
               f"{row['ends']['files']['bit_exact']}"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", choices=["torch", "infer", "cpu"],
                    default=["torch", "infer"])
    ap.add_argument("--sizes", type=float, nargs="+", default=[16])
    ap.add_argument("--steps-between", type=int, default=20)
    ap.add_argument("--root", type=Path, default=Path("/var/tmp/torpor-sbench"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--agent-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/results/store_e2e.json"))
    ap.add_argument("--no-ends", dest="ends", action="store_false",
                    help="skip the first checkpoints that end the program (streamed / files)")
    args = ap.parse_args()
    args.root.mkdir(parents=True, exist_ok=True, mode=0o700)
    # the store's own account of each unpack (thread-seconds reading, verifying, writing)
    for name in ("torpor.store.store", "torpor.store.stream"):
        store_log = logging.getLogger(name)
        store_log.setLevel(logging.INFO)
        store_log.addHandler(logging.StreamHandler(sys.stderr))
    doc = {"host": platform.node(), "cpus": os.cpu_count(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "targets": TARGETS, "rows": []}
    bench = StoreBench(args)
    try:
        for kind in args.kinds:
            for gib in args.sizes:
                row = bench.one(kind, gib)
                doc["rows"].append(row)
                print(line(row), flush=True)
                args.out.write_text(json.dumps(doc, indent=2) + "\n")
    finally:
        bench.stop_all()
        shutil.rmtree(bench.work, ignore_errors=True)
        if args.agent_dir is None:               # made by Bench for this run
            shutil.rmtree(bench.agent_dir, ignore_errors=True)
    return 0 if all(r["driver"]["bit_exact"] and r["store"]["bit_exact"]
                    and all(e["bit_exact"] for e in r.get("ends", {}).values())
                    for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
