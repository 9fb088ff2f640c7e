"""OCI bundle specs (config.json): which GPUs a container uses, and moving it to other GPUs.

A container reaches NVIDIA GPUs in three ways, all visible in its spec:
  devices       linux.devices entries /dev/nvidia<minor> (podman --device, CDI-resolved specs)
  environment   NVIDIA_VISIBLE_DEVICES=all|none|void|<index>,...|<uuid>,... (nvidia-container-
                toolkit's legacy hook reads it)
  CDI           annotations cdi.k8s.io/<name> = "nvidia.com/gpu=<index|uuid|all>,..."
detect() reads all three; rewrite() moves every one of them from old GPUs to new ones (by UUID,
index and minor number), including the device cgroup rules that let /dev/nvidia<minor> open.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from .errors import UsageError
from .files import atomic_write, loads_json, read_small_file
from .gpus import Inventory

NVIDIA_MAJOR = 195
DEVICE_RE = re.compile(r"/dev/nvidia([0-9]+)")   # fullmatch: no trailing newline, ASCII digits
CDI_PREFIX = "cdi.k8s.io/"
CDI_KIND = "nvidia.com/gpu"
VISIBLE = "NVIDIA_VISIBLE_DEVICES"
DEVICE_MAP_ANNOTATION = "org.torpor.device-map"  # OLD_UUID=NEW_UUID,...: restore placement
HOOK_ANNOTATION = "org.torpor.hooks"             # "off": the shim adds no hooks at create
AGENT_ANNOTATION = "org.torpor.agent"            # "on"/"off": preload the agent (config `agent`)
AGENT_SKIPPED_ANNOTATION = "org.torpor.agent-skipped"  # set by torpor-runtime: why the agent
                                                 # was not preloaded (the container's libc)
STORE_ANNOTATION = "org.torpor.store"            # "on"/"off": pack checkpoints into the image
                                                 # store (config `store_containers`)
ROOT_KEY_ANNOTATION = "org.torpor.root-key"      # set by torpor-runtime: the key of the runtime
                                                 # root the container lives under (its name:
                                                 # container_name); torpor-hook, which the
                                                 # runtime does not tell --root, reads it from
                                                 # the container's state
AGENT_LIBRARY_IN_CONTAINER = "/run/torpor/agent/libtorpor-agent.so"
AGENT_DIR_IN_CONTAINER = "/run/torpor/agents"


@dataclasses.dataclass
class GpuUse:
    """What a spec asks for. minors: /dev/nvidiaN devices; visible: NVIDIA_VISIBLE_DEVICES
    items; cdi: CDI device names of kind nvidia.com/gpu."""

    minors: list[int] = dataclasses.field(default_factory=list)
    visible: list[str] = dataclasses.field(default_factory=list)
    cdi: list[str] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.minors or self.visible or self.cdi)

    def uuids(self, inv: Inventory | None) -> list[str]:
        """The GPU UUIDs these name, as far as inv (NVML) can tell; [] without inv."""
        out: list[str] = []
        for minor in self.minors:
            g = inv.by_minor(minor) if inv else None
            if g:
                out.append(g.uuid)
        for item in [*self.visible, *self.cdi]:
            if item.startswith("GPU-"):
                out.append(item)
            elif inv and item == "all":
                out += [g.uuid for g in inv.gpus]
            elif inv and item.isdigit():
                out += [g.uuid for g in inv.gpus if g.index == int(item)]
        return list(dict.fromkeys(out))


_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def validate_container_id(cid: str) -> str:
    """A container id fit to name a file (torpord's records, agent socket directories,
    torpor-runtime's markers): the whole id, as the native front's valid_id reads it (a
    trailing newline, which re's "$" lets through, is refused too)."""
    if not isinstance(cid, str) or not _ID_RE.fullmatch(cid) or ".." in cid or cid == ".":
        raise UsageError(f"bad container id {cid!r}: use 1-128 of [A-Za-z0-9_.-], no '..'")
    return cid


# A container's name at torpor: its id, and which runtime root it lives under. One id may live
# under two roots at once (containerd namespaces, podman and ctr side by side), so what torpor
# keeps per container on the host (torpor-runtime's marker, the agent socket directory
# <run_dir>/agents/<name>, torpord's record) is named <id>@<root key> (runtime/markers.py
# root_key: 16 lowercase hex). A bare <id> is what an earlier torpor named them by.
NAME_SEP = "@"
_ROOT_KEY_RE = re.compile(r"[0-9a-f]{16}")


def container_name(cid: str, root_key: str = "") -> str:
    """<id>@<root key>, or <id> alone without a key (an earlier torpor's name); UsageError
    for a bad id or key."""
    name = validate_container_id(cid) + (NAME_SEP + root_key if root_key else "")
    return validate_container_name(name)


def validate_container_name(name: str) -> str:
    """A container's name at torpor (container_name) fit to name a file in one directory: an
    id as validate_container_id reads it, then nothing or '@' and 16 lowercase hex digits.
    Nothing else ('/', a second '@', a newline) gets through."""
    cid, sep, key = name.partition(NAME_SEP) if isinstance(name, str) else ("", "", "")
    try:
        validate_container_id(cid)
    except UsageError:
        raise UsageError(f"bad container name {name!r}: an id (1-128 of [A-Za-z0-9_.-], no "
                         "'..'), optionally '@' and 16 lowercase hex digits") from None
    if sep and not _ROOT_KEY_RE.fullmatch(key):
        raise UsageError(f"bad container name {name!r}: after '@', 16 lowercase hex digits "
                         "(the runtime root's key)")
    return name


def split_name(name: str) -> tuple[str, str]:
    """A container's name (validate_container_name) as (id, root key; "" for none)."""
    cid, _, key = validate_container_name(name).partition(NAME_SEP)
    return cid, key


MAX_SPEC = 64 << 20   # as the native front's MAX_SPEC: a bigger config.json is no spec of ours


def load(bundle: Path) -> dict[str, Any]:
    path = Path(bundle) / "config.json"
    try:
        spec = loads_json(read_small_file(path, MAX_SPEC))
    except FileNotFoundError:
        raise UsageError(f"no OCI spec at {path}") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the OCI spec {path}: {e}") from e
    if not isinstance(spec, dict):
        raise UsageError(f"{path} is not an OCI spec (not a JSON object)")
    return spec


def save(bundle: Path, spec: dict[str, Any]) -> None:
    """Atomic replace, keeping the file's mode (runtimes read it as root)."""
    path = Path(bundle) / "config.json"
    mode = os.stat(path).st_mode & 0o777
    atomic_write(path, json.dumps(spec, indent=1).encode(), mode=mode)


def _env(spec: Mapping[str, Any]) -> list[str]:
    env = _section(spec, "process").get("env")
    return [e for e in env if isinstance(e, str)] if isinstance(env, list) else []


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _dicts(value: Any) -> list[dict[str, Any]]:
    """The objects of a spec list (a malformed spec is the runtime's to refuse, not ours)."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _section(spec: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = spec.get(key)
    return value if isinstance(value, dict) else {}


def detect(spec: Mapping[str, Any]) -> GpuUse:
    use = GpuUse()
    for dev in _dicts(_section(spec, "linux").get("devices")):
        m = DEVICE_RE.fullmatch(str(dev.get("path", "")))
        if m:
            use.minors.append(int(m.group(1)))
    for item in _env(spec):
        key, _, value = item.partition("=")
        if key == VISIBLE and value.strip() not in ("", "none", "void"):
            use.visible = _split(value)
    for key, value in _section(spec, "annotations").items():
        if key.startswith(CDI_PREFIX) and isinstance(value, str):
            use.cdi += [name.partition("=")[2] for name in _split(value)
                        if name.partition("=")[0] == CDI_KIND]
    return use


@dataclasses.dataclass(frozen=True)
class Move:
    """One GPU's move: old and new UUID, index and minor (None where unknown)."""

    old_uuid: str
    new_uuid: str
    old_index: int | None
    new_index: int | None
    old_minor: int | None
    new_minor: int | None


def moves(gpu_map: Mapping[str, str], saved_gpus: list[Mapping[str, Any]],
          inv: Inventory) -> list[Move]:
    """The moves for gpu_map (old UUID -> new UUID), old index/minor from the checkpoint's
    GPU list, new ones from this host."""
    saved = {g["uuid"]: g for g in saved_gpus}
    out = []
    for old, new in gpu_map.items():
        if old == new:
            continue
        g_old, g_new = saved.get(old, {}), inv.by_uuid(new)
        out.append(Move(old, new, g_old.get("index"), g_new.index if g_new else None,
                        g_old.get("minor"), g_new.minor if g_new else None))
    return out


def _swap(item: str, moves: list[Move]) -> str:
    for mv in moves:
        if item == mv.old_uuid:
            return mv.new_uuid
        if item.isdigit() and mv.old_index is not None and int(item) == mv.old_index \
                and mv.new_index is not None:
            return str(mv.new_index)
    return item


def _swap_list(value: str, moves: list[Move]) -> str:
    return ",".join(_swap(v, moves) for v in _split(value))


def rewrite(spec: dict[str, Any], moves: list[Move]) -> list[str]:
    """Point spec at the new GPUs, in place. Every replacement is simultaneous (GPU 0 -> 1 and
    1 -> 0 swap cleanly). Returns what changed, one line each."""
    changes: list[str] = []
    by_minor = {mv.old_minor: mv for mv in moves if mv.old_minor is not None}
    linux = _section(spec, "linux")
    for dev in _dicts(linux.get("devices")):
        m = DEVICE_RE.fullmatch(str(dev.get("path", "")))
        if dev.get("major", NVIDIA_MAJOR) != NVIDIA_MAJOR:
            continue   # named like a GPU, another device behind it: its minor is not a GPU's
        if m and int(m.group(1)) in by_minor and by_minor[int(m.group(1))].new_minor is not None:
            new = by_minor[int(m.group(1))].new_minor
            changes.append(f"device {dev['path']} -> /dev/nvidia{new}")
            dev["path"], dev["minor"] = f"/dev/nvidia{new}", new
    for rule in _dicts(_section(linux, "resources").get("devices")):
        if rule.get("major") == NVIDIA_MAJOR and rule.get("minor") in by_minor:
            new = by_minor[rule["minor"]].new_minor
            if new is not None:
                changes.append(f"device cgroup rule c {NVIDIA_MAJOR}:{rule['minor']} -> "
                               f"{NVIDIA_MAJOR}:{new}")
                rule["minor"] = new
    for mount in _dicts(spec.get("mounts")):
        for key in ("destination", "source"):
            m = DEVICE_RE.fullmatch(str(mount.get(key, "")))
            if m and int(m.group(1)) in by_minor and by_minor[int(m.group(1))].new_minor is not None:
                mount[key] = f"/dev/nvidia{by_minor[int(m.group(1))].new_minor}"
                changes.append(f"mount {key} /dev/nvidia{m.group(1)} -> {mount[key]}")
    env = _section(spec, "process").get("env")
    for i, item in enumerate(env if isinstance(env, list) else []):
        key, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
        if key == VISIBLE and sep:
            new_value = _swap_list(value, moves)
            if new_value != value:
                env[i] = f"{VISIBLE}={new_value}"
                changes.append(f"{VISIBLE}={value} -> {new_value}")
    annotations = _section(spec, "annotations")
    for key, value in list(annotations.items()):
        if key.startswith(CDI_PREFIX) and isinstance(value, str):
            names = []
            for name in _split(value):
                kind, sep, dev = name.partition("=")
                names.append(f"{kind}={_swap_list(dev, moves)}" if kind == CDI_KIND and sep
                             else name)
            if ",".join(names) != value:
                annotations[key] = ",".join(names)
                changes.append(f"annotation {key}: {value} -> {annotations[key]}")
    return changes


def device_map_annotation(spec: Mapping[str, Any]) -> list[str]:
    value = _section(spec, "annotations").get(DEVICE_MAP_ANNOTATION, "")
    return [value] if isinstance(value, str) and value.strip() else []


# -- hooks --------------------------------------------------------------------------------------

HOOK_STAGES = ("createRuntime", "poststop")


def add_hooks(spec: dict[str, Any], hook_path: str, env: Mapping[str, str] | None = None,
              timeout_s: int = 30) -> list[str]:
    """Add torpor's createRuntime and poststop hooks unless present (podman may have added them
    from hooks.d already). env: the hook's environment (runtimes give hooks only that).
    Returns the stages added."""
    hooks = spec.setdefault("hooks", {})
    added = []
    for stage in HOOK_STAGES:
        entries = hooks.setdefault(stage, [])
        if any(Path(str(h.get("path", ""))).name == Path(hook_path).name for h in entries):
            continue
        hook: dict[str, Any] = {"path": hook_path, "args": ["torpor-hook", stage],
                                "timeout": timeout_s}
        if env:
            hook["env"] = [f"{k}={v}" for k, v in env.items()]
        entries.append(hook)
        added.append(stage)
    return added


# -- the in-process agent -----------------------------------------------------------------------

def _switch(spec: Mapping[str, Any], annotation: str, default: bool) -> bool:
    """An "on"/"off" annotation, else the configured default."""
    value = _section(spec, "annotations").get(annotation)
    return value == "on" if value in ("on", "off") else default


def wants_agent(spec: Mapping[str, Any], default: bool) -> bool:
    return _switch(spec, AGENT_ANNOTATION, default)


def wants_store(spec: Mapping[str, Any], default: bool) -> bool:
    return _switch(spec, STORE_ANNOTATION, default)


def add_agent(spec: dict[str, Any], library: Path, host_dir: Path) -> bool:
    """Preload the agent: its library bound read-only into the container, its socket directory
    (one per container on the host: PIDs repeat across containers) bound read-write, and
    LD_PRELOAD / TORPOR_AGENT_DIR in the process environment. False when already there."""
    mounts = spec.setdefault("mounts", [])
    if any(isinstance(m, dict) and m.get("destination") == AGENT_LIBRARY_IN_CONTAINER
           for m in mounts):
        return False
    mounts.append({"destination": AGENT_LIBRARY_IN_CONTAINER, "type": "bind",
                   "source": str(library), "options": ["bind", "ro", "nosuid", "nodev"]})
    mounts.append({"destination": AGENT_DIR_IN_CONTAINER, "type": "bind",
                   "source": str(host_dir), "options": ["bind", "rw", "nosuid", "nodev", "noexec"]})
    process = spec.setdefault("process", {})
    env = [e for e in process.get("env") or [] if isinstance(e, str)]
    preload = next((e.partition("=")[2] for e in env if e.startswith("LD_PRELOAD=")), "")
    env = [e for e in env if not e.startswith(("LD_PRELOAD=", "TORPOR_AGENT_DIR="))]
    env.append("LD_PRELOAD=" + " ".join(filter(None, [AGENT_LIBRARY_IN_CONTAINER, preload])))
    env.append(f"TORPOR_AGENT_DIR={AGENT_DIR_IN_CONTAINER}")
    process["env"] = env
    return True


def mark_agent_skipped(spec: dict[str, Any], reason: str) -> None:
    """Say in the spec's annotations (which torpor-hook registers with torpord) why the agent
    was not preloaded."""
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict):
        annotations = spec["annotations"] = {}
    annotations[AGENT_SKIPPED_ANNOTATION] = reason[:500]


def set_root_key(spec: dict[str, Any], root_key: str) -> bool:
    """Name the container's runtime root (its key) in the spec's annotations, which the
    runtime hands every hook in the container's state (packaging/oci-hooks.d's too, which
    get no environment from torpor-runtime). True if the spec changed."""
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict):
        annotations = spec["annotations"] = {}
    if annotations.get(ROOT_KEY_ANNOTATION) == root_key:
        return False
    annotations[ROOT_KEY_ANNOTATION] = root_key
    return True


