"""Which GPU each checkpointed GPU goes to on restore, checked before anything starts.

Rules, per GPU of the checkpoint: an explicit OLD=NEW map wins; else the same UUID when it
is present with enough free memory; else another GPU of the same model with the most free
memory, each target used once. A target must be the same model and have at least the GPU
memory the checkpoint's processes held on it. Anything else is a PreflightError.
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
    need: dict[str, int] = {g["uuid"]: 0 for g in m["gpus"]}
    for p in m["processes"]:
        gpus = p.get("gpus") or []
        for uuid in gpus:
            need[uuid] = need.get(uuid, 0) + int(p.get("gpu_memory", 0)) // max(1, len(gpus))
    return need


def plan(m: Mapping[str, Any], inv: Inventory, explicit: Mapping[str, str]) -> dict[str, str]:
    saved = {g["uuid"]: g for g in m["gpus"]}
    for old in explicit:
        if old not in saved:
            raise UsageError(f"--device-map names {old}, which is not a GPU of this checkpoint "
                             f"(its GPUs: {', '.join(saved) or 'none'})")
    need = need_per_gpu(m)
    taken: dict[str, int] = {}  # target uuid -> bytes promised
    out: dict[str, str] = {}

    def fits(uuid: str, old: str) -> str | None:
        g = inv.by_uuid(uuid)
        if g is None:
            return f"GPU {uuid} is not on this host"
        if g.name != saved[old]["name"]:
            return f"GPU {uuid} is a {g.name}, the checkpoint ran on a {saved[old]['name']}"
        free = g.memory_free - taken.get(uuid, 0)
        if free < need.get(old, 0):
            return (f"GPU {uuid} has {human_bytes(free)} free, the checkpoint needs "
                    f"{human_bytes(need.get(old, 0))}")
        return None

    for old in saved:
        if old in explicit:
            why = fits(explicit[old], old)
            if why:
                raise PreflightError(f"cannot restore onto {explicit[old]}: {why}")
            out[old] = explicit[old]
        elif fits(old, old) is None:
            out[old] = old
        else:
            candidates = sorted((g for g in inv.gpus if g.uuid not in out.values()
                                 and fits(g.uuid, old) is None),
                                key=lambda g: -g.memory_free)
            if not candidates:
                why = fits(old, old)
                raise PreflightError(f"no GPU here can take {saved[old]['name']} {old} "
                                     f"({why}; no other {saved[old]['name']} with "
                                     f"{human_bytes(need.get(old, 0))} free)")
            out[old] = candidates[0].uuid
        taken[out[old]] = taken.get(out[old], 0) + need.get(old, 0)
    return out
