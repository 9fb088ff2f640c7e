"""torpord: the sidecar that owns the GPU checkpoint engine for containers.

    torpord [--foreground] [--socket PATH] [--op-timeout SECONDS] [--log-level LEVEL]

gRPC (proto/torpor.proto) on <run_dir>/torpord.sock, behind a SO_PEERCRED check (peercred.py);
root's calls are served apart, also on <run_dir>/private/root.sock (root_socket()), which
root's clients use first.
A container checkpoint is LockAndCheckpoint, then the runtime's CRIU dump, then Finish,
Rollback or RestoreAndUnlock; the operation stays open (journal entry and PID locks held by
torpord) in between, and is rolled back by torpord when not ended within --op-timeout.

Programs under the in-process agent: given a data directory (gpu_data_dir, torpor-runtime
names <image-path>/torpor-gpu), LockAndCheckpoint has their agents move their bulk GPU memory
there first, and every way an operation ends gives it back through the agent (engine/ has
the order). The sockets are in the container's agent directory (agent.container_dir).

At start torpord rolls back what dead torpor processes left locked or checkpointed
(engine.recover()). On SIGTERM/SIGINT it stops accepting, lets calls in flight finish, rolls
back its open operations and exits 0. SIGUSR2 writes every thread's stack into its log (what a
torpord that seems stuck is waiting for), and it goes on.

This module is the daemon: argv, sockets, signals, logging, the single-instance lock and the
`torpord` entry point (main). The handlers are service.py's, the open operations
operations.py's, the registered containers containers.py's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import faulthandler
import logging
import math
import os
import signal
import sys
import threading
from pathlib import Path

import grpc

from .. import __version__, config, logs, procs
from ..engine import Engine
from ..errors import ExitCode, SidecarError, TorporError, UsageError
from ..files import private_dir
from ..progress import Progress
from . import proto, root_socket
from .operations import DEFAULT_OP_TIMEOUT_S
from .peercred import PeerCredProxy
from .service import Service, servicer

log = logging.getLogger("torpor.sidecar")

_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes, NUL included


def _daemonize() -> None:
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    fd = os.open(os.devnull, os.O_RDWR)
    for n in (0, 1, 2):
        os.dup2(fd, n)
    if fd > 2:
        os.close(fd)


def _setup_logging(cfg: config.Config, level: str, foreground: bool) -> None:
    logs.setup(cfg.state_dir, None if foreground else "torpord.log", stderr=foreground,
               level=getattr(logging, level.upper(), logging.INFO), stderr_formatted=True,
               fmt="%(asctime)s torpord[%(process)d] %(levelname)s %(message)s", must=True)


def _run_dir(cfg: config.Config) -> Path:
    """run_dir: 0700, or 0711 when a non-root socket owner must reach the socket inside."""
    d = cfg.run_dir
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    want = 0o711 if cfg.socket_owner_uid else 0o700
    st = d.stat()
    if st.st_uid == os.geteuid() and st.st_mode & 0o777 != want:
        os.chmod(d, want)
    return d


def _single_instance(run_dir: Path) -> int:
    fd = os.open(run_dir / "torpord.pid", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SidecarError(f"torpord is already running (pid {other}) for {run_dir}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _path(text: str) -> Path:
    """A path option: never empty (Path("") is the current directory: --socket "" bound the
    socket onto it and failed with a traceback)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path was given")
    return Path(text)