def name_in_state(state: Mapping[str, Any]) -> str:
    """A container's name at torpor (container_name) from its OCI state as a hook reads it:
    its id, and the root key torpor-runtime annotated (none: a container it did not create,
    or an earlier torpor's, named by its id alone). UsageError for a bad id or key."""
    annotations = state.get("annotations")
    key = annotations.get(ROOT_KEY_ANNOTATION, "") if isinstance(annotations, dict) else ""
    return container_name(state.get("id"), key if isinstance(key, str) else "?")


def agent_host_dir(spec: Mapping[str, Any]) -> str | None:
    """The host directory the spec binds at the agent's socket directory (add_agent), or
    None."""
    for m in _dicts(spec.get("mounts")):
        if m.get("destination") == AGENT_DIR_IN_CONTAINER and isinstance(m.get("source"), str):
            return m["source"]
    return None


def has_agent(spec: Mapping[str, Any]) -> bool:
    """Does the spec bind the agent's socket directory (add_agent)?"""
    return any(m.get("destination") == AGENT_DIR_IN_CONTAINER for m in _dicts(spec.get("mounts")))


def repoint_agent(spec: dict[str, Any], library: Path, host_dir: Path) -> bool:
    """A restored container (maybe on another host, under another id) gets this host's agent
    library and its own socket directory. False when it has no agent."""
    found = False
    for m in _dicts(spec.get("mounts")):
        if m.get("destination") == AGENT_LIBRARY_IN_CONTAINER:
            m["source"], found = str(library), True
        elif m.get("destination") == AGENT_DIR_IN_CONTAINER:
            m["source"], found = str(host_dir), True
    return found


def host_ids(spec: Mapping[str, Any]) -> tuple[int, int]:
    """The host uid and gid the container's process runs as (through the user namespace's
    mappings when it has them): who must be able to create the agent's socket."""
    user = _section(_section(spec, "process"), "user")
    linux = _section(spec, "linux")

    def to_host(value: Any, mappings: Any) -> int:
        ident = value if isinstance(value, int) and value >= 0 else 0
        table = _dicts(mappings)
        if not table:
            return ident
        for m in table:
            start, host, size = m.get("containerID", 0), m.get("hostID", 0), m.get("size", 0)
            if isinstance(start, int) and isinstance(host, int) and isinstance(size, int) \
                    and start <= ident < start + size:
                return host + ident - start
        return 65534  # unmapped: the kernel's overflow id
    return (to_host(user.get("uid"), linux.get("uidMappings")),
            to_host(user.get("gid"), linux.get("gidMappings")))
