"""A CUDA program for the agent's tests (tests/unit/test_agent.py), against the fake libcuda.

    python agent_probe.py --lib PATH      (run it under LD_PRELOAD=libtorpor-agent.so)

Prints {"ready": true, "pid": N} once the library is loaded (no driver call made yet), then
reads commands from stdin, one a line: "<id> <command> [args...]". Each runs in a thread of its
own (a call held at the agent's gate does not hold the next command) and answers one JSON line
{"id", "rc", "t0", "t1", ...}: rc is the CUresult (or -1 and "error"), t0/t1 time.monotonic()
(CLOCK_MONOTONIC, comparable with the test's) just before and just after the driver call (the
first and the last one, for a command that makes several).

Doors, the way a command reaches a driver function:
  dlsym      the CDLL's attribute: dlsym(handle of libcuda, "cuMemAlloc_v2")
  proc       cuGetProcAddress("cuMemAlloc", ..., 12000, 0) (itself found through dlsym)
  proc_v2    cuGetProcAddress_v2("cuMemAlloc", ..., 12000, 0, &status)
  global     CDLL(None)'s attribute: dlsym(the main program's handle, ...), the global scope
Commands (a command written "@name" first makes init's context current in its thread, as the
CUDA runtime does in every thread it runs in; untimed):
  init                          cuInit, cuDeviceGet 0, cuCtxCreate_v2   -> "ctx"
  ctx DEV DOOR                  cuDeviceGet DEV, cuCtxCreate_v2: "@" commands use it from now
                                on (a program with several GPUs)        -> "ctx"
  alloc BYTES DOOR              cuMemAlloc                              -> "ptr"
  pitch WIDTH HEIGHT ELEM DOOR  cuMemAllocPitch                         -> "ptr", "pitch"
  free PTR DOOR                 cuMemFree
  sync DOOR                     cuStreamSynchronize(0)
  ctxsync DOOR                  cuCtxSynchronize
  launch DOOR | htod PTR N DOOR | dtoh PTR N DOOR
  addr BASE DOOR                no call: "fn", the address the door gives, and "object", the
                                file dladdr() says it lies in (rc 0, or -1 when not found)
  cached PTR HANDLE BYTES       no call: a fake sys.modules["torch"] whose cuda.empty_cache()
                                gives back that VMM mapping (vmmfree), once
  dup2 FD NUMBER                no call: the program puts a descriptor of its own at NUMBER
                                (closing what was there), close-on-exec
  quit                          exits 0 (after answering)
Memory commands: numbers (decimal or 0x...), then an optional DOOR (default dlsym). One that
makes several calls stops at the first failing one: rc is its CUresult, "failed" its base name.
  fill PTR N SEED               cuMemcpyHtoD of pattern(SEED, N) (random.Random(SEED).randbytes,
                                16 MiB at a time; zeros for a negative SEED) to PTR
  check PTR N SEED              cuMemcpyDtoH of N bytes at PTR, compared with pattern(SEED, N)
                                -> "ok", "bad" (offset of the first wrong byte, or null)
  streamcopy PTR N SEED         the pattern through pinned memory and a stream: cuMemHostAlloc x2,
                                cuStreamCreate, cuEventCreate, cuMemcpyHtoDAsync, cuEventRecord,
                                cuEventSynchronize, cuMemcpyDtoHAsync, cuStreamSynchronize, then
                                everything freed -> "ok" (the data came back)
  vmm BYTES                     the program's own VMM use (PyTorch expandable segments): BYTES
                                rounded up to the granularity, cuMemAddressReserve, cuMemCreate
                                (device 0), cuMemMap, cuMemSetAccess (read-write, device 0)
                                -> "ptr", "handle", "size"; on a failure what was done is undone
  vmmfd BYTES                   as vmm, the memory created exportable as a POSIX file descriptor
                                (requestedHandleTypes)
  vmmfree PTR HANDLE BYTES      cuMemUnmap, cuMemRelease, cuMemAddressFree (BYTES rounded up too)
  reserve BYTES                 cuMemAddressReserve(BYTES, alignment 0, addr 0) -> "ptr"
  create BYTES                  cuMemCreate(BYTES, pinned on device 0) -> "handle"
  map PTR BYTES HANDLE          cuMemMap(PTR, BYTES, 0, HANDLE, 0)
  access PTR BYTES              cuMemSetAccess(PTR, BYTES, read-write for device 0)
  unmap PTR BYTES | release HANDLE | addrfree PTR BYTES
  retain PTR                    cuMemRetainAllocationHandle -> "handle"
  export HANDLE                 cuMemExportToShareableHandle(POSIX file descriptor) -> "fd" (the
                                probe's now: the test closes it through /proc or leaves it)
  meminfo                       cuMemGetInfo -> "free", "total"
  range PTR                     cuMemGetAddressRange -> "base", "size"; cuPointerGetAttribute
                                RANGE_START_ADDR, RANGE_SIZE -> "attr_base", "attr_size"
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import sys
import threading
import time

c_ptr = ctypes.POINTER(ctypes.c_ulonglong)

# base name -> (exported name, argtypes); every one returns CUresult (int)
FUNCS = {
    "cuCtxSetCurrent": ("cuCtxSetCurrent", [ctypes.c_void_p]),
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
    "cuMemcpyHtoDAsync": ("cuMemcpyHtoDAsync_v2", [ctypes.c_ulonglong, ctypes.c_void_p,
                                                   ctypes.c_size_t, ctypes.c_void_p]),
    "cuMemcpyDtoHAsync": ("cuMemcpyDtoHAsync_v2", [ctypes.c_void_p, ctypes.c_ulonglong,
                                                   ctypes.c_size_t, ctypes.c_void_p]),
    "cuMemGetInfo": ("cuMemGetInfo_v2", [ctypes.POINTER(ctypes.c_size_t)] * 2),
    "cuMemGetAddressRange": ("cuMemGetAddressRange_v2", [c_ptr, ctypes.POINTER(ctypes.c_size_t),
                                                         ctypes.c_ulonglong]),
    "cuPointerGetAttribute": ("cuPointerGetAttribute", [ctypes.c_void_p, ctypes.c_int,
                                                        ctypes.c_ulonglong]),
    "cuMemGetAllocationGranularity": ("cuMemGetAllocationGranularity",
                                      [ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                                       ctypes.c_int]),
    "cuMemAddressReserve": ("cuMemAddressReserve", [c_ptr, ctypes.c_size_t, ctypes.c_size_t,
                                                    ctypes.c_ulonglong, ctypes.c_ulonglong]),
    "cuMemAddressFree": ("cuMemAddressFree", [ctypes.c_ulonglong, ctypes.c_size_t]),
    "cuMemCreate": ("cuMemCreate", [c_ptr, ctypes.c_size_t, ctypes.c_void_p,
                                    ctypes.c_ulonglong]),
    "cuMemRelease": ("cuMemRelease", [ctypes.c_ulonglong]),
    "cuMemExportToShareableHandle": ("cuMemExportToShareableHandle",
                                     [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int,
                                      ctypes.c_ulonglong]),
    "cuMemMap": ("cuMemMap", [ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_size_t,
                              ctypes.c_ulonglong, ctypes.c_ulonglong]),
    "cuMemUnmap": ("cuMemUnmap", [ctypes.c_ulonglong, ctypes.c_size_t]),
    "cuMemSetAccess": ("cuMemSetAccess", [ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p,
                                          ctypes.c_size_t]),
    "cuMemRetainAllocationHandle": ("cuMemRetainAllocationHandle", [c_ptr, ctypes.c_void_p]),
    "cuStreamCreate": ("cuStreamCreate", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
    "cuStreamDestroy": ("cuStreamDestroy_v2", [ctypes.c_void_p]),
    "cuEventCreate": ("cuEventCreate", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
    "cuEventRecord": ("cuEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
    "cuEventSynchronize": ("cuEventSynchronize", [ctypes.c_void_p]),
    "cuEventDestroy": ("cuEventDestroy_v2", [ctypes.c_void_p]),
    "cuMemHostAlloc": ("cuMemHostAlloc", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                          ctypes.c_uint]),
    "cuMemFreeHost": ("cuMemFreeHost", [ctypes.c_void_p]),
}


# cuda.h's VMM structs and values (the ABI the fake and the driver share)
class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CallFailed(Exception):
    def __init__(self, base: str, rc: int):
        super().__init__(f"{base}: CUresult {rc}")
        self.base, self.rc = base, rc


PINNED, LOCATION_DEVICE, PROT_READWRITE, GRANULARITY_RECOMMENDED = 1, 1, 3, 1
POSIX_FD = 1   # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
RANGE_START_ADDR, RANGE_SIZE = 11, 12
CHUNK = 16 << 20


def pattern(seed: int, n: int):
    """The bytes `fill` writes and `check` expects, as (offset, chunk): random.Random(seed).
    randbytes, CHUNK at a time (the last one shorter), n bytes in all; zeros for seed < 0."""
    rng = random.Random(seed)
    for off in range(0, n, CHUNK):
        size = min(CHUNK, n - off)
        yield off, bytes(size) if seed < 0 else rng.randbytes(size)


def device_prop(device: int = 0) -> CUmemAllocationProp:
    prop = CUmemAllocationProp()
    prop.type, prop.location.type, prop.location.id = PINNED, LOCATION_DEVICE, device
    return prop


def access_desc(device: int = 0) -> CUmemAccessDesc:
    desc = CUmemAccessDesc()
    desc.location.type, desc.location.id, desc.flags = LOCATION_DEVICE, device, PROT_READWRITE
    return desc


# command -> how many numbers (decimal or 0x...) it takes before its optional DOOR
MEMORY_COMMANDS = {"fill": 3, "check": 3, "streamcopy": 3, "vmm": 1, "vmmfd": 1, "vmmfree": 3,
                   "reserve": 1, "create": 1, "map": 3, "access": 2, "unmap": 2, "release": 1,
                   "addrfree": 2, "retain": 1, "export": 1, "meminfo": 0, "range": 1}


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
        self.ctx: int | None = None                      # init's context

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
        if cmd.startswith("@"):  # as a CUDA runtime thread: the context current first
            cmd = cmd[1:]
            if self.ctx:
                self.func("cuCtxSetCurrent", "dlsym")(self.ctx)

        def call(f, *a):
            t0 = time.monotonic()
            rc = f(*a)
            t1 = time.monotonic()
            timed.append((t0, t1))
            return rc

        door = args[-1] if args else "dlsym"
        if cmd in MEMORY_COMMANDS:                   # fixed arguments, then an optional door
            n = MEMORY_COMMANDS[cmd]
            door = args[n] if len(args) > n else "dlsym"
            try:
                rc = self.memory(doc, cmd, args, door, call)
            except CallFailed as e:
                rc, doc["failed"] = e.rc, e.base
        elif cmd in ("init", "ctx"):
            rc = call(self.func("cuInit", door), 0) if cmd == "init" else 0
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            if rc == 0:
                rc = call(self.func("cuDeviceGet", door), ctypes.byref(dev),
                          int(args[0]) if cmd == "ctx" else 0)
            if rc == 0:
                rc = call(self.func("cuCtxCreate", door), ctypes.byref(ctx), 0, dev)
            doc["ctx"] = self.ctx = ctx.value
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
        elif cmd == "cached":
            self.fake_torch(args[:3])
            rc = 0
        elif cmd == "forkfds":   # a child forked, its descriptors then: a pipe tells them
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                os.write(w, json.dumps(sorted(os.listdir("/proc/self/fd"), key=int)).encode())
                os._exit(0)
            os.close(w)
            with os.fdopen(r) as f:
                doc["child_fds"] = json.loads(f.read())
            os.waitpid(pid, 0)
            doc["fds"] = sorted(os.listdir("/proc/self/fd"), key=int)
            rc = 0
        elif cmd == "dup2":
            os.dup2(int(args[0]), int(args[1]), inheritable=False)
            rc = 0
        elif cmd == "quit":
            rc = 0
        else:
            raise ValueError(f"unknown command {cmd!r}")
        doc["rc"] = rc
        if timed:
            doc["t0"], doc["t1"] = timed[0][0], timed[-1][1]
        return doc

    def fake_torch(self, held: list[str]) -> None:
        """sys.modules["torch"], as the agent's cache release sees it: its empty_cache() gives
        back the VMM mapping PTR HANDLE BYTES (as PyTorch's expandable segments do)."""
        import types

        def empty_cache() -> None:
            if held:
                self.run("cache", "@vmmfree", list(held))
                held.clear()
        cuda = types.SimpleNamespace(is_initialized=lambda: True, synchronize=lambda: None,
                                     empty_cache=empty_cache)
        sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)

    def memory(self, doc: dict, cmd: str, args: list[str], door: str, call) -> int:
        """The commands of MEMORY_COMMANDS; a failing driver call raises CallFailed."""
        def step(base: str, *a) -> None:
            rc = call(self.func(base, door), *a)
            if rc:
                raise CallFailed(base, rc)

        def undo(base: str, *a) -> None:         # clean-up after a failure: not timed
            self.func(base, door)(*a)

        num = [int(a, 0) for a in args[:MEMORY_COMMANDS[cmd]]]
        ptr, handle, size = ctypes.c_ulonglong(), ctypes.c_ulonglong(), ctypes.c_size_t()
        prop = device_prop(0)
        if cmd in ("fill", "check"):
            addr, n, seed = num
            buf = ctypes.create_string_buffer(max(1, min(CHUNK, n)))
            for off, chunk in pattern(seed, n):
                if cmd == "fill":
                    step("cuMemcpyHtoD", addr + off, chunk, len(chunk))
                    continue
                step("cuMemcpyDtoH", buf, addr + off, len(chunk))
                got = buf.raw[:len(chunk)]
                if got != chunk:
                    doc["ok"] = False
                    doc["bad"] = off + next(i for i, (a, b) in enumerate(zip(got, chunk))
                                            if a != b)
                    return 0
            if cmd == "check":
                doc["ok"], doc["bad"] = True, None
        elif cmd in ("vmm", "vmmfd"):
            prop.requestedHandleTypes = POSIX_FD if cmd == "vmmfd" else 0
            step("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(prop),
                 GRANULARITY_RECOMMENDED)
            nbytes = -(-num[0] // size.value) * size.value
            step("cuMemAddressReserve", ctypes.byref(ptr), nbytes, 0, 0, 0)
            done = [("cuMemAddressFree", ptr.value, nbytes)]
            try:
                step("cuMemCreate", ctypes.byref(handle), nbytes, ctypes.byref(prop), 0)
                done.append(("cuMemRelease", handle.value))
                step("cuMemMap", ptr.value, nbytes, 0, handle.value, 0)
                done.append(("cuMemUnmap", ptr.value, nbytes))
                step("cuMemSetAccess", ptr.value, nbytes, ctypes.byref(access_desc(0)), 1)
            except CallFailed:
                for what in reversed(done):
                    undo(*what)
                raise
            doc["ptr"], doc["handle"], doc["size"] = ptr.value, handle.value, nbytes
        elif cmd == "vmmfree":
            step("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(prop),
                 GRANULARITY_RECOMMENDED)
            nbytes = -(-num[2] // size.value) * size.value
            step("cuMemUnmap", num[0], nbytes)
            step("cuMemRelease", num[1])
            step("cuMemAddressFree", num[0], nbytes)
        elif cmd == "reserve":
            step("cuMemAddressReserve", ctypes.byref(ptr), num[0], 0, 0, 0)
            doc["ptr"] = ptr.value
        elif cmd == "create":
            step("cuMemCreate", ctypes.byref(handle), num[0], ctypes.byref(prop), 0)
            doc["handle"] = handle.value
        elif cmd == "map":
            step("cuMemMap", num[0], num[1], 0, num[2], 0)
        elif cmd == "access":
            step("cuMemSetAccess", num[0], num[1], ctypes.byref(access_desc(0)), 1)
        elif cmd == "unmap":
            step("cuMemUnmap", num[0], num[1])
        elif cmd == "release":
            step("cuMemRelease", num[0])
        elif cmd == "addrfree":
            step("cuMemAddressFree", num[0], num[1])
        elif cmd == "retain":
            step("cuMemRetainAllocationHandle", ctypes.byref(handle), num[0])
            doc["handle"] = handle.value
        elif cmd == "export":
            fd = ctypes.c_int(-1)
            step("cuMemExportToShareableHandle", ctypes.byref(fd), num[0], POSIX_FD, 0)
            doc["fd"] = fd.value
        elif cmd == "meminfo":
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            step("cuMemGetInfo", ctypes.byref(free), ctypes.byref(total))
            doc["free"], doc["total"] = free.value, total.value
        elif cmd == "range":
            step("cuMemGetAddressRange", ctypes.byref(ptr), ctypes.byref(size), num[0])
            doc["base"], doc["size"] = ptr.value, size.value
            step("cuPointerGetAttribute", ctypes.byref(ptr), RANGE_START_ADDR, num[0])
            step("cuPointerGetAttribute", ctypes.byref(size), RANGE_SIZE, num[0])
            doc["attr_base"], doc["attr_size"] = ptr.value, size.value
        elif cmd == "streamcopy":
            self.streamcopy(doc, *num, step, undo)
        return 0

    def streamcopy(self, doc: dict, addr: int, n: int, seed: int, step, undo) -> None:
        """Pinned buffer -> device -> another pinned buffer on a stream of its own, an event
        between the two copies; doc["ok"]: the second buffer holds the pattern."""
        src, dst = ctypes.c_void_p(), ctypes.c_void_p()
        stream, event = ctypes.c_void_p(), ctypes.c_void_p()
        done = []
        try:
            step("cuMemHostAlloc", ctypes.byref(src), max(1, n), 0)
            done.append(("cuMemFreeHost", src))
            step("cuMemHostAlloc", ctypes.byref(dst), max(1, n), 0)
            done.append(("cuMemFreeHost", dst))
            step("cuStreamCreate", ctypes.byref(stream), 1)
            done.append(("cuStreamDestroy", stream))
            step("cuEventCreate", ctypes.byref(event), 2)
            done.append(("cuEventDestroy", event))
            for off, chunk in pattern(seed, n):
                ctypes.memmove(src.value + off, chunk, len(chunk))
            step("cuMemcpyHtoDAsync", addr, src, n, stream)
            step("cuEventRecord", event, stream)
            step("cuEventSynchronize", event)
            step("cuMemcpyDtoHAsync", dst, addr, n, stream)
            step("cuStreamSynchronize", stream)
            doc["ok"] = all(ctypes.string_at(dst.value + off, len(chunk)) == chunk
                            for off, chunk in pattern(seed, n))
        finally:
            for what in reversed(done):
                undo(*what)

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
