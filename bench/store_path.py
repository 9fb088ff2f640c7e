#!/usr/bin/env python3
"""Benchmark: the image store's path on the CPU: ingest (hash, zstd, write, fsync) and verified
read-back of synthetic data shaped like GPU memory, at several chunk sizes, plus the bytes a
second snapshot writes after a few chunks changed. Writes JSON (--out) and prints a table.

    python3 bench/store_path.py --gib 0.5 --chunk-mib 1 2 4 16 --root /var/tmp/torpor-store-bench \
        --out bench/results/store_path-cpu-DATE.json

Data (one file, --gib): a quarter zeros (unused or cleared allocations), half float32 tensors
shaped like trained weights (random mantissas, a few exponent values: what zstd can gain on
real weights), a quarter random bytes (optimizer noise, packed or already-compressed data).
Yardsticks measured in the same run: one thread of sha256 and of zstd level 1, a plain copy of
the file (write + fsync) to the same disk, and the fixed cost of storing one (tiny) chunk.

Read-back reads a store just written (in the page cache): it measures verification and
decompression, not the disk.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shim")]

import zstandard  # noqa: E402

from torpor.store import Store  # noqa: E402
from torpor.store.backend import LocalBackend  # noqa: E402

MiB = 1 << 20
GB = 1e9
# float32 exponent byte (little-endian byte 3) of values around 0.01-0.06, either sign
EXPONENT = bytes((b & 0x80) | 0x3C | (b & 0x01) for b in range(256))


def gpu_like(size: int) -> bytearray:
    """size bytes: zeros, float32 weight-like tensors, random (see the module docstring)."""
    quarter = size // 4
    floats = bytearray(os.urandom(2 * quarter))
    floats[3::4] = os.urandom(len(floats) // 4).translate(EXPONENT)
    return bytearray(quarter) + floats + bytearray(os.urandom(size - 3 * quarter))


def put_overhead_ms(root: Path, count: int = 1000) -> float:
    """The fixed cost of one chunk: a 4 KiB blob put (temp file, fsync, link, unlink)."""
    backend = LocalBackend(root)
    t = time.perf_counter()
    for _ in range(count):
        backend.put_blob(os.urandom(32).hex(), b"x" * 4096)
    backend.sync()
    ms = (time.perf_counter() - t) / count * 1e3
    shutil.rmtree(root)
    return round(ms, 3)


def yardsticks(data: bytearray, src: Path, dest: Path) -> dict[str, float]:
    sample = bytes(data[len(data) // 4: len(data) // 4 + 64 * MiB])
    t = time.perf_counter()
    hashlib.sha256(sample).digest()
    sha = len(sample) / (time.perf_counter() - t) / GB
    t = time.perf_counter()
    zstandard.ZstdCompressor(level=1).compress(sample)
    zst = len(sample) / (time.perf_counter() - t) / GB
    t = time.perf_counter()
    with open(src, "rb") as fi, open(dest, "wb") as fo:
        shutil.copyfileobj(fi, fo, 8 * MiB)
        fo.flush()
        os.fsync(fo.fileno())
    copy = len(data) / (time.perf_counter() - t) / GB
    dest.unlink()
    return {"sha256_1thread_gbps": round(sha, 3), "zstd1_1thread_gbps_on_floats": round(zst, 3),
            "copy_fsync_gbps": round(copy, 3),
            "chunk_put_overhead_ms": put_overhead_ms(dest.parent / "overhead")}


def one_size(data: bytearray, src: Path, root: Path, chunk_mib: int, changed: int) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    store = Store(root, chunk_size=chunk_mib * MiB)
    t = time.perf_counter()
    _, first = store.ingest_dir(src.parent, "one")
    ingest_s = time.perf_counter() - t
    t = time.perf_counter()
    read = sum(len(b) for b in store.read_file("one", src.name))
    read_s = time.perf_counter() - t
    assert read == len(data)
    step = len(data) // changed
    with open(src, "r+b") as f:   # one byte in `changed` chunks spread over the file
        for k in range(changed):
            f.seek(k * step + step // 2)
            f.write(b"\x5a")
    t = time.perf_counter()
    _, second = store.ingest_dir(src.parent, "two")
    second_s = time.perf_counter() - t
    with open(src, "wb") as f:
        f.write(data)
    stored = sum(b.size for b in store.backend.blobs())
    shutil.rmtree(root)
    return {"chunk_mib": chunk_mib, "chunks": first.chunks, "zero_chunks": first.zero_chunks,
            "blobs": first.new_chunks, "stored_bytes": stored,
            "compression_ratio": round(len(data) / first.new_bytes, 3),
            "ratio_of_nonzero": round((len(data) - first.zero_chunks * chunk_mib * MiB)
                                      / first.new_bytes, 3),
            "ingest_s": round(ingest_s, 3), "ingest_gbps": round(len(data) / ingest_s / GB, 3),
            "read_s": round(read_s, 3), "read_gbps": round(len(data) / read_s / GB, 3),
            "second_changed_chunks": changed, "second_new_chunks": second.new_chunks,
            "second_new_bytes": second.new_bytes, "second_s": round(second_s, 3),
            "second_gbps": round(len(data) / second_s / GB, 3)}


def median_of(runs: list[dict]) -> dict:
    """Per key, the median over the rounds of one chunk size."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--chunk-mib", type=int, nargs="+", default=[1, 2, 4, 16])
    ap.add_argument("--changed", type=int, default=4, help="chunks changed for the 2nd snapshot")
    ap.add_argument("--repeat", type=int, default=3,
                    help="rounds over the chunk sizes (interleaved: disk write-back is noisy)")
    ap.add_argument("--root", type=Path, default=Path("/var/tmp/torpor-store-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/store_path.json"))
    args = ap.parse_args()
    size = int(args.gib * (1 << 30)) // (16 * MiB) * (16 * MiB)
    src = args.root / "src" / "gpu-memory.bin"
    src.parent.mkdir(parents=True, exist_ok=True)
    data = gpu_like(size)
    src.write_bytes(data)
    result = {"benchmark": "store_path", "host": platform.node(), "cpus": os.cpu_count(),
              "date": datetime.date.today().isoformat(), "bytes": size,
              "yardsticks": yardsticks(data, src, args.root / "copy.bin"),
              "runs": [one_size(data, src, args.root / "store", c, args.changed)
                       for _ in range(args.repeat) for c in args.chunk_mib]}
    result["median"] = [median_of([r for r in result["runs"] if r["chunk_mib"] == c])
                        for c in args.chunk_mib]
    shutil.rmtree(args.root)
    print(f"{size / GB:.2f} GB, {os.cpu_count()} CPUs; yardsticks {result['yardsticks']}")
    print(f"median of {args.repeat} rounds")
    print(f"{'chunk':>6} {'ingest GB/s':>11} {'read GB/s':>9} {'ratio':>6} {'blobs':>6} "
          f"{'2nd writes':>11} {'2nd GB/s':>8}")
    for r in result["median"]:
        print(f"{r['chunk_mib']:>4} M {r['ingest_gbps']:>11.2f} {r['read_gbps']:>9.2f} "
              f"{r['compression_ratio']:>6.2f} {r['blobs']:>6} "
              f"{r['second_new_bytes'] / MiB:>8.1f} MiB {r['second_gbps']:>8.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
