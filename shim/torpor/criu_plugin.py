"""torpor-criu-helper: what torpor's CRIU plugin (packaging/criu-plugin) runs for the device
phases, each a call to torpord. The plugin is loaded by every CRIU run on the node, under any
engine; it execs this helper only for process trees that map libcuda.

    torpor-criu-helper lock --pid ROOT --images DIR --criu-pid PID    (dump, PAUSE_DEVICES)
    torpor-criu-helper check --images DIR                             (restore, init)
    torpor-criu-helper restore --images DIR --pids P1,P2,...          (restore, after CRIU)

Contract with the plugin: exit 0 and a last stdout line "torpor-criu-result: locked OP_ID" or
"torpor-criu-result: skip REASON" (lock), "torpor-criu-result: ok" (check, restore); anything
else is a failure, one line on stderr, exit code from errors.ExitCode.

lock leaves alone (skip) a tree torpor already holds: any process in an open torpord operation
or a CUDA process not RUNNING (the `torpor` CLI or torpor-runtime locked it: never twice), and
one without CUDA processes. Otherwise torpord's LockAndCheckpoint, owned by this helper, which
prints its result, lets go of its stdout/stderr and stays: the plugin writes its verdict ("ok"
after a dump, else "failed"; EOF if CRIU died) to fd 3 at its fini; once CRIU has exited the
helper ends the operation (Finish: the dumped tasks are gone, --leave-running ones RUNNING again;
Rollback: RUNNING again). Should the helper die, torpord rolls back (owner gone, no ptrace).
The GPU manifest (MANIFEST, 0600) and the agents' data (DATA_DIR) go into CRIU's images
directory, so the archive an engine packs from it carries them. restore reads that manifest
back (untrusted: every field checked) and has torpord restore and unlock the restored PIDs,
on the GPUs placement.plan picks (the explicit
$TORPOR_GPU_MAP OLD=NEW,... first, else the same GPU where it fits, else another of its model);
check refuses (PREFLIGHT) before CRIU restores anything when no GPU here fits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from . import config, gpus, placement, procs
from .driver import is_gpu_uuid
from .errors import BusyError, ExitCode, TorporError, UsageError
from .errors import CorruptCheckpointError as CorruptError
from .files import write_json
from .flows.container import AgentMove, CudaProcess
from .gpus import Inventory
from .placement import parse_device_map
from .sidecar.client import Client
from .sidecar.convert import ProcessStatus

MANIFEST = "torpor-criu.json"   # in CRIU's images directory (the plugin's MANIFEST)
DATA_DIR = "torpor-gpu"         # the agents' data files, <images>/torpor-gpu/<pid>/
FORMAT = "torpor-criu-plugin"
VERSION = 1
RESULT = "torpor-criu-result:"
MAX_MANIFEST = 1 << 20


CALL_TIMEOUT_S = 900.0   # one torpord call; a lock of a large program moves GBs first. A helper
                         # killed meanwhile is a dead owner: torpord rolls its operation back


def _client() -> Client:
    return Client(config.load(), timeout=CALL_TIMEOUT_S)


def _images(path: str) -> Path:
    p = Path(path)
    if not p.is_absolute() or not p.is_dir():
        raise UsageError(f"CRIU's images directory {path!r} is not an absolute directory")
    return p


def held_by_torpor(processes: Sequence[ProcessStatus]) -> str | None:
    """Why torpor already holds these processes (torpord's Status of them), or None: one in
    an open torpord operation, or a CUDA process some other torpor locked (its driver state is
    not RUNNING)."""
    for p in processes:
        if p.op_id:
            return f"PID {p.pid} is held by torpord operation {p.op_id}"
        if p.cuda and p.state and p.state != "RUNNING":
            return f"PID {p.pid} is already {p.state} (torpor checkpoints it itself)"
    return None


def lock(pid: int, images: Path) -> tuple[str, str]:
    """The dump's device phase: (result line's value, the open operation or "")."""
    tree = procs.tree(procs.require(pid))
    with _client() as c:
        processes = c.status(pids=tree).processes
        why = held_by_torpor(processes)
        if why:
            return f"skip {why}", ""
        if not any(p.cuda for p in processes):
            return "skip no CUDA process in the tree", ""
        ck = c.lock_and_checkpoint([pid], owner_pid=os.getpid(),
                                   gpu_data_dir=images / DATA_DIR)
        try:
            write_json(images / MANIFEST, {
                "format": FORMAT, "version": VERSION, "op_id": ck.op_id, "root_pid": pid,
                "pids": list(ck.pids), **gpu_entries(ck.cuda_processes, _inventory()),
                "agents": {str(a.pid): a.to_manifest() for a in ck.agents}})
        except BaseException:
            c.rollback(ck.op_id)
            raise
    return f"locked {ck.op_id}", ck.op_id


def end(op_id: str, criu_pid: int, criu_start: int | None, ctl: int) -> None:
    """After the lock: the plugin's verdict on fd ctl ("ok"; anything else or EOF: failed),
    then, once CRIU has exited (its tasks killed or let go), Finish or Rollback."""
    with os.fdopen(ctl, "rb") as f:
        verdict = f.read(16).strip()
    while criu_start is not None and procs.start_time(criu_pid) == criu_start \
            and procs.alive(criu_pid):   # a zombie CRIU has let its tasks go
        time.sleep(0.01)
    with _client() as c:
        if verdict == b"ok":
            c.finish(op_id, timeout=600)
        else:
            c.rollback(op_id, timeout=600)


def _detach_stdio() -> None:
    """The plugin reads stdout/stderr to EOF: hand them back before staying on."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