def _seconds(text: str) -> float:
    """--op-timeout: a finite number of seconds above 0 (nan and inf were taken: an open
    operation, its program locked on the GPU, was then never rolled back)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torpord", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"torpord {__version__}")
    p.add_argument("--config", type=_path, help="config file (default /etc/torpor/config.toml)")
    p.add_argument("--socket", type=_path, help="public socket (default <run_dir>/torpord.sock)")
    p.add_argument("--op-timeout", type=_seconds, default=DEFAULT_OP_TIMEOUT_S, metavar="SECONDS",
                   help="roll back an open operation not ended within this (default 600)")
    p.add_argument("--foreground", action="store_true",
                   help="stay in the foreground and log to stderr (systemd); otherwise detach "
                        "and log to <state_dir>/torpord.log")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config.load(args.config)
        if os.geteuid() != 0:  # it checkpoints other users' programs and owns /run/torpor
            raise UsageError("torpord must run as root (sudo torpord, or the torpord service)")
        public = (args.socket or cfg.socket_path).absolute()
        private = cfg.run_dir.absolute() / "private" / "grpc.sock"
        for path in (public, private):
            if len(str(path).encode()) > _SUN_PATH_MAX:
                raise UsageError(f"socket path too long for a Unix socket: {path}")
        proto()
    except TorporError as e:
        print(f"torpord: {e.line()}", file=sys.stderr)
        return e.exit_code
    if not args.foreground:
        _daemonize()
    _setup_logging(cfg, args.log_level, args.foreground)
    try:
        return _serve(cfg, args, public, private)
    except TorporError as e:
        log.error("%s", e.line())
        return e.exit_code
    except OSError as e:   # a socket path it cannot bind (a directory, one in use): one line
        log.error("cannot serve: %s%s", e.strerror or e,
                  f": {e.filename}" if e.filename else "")
        log.debug("the error", exc_info=True)
        return ExitCode.ERROR


def _serve(cfg: config.Config, args: argparse.Namespace, public: Path, private: Path) -> int:
    _, pb_grpc = proto()
    run_dir = _run_dir(cfg)
    lock_fd = _single_instance(run_dir)
    public.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    private_dir(private.parent)
    if private.is_socket():
        private.unlink()

    try:
        messages = Engine(cfg, Progress(stream=None)).recover()
        for msg in messages:
            log.warning("recovery: %s", msg)
        log.info("recovery: %s",
                 f"{len(messages)} message(s)" if messages else "nothing to recover")
    except Exception:   # torpord must come up: the reaper retries every RECOVERY_PERIOD_S
        log.exception("recovery at start failed")

    why = procs.raise_fd_limit()   # each connection torpord splices holds two
    if why:
        log.warning("%s", why)
    service = Service(cfg, args.op_timeout)
    # Two gRPC servers over one service: root's calls have workers of their own, so that no
    # flood of the socket owner's calls queues in front of them (the proxy routes by uid);
    # past its bound a flood's calls are refused (RESOURCE_EXHAUSTED), not queued without end.
    root_private = root_socket(cfg.run_dir)
    servers = []
    for path, workers, bound in ((private, 16, 256), (root_private, 4, 64)):
        if path.is_socket():
            path.unlink()
        srv = grpc.server(concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="rpc" if bound == 256 else "rpc-root"),
            maximum_concurrent_rpcs=bound)
        pb_grpc.add_TorporServicer_to_server(servicer(service), srv)
        if srv.add_insecure_port(f"unix://{path}") == 0:
            raise SidecarError(f"cannot listen on {path}")
        srv.start()
        os.chmod(path, 0o600)
        servers.append(srv)
    allowed = {0, cfg.socket_owner_uid}
    proxy = PeerCredProxy(public, private, allowed, mode=0o660, owner_uid=cfg.socket_owner_uid,
                          routes={0: root_private})
    proxy.start()
    service.ops.start_reaper()

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR2, all_threads=True)   # into the log (its stderr)
    log.info("torpord %s (pid %d) listening on %s (uids %s), op timeout %.0f s", __version__,
             os.getpid(), public, ",".join(map(str, sorted(allowed))), args.op_timeout)

    while not stop.wait(1.0):
        pass

    proxy.stop_accepting()
    service.stopping()
    for stopped in [srv.stop(grace=5) for srv in servers]:
        stopped.wait(10)
    service.shutdown()   # waits for the handlers gRPC stopped waiting for
    proxy.close()
    for path in (private, root_private):
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    os.close(lock_fd)
    log.info("torpord stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
