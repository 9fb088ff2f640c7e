"""The client side of the in-process agent (agent/, libtorpor-agent.so): one Unix socket per
program, `<agent_dir>/agent-<pid>.sock`, one command a line, one JSON object a reply.

    with AgentClient.for_pid(1234) as a:
        a.status()     # {"pid", "gate": "open"|"closed", "in_flight", "allocations", "bytes"}
        a.close(5000)  # gate closed, calls in flight done, contexts synchronized (or AgentError)
        a.open()

The agent accepts only root and the program's own uid (SO_PEERCRED). We trust the socket only
when root or the program's uid owns it (another user could otherwise plant one in its place).
"""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path
from typing import Any

from .errors import NotFoundError, TorporError

DEFAULT_DIR = Path("/run/torpor/agents")
REPLY_MAX = 1 << 20
LIBRARY = Path(__file__).resolve().parent / "_agent" / "libtorpor-agent.so"


class AgentError(TorporError):
    pass


def library() -> Path:
    """The agent library the package build made (setup.py builds agent/ into torpor/_agent/)."""
    if not LIBRARY.is_file():
        raise NotFoundError(f"the torpor agent library is missing ({LIBRARY})",
                            hint="reinstall torpor: the build compiles agent/ with make and gcc")
    return LIBRARY


def preload_env(env: dict[str, str], agent_dir: Path, libcuda: str) -> dict[str, str]:
    """env with the agent preloaded (ahead of any LD_PRELOAD already there), its socket
    directory and the driver it should wrap."""
    out = dict(env)
    out["LD_PRELOAD"] = " ".join(filter(None, [str(library()), env.get("LD_PRELOAD", "")]))
    out["TORPOR_AGENT_DIR"] = str(agent_dir)
    if libcuda != "libcuda.so.1":
        out["TORPOR_AGENT_LIBCUDA"] = libcuda
    return out


def socket_path(pid: int, agent_dir: Path | None = None) -> Path:
    d = agent_dir or Path(os.environ.get("TORPOR_AGENT_DIR") or DEFAULT_DIR)
    return d / f"agent-{int(pid)}.sock"


class AgentClient:
    def __init__(self, path: Path, owner_uid: int | None = None, timeout: float = 30.0):
        self.path = Path(path)
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            raise NotFoundError(f"no torpor agent socket at {self.path}") from None
        trusted = {0, os.geteuid()} | ({owner_uid} if owner_uid is not None else set())
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid not in trusted:
            raise AgentError(f"{self.path} is not an agent socket we can trust (owner uid "
                             f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(self.path))
        except OSError as e:
            self.sock.close()
            raise AgentError(f"cannot reach the agent at {self.path}: {e.strerror}") from e
        self._buf = b""

    @classmethod
    def for_pid(cls, pid: int, agent_dir: Path | None = None, timeout: float = 30.0
                ) -> "AgentClient":
        from .procs import owner_uid
        return cls(socket_path(pid, agent_dir), owner_uid(pid), timeout)

    def close_socket(self) -> None:
        self.sock.close()

    def __enter__(self) -> "AgentClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_socket()

    def call(self, line: str) -> dict[str, Any]:
        try:
            self.sock.sendall(line.encode() + b"\n")
            while b"\n" not in self._buf:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise AgentError(f"the agent at {self.path} hung up on '{line}'")
                self._buf += chunk
                if len(self._buf) > REPLY_MAX:
                    raise AgentError(f"the agent at {self.path} sent an oversized reply")
        except OSError as e:
            raise AgentError(f"agent at {self.path}: {e}") from e
        raw, _, self._buf = self._buf.partition(b"\n")
        try:
            reply = json.loads(raw)
        except ValueError as e:
            raise AgentError(f"the agent at {self.path} sent a non-JSON reply: {raw[:200]!r}"
                             ) from e
        if not isinstance(reply, dict):
            raise AgentError(f"the agent at {self.path} sent {reply!r}")
        if reply.get("ok") is False:
            raise AgentError(f"agent '{line}': {reply.get('error', 'failed')}")
        return reply

    def status(self) -> dict[str, Any]:
        return self.call("status")

    def close(self, timeout_ms: int = 10_000) -> dict[str, Any]:
        """Close the gate: new driver calls wait, calls in flight finish, contexts sync."""
        return self.call(f"close {int(timeout_ms)}")

    def open(self) -> dict[str, Any]:
        return self.call("open")
