#!/usr/bin/env python3
"""Benchmark: the CRIU share of a checkpoint (host memory), through each way CRIU >= 4 offers
and through the image store, side by side on one program in one run (issue 5, item 5).

    python3 bench/criu_share.py --mib 1024 --repeat 2 --disk /var/tmp/torpor-criu-bench \
        --out bench/results/criu_share-HOST-DATE.json

The program holds --mib of memory shaped like a training process's host memory (store_path.py's
gpu_like: a quarter zeros, half float32 tensors, a quarter random) at a fixed address, and
between checkpoints changes --change-mib of it plus a page of new heap below it.

Ways, each a `criu dump --leave-running` of the same program, made durable (fsync) on --disk:
  disk          criu dump -D DIR on the disk (what `torpor checkpoint -D DIR` does)
  page-server   criu page-server -D DIR on the disk, the dump sending pages over a local socket
                (its time includes starting the server: start_seconds says how much)
  shm+store     criu dump into /dev/shm, then packed into a store on the disk (zstd, dedup)
  disk+store    criu dump -D DIR on the disk, then packed into a store there (today's --store)
Then a second checkpoint after the change: the store's new bytes, against CRIU's own
incremental dump (pre-dump --track-mem, then dump --prev-images-dir: only pages written since).
`criu --stream` needs criu-image-streamer, which no distribution packages: not measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "shim"), str(ROOT / "bench")]

from store_path import gpu_like  # noqa: E402

from torpor.store import Store, pages  # noqa: E402

MiB = 1 << 20
GB = 1e9
ADDR = 0x200000000000

PROGRAM = """
import ctypes, mmap, os, sys, time
sys.path[:0] = [sys.argv[3]]
from store_path import gpu_like
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
size, addr = int(sys.argv[1]), int(sys.argv[2])
at = libc.mmap(addr, size, 3, 0x22 | 0x100000, -1, 0)
assert at == addr, ctypes.get_errno()
ctypes.memmove(at, bytes(gpu_like(size)), size)
heap = libc.mmap(addr - (1 << 30), 1 << 30, 3, 0x22 | 0x100000, -1, 0)   # just below
assert heap == addr - (1 << 30), ctypes.get_errno()
control = sys.stdin.buffer
print("ready", flush=True)
n = 0
for line in control:                 # "change OFFSET LEN": rewrite LEN bytes, one new heap page
    _, off, length = line.split()
    ctypes.memmove(at + int(off), os.urandom(int(length)), int(length))
    ctypes.memset(heap + n * 4096, 1, 1)
    n += 1
    print("changed", flush=True)
