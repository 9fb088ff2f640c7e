"""torpor-hook: the OCI hook that tells torpord about GPU containers.

    torpor-hook createRuntime   (the container's state JSON on stdin, as the OCI spec says)
    torpor-hook poststop
    torpor-hook                 (the stage read from the state: "stopped" is poststop)

createRuntime runs when the runtime has made the container's namespaces (also on a restore,
with the restored PID): a container whose spec names NVIDIA GPUs (torpor.oci.detect) is
registered with torpord — id, bundle, host PID, GPU UUIDs, annotations — so `torpor ps`,
torpord's List and container-id requests know it. poststop forgets it. Containers without GPUs
are left alone. The record is named as torpor names the container, <id>@<root key>
(oci.name_in_state): the runtime does not tell a hook its --root, so torpor-runtime puts the
root's key into the spec's annotations at create and restore, which the state carries. A
container without it (created by an earlier torpor, or not by torpor-runtime) is registered by
its id alone.

A hook must never stop a container: every failure is logged (<state_dir>/hooks.log and
stderr) and the hook exits 0. The checkpoint flow does not depend on registration: it reads
the runtime's state itself.

podman runs it from hooks.d (packaging/oci-hooks.d/torpor.json); torpor-runtime adds it to the
spec of GPU containers at create (containerd reads no hooks.d).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("torpor.hook")
STAGES = ("createRuntime", "prestart", "poststop")
# The hook's own waits, well inside the 30 s the runtime gives it (oci.add_hooks,
# packaging/oci-hooks.d/torpor.json): a hook the runtime kills at its timeout fails the
# container's create, which no registration is worth. ping (3 s), torpord's start, the call.
START_WAIT_S = 10.0
CALL_TIMEOUT_S = 5.0


def _setup_logging(state_dir: Path) -> None:
    from torpor import logs
    logs.setup(state_dir, "hooks.log", stderr=True, stderr_tracebacks=False)


def read_state(stream) -> dict:
    """The container's state (OCI runtime spec, "State") from stream: a JSON object with a
    string id, else ValueError saying what came instead."""
    if stream is None:
        raise ValueError("no container state: stdin is closed")
    try:
        state = json.load(stream)
    except RecursionError:
        raise ValueError("the container state on stdin is nested too deep") from None
    if not isinstance(state, dict):
        raise ValueError(f"the container state on stdin is a JSON {type(state).__name__}, "
                         "not an object")
    if not isinstance(state.get("id"), str) or not state["id"]:
        raise ValueError("the container state on stdin has no id")
    return state


def register(state: dict, cfg) -> str:
    from torpor import gpus, oci
    from torpor.errors import NoDriverError
    from torpor.sidecar.client import Client, ensure_running

    bundle = Path(state.get("bundle") or "")
    use = oci.detect(oci.load(bundle))
    if not use:
        return "not a GPU container"
    try:
        inv = gpus.discover()
    except NoDriverError:
        inv = None
    pid = int(state.get("pid") or 0)
    name = oci.name_in_state(state)
    ensure_running(cfg, wait_s=START_WAIT_S)
    with Client(cfg, timeout=CALL_TIMEOUT_S) as c:
        c.register_container(name, bundle, [pid] if pid > 1 else [], use.uuids(inv),
                             {k: v for k, v in (state.get("annotations") or {}).items()
                              if isinstance(v, str)})
    return f"registered as {name} (PID {pid}, GPUs {','.join(use.uuids(inv)) or use})"


def unregister(state: dict, cfg) -> str:
    from torpor import oci
    from torpor.sidecar.client import Client
    if not cfg.socket_path.exists():
        return "torpord is not running"
    with Client(cfg, timeout=CALL_TIMEOUT_S) as c:
        existed = c.unregister_container(oci.name_in_state(state), missing_ok=True)
    return "unregistered" if existed else "was not registered"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    stage = args[0] if args else "auto"
    if stage not in (*STAGES, "auto"):
        print(f"torpor-hook: usage: torpor-hook {{{'|'.join(STAGES)}}} < container state JSON",
              file=sys.stderr)
        return 2
    try:
        from torpor import config
        cfg = config.load()
    except Exception as e:  # a broken config must not stop containers either
        print(f"torpor-hook: {stage}: config: {e}", file=sys.stderr)
        return 0
    _setup_logging(cfg.state_dir)
    from torpor.errors import TorporError
    from torpor.files import printable
    cid = "?"
    try:
        state = read_state(sys.stdin)
        cid = printable(state["id"], 80)
        if stage == "auto":
            stage = "poststop" if state.get("status") == "stopped" else "createRuntime"
        outcome = unregister(state, cfg) if stage == "poststop" else register(state, cfg)
        log.info("%s %s: %s", stage, cid, outcome)
    except Exception as e:   # one line on stderr; a traceback, for a bug, in hooks.log only
        log.warning("%s %s: %s (the container goes on without torpor's registration)",
                    stage, cid, printable(e, 500),
                    exc_info=not isinstance(e, (TorporError, OSError, ValueError, KeyError)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
