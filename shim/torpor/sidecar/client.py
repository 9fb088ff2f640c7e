"""The client side of torpord: Client(cfg) for the OCI shim and the CLI, ping() for doctor.

    with Client(cfg) as c:
        ck = c.lock_and_checkpoint(container_id="abc")       # GPU state now in host memory
        try:
            run_runc_checkpoint(...)
        except Exception:
            c.rollback(ck.op_id)                              # program RUNNING again
            raise
        c.finish(ck.op_id)                                    # or c.restore_and_unlock(op_id=...)

Every method returns the typed values of convert.py (frozen dataclasses with the response
messages' field names, repeated fields as tuples, maps as dicts) and raises the TorporError subclass torpord raised,
rebuilt from the `torpor-exit-code` trailer; SidecarError when torpord cannot be reached.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import grpc

from ..config import Config
from ..doctor import OK, WARN, Check, torpord_hint
from ..errors import SidecarError, TorporError
from ..files import private_dir
from . import error_from_rpc, proto, root_socket
from .convert import (AgentData, Checkpointed, Container, Listing, OperationResult, Restored,
                      Status, check_from_pb, from_pb, to_pb)




FINGERPRINTS = {"": 0, "index": 1, "skip": 2}   # LockAndCheckpointRequest.fingerprints
# The driver's own copy of a whole GPU's memory at its slowest (1.5 GB/s out: 141 GB in ~95 s),
# with room to spare.
DRIVER_MARGIN_S = 300.0


def work_timeout(cfg: Config) -> float:
    """How long one call that does a process's GPU work (LockAndCheckpoint, Finish, Rollback,
    RestoreAndUnlock) may take before its caller gives up: a driver lock, one agent's move and
    the driver's copy of a whole GPU. A torpord that hangs then fails the runtime's command
    instead of hanging the engine (podman, containerd's shim) for good; torpord ends the work
    as it ends any whose caller went away (rolled back; a restored container is stopped)."""
    return cfg.lock_timeout_s + cfg.agent_timeout_s + DRIVER_MARGIN_S


def _answers(path: Path) -> bool:
    """Does a socket listen at path? A torpord killed leaves its root door behind, and a
    client that took it would fail where the public socket (or starting torpord) works."""
    if not path.is_socket():
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


class Client:
    """One channel to torpord. Thread-safe; close() (or `with`) when done."""

    def __init__(self, cfg: Config, socket_path: Path | str | None = None,
                 timeout: float | None = None):
        self.cfg = cfg
        self.socket_path = Path(socket_path or cfg.socket_path).absolute()
        self.timeout = timeout
        self.pb, pb_grpc = proto()
        door = root_socket(cfg.run_dir)   # root's own, past any flood on the public socket
        use = door if socket_path is None and os.geteuid() == 0 and _answers(door) else None
        self.target = use or self.socket_path
        self.channel = grpc.insecure_channel(f"unix://{self.target}")
        self.stub = pb_grpc.TorporStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        if not self.socket_path.exists():
            raise SidecarError(f"torpord is not running (no socket at {self.socket_path})",
                               hint=torpord_hint())
        try:
            return getattr(self.stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            err: TorporError = error_from_rpc(e.code(), e.details(), e.trailing_metadata())
            raise err from None

    # -- containers ---------------------------------------------------------------------------
    def register_container(self, container_id: str, bundle: str | os.PathLike = "",
                           pids: Iterable[int] = (), gpu_uuids: Iterable[str] = (),
                           annotations: Mapping[str, str] | None = None) -> Container:
        req = self.pb.RegisterContainerRequest(id=container_id, bundle=str(bundle),
                                               pids=list(pids), gpu_uuids=list(gpu_uuids),
                                               annotations=dict(annotations or {}))
        return from_pb(Container, self._call("RegisterContainer", req))

    def unregister_container(self, container_id: str, missing_ok: bool = False) -> bool:
        req = self.pb.UnregisterContainerRequest(id=container_id, missing_ok=missing_ok)
        return self._call("UnregisterContainer", req).existed

    # -- checkpoint -----------------------------------------------------------------------------
    def lock_and_checkpoint(self, pids: Iterable[int] = (), container_id: str = "", *,
                            lock_timeout_s: float | None = None, descendants: bool = True,
                            owner_pid: int = 0, gpu_data_dir: str | os.PathLike = "",
                            agent_container_id: str = "", fingerprints: str = "",
                            staged: bool = False, drain: bool = False,
                            timeout: float | None = None) -> Checkpointed:
        """Lock and checkpoint the CUDA processes among pids (and their descendants) or the
        container's; the operation stays open: end it with finish/rollback/restore_and_unlock.
        owner_pid: torpord rolls the operation back should that process die before ending it.
        gpu_data_dir: programs under the agent move their GPU memory into files there first
        (their sockets in agent_container_id's agent directory). fingerprints: "skip" (the
        agents skip what torpord's image store holds; hold its lock until the pack) or "index"
        (fingerprinted only: the program is left running), "" none. staged: gpu_data_dir is a
        staging directory in host memory under torpord's suspend_dir (flows/writeout.py).
        drain (with staged): this caller reads restore_and_unlock's drain_error, so torpord
        may leave the copy to copiers beside the dump (config leave_running_drain). Returns the open operation: op_id, pids, cuda_processes, timings, deadline,
        container_id and what each agent moved (agents)."""
        req = self.pb.LockAndCheckpointRequest(pids=list(pids), container_id=container_id,
                                               no_descendants=not descendants, owner_pid=owner_pid,
                                               gpu_data_dir=str(gpu_data_dir),
                                               agent_container_id=agent_container_id,
                                               fingerprints=FINGERPRINTS[fingerprints],
                                               staged=staged, drain=drain)
        if lock_timeout_s is not None:
            req.lock_timeout_s = lock_timeout_s
        return from_pb(Checkpointed, self._call("LockAndCheckpoint", req, timeout))

    def finish(self, op_id: str, timeout: float | None = None) -> OperationResult:
        """The dump succeeded: close the operation."""
        return from_pb(OperationResult,
                       self._call("Finish", self.pb.OperationRequest(op_id=op_id), timeout))

    def rollback(self, op_id: str, timeout: float | None = None) -> OperationResult:
        """The dump failed: bring the live CUDA processes back to RUNNING, close the op."""
        return from_pb(OperationResult,
                       self._call("Rollback", self.pb.OperationRequest(op_id=op_id), timeout))

    # -- restore --------------------------------------------------------------------------------
    def restore_and_unlock(self, op_id: str = "", pids: Iterable[int] = (),
                           container_id: str = "", gpu_map: Mapping[str, str] | None = None, *,
                           descendants: bool = True, gpu_data_dir: str | os.PathLike = "",
                           agents: Iterable[AgentData] = (),
                           agent_container_id: str = "",
                           gpu_data_packed: str | os.PathLike = "",
                           timeout: float | None = None) -> Restored:
        """op_id: end an open checkpoint by giving the (still running) processes their GPU
        state back (--leave-running). pids/container_id: a restored container's new host PIDs
        (CHECKPOINTED in the driver) get their GPU state (on gpu_map's GPUs) and run; agents
        (as lock_and_checkpoint returned them) their memory back from
        gpu_data_dir through their agent (in agent_container_id's agent directory), or, given
        gpu_data_packed (the packed checkpoint directory), from the image store.
        Returns op_id, pids (the CUDA PIDs restored), timings, gpu_map and each agent's
        resume (agents)."""
        req = self.pb.RestoreAndUnlockRequest(
            op_id=op_id, pids=list(pids), container_id=container_id, gpu_map=dict(gpu_map or {}),
            no_descendants=not descendants, gpu_data_dir=str(gpu_data_dir),
            agents=[to_pb(self.pb, a) for a in agents],
            agent_container_id=agent_container_id, gpu_data_packed=str(gpu_data_packed))
        return from_pb(Restored, self._call("RestoreAndUnlock", req, timeout))

    # -- inspection -------------------------------------------------------------------------------
    def status(self, op_id: str = "", pids: Iterable[int] = (),
               container_id: str = "") -> Status:
        """Each process's state (processes) and, asked by op_id, the operation's."""
        req = self.pb.StatusRequest(op_id=op_id, pids=list(pids), container_id=container_id)
        return from_pb(Status, self._call("Status", req))

    def list(self, timeout: float | None = None) -> Listing:
        """torpord's version and PID, containers, open operations and GPU processes."""
        return from_pb(Listing, self._call("List", self.pb.ListRequest(), timeout))

    def doctor(self, timeout: float | None = None) -> list[Check]:
        resp = self._call("Doctor", self.pb.DoctorRequest(), timeout)
        return [check_from_pb(c) for c in resp.checks]


def ping(cfg: Config, socket_path: Path | str | None = None, timeout: float = 3.0) -> Check:
    """torpord's version and counts (OK), or WARN "not running" (used by `torpor doctor`)."""
    path = Path(socket_path or cfg.socket_path)
    if not path.exists():
        return Check("torpord", WARN, f"not running (no socket at {path})",
                     torpord_hint())
    try:
        with Client(cfg, path, timeout=timeout) as c:
            info = c.list()
    except TorporError as e:
        return Check("torpord", WARN, f"not running or not answering at {path}: {e}",
                     torpord_hint("restart") + "; torpord answers root and socket_owner_uid only")
    return Check("torpord", OK,
                 f"torpord {info.version} (pid {info.server_pid}) on {path}: "
                 f"{len(info.containers)} container(s), "
                 f"{len(info.operations)} open operation(s)")


_started: list[subprocess.Popen] = []


def ensure_running(cfg: Config, socket_path: Path | str | None = None, wait_s: float = 20.0,
                   extra_args: Iterable[str] = ()) -> Check:
    """Start torpord (detached, its own session, log in <state_dir>/torpord.log) unless it
    answers already; wait until it does. Returns ping()'s OK check; SidecarError otherwise."""
    check = ping(cfg, socket_path)
    if check.status == OK:
        return check
    state = private_dir(cfg.state_dir)
    log_path = state / "torpord.log"
    cmd = [sys.executable, "-m", "torpor.sidecar.daemon", "--foreground", *extra_args]
    if socket_path:
        cmd += ["--socket", str(socket_path)]
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd,
                                start_new_session=True, close_fds=True, cwd="/")
    finally:
        os.close(fd)
    _started.append(proc)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        check = ping(cfg, socket_path, timeout=1.0)
        if check.status == OK:
            return check
        if proc.poll() is not None:
            # Lost a race with another starter? Then that one answers.
            check = ping(cfg, socket_path, timeout=2.0)
            if check.status == OK:
                return check
            raise SidecarError(f"torpord exited with {proc.returncode} at start: "
                               f"{_tail(log_path)}", hint=f"see {log_path}")
        time.sleep(0.1)
    raise SidecarError(f"torpord did not answer within {wait_s:.0f} s: {check.detail}",
                       hint=f"see {log_path}")


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"