def _inventory() -> Inventory | None:
    try:
        return gpus.discover()
    except TorporError:
        return None


def gpu_entries(cuda: Sequence[CudaProcess], inv: Inventory | None) -> dict[str, Any]:
    """The manifest's "gpus" (uuid, name: "" where NVML is missing) and "processes" (pid, its
    GPUs and memory on each), as torpor.json spells them: placement.plan reads them."""
    used = sorted({u for p in cuda for u in p.gpu_uuids})
    names = {u: (g.name if inv and (g := inv.by_uuid(u)) else "") for u in used}
    return {"gpus": [{"uuid": u, "name": names[u]} for u in used],
            "processes": [{"pid": p.pid, "gpus": list(p.gpu_uuids),
                           "gpu_memory": p.gpu_memory,
                           "gpu_memory_by_gpu": dict(p.gpu_memory_by_gpu)} for p in cuda]}


def _check_gpus(m: dict[str, Any]) -> None:
    gpus_, procs_ = m.get("gpus"), m.get("processes")
    if not isinstance(gpus_, list) or not isinstance(procs_, list):
        raise ValueError("no 'gpus' or 'processes' list")
    for g in gpus_:
        if not (isinstance(g, dict) and is_gpu_uuid(g.get("uuid"))
                and isinstance(g.get("name"), str)):
            raise ValueError("bad 'gpus' entry")
    known = {g["uuid"] for g in gpus_}
    for p in procs_:
        if not (isinstance(p, dict) and procs.is_pid(p.get("pid"))
                and isinstance(p.get("gpus"), list) and set(p["gpus"]) <= known
                and isinstance(p.get("gpu_memory"), int) and p["gpu_memory"] >= 0
                and isinstance(p.get("gpu_memory_by_gpu"), dict)
                and all(k in known and isinstance(v, int) and v >= 0
                        for k, v in p["gpu_memory_by_gpu"].items())):
            raise ValueError("bad 'processes' entry")


