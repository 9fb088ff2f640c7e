"""Yardsticks the benchmarks measure in the same run as their figures (issue 20: where a target
is bound by the machine, the bound is measured beside it and torpor's ratio to it reported).

    pinned_copy_gbps(gib)   pinned host<->device copies of gib GiB (driver_path.py's torch
                            measurement, run in a child process so that no CUDA context stays
                            in the caller): {"d2h": GB/s, "h2d": GB/s}, or {"error": why}
    disk_gbps(dir, gib)     one file of gib GiB written through the page cache and fsynced
                            (what a durable archive or checkpoint costs), then read back with
                            O_DIRECT (cold; where the filesystem refuses O_DIRECT, after
                            dropping it from the page cache: "read_direct" false): {"write":
                            GB/s, "read": GB/s, ...}; the file is removed whatever happens
    tmpfs(path, gib)        a tmpfs of gib GiB mounted at path for a with-block, unmounted
                            after: host memory for checkpoints that fit neither /dev/shm (half
                            the RAM) nor the disk
    StallWatch(step)        while a with-block runs, the program's step counter (step() -> int)
                            is read every 10 ms; .longest_s is the longest it stood still (a
                            --leave-running pause as the program saw it), .samples how often
                            it was read
    ratio(a, b)             a / b, None where either is missing or b is not positive
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

HERE = Path(__file__).resolve().parent
GB, GiB = 1e9, 1 << 30
BLOCK = 64 << 20


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def pinned_copy_gbps(gib: float = 4.0, timeout: float = 300) -> dict:
    code = ("import json, sys; sys.path.insert(0, %r); from driver_path import pinned_copy_gbps; "
            "print(json.dumps(pinned_copy_gbps(%r)))" % (str(HERE), float(gib)))
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"pinned copy measurement ran past {timeout:.0f} s"}
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]}
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["gib"] = gib
    return out


def disk_gbps(directory: Path, gib: float = 4.0) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".disk-probe-{os.getpid()}"
    blocks = max(1, int(gib * GiB) // BLOCK)
    buf = mmap.mmap(-1, BLOCK)                  # page aligned, as O_DIRECT wants
    buf.write(os.urandom(BLOCK))                # incompressible, should the disk compress
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            t = time.perf_counter()
            for k in range(blocks):
                os.pwrite(fd, buf, k * BLOCK)
            os.fsync(fd)
            write_s = time.perf_counter() - t
        finally:
            os.close(fd)
        direct = True
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:                         # tmpfs and some others: no O_DIRECT
            direct = False
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            t = time.perf_counter()
            for k in range(blocks):
                os.preadv(fd, [buf], k * BLOCK)
            read_s = time.perf_counter() - t
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
        buf.close()
    n = blocks * BLOCK
    return {"bytes": n, "write": n / write_s / GB, "read": n / read_s / GB,
            "write_s": write_s, "read_s": read_s, "read_direct": direct,
            "dir": str(directory)}


@contextlib.contextmanager
def tmpfs(path: Path, gib: float) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(gib * GiB)},mode=0700",
                    "torpor-bench", str(path)], check=True, capture_output=True, text=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class StallWatch:
    def __init__(self, step: Callable[[], int], every: float = 0.01):
        self.step, self.every = step, every
        self.longest_s, self.samples = 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        since_t, since_step = time.monotonic(), self.step()
        while not self._stop.is_set():
            now, s = time.monotonic(), self.step()
            self.samples += 1
            if s != since_step:
                since_t, since_step = now, s
            self.longest_s = max(self.longest_s, now - since_t)
            self._stop.wait(self.every)

    def __enter__(self) -> "StallWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
