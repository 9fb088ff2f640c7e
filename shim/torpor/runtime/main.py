"""torpor-runtime's entry point: read argv, pass it on, or run one of the GPU flows."""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

from .. import config
from ..errors import ExitCode, TorporError, UsageError
from ..files import private_dir
from . import argv as argv_mod

log = logging.getLogger("torpor.runtime")
SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Runtime:
    """The real runtime, called with the global options podman or containerd gave us."""

    def __init__(self, path: str, inv: argv_mod.Invocation):
        self.path = path
        self.inv = inv

    def argv(self, *args: str) -> list[str]:
        return [self.path, *self.inv.global_args, *args]

    def state(self, container_id: str) -> dict[str, Any]:
        out = subprocess.run(self.argv("state", container_id), capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0:
            raise TorporError(f"{Path(self.path).name} state {container_id} failed: "
                              f"{out.stderr.strip() or out.stdout.strip()}")
        try:
            st = json.loads(out.stdout)
        except ValueError as e:
            raise TorporError(f"{Path(self.path).name} state {container_id}: not JSON ({e})")
        return st

    def call(self, *args: str) -> None:
        """One command of the real runtime (pause, resume, ...); TorporError if it fails."""
        out = subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise TorporError(f"{Path(self.path).name} {' '.join(args)} failed: "
                              f"{out.stderr.strip() or out.stdout.strip()}")

    def kill(self, container_id: str) -> None:
        subprocess.run(self.argv("kill", container_id, "KILL"), capture_output=True, timeout=60)

    def exec(self) -> NoReturn:
        """Become the real runtime with our own argv: podman/containerd see runc itself."""
        os.execv(self.path, [self.path, *self.inv.argv])

    def run(self) -> subprocess.Popen:
        """The real runtime with our argv, as a child sharing our stdio."""
        return subprocess.Popen([self.path, *self.inv.argv], close_fds=False)


def find_runtime(name: str) -> str:
    """The real runtime's path; never ourselves (a loop would fork until the machine stops)."""
    path = name if "/" in name else shutil.which(
        name, path=os.environ.get("PATH", "") + ":" + SEARCH_PATH)
    if not path or not os.access(path, os.X_OK):
        raise UsageError(f"OCI runtime '{name}' not found",
                         hint="install runc or crun, or set oci_runtime in /etc/torpor/config.toml")
    me = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.realpath(path) == me or Path(path).name.startswith("torpor-runtime"):
        raise UsageError(f"oci_runtime points at torpor-runtime itself ({path})",
                         hint="set oci_runtime to runc or crun")
    return path


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
        line = f'time="{now}" level=error msg="torpor: {message}"'
    try:
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError:
        pass


def _setup_logging(cfg: config.Config) -> None:
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    try:
        private_dir(cfg.state_dir)
        fh = logging.FileHandler(cfg.state_dir / "runtime.log")
        fh.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(message)s"))
        root.addHandler(fh)
    except OSError:
        pass
    if os.environ.get("TORPOR_DEBUG"):
        root.addHandler(logging.StreamHandler(sys.stderr))


def main(argv: list[str] | None = None) -> int:
    inv = argv_mod.parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config.load()
        runtime = Runtime(find_runtime(cfg.oci_runtime), inv)
    except TorporError as e:
        report(inv, e.line())
        return e.exit_code
    flows = _flows()
    if inv.command not in flows or inv.wants_help or not inv.container_id:
        runtime.exec()
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


def _flows() -> dict[str, Any]:
    from . import checkpoint, lifecycle, restore
    return {"create": lifecycle.create, "delete": lifecycle.delete,
            "checkpoint": checkpoint.run, "restore": restore.run}


if __name__ == "__main__":
    sys.exit(main())
