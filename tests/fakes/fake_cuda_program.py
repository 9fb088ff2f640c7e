"""A CUDA "workload" for tests, against the fake libcuda (tests/fakes/fake_libcuda.c).

    python fake_cuda_program.py --gpu N --mem BYTES --status FILE [--lib PATH] [--max-ticks N]
                                [--fill OFFSET:LENGTH ...] [--pieces K]

cuInit, cuCtxCreate_v2 on device N (which registers this pid as a CUDA process), cuMemAlloc_v2
of BYTES (never written: zeros), each --fill stretch of it written with random bytes
(cuMemcpyHtoD_v2), then forever: cuCtxSynchronize (blocks while the process is LOCKED or CHECKPOINTED),
tick += 1, rewrite FILE atomically with JSON {"pid", "tick"} every ~50 ms.
The first status (tick 0) is written once the context and the memory exist; it also holds
"ptr", the allocation's device address (the fake's device memory is this process's memory: a
test reads it through /proc/PID/mem). --pieces K: K allocations of BYTES / K instead of one,
each --fill stretch written in each of them, "ptrs" their addresses ("ptr" the first's): many
allocations, as PyTorch's expandable segments make (one every 20 MiB).

The library is --lib, else $TORPOR_LIBCUDA, else libcuda.so.1. On a CUDA error it writes
{"pid", "tick", "error": "<CUresult name>"} and exits 3.

Its fake state entry is proc/<pid>, or proc/<scope>.<pid> under FAKE_CUDA_SCOPE=<scope> (pid as
getpid() sees it, i.e. inside its pid namespace; see fakegpu.py). It needs only the stdlib, so
it runs under the system /usr/bin/python3 in a container (fakegpu.FakeGpu.container_workload).

It keeps nothing but plain files open (the library and FILE's directory), so CRIU can dump it;
start it with stdin/stdout/stderr on /dev/null or a file, never a pipe (fakegpu.spawn does).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time


def write_status(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--mem", type=int, default=1 << 30)
    ap.add_argument("--status", required=True)
    ap.add_argument("--lib", default=os.environ.get("TORPOR_LIBCUDA", "libcuda.so.1"))
    ap.add_argument("--max-ticks", type=int, default=0, help="exit after this many (0: never)")
    ap.add_argument("--fill", action="append", default=[], metavar="OFFSET:LENGTH",
                    help="write random bytes there (the rest stays zeros)")
    ap.add_argument("--pieces", type=int, default=1, help="allocations of --mem / K each")
    args = ap.parse_args()

    lib = ctypes.CDLL(args.lib)
    # FAKE_PROGRAM_MAP=FILE: FILE mapped as a loaded library is (e.g. a stand-in for jaxlib's
    # xla_extension.so, which torpor looks for in /proc/PID/maps)
    mapped = None
    if os.environ.get("FAKE_PROGRAM_MAP"):
        import mmap
        with open(os.environ["FAKE_PROGRAM_MAP"], "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # noqa: F841 (kept)
    pid = os.getpid()
    tick = 0

    def check(rc: int, call: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            lib.cuGetErrorName(rc, ctypes.byref(name))
            text = name.value.decode() if name.value else f"CUresult {rc}"
            write_status(args.status, {"pid": pid, "tick": tick, "error": f"{call}: {text}"})
            sys.exit(3)

    check(lib.cuInit(0), "cuInit")
    dev = ctypes.c_int(0)
    check(lib.cuDeviceGet(ctypes.byref(dev), args.gpu), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate_v2")
    ptrs = []
    for _ in range(max(1, args.pieces)):
        ptr = ctypes.c_ulonglong(0)
        check(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(args.mem // max(1, args.pieces))),
              "cuMemAlloc_v2")
        ptrs.append(ptr.value)
    lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_char_p, ctypes.c_size_t]
    for at in ptrs:
        for spec in args.fill:
            off, length = (int(x) for x in spec.split(":"))
            data = os.urandom(length)
            check(lib.cuMemcpyHtoD_v2(at + off, data, length), "cuMemcpyHtoD_v2")

    doc = {"pid": pid, "tick": tick, "ptr": ptrs[0]}
    if args.pieces > 1:
        doc["ptrs"] = ptrs
    write_status(args.status, doc)
    while True:
        check(lib.cuCtxSynchronize(), "cuCtxSynchronize")
        tick += 1
        doc["tick"] = tick
        write_status(args.status, doc)
        if args.max_ticks and tick >= args.max_ticks:
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
