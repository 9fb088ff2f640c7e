"""torpor-runtime's entry point: read argv, pass it on (runc.py), or run one of the GPU flows
(checkpoint.py, restore.py, lifecycle.py)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from typing import Any, NoReturn

from .. import config, logs
from ..errors import ExitCode, TorporError
from . import argv as argv_mod
from . import checkpoint, lifecycle, restore
from .runc import Runtime, find_runtime

log = logging.getLogger("torpor.runtime")


def report(inv: argv_mod.Invocation, message: str) -> None:
    """One line on stderr, and in the runtime log where the caller reads errors (containerd
    and conmon read --log, in --log-format)."""
    print(f"torpor-runtime: error: {message}", file=sys.stderr)
    path = inv.global_opts.get("log")
    if not isinstance(path, str) or not path:
        return
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    if inv.global_opts.get("log-format") == "json":
        line = json.dumps({"level": "error", "msg": f"torpor: {message}", "time": now})
    else:
        # logrus's text format quotes a value as Go's %q does: a '"' or '\\' in the message
        # (runc's own stderr is quoted into ours) must not end msg early
        line = f'time="{now}" level=error msg={json.dumps(f"torpor: {message}")}'
    try:
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError:
        pass


def _setup_logging(cfg: config.Config) -> None:
    logs.setup(cfg.state_dir, "runtime.log", stderr=bool(os.environ.get("TORPOR_DEBUG")))


def main(argv: list[str] | None = None) -> int:
    inv = argv_mod.parse(sys.argv[1:] if argv is None else argv)
    os.environ["TORPOR_CRIU_PLUGIN"] = "off"  # runc's CRIU: the plugin leaves our flows alone
    try:
        cfg = config.load()
        runtime = Runtime(find_runtime(cfg.oci_runtime), inv)
    except TorporError as e:
        report(inv, e.line())
        return e.exit_code
    flows = FLOWS
    if inv.command not in flows or inv.wants_help or not inv.container_id:
        try:
            runtime.exec()
        except TorporError as e:   # the runtime cannot be run: one line, not a traceback
            report(inv, e.line())
            return e.exit_code
    os.umask(0o077)  # images hold process memory
    _setup_logging(cfg)
    try:
        return int(flows[inv.command](cfg, runtime, inv) or 0)
    except TorporError as e:
        log.error("%s %s: %s", inv.command, inv.container_id, e.line(), exc_info=True)
        report(inv, e.line())
        return e.exit_code
    except KeyboardInterrupt:
        report(inv, "interrupted")
        return ExitCode.INTERRUPTED
    except Exception as e:  # a bug: one line for the operator, the traceback in the log
        log.critical("%s %s: unexpected error", inv.command, inv.container_id, exc_info=True)
        report(inv, f"internal error: {type(e).__name__}: {e} (see {cfg.state_dir}/runtime.log)")
        return ExitCode.ERROR


# run is create and start in one: the front hands a GPU container's run here as it does its
# create, and the spec needs the same hooks, agent and marker
FLOWS: dict[str, Any] = {"create": lifecycle.create, "run": lifecycle.create,
                         "delete": lifecycle.delete, "resume": lifecycle.resume,
                         "checkpoint": checkpoint.run,
                         "restore": restore.run}


def entry() -> NoReturn:
    """torpor-runtime-py: main(), then out at once. An engine reads a runtime killed before it
    exits as failed whatever it did (conmon then waits for the restored container's end to
    read the runtime's error): the journal entry that lets recovery stop such a container is
    closed as the flow's last step, so no interpreter teardown (gRPC's threads, logging) may
    stretch the gap between that and the exit status the engine reads."""
    rc = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


if __name__ == "__main__":
    entry()
