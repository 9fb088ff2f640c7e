"""Which GPU each checkpointed GPU goes to on restore, checked before anything starts.

Rules, per GPU of the checkpoint (the one that held the most first): an explicit OLD=NEW map
wins; else the same UUID when it is present with enough free memory and no other GPU of the
checkpoint went there; else another GPU of the same model with the most free memory. Every
target is used once: a program's GPUs each need one of their own. A target must be the same
model and have at least the GPU memory the checkpoint's processes held on it (per GPU, as
NVML told at the checkpoint: need_per_gpu). Anything else is a PreflightError.
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


def plan(m: Mapping[str, Any], inv: Inventory, explicit: Mapping[str, str]) -> dict[str, str]:
    saved = {g["uuid"]: g for g in m["gpus"]}
    for old in explicit:
        if old not in saved:
            raise UsageError(f"--device-map names {old}, which is not a GPU of this checkpoint "
                             f"(its GPUs: {', '.join(saved) or 'none'})")
    twice = {n for n in explicit.values() if list(explicit.values()).count(n) > 1}
    if twice:
        raise UsageError(f"--device-map sends two GPUs of the checkpoint to {min(twice)}: a "
                         "program's GPUs each need one of their own")
    need = need_per_gpu(m)
    out: dict[str, str] = {}

    def fits(uuid: str, old: str) -> str | None:
        g = inv.by_uuid(uuid)
        if g is None:
            return f"GPU {uuid} is not on this host"
        if g.name != saved[old]["name"]:
            return f"GPU {uuid} is a {g.name}, the checkpoint ran on a {saved[old]['name']}"
        if g.memory_free < need.get(old, 0):
            return (f"GPU {uuid} has {human_bytes(g.memory_free)} free, the checkpoint needs "
                    f"{human_bytes(need.get(old, 0))}")
        return None

    for old, new in explicit.items():
        why = fits(new, old)
        if why:
            raise PreflightError(f"cannot restore onto {new}: {why}")
        out[old] = new
    # each GPU of the checkpoint onto a GPU of its own: the one that held most first, onto
    # itself where it fits, else the free one of its model with the most memory free
    for old in sorted((o for o in saved if o not in out), key=lambda o: -need.get(o, 0)):
        if old not in out.values() and fits(old, old) is None:
            out[old] = old
            continue
        candidates = sorted((g for g in inv.gpus if g.uuid not in out.values()
                             and fits(g.uuid, old) is None), key=lambda g: -g.memory_free)
        if not candidates:
            why = fits(old, old) or f"GPU {old} is taken by another of this checkpoint's GPUs"
            raise PreflightError(f"no GPU here can take {saved[old]['name']} {old} "
                                 f"({why}; no other {saved[old]['name']} with "
                                 f"{human_bytes(need.get(old, 0))} free)")
        out[old] = candidates[0].uuid
    return {old: out[old] for old in saved}