def read_manifest(images: Path) -> dict[str, Any]:
    """The plugin's manifest, checked; CorruptError for anything else."""
    path = images / MANIFEST
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise CorruptError(f"cannot open {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_MANIFEST + 1)
    if len(raw) > MAX_MANIFEST:
        raise CorruptError(f"{path} is larger than {MAX_MANIFEST} bytes")
    try:
        m = json.loads(raw)
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} version {VERSION} manifest")
        if not isinstance(m.get("op_id"), str) or not isinstance(m.get("agents"), dict):
            raise ValueError("no 'op_id' or 'agents' map")
        _check_gpus(m)
        agents = [AgentMove.of(int(k), v) for k, v in m["agents"].items()]
        if any(not procs.is_pid(a.pid) or not procs.is_pid(a.nspid) or any(n < 0 for n in a.files)
               for a in agents):
            raise ValueError("bad 'agents' entry")
        m["agents"] = agents
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise CorruptError(f"{path}: {e}") from None
    return m


def gpu_map(m: dict[str, Any], inv: Inventory | None) -> dict[str, str]:
    """Where the checkpoint's GPUs go: placement.plan's rules (an explicit $TORPOR_GPU_MAP
    OLD=NEW,... first, else the same GPU where it fits, else another of its model with room);
    PreflightError when none fits. Without NVML (here or at the dump) only the explicit map."""
    explicit = parse_device_map([os.environ.get("TORPOR_GPU_MAP", "")])
    if inv is None or any(not g["name"] for g in m["gpus"]):
        return explicit
    return placement.driver_map(placement.plan(m, inv, explicit), explicit)


def check(images: Path, wait_s: float = 60.0) -> str:
    """The restore's init: the manifest reads, the GPUs fit (gpu_map), torpord answers, the dump's
    operation is over (its helper ends it just after that CRIU exited: a restore right after
    must not race it)."""
    m = read_manifest(images)
    gpu_map(m, _inventory())
    deadline = time.monotonic() + wait_s
    with _client() as c:
        while any(o.op_id == m.get("op_id") for o in c.list(timeout=10).operations):
            if time.monotonic() > deadline:
                raise BusyError(f"torpord operation {m.get('op_id')} of this checkpoint's "
                                f"dump is still open after {wait_s:.0f} s")
            time.sleep(0.05)
    return "ok"


def restore(images: Path, pids: Sequence[int]) -> str:
    """After CRIU restored the tree (its processes CHECKPOINTED in the driver)."""
    m = read_manifest(images)
    with _client() as c:
        kw: dict[str, Any] = {}
        if m["agents"]:
            kw = {"gpu_data_dir": images / DATA_DIR, "agents": m["agents"]}
        c.restore_and_unlock(pids=pids, gpu_map=gpu_map(m, _inventory()), descendants=False,
                             **kw)
    return "ok"


def _pids(text: str) -> list[int]:
    try:
        out = [int(p) for p in text.split(",")]
    except ValueError:
        raise UsageError(f"bad PID list {text!r}") from None
    if not out or any(p <= 0 for p in out):
        raise UsageError(f"bad PID list {text!r}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="torpor-criu-helper",
                                 description="device phases for torpor's CRIU plugin")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("lock")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--criu-pid", type=int, required=True)
    p.add_argument("--ctl-fd", type=int, default=3)
    p = sub.add_parser("check")
    p.add_argument("--images", required=True)
    p = sub.add_parser("restore")
    p.add_argument("--images", required=True)
    p.add_argument("--pids", required=True)
    args = ap.parse_args(argv)
    try:
        images = _images(args.images)
        if args.cmd == "lock":
            criu_start = procs.start_time(args.criu_pid)
            res, op_id = lock(args.pid, images)
            if op_id:
                print(f"{RESULT} {res}", flush=True)
                _detach_stdio()
                try:
                    end(op_id, args.criu_pid, criu_start, args.ctl_fd)
                except TorporError:
                    return 1   # torpord rolls back an operation whose owner is gone
                return 0
        elif args.cmd == "check":
            res = check(images)
        else:
            res = restore(images, _pids(args.pids))
    except TorporError as e:
        print(f"torpor-criu-helper: {e.line()}", file=sys.stderr)
        return e.exit_code
    except OSError as e:     # e.g. the manifest could not be written (rolled back first)
        print(f"torpor-criu-helper: {e}", file=sys.stderr)
        return ExitCode.ERROR
    print(f"{RESULT} {res}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
