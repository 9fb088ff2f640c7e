#!/usr/bin/env python3
"""Benchmark: how fast the image store can make chunks durable on a disk, the bound of a first
checkpoint into the store (issue 5): 4 MiB chunks of incompressible data, lengths like zstd's
output of float32 weights (3.3-4 MiB, not block multiples), written by --threads threads at
once, each way until every byte and name is durable, interleaved over --rounds rounds:

- put_blob:  the store's way (backend.LocalBackend.put_blob): temp file, write, fsync, link,
             unlink; the chunk directories synced at the end;
- direct:    the same with O_DIRECT from an aligned buffer (the length padded to the block,
             then truncated back), fdatasync, link, unlink; directories synced at the end;
- one-sync:  buffered writes and links with no fsync, then one syncfs (what the page cache's
             writeback gives when nothing waits per chunk);
- raw:       the disk itself: each thread writes its share into one preallocated file with
             O_DIRECT, 4 MiB at a time, then fdatasync (no names, no metadata).

    python3 bench/chunk_writes.py --gib 16 --threads 16 --root /var/tmp/torpor-cw \
        --out bench/results/chunk_writes-h200-DATE.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import mmap
import os
import platform
import random
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shim")]

from torpor.files import fsync_dir  # noqa: E402
from torpor.store.backend import LocalBackend  # noqa: E402

MiB = 1 << 20
CHUNK = 4 * MiB
BLOCK = 4096
GB = 1e9


def lengths(count: int, seed: int = 1) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(int(CHUNK * 0.82), CHUNK + 1) for _ in range(count)]


def sources(n: int = 32) -> list[bytes]:
    return [os.urandom(CHUNK) for _ in range(n)]


def name(i: int) -> str:
    return f"{i:016x}" + "0" * 48


def way_put_blob(root: Path, lens: list[int], src: list[bytes], threads: int) -> None:
    backend = LocalBackend(root)

    def put(i: int) -> None:
        backend.put_blob(name(i), memoryview(src[i % len(src)])[:lens[i]])
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, range(len(lens))))
    backend.sync()


def way_direct(root: Path, lens: list[int], src: list[bytes], threads: int) -> None:
    backend = LocalBackend(root)
    local = threading.local()          # an aligned buffer a thread (O_DIRECT needs one)

    def put(i: int) -> None:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, CHUNK)
        n = lens[i]
        buf[:n] = memoryview(src[i % len(src)])[:n]
        padded = (n + BLOCK - 1) // BLOCK * BLOCK
        final = backend._blob(name(i))
        tmp = backend.tmp / f"{name(i)[:16]}.{os.getpid()}.{time.monotonic_ns()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(buf)[:padded]
            while view:
                view = view[os.write(fd, view):]
            os.ftruncate(fd, n)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        final.parent.mkdir(mode=0o700, exist_ok=True)
        os.link(tmp, final)
        os.unlink(tmp)
        backend._dirty.add(final.parent)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, range(len(lens))))
    backend.sync()


def way_one_sync(root: Path, lens: list[int], src: list[bytes], threads: int) -> None:
    backend = LocalBackend(root)

    def put(i: int) -> None:
        final = backend._blob(name(i))
        final.parent.mkdir(mode=0o700, exist_ok=True)
        with open(final, "wb") as f:
            f.write(memoryview(src[i % len(src)])[:lens[i]])
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, range(len(lens))))
    fd = os.open(root, os.O_RDONLY)
    try:
        os.syncfs(fd) if hasattr(os, "syncfs") else os.sync()
    finally:
        os.close(fd)
    for d in backend.chunks.iterdir():
        fsync_dir(d)


def way_raw(root: Path, lens: list[int], src: list[bytes], threads: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    share = (len(lens) + threads - 1) // threads

    def write(t: int) -> None:
        path = root / f"raw-{t}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        buf = mmap.mmap(-1, CHUNK)
        try:
            os.posix_fallocate(fd, 0, share * CHUNK)
            for k in range(share):
                i = t * share + k
                if i >= len(lens):
                    break
                buf[:] = src[i % len(src)]
                os.pwrite(fd, buf, k * CHUNK)
            os.fdatasync(fd)
        finally:
            os.close(fd)
            buf.close()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(threads)))


WAYS = {"put_blob": way_put_blob, "direct": way_direct, "one-sync": way_one_sync,
        "raw": way_raw}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--threads", type=int, nargs="+", default=[16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS))
    ap.add_argument("--root", type=Path, default=Path("/var/tmp/torpor-cw"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    count = int(args.gib * (1 << 30)) // CHUNK
    lens = lengths(count)
    src = sources()
    runs = []
    for r in range(args.rounds):
        order = args.ways if r % 2 == 0 else list(reversed(args.ways))
        for threads in args.threads:
            for way in order:
                shutil.rmtree(args.root, ignore_errors=True)
                os.sync()
                t = time.perf_counter()
                WAYS[way](args.root / "s", lens, src, threads)
                s = time.perf_counter() - t
                nbytes = count * CHUNK if way == "raw" else sum(lens)
                runs.append({"round": r, "way": way, "threads": threads, "seconds": round(s, 3),
                             "bytes": nbytes, "gb_per_s": round(nbytes / s / GB, 3)})
                print(f"round {r} {way:9s} t{threads:<3d} {s:7.2f} s  "
                      f"{nbytes / s / GB:5.2f} GB/s", flush=True)
    shutil.rmtree(args.root, ignore_errors=True)
    best = {}
    for run in runs:
        key = f"{run['way']}/t{run['threads']}"
        best[key] = max(best.get(key, 0), run["gb_per_s"])
    doc = {"benchmark": "chunk_writes", "date": datetime.datetime.now(datetime.timezone.utc)
           .isoformat(timespec="seconds"), "host": platform.node(), "kernel": platform.release(),
           "gib": args.gib, "chunks": count, "runs": runs, "best_gb_per_s": best}
    print(json.dumps(best))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
