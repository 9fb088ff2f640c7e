#!/usr/bin/env python3
"""Benchmark: a second checkpoint's pack into the image store with host fingerprints (a chunk
the owner's snapshots hold is taken without its sha256: store/fingerprints.py) against the same
pack without them, side by side on the same CRIU images. Needs root and CRIU; no GPU. Writes
JSON (--out) and prints a line per variant.

    python3 bench/incremental_pack.py --mib 1024 --rounds 3 \
        --out bench/results/incremental_pack-cpu-DATE.json

The program holds --mib of random bytes that never change and, below them, memory that gains
a page every tick (tests/integration/test_store_cli.py's STABLE_PROGRAM). Its first checkpoint
is packed into a store; a second one, left running, is dumped once. Each round copies the
store and the second dump twice and packs one copy with fingerprints, the other without, in
alternating order; the copies are read once before timing, so both packs find them in the
page cache (as a pack does, right after CRIU wrote them).

Then the whole second `checkpoint --store` (dump, seal, pack), also in alternating rounds, each
into a fresh copy of the first store: "now", against "before" (sealed with checksums of every
image file, packed with no fingerprints: what it did before both changes).
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

from tests.integration.test_store_cli import STABLE_PROGRAM  # noqa: E402
from torpor import config  # noqa: E402
from torpor.flows import process  # noqa: E402
from torpor.engine import Engine  # noqa: E402
from torpor.store import Store, fingerprints, images  # noqa: E402
from torpor.store.fingerprints import owner_of  # noqa: E402

OWNER = owner_of(uid=os.getuid())


def start(mib: int, status: Path) -> subprocess.Popen:
    src = STABLE_PROGRAM.replace("size = 64 << 20", f"size = {mib} << 20").replace(
        "ctypes.memmove(stable, random.Random(7).randbytes(size), size)",
        "[ctypes.memmove(stable + o, random.Random(o).randbytes(64 << 20), 64 << 20)"
        " for o in range(0, size, 64 << 20)]")
    p = subprocess.Popen([sys.executable, "-c", src, str(status)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, start_new_session=True)
    while not (status.exists() and status.read_text()):
        if p.poll() is not None:
            raise SystemExit(f"the program exited ({p.returncode})")
        time.sleep(0.05)
    return p


def warm(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(16 << 20):
                    pass


def one_pack(base: Path, store0: Path, ck0: Path, with_fp: bool) -> dict:
    store_dir, ck = base / "store", base / "ck"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o700)
    shutil.copytree(store0, store_dir, symlinks=True)
    shutil.copytree(ck0, ck, symlinks=True)
    warm(ck)
    os.sync()
    store = Store(store_dir)
    t = time.perf_counter()
    if with_fp:
        _doc, st = images.pack(store, ck, "two", OWNER)
    else:   # the same pack with no fingerprints known (what it was before them)
        known = no_fingerprints()
        try:
            _doc, st = images.pack(store, ck, "two", OWNER)
        finally:
            fingerprints.known = known
    seconds = time.perf_counter() - t
    return {"seconds": round(seconds, 4), "logical": st.logical, "chunks": st.chunks,
            "new_chunks": st.new_chunks, "reused_chunks": st.reused_chunks,
            "by_fingerprint": st.by_fingerprint}


def no_fingerprints() -> object:
    """fingerprints.known answering None: a pack as it was before them."""
    known, fingerprints.known = fingerprints.known, lambda s, o: None
    return known


def one_checkpoint(base: Path, store0: Path, pid: int, variant: str) -> dict:
    """A whole second `checkpoint --store` of the live program into a copy of store0: "now",
    or "before" (sealed with checksums, packed without fingerprints)."""
    store_dir, ck = base / "store", base / "ck"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o700)
    shutil.copytree(store0, store_dir, symlinks=True)
    engine = Engine(config.load(env={"TORPOR_STORE_DIR": str(store_dir),
                                     "TORPOR_STATE_DIR": str(base / "state")}))
    os.sync()   # the copy's writeback must not land in the dump's time
    t = time.perf_counter()
    if variant == "now":
        process.checkpoint_into_store(engine, pid, ck, "two", leave_running=True)
    else:
        process.checkpoint(engine, pid, ck, leave_running=True)     # seals with checksums
        known = no_fingerprints()
        try:
            images.pack(Store(store_dir), ck, "two", OWNER)
        finally:
            fingerprints.known = known
    return {"seconds": round(time.perf_counter() - t, 4),
            "timings": {k: round(v, 4) for k, v in engine.progress.timings.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", type=Path, default=Path("/var/tmp/torpor-incremental-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/incremental_pack.json"))
    args = ap.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    args.root.mkdir(mode=0o700, parents=True)
    engine = Engine(config.load(env={"TORPOR_STORE_DIR": str(args.root / "store0"),
                                     "TORPOR_STATE_DIR": str(args.root / "state")}))
    prog = start(args.mib, args.root / "n.txt")
    try:
        t = time.perf_counter()
        process.checkpoint_into_store(engine, prog.pid, args.root / "ck1", "one",
                                      leave_running=True)
        first_s = time.perf_counter() - t
        time.sleep(0.5)   # a few ticks: new low pages move the stable bytes in the page image
        t = time.perf_counter()
        process.checkpoint(engine, prog.pid, args.root / "ck2", leave_running=True)
        dump_s = time.perf_counter() - t
        whole: dict[str, list[dict]] = {"now": [], "before": []}
        for r in range(args.rounds):
            for variant in (["now", "before"] if r % 2 == 0 else ["before", "now"]):
                whole[variant].append(one_checkpoint(args.root / "whole", args.root / "store0",
                                                     prog.pid, variant))
    finally:
        prog.kill()
    runs: dict[str, list[dict]] = {"fingerprints": [], "sha256": []}
    for r in range(args.rounds):
        order = ["fingerprints", "sha256"] if r % 2 == 0 else ["sha256", "fingerprints"]
        for variant in order:
            runs[variant].append(one_pack(args.root / "trial", args.root / "store0",
                                          args.root / "ck2", variant == "fingerprints"))
    shutil.rmtree(args.root, ignore_errors=True)
    median = {v: statistics.median(x["seconds"] for x in rs) for v, rs in runs.items()}
    median_whole = {v: statistics.median(x["seconds"] for x in rs) for v, rs in whole.items()}
    result = {
        "bench": "incremental_pack", "host": platform.node(), "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mib": args.mib, "first_checkpoint_s": round(first_s, 3),
        "second_dump_s": round(dump_s, 3), "runs": runs,
        "median_pack_s": median, "ratio_pack": round(median["sha256"] / median["fingerprints"], 2),
        "second_checkpoint": whole, "median_second_checkpoint_s": median_whole,
        "ratio_second_checkpoint": round(median_whole["before"] / median_whole["now"], 2),
    }
    for v, rs in runs.items():
        print(f"{v:13s} pack {median[v]:.3f} s (median of {len(rs)}), {rs[0]['logical'] / 1e9:.2f} "
              f"GB, {rs[0]['by_fingerprint']} of {rs[0]['chunks']} chunks by fingerprint")
    print(f"second dump {dump_s:.3f} s; pack without / with fingerprints: {result['ratio_pack']}x")
    print(f"whole second checkpoint --store: before {median_whole['before']:.3f} s, now "
          f"{median_whole['now']:.3f} s: {result['ratio_second_checkpoint']}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
