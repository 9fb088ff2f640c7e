#!/usr/bin/env python3
"""A self-verifying target for `torpor demo`: holds N MiB of known data and keeps checking it.

GPU mode (libcuda loads, cuInit succeeds, a device exists; unless --cpu) keeps the data in one
cuMemAlloc buffer on device 0 under the primary context; CPU mode keeps it in a bytearray. The
data is a deterministic pattern: a 1 MiB pseudo-random block whose every 4 KiB page is stamped
with (MiB index, page index), so misplaced pages are caught as well as flipped bits.

Every tick reads one rotating MiB back and checks it, checks that a small counter allocation
still holds the previous tick (written by cuMemsetD32 on the device) and advances it; every
--verify-every ticks, and on SIGUSR1, the whole buffer is read back and checked. The status
file (JSON, replaced atomically every tick) says how far it got. On any mismatch or CUDA error
it writes last_error and exits 3. Standard library + ctypes only: it must run anywhere.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import signal
import struct
import sys
import time

MIB, PAGE, PIECE_MIB = 1 << 20, 4096, 64
SEED = 0x70B9
EXIT_FAILED = 3


class DemoError(Exception):
    """A CUDA error or a failed check; ends the program with exit code 3."""


class Mismatch(DemoError):
    """The data read back is not what was written."""


def pattern(index: int, base: bytes) -> bytearray:
    """MiB number `index` of the buffer: `base` with each page stamped (index, page)."""
    block = bytearray(base)
    for page in range(MIB // PAGE):
        block[page * PAGE:page * PAGE + 16] = struct.pack("<QQ", index, page)
    return block


class Cuda:
    """The few driver-API calls used, with their cuda.h signatures; every call is checked."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        i, u32, u64 = ctypes.c_int, ctypes.c_uint, ctypes.c_uint64
        sz, vp = ctypes.c_size_t, ctypes.c_void_p
        P = ctypes.POINTER
        for name, argtypes in {
            "cuInit": [u32], "cuDeviceGetCount": [P(i)], "cuDeviceGet": [P(i), i],
            "cuDeviceGetName": [ctypes.c_char_p, i, i],
            "cuDevicePrimaryCtxRetain": [P(vp), i], "cuDevicePrimaryCtxRelease_v2": [i],
            "cuCtxSetCurrent": [vp], "cuCtxSynchronize": [],
            "cuMemAlloc_v2": [P(u64), sz], "cuMemFree_v2": [u64],
            "cuMemcpyHtoD_v2": [u64, vp, sz], "cuMemcpyDtoH_v2": [vp, u64, sz],
            "cuMemsetD32_v2": [u64, u32, sz], "cuGetErrorName": [i, P(ctypes.c_char_p)],
        }.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int

    def __call__(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            ok = self.lib.cuGetErrorName(rc, ctypes.byref(text)) == 0 and text.value
            raise DemoError(f"{name} failed: {text.value.decode() if ok else 'CUresult'} ({rc})")


def probe_gpu(path: str) -> tuple[Cuda | None, str | None]:
    """The driver if it loads, initializes and has a device; else None and why not."""
    try:
        cu = Cuda(path)
    except (OSError, AttributeError) as e:
        return None, f"cannot load {path}: {e}"
    count = ctypes.c_int()
    try:
        cu("cuInit", 0)
        cu("cuDeviceGetCount", ctypes.byref(count))
    except DemoError as e:
        return None, str(e)
    return (cu, None) if count.value > 0 else (None, "no CUDA device")


class GpuBuffer:
    mode = "gpu"

    def __init__(self, cu: Cuda, nbytes: int):
        self.cu, self.ptr, self.counter, self.ctx = cu, ctypes.c_uint64(), ctypes.c_uint64(), None
        self.dev = ctypes.c_int()
        cu("cuDeviceGet", ctypes.byref(self.dev), 0)
        name = ctypes.create_string_buffer(256)
        cu("cuDeviceGetName", name, len(name), self.dev)
        self.device = name.value.decode(errors="replace")
        ctx = ctypes.c_void_p()
        cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self.dev)
        self.ctx = ctx
        cu("cuCtxSetCurrent", ctx)
        cu("cuMemAlloc_v2", ctypes.byref(self.ptr), nbytes)
        cu("cuMemAlloc_v2", ctypes.byref(self.counter), PAGE)
        self.host = ctypes.create_string_buffer(min(nbytes, PIECE_MIB * MIB))  # staging for reads
        self.words = (ctypes.c_uint32 * (PAGE // 4))()

    def write(self, offset: int, data: bytearray) -> None:
        src = (ctypes.c_char * len(data)).from_buffer(data)
        self.cu("cuMemcpyHtoD_v2", self.ptr.value + offset, src, len(data))

    def read(self, offset: int, n: int) -> memoryview:
        self.cu("cuMemcpyDtoH_v2", self.host, self.ptr.value + offset, n)
        return memoryview(self.host).cast("B")[:n]

    def get_counter(self) -> set[int]:
        self.cu("cuMemcpyDtoH_v2", self.words, self.counter.value, PAGE)
        return set(self.words)

    def set_counter(self, value: int) -> None:
        self.cu("cuMemsetD32_v2", self.counter.value, value, PAGE // 4)
        self.cu("cuCtxSynchronize")

    def close(self) -> None:
        for ptr in (self.ptr, self.counter):
            if ptr.value:
                self.cu.lib.cuMemFree_v2(ptr)
        if self.ctx is not None:
            self.cu.lib.cuDevicePrimaryCtxRelease_v2(self.dev)


class CpuBuffer:
    mode, device = "cpu", None

    def __init__(self, nbytes: int):
        self.data, self.counter = bytearray(nbytes), 0

    def write(self, offset: int, data: bytearray) -> None:
        self.data[offset:offset + len(data)] = data

    def read(self, offset: int, n: int) -> memoryview:
        return memoryview(self.data)[offset:offset + n]

    def get_counter(self) -> set[int]:
        return {self.counter}

    def set_counter(self, value: int) -> None:
        self.counter = value

    def close(self) -> None:
        pass


def verify_all(buf, digests: list[bytes], expected: str) -> None:
    whole = hashlib.sha256()
    for start in range(0, len(digests), PIECE_MIB):
        n = min(PIECE_MIB, len(digests) - start)
        piece = buf.read(start * MIB, n * MIB)
        whole.update(piece)
        for j in range(n):
            if hashlib.sha256(piece[j * MIB:(j + 1) * MIB]).digest() != digests[start + j]:
                raise Mismatch(f"full verify: MiB {start + j} does not match its pattern")
    if whole.hexdigest() != expected:
        raise Mismatch("full verify: sha256 of the whole buffer does not match")


def write_status(path: str, state: dict) -> None:
    state["pid"], state["updated"] = os.getpid(), time.time()
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.write("\n")
    os.replace(tmp, path)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--status", required=True, help="JSON status file, replaced every tick")
    p.add_argument("--mib", type=int, default=256, help="MiB of data to hold (default 256)")
    p.add_argument("--cpu", action="store_true", help="keep the data in host memory")
    p.add_argument("--libcuda", default=os.environ.get("TORPOR_LIBCUDA", "libcuda.so.1"))
    p.add_argument("--interval", type=float, default=0.2, help="seconds between ticks")
    p.add_argument("--verify-every", type=int, default=25,
                   help="full verify every N ticks (0: only on SIGUSR1)")
    p.add_argument("--max-ticks", type=int, default=0, help="exit 0 after N ticks (0: run forever)")
    p.add_argument("--self-test-corrupt-at", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mib < 1:
        p.error("--mib must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    state = {"pid": os.getpid(), "mode": None, "device": None, "mib": args.mib, "tick": 0,
             "verified_tick": None, "verified_ok": None, "verifications": 0,
             "last_error": None, "sha256_expected": None, "note": None}
    want_verify = [False]
    signal.signal(signal.SIGUSR1, lambda *_: want_verify.__setitem__(0, True))
    buf, tick = None, 0
    try:
        cu, why_not = (None, "--cpu given") if args.cpu else probe_gpu(args.libcuda)
        buf = GpuBuffer(cu, args.mib * MIB) if cu else CpuBuffer(args.mib * MIB)
        state.update(mode=buf.mode, device=buf.device, note=why_not and f"cpu mode: {why_not}")
        base, whole, digests = random.Random(SEED).randbytes(MIB), hashlib.sha256(), []
        for i in range(args.mib):
            block = pattern(i, base)
            buf.write(i * MIB, block)
            whole.update(block)
            digests.append(hashlib.sha256(block).digest())
        state["sha256_expected"] = expected = whole.hexdigest()
        buf.set_counter(0)
        print(f"torpor demo: pid {os.getpid()} mode {buf.mode} device {buf.device} "
              f"mib {args.mib} status {args.status}", flush=True)

        def verify():
            verify_all(buf, digests, expected)
            state.update(verified_tick=tick, verified_ok=True,
                         verifications=state["verifications"] + 1)

        verify()
        write_status(args.status, state)
        while not args.max_ticks or tick < args.max_ticks:
            time.sleep(args.interval)
            tick += 1
            if tick == args.self_test_corrupt_at:  # test hook: flip one byte somewhere
                at = ((tick + args.mib // 2) % args.mib) * MIB + MIB // 2 + 7
                byte = bytearray(buf.read(at, 1))
                byte[0] ^= 0xFF
                buf.write(at, byte)
            i = tick % args.mib
            if hashlib.sha256(buf.read(i * MIB, MIB)).digest() != digests[i]:
                raise Mismatch(f"tick {tick}: MiB {i} does not match its pattern")
            seen = buf.get_counter()
            if seen != {(tick - 1) & 0xFFFFFFFF}:
                raise Mismatch(
                    f"tick {tick}: device counter holds {sorted(seen)[:4]}, not {tick - 1}")
            buf.set_counter(tick & 0xFFFFFFFF)
            if want_verify[0] or (args.verify_every and tick % args.verify_every == 0):
                want_verify[0] = False
                verify()
            state["tick"] = tick
            write_status(args.status, state)
        return 0
    except DemoError as e:
        state["last_error"] = f"tick {tick}: {e}" if not str(e).startswith("tick") else str(e)
        if isinstance(e, Mismatch):
            state.update(verified_tick=tick, verified_ok=False)
        write_status(args.status, state)
        print(f"torpor demo: FAILED: {state['last_error']}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        if buf is not None:
            buf.close()


if __name__ == "__main__":
    sys.exit(main())
