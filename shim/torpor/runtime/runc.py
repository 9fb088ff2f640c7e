"""The real OCI runtime (runc or crun): where it is, and its invocation with the global
options podman or containerd gave torpor-runtime."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

from ..errors import TorporError, UsageError
from . import argv as argv_mod

SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Runtime:
    """The real runtime, called with the global options podman or containerd gave us."""

    def __init__(self, path: str, inv: argv_mod.Invocation):
        self.path = path
        self.inv = inv

    def argv(self, *args: str, to_log: bool = True) -> list[str]:
        """The runtime's argv for args, with the engine's global options; to_log=False: not
        --log/--log-format (errors then come on stderr, not into the engine's log)."""
        g = self.inv.global_args if to_log else without_log(self.inv.global_args)
        return [self.path, *g, *args]

    def _cannot_run(self, e: OSError) -> UsageError:
        """One line for a runtime that find_runtime found but the kernel will not run (gone
        since, a script whose interpreter is missing, no right to run it)."""
        return UsageError(f"cannot run the OCI runtime {self.path}: {e.strerror or e}",
                          hint="install runc or crun, or set oci_runtime in "
                               "/etc/torpor/config.toml")

    def _capture(self, *args: str, to_log: bool = True) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(self.argv(*args, to_log=to_log), capture_output=True,
                                  text=True, timeout=60)
        except OSError as e:
            raise self._cannot_run(e) from None
        except subprocess.TimeoutExpired:
            raise TorporError(f"{Path(self.path).name} {' '.join(args)}: no answer within "
                              "60 s") from None

    def state(self, container_id: str, to_log: bool = True) -> dict[str, Any]:
        out = self._capture("state", container_id, to_log=to_log)
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
        out = self._capture(*args)
        if out.returncode != 0:
            raise TorporError(f"{Path(self.path).name} {' '.join(args)} failed: "
                              f"{out.stderr.strip() or out.stdout.strip()}")

    def kill(self, container_id: str) -> None:
        """SIGKILL the container; a runtime that cannot be run stops nothing (the caller is
        reporting a failure already)."""
        try:
            self._capture("kill", container_id, "KILL")
        except TorporError:
            pass

    def exec(self) -> NoReturn:
        """Become the real runtime with our own argv: podman/containerd see runc itself.
        UsageError (one line) if the kernel will not run it."""
        try:
            os.execv(self.path, [self.path, *self.inv.argv])
        except OSError as e:
            raise self._cannot_run(e) from None

    def run(self) -> subprocess.Popen:
        """The real runtime with our argv, as a child sharing our stdio; UsageError (one
        line) if it cannot be started."""
        try:
            return subprocess.Popen([self.path, *self.inv.argv], close_fds=False)
        except OSError as e:
            raise self._cannot_run(e) from None


LOG_OPTIONS = {"log", "log-format"}


def without_log(global_args: list[str]) -> list[str]:
    """Global options as argv.parse read them, less --log and --log-format (either form)."""
    out: list[str] = []
    i = 0
    while i < len(global_args):
        a = global_args[i]
        name, eq, _ = a.lstrip("-").partition("=")
        if a.startswith("-") and a != "--" and name in LOG_OPTIONS:
            i += 1 if eq else 2
            continue
        out.append(a)
        i += 1
    return out


def find_runtime(name: str) -> str:
    """The real runtime's path; never ourselves (a loop would fork until the machine stops)."""
    path = name if "/" in name else shutil.which(
        name, path=os.environ.get("PATH", "") + ":" + SEARCH_PATH)
    if not path or os.path.isdir(path) or not os.access(path, os.X_OK):   # as the front
        raise UsageError(f"OCI runtime '{name}' not found",
                         hint="install runc or crun, or set oci_runtime in /etc/torpor/config.toml")
    me = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.realpath(path) == me or Path(path).name.startswith("torpor-runtime"):
        raise UsageError(f"oci_runtime points at torpor-runtime itself ({path})",
                         hint="set oci_runtime to runc or crun")
    return path
