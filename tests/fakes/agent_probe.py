"""A CUDA program for the agent's tests (tests/unit/test_agent.py), against the fake libcuda.

    python agent_probe.py --lib PATH      (run it under LD_PRELOAD=libtorpor-agent.so)

Prints {"ready": true, "pid": N} once the library is loaded (no driver call made yet), then
reads commands from stdin, one a line: "<id> <command> [args...]". Each runs in a thread of its
own (a call held at the agent's gate does not hold the next command) and answers one JSON line
{"id", "rc", "t0", "t1", ...}: rc is the CUresult (or -1 and "error"), t0/t1 time.monotonic()
(CLOCK_MONOTONIC, comparable with the test's) just before and just after the driver call.

Doors, the way a command reaches a driver function:
  dlsym      the CDLL's attribute: dlsym(handle of libcuda, "cuMemAlloc_v2")
  proc       cuGetProcAddress("cuMemAlloc", ..., 12000, 0) (itself found through dlsym)
  proc_v2    cuGetProcAddress_v2("cuMemAlloc", ..., 12000, 0, &status)
  global     CDLL(None)'s attribute: dlsym(the main program's handle, ...), the global scope
Commands:
  init                          cuInit, cuDeviceGet 0, cuCtxCreate_v2   -> "ctx"
  alloc BYTES DOOR              cuMemAlloc                              -> "ptr"
  pitch WIDTH HEIGHT ELEM DOOR  cuMemAllocPitch                         -> "ptr", "pitch"
  free PTR DOOR                 cuMemFree
  sync DOOR                     cuStreamSynchronize(0)
  ctxsync DOOR                  cuCtxSynchronize
  launch DOOR | htod PTR N DOOR | dtoh PTR N DOOR
  addr BASE DOOR                no call: "fn", the address the door gives, and "object", the
                                file dladdr() says it lies in (rc 0, or -1 when not found)
  quit                          exits 0 (after answering)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time

c_ptr = ctypes.POINTER(ctypes.c_ulonglong)

# base name -> (exported name, argtypes); every one returns CUresult (int)
FUNCS = {
    "cuInit": ("cuInit", [ctypes.c_uint]),
    "cuDeviceGet": ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
    "cuCtxCreate": ("cuCtxCreate_v2", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint,
                                       ctypes.c_int]),
    "cuCtxSynchronize": ("cuCtxSynchronize", []),
    "cuMemAlloc": ("cuMemAlloc_v2", [c_ptr, ctypes.c_size_t]),
    "cuMemAllocPitch": ("cuMemAllocPitch_v2", [c_ptr, ctypes.POINTER(ctypes.c_size_t),
                                               ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint]),
    "cuMemFree": ("cuMemFree_v2", [ctypes.c_ulonglong]),
    "cuStreamSynchronize": ("cuStreamSynchronize", [ctypes.c_void_p]),
    "cuLaunchKernel": ("cuLaunchKernel", [ctypes.c_void_p] + [ctypes.c_uint] * 7 +
                       [ctypes.c_void_p] * 3),
    "cuMemcpyHtoD": ("cuMemcpyHtoD_v2", [ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t]),
    "cuMemcpyDtoH": ("cuMemcpyDtoH_v2", [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t]),
}


class Dl_info(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


class Probe:
    def __init__(self, lib: str):
        self.lib = ctypes.CDLL(lib)                      # dlopen(lib, RTLD_LOCAL)
        self.main = ctypes.CDLL(None)
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(Dl_info)]
        self.out = threading.Lock()

    def address(self, base: str, door: str) -> int | None:
        """The address the door gives for `base` (cuda.h's name, e.g. cuMemAlloc)."""
        name = FUNCS[base][0] if base in FUNCS else base
        if door in ("dlsym", "global"):
            lib = self.lib if door == "dlsym" else self.main
            try:
                return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
            except AttributeError:
                return None
        if door in ("proc", "proc_v2"):
            pfn = ctypes.c_void_p()
            if door == "proc":
                f = self.lib.cuGetProcAddress
                f.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                              ctypes.c_uint64]
                rc = f(base.encode(), ctypes.byref(pfn), 12000, 0)
            else:
                status = ctypes.c_int(-1)
                f = self.lib.cuGetProcAddress_v2
                f.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                              ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
                rc = f(base.encode(), ctypes.byref(pfn), 12000, 0, ctypes.byref(status))
                if rc == 0 and status.value != 0:
                    raise RuntimeError(f"cuGetProcAddress_v2({base}): status {status.value}")
            return pfn.value if rc == 0 else None
        raise ValueError(f"unknown door {door!r}")

    def func(self, base: str, door: str):
        addr = self.address(base, door)
        if addr is None:
            raise RuntimeError(f"{base} not found through {door}")
        return ctypes.CFUNCTYPE(ctypes.c_int, *FUNCS[base][1])(addr)

    def object_of(self, addr: int) -> str | None:
        info = Dl_info()
        if not self.libc.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) or not info.dli_fname:
            return None
        return info.dli_fname.decode()

    def run(self, cid: str, cmd: str, args: list[str]) -> dict:
        doc: dict = {"id": cid}
        timed = []

        def call(f, *a):
            t0 = time.monotonic()
            rc = f(*a)
            t1 = time.monotonic()
            timed.append((t0, t1))
            return rc

        door = args[-1] if args else "dlsym"
        if cmd == "init":
            rc = call(self.func("cuInit", door), 0)
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            if rc == 0:
                rc = call(self.func("cuDeviceGet", door), ctypes.byref(dev), 0)
            if rc == 0:
                rc = call(self.func("cuCtxCreate", door), ctypes.byref(ctx), 0, dev)
            doc["ctx"] = ctx.value
        elif cmd == "alloc":
            ptr = ctypes.c_ulonglong()
            rc = call(self.func("cuMemAlloc", door), ctypes.byref(ptr), int(args[0]))
            doc["ptr"] = ptr.value
        elif cmd == "pitch":
            ptr, pitch = ctypes.c_ulonglong(), ctypes.c_size_t()
            rc = call(self.func("cuMemAllocPitch", door), ctypes.byref(ptr), ctypes.byref(pitch),
                      int(args[0]), int(args[1]), int(args[2]))
            doc["ptr"], doc["pitch"] = ptr.value, pitch.value
        elif cmd == "free":
            rc = call(self.func("cuMemFree", door), int(args[0], 0))
        elif cmd == "sync":
            rc = call(self.func("cuStreamSynchronize", door), None)
        elif cmd == "ctxsync":
            rc = call(self.func("cuCtxSynchronize", door))
        elif cmd == "launch":
            rc = call(self.func("cuLaunchKernel", door), 0x1000, 1, 1, 1, 32, 1, 1, 0, None,
                      None, None)
        elif cmd in ("htod", "dtoh"):
            buf = ctypes.create_string_buffer(int(args[1]))
            if cmd == "htod":
                rc = call(self.func("cuMemcpyHtoD", door), int(args[0], 0), buf, int(args[1]))
            else:
                rc = call(self.func("cuMemcpyDtoH", door), buf, int(args[0], 0), int(args[1]))
        elif cmd == "addr":
            addr = self.address(args[0], door)
            rc = 0 if addr is not None else -1
            doc["fn"] = addr
            doc["object"] = self.object_of(addr) if addr else None
        elif cmd == "quit":
            rc = 0
        else:
            raise ValueError(f"unknown command {cmd!r}")
        doc["rc"] = rc
        if timed:
            doc["t0"], doc["t1"] = timed[-1]
        return doc

    def answer(self, cid: str, cmd: str, args: list[str]) -> None:
        try:
            doc = self.run(cid, cmd, args)
        except Exception as e:  # noqa: BLE001  (reported to the test, which fails on it)
            doc = {"id": cid, "rc": -1, "error": f"{type(e).__name__}: {e}"}
        with self.out:
            print(json.dumps(doc), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    probe = Probe(ap.parse_args().lib)
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        cid, cmd, args = parts[0], parts[1] if len(parts) > 1 else "", parts[2:]
        if cmd == "quit":
            probe.answer(cid, cmd, args)
            return 0
        threading.Thread(target=probe.answer, args=(cid, cmd, args), daemon=True).start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
