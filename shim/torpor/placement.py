"""Which GPU each checkpointed GPU goes to on restore, checked before anything starts.

Rules, per GPU of the checkpoint (the one that held the most first): an explicit OLD=NEW map
wins; else the same UUID when it is present with enough free memory and no other GPU of the
checkpoint went there; else another GPU of the same model with the most free memory, one that
no other GPU of the checkpoint went to where one fits. A target must be the same model and
have room for what the checkpoint's processes held on every GPU placed on it (per GPU, as NVML
told at the checkpoint: need_per_gpu). Two GPUs that one process used never share a target:
its GPUs each need one of their own (the processes of a job, one GPU each, may share one;
a container's GPUs never do: share=False). A GPU whose model the checkpoint does not know
(name "": NVML did not answer there) goes onto itself or where the map says only. Anything
else is a PreflightError.
"""

from __future__ import annotations

from typing import Any, Mapping

from .errors import PreflightError, UsageError
from .gpus import Inventory
from .progress import human_bytes


def parse_device_map(items: list[str]) -> dict[str, str]:
    """['OLD=NEW', 'A=B,C=D'] -> {OLD: NEW, ...}."""
    out: dict[str, str] = {}
    for item in items:
        for pair in filter(None, item.split(",")):
            old, sep, new = pair.partition("=")
            if not sep or not old.strip() or not new.strip():
                raise UsageError(f"bad --device-map '{pair}': expected OLD_UUID=NEW_UUID")
            out[old.strip()] = new.strip()
    return out


def given_map(m: Mapping[str, Any], given: list[str]) -> dict[str, str]:
    """OLD=NEW pairs from the GPUs a restored container was given (the new container's spec:
    the kubelet's device plugin allocates them before CRI CreateContainer restores into it):
    the checkpoint's GPUs, in order, onto those, when they are as many and not the same set.
    {} otherwise (a restore into the checkpointed container's own spec: podman, ctr)."""
    saved = [g["uuid"] for g in m["gpus"]]
    if not given or len(given) != len(saved) or set(given) == set(saved):
        return {}
    return dict(zip(saved, given))


def driver_map(gpu_map: Mapping[str, str], explicit: Mapping[str, str]) -> dict[str, str]:
    """The GPU pairs the driver restores with: none when every GPU stays where it was and no
    map was asked for (same GPUs: the driver restores without pairs)."""
    if explicit or any(old != new for old, new in gpu_map.items()):
        return dict(gpu_map)
    return {}


def need_per_gpu(m: Mapping[str, Any]) -> dict[str, int]:
    """GPU memory the checkpoint's processes held on each of its GPUs: NVML's figure per GPU
    where the manifest has it, else (checkpoints before it did) each process's total split
    evenly over its GPUs, which a program holding most of its memory on one GPU is not."""
    need: dict[str, int] = {g["uuid"]: 0 for g in m["gpus"]}
    for p in m["processes"]:
        gpus = p.get("gpus") or []
        by_gpu = p.get("gpu_memory_by_gpu") or {}
        for uuid in gpus:
            share = by_gpu[uuid] if uuid in by_gpu else \
                int(p.get("gpu_memory", 0)) // max(1, len(gpus))
            need[uuid] = need.get(uuid, 0) + share
    return need


def plan(m: Mapping[str, Any], inv: Inventory, explicit: Mapping[str, str],
         share: bool = True) -> dict[str, str]:
    """old UUID -> new UUID for every GPU of the checkpoint. share=False: no two share a target
    even where no process used both (a container: its device list must keep its length, or
    the indices its programs use would move)."""
    saved = {g["uuid"]: g for g in m["gpus"]}
    for old in explicit:
        if old not in saved:
            raise UsageError(f"--device-map names {old}, which is not a GPU of this checkpoint "
                             f"(its GPUs: {', '.join(saved) or 'none'})")
    need = need_per_gpu(m)
    together = [set(p.get("gpus") or []) for p in m["processes"]]   # a process's own GPUs
    taken: dict[str, int] = {}    # target uuid -> bytes promised
    out: dict[str, str] = {}

    def fits(uuid: str, old: str, mapped: bool = False) -> str | None:
        g = inv.by_uuid(uuid)
        if g is None:
            return f"GPU {uuid} is not on this host"
        model = saved[old]["name"]
        if not model and uuid != old and not mapped:   # NVML did not answer at the checkpoint
            return (f"the checkpoint does not say which model {old} is: it goes back onto "
                    "itself, or where a device map says")
        if model and g.name != model:
            return f"GPU {uuid} is a {g.name}, the checkpoint ran on a {model}"
        shared = [o for o, n in out.items()
                  if n == uuid and (not share or any({o, old} <= t for t in together))]
        if shared:
            return (f"GPU {uuid} takes {shared[0]} already, and "
                    + ("one process used both" if share else "this is a container")
                    + ": its GPUs each need one of their own")
        free = g.memory_free - taken.get(uuid, 0)
        if free < need.get(old, 0):
            return (f"GPU {uuid} has {human_bytes(free)} free, the checkpoint needs "
                    f"{human_bytes(need.get(old, 0))}")
        return None

    def place(old: str, new: str) -> None:
        out[old] = new
        taken[new] = taken.get(new, 0) + need.get(old, 0)

    for old, new in explicit.items():
        why = fits(new, old, mapped=True)
        if why:
            raise PreflightError(f"cannot restore onto {new}: {why}")
        place(old, new)
    # the GPU that held the most first: onto itself where it fits, else onto the GPU of its
    # model with the most memory free, one no other GPU of the checkpoint went to if any fits
    for old in sorted((o for o in saved if o not in out), key=lambda o: -need.get(o, 0)):
        if fits(old, old) is None and old not in out.values():
            place(old, old)
            continue
        candidates = sorted((g for g in inv.gpus if fits(g.uuid, old) is None),
                            key=lambda g: (g.uuid in out.values(),
                                           -(g.memory_free - taken.get(g.uuid, 0))))
        if not candidates:
            why = fits(old, old)
            if not saved[old]["name"]:
                raise PreflightError(f"GPU {old} of the checkpoint cannot go back onto itself "
                                     f"({why}), and the checkpoint does not say which model it "
                                     "is: a device map has to say where it goes")
            raise PreflightError(f"no GPU here can take {saved[old]['name']} {old} "
                                 f"({why}; no other {saved[old]['name']} with "
                                 f"{human_bytes(need.get(old, 0))} free)")
        place(old, candidates[0].uuid)
    return {old: out[old] for old in saved}