"""


def durable(path: Path) -> None:
    """fsync every file under path (a dump counts once it is on the disk)."""
    for root, _dirs, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def criu(*args: str) -> None:
    subprocess.run(["criu", *args, "-v0"], check=True, stdin=subprocess.DEVNULL)


def dump(pid: int, d: Path, *extra: str) -> None:
    d.mkdir(parents=True)
    criu("dump", "-t", str(pid), "-D", str(d), "--leave-running", "-o", "dump.log", *extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def way_disk(pid: int, work: Path, store: Store, tag: str) -> dict:
    d = work / f"disk-{tag}"
    t = timed(lambda: (dump(pid, d), durable(d)))
    return {"seconds": t, "bytes": tree_bytes(d)}


def way_page_server(pid: int, work: Path, store: Store, tag: str) -> dict:
    d, s = work / f"ps-{tag}", work / f"ps-{tag}-server"
    s.mkdir()
    port = free_port()
    t0 = time.perf_counter()
    # --daemon returns once the server listens; it serves this one dump, then exits
    criu("page-server", "-D", str(s), "--address", "127.0.0.1", "--port", str(port),
         "--daemon", "--pidfile", str(work / "ps.pid"), "-o", "ps.log")
    server = int((work / "ps.pid").read_text())
    started = time.perf_counter() - t0
    dump(pid, d, "--page-server", "--address", "127.0.0.1", "--port", str(port))
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{server}") and time.monotonic() < deadline:
        time.sleep(0.005)
    durable(d)
    durable(s)
    (work / "ps.pid").unlink()
    return {"seconds": time.perf_counter() - t0, "start_seconds": started,
            "bytes": tree_bytes(d) + tree_bytes(s)}


def _to_store(pid: int, d: Path, store: Store, name: str) -> dict:
    t_dump = timed(lambda: dump(pid, d))
    t0 = time.perf_counter()
    _, stats = store.ingest_dir(d, name, {}, pages.page_image_pieces(d, store.chunk_size))
    t_pack = time.perf_counter() - t0
    return {"seconds": t_dump + t_pack, "dump_seconds": t_dump, "pack_seconds": t_pack,
            "bytes": stats.new_bytes, "logical": stats.logical, "new_chunks": stats.new_chunks,
            "reused_chunks": stats.reused_chunks, "zero_chunks": stats.zero_chunks}


def way_shm_store(pid: int, work: Path, store: Store, tag: str) -> dict:
    d = Path(tempfile.mkdtemp(prefix="torpor-criu-bench-", dir="/dev/shm")) / "d"
    try:
        return _to_store(pid, d, store, f"shm-{tag}")
    finally:
        shutil.rmtree(d.parent)


def way_disk_store(pid: int, work: Path, store: Store, tag: str) -> dict:
    return _to_store(pid, work / f"ds-{tag}", store, f"disk-{tag}")


WAYS = {"disk": way_disk, "page-server": way_page_server, "shm+store": way_shm_store,
        "disk+store": way_disk_store}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--change-mib", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--disk", type=Path, default=Path("/var/tmp/torpor-criu-bench"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    shutil.rmtree(args.disk, ignore_errors=True)
    args.disk.mkdir(parents=True, mode=0o700)
    size = args.mib * MiB
    prog = subprocess.Popen([sys.executable, "-c", PROGRAM, str(size), str(ADDR),
                             str(ROOT / "bench")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True)
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    result: dict = {"host": platform.node(), "cpus": os.cpu_count(),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds"),
                    "criu": subprocess.run(["criu", "--version"], capture_output=True,
                                           text=True).stdout.split()[1],
                    "program_mib": args.mib, "change_mib": args.change_mib}
    try:
        assert prog.stdout.readline().strip() == b"ready"
        for i in range(args.repeat):
            # a fresh store per repeat: each way's first checkpoint writes everything
            for way, fn in WAYS.items():
                store = Store(args.disk / f"store-{way}-{i}", workers=os.cpu_count() or 2)
                r = fn(prog.pid, args.disk, store, str(i))
                r["gb_per_s"] = size / GB / r["seconds"]
                runs[way].append(r)
                print(f"{way:12} run {i}: {r['seconds']:6.2f} s  {r['bytes'] / GB:6.3f} GB",
                      flush=True)
                for p in args.disk.iterdir():
                    if not p.name.startswith("store-"):
                        shutil.rmtree(p)
        result["runs"] = runs
        result["incremental"] = incremental(prog, args, size)
    finally:
        os.killpg(prog.pid, signal.SIGKILL)
        prog.wait()
        shutil.rmtree(args.disk, ignore_errors=True)
    best = {w: min(r["seconds"] for r in rs) for w, rs in runs.items()}
    size_of = {w: min(r["bytes"] for r in rs) for w, rs in runs.items()}
    result["ratios_vs_disk"] = {w: {"time": best[w] / best["disk"],
                                    "bytes": size_of[w] / size_of["disk"]} for w in WAYS}
    print(json.dumps({"best_seconds": best, "ratios_vs_disk": result["ratios_vs_disk"],
                      "incremental": result["incremental"]}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def incremental(prog: subprocess.Popen, args: argparse.Namespace, size: int) -> dict:
    """Second checkpoint after --change-mib changed: the store's new bytes against CRIU's own
    incremental dump (pages written since a --track-mem pre-dump; needs the kernel's
    soft-dirty tracking, which some kernels lack: then recorded as unavailable)."""
    store = Store(args.disk / "store-incremental", workers=os.cpu_count() or 2)
    first = _to_store(prog.pid, args.disk / "inc-1", store, "one")
    pre = args.disk / "pre"
    pre.mkdir()
    tracked = subprocess.run(["criu", "pre-dump", "-t", str(prog.pid), "-D", str(pre),
                              "--track-mem", "-o", "pre.log", "-v1"], stdin=subprocess.DEVNULL,
                             capture_output=True, text=True)
    change = args.change_mib * MiB
    prog.stdin.write(f"change {size // 3} {change}\n".encode())
    prog.stdin.flush()
    line = prog.stdout.readline()
    assert line.strip() == b"changed", (line, prog.poll())
    second = _to_store(prog.pid, args.disk / "inc-2", store, "two")
    out = {"changed_bytes": change, "store_first_bytes": first["bytes"],
           "store_second_bytes": second["bytes"],
           "store_second_fraction": second["bytes"] / first["bytes"],
           "store_second_seconds": second["seconds"]}
    if tracked.returncode:
        lines = (tracked.stderr + (pre / "pre.log").read_text(errors="replace")).splitlines()
        out["criu_incremental"] = "unavailable: " + next(
            (ln for ln in lines if "Error" in ln), f"pre-dump exit {tracked.returncode}")
        return out
    d = args.disk / "criu-inc"
    t = timed(lambda: (dump(prog.pid, d, "--prev-images-dir", "../pre", "--track-mem"),
                       durable(d)))
    out.update(criu_incremental_bytes=tree_bytes(d), criu_incremental_seconds=t,
               criu_incremental_fraction=tree_bytes(d) / tree_bytes(args.disk / "inc-1"))
    return out


if __name__ == "__main__":
    main()
