"""torpord, the sidecar: a gRPC server on a Unix socket that owns the engine for containers.

daemon.py     the `torpord` daemon: argv, sockets, signals, logging, single instance
service.py    the gRPC face: the handlers of the Torpor service and its servicer
operations.py the operation table: open operations, op timeout, reaper, shutdown rollback
containers.py the container registry: one record per registered container
request_args.py what the handlers make of a request's PIDs and paths, and their checks
convert.py    protobuf messages <-> typed values (frozen dataclasses), both directions
peercred.py   the public socket: SO_PEERCRED check, then a byte splice to the private gRPC socket
client.py     Client(cfg) for the OCI shim and the CLI; ping() for `torpor doctor`

This module holds what both ends share: the generated modules, and how a TorporError travels
as a gRPC status.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import grpc

from .. import errors
from ..errors import ExitCode, TorporError

def root_socket(run_dir: Path) -> Path:
    """Root's own door: its gRPC server's socket, in torpord's 0700 private directory, which
    root's clients use when it is there; no flood on the public socket can stand before it."""
    return Path(run_dir).absolute() / "private" / "root.sock"


def proto():
    """The generated modules (torpor._proto); a clear error when they were never generated."""
    try:
        from .._proto import torpor_pb2, torpor_pb2_grpc
    except ImportError as e:
        raise errors.SidecarError(f"the gRPC modules are missing ({e})",
                                  hint="run 'python proto/generate.py' or reinstall torpor") from e
    return torpor_pb2, torpor_pb2_grpc


EXIT_CODE_KEY = "torpor-exit-code"
MESSAGE_KEY = "torpor-message"
HINT_KEY = "torpor-hint"
CLASS_KEY = "torpor-error"       # the TorporError subclass name, e.g. "RolledBackError"

# torpor exit code -> gRPC status code (everything else: INTERNAL)
STATUS_OF_EXIT: dict[int, grpc.StatusCode] = {
    ExitCode.OK: grpc.StatusCode.OK,
    ExitCode.USAGE: grpc.StatusCode.INVALID_ARGUMENT,
    ExitCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ExitCode.NO_DRIVER: grpc.StatusCode.UNAVAILABLE,
    ExitCode.CRIU: grpc.StatusCode.INTERNAL,
    ExitCode.BUSY: grpc.StatusCode.ABORTED,
    ExitCode.PREFLIGHT: grpc.StatusCode.FAILED_PRECONDITION,
    ExitCode.ROLLED_BACK: grpc.StatusCode.INTERNAL,
    ExitCode.CORRUPT: grpc.StatusCode.DATA_LOSS,
    ExitCode.SIDECAR: grpc.StatusCode.UNAVAILABLE,
    ExitCode.INTERRUPTED: grpc.StatusCode.CANCELLED,
}

# torpor exit code -> the TorporError subclass a client raises
ERROR_OF_EXIT: dict[int, type[TorporError]] = {
    ExitCode.USAGE: errors.UsageError,
    ExitCode.NOT_FOUND: errors.NotFoundError,
    ExitCode.NO_DRIVER: errors.NoDriverError,
    ExitCode.CRIU: errors.CriuError,
    ExitCode.BUSY: errors.BusyError,
    ExitCode.PREFLIGHT: errors.PreflightError,
    ExitCode.ROLLED_BACK: errors.RolledBackError,
    ExitCode.CORRUPT: errors.CorruptCheckpointError,
    ExitCode.SIDECAR: errors.SidecarError,
}


def grpc_status(error: BaseException) -> tuple[grpc.StatusCode, int, str, tuple[tuple[str, str], ...]]:
    """(status code, exit code, one-line details, trailing metadata) for an error raised by a
    handler. A non-TorporError is exit code 1 (ERROR), INTERNAL."""
    if isinstance(error, TorporError):
        code, line, message, hint = int(error.exit_code), error.line(), str(error), error.hint
    else:
        code = ExitCode.ERROR
        message = f"internal error in torpord: {type(error).__name__}: {error}"
        line, hint = message, None
    status = STATUS_OF_EXIT.get(code, grpc.StatusCode.INTERNAL)
    if status == grpc.StatusCode.OK:  # an error never travels as OK
        status = grpc.StatusCode.INTERNAL
    md: list[tuple[str, str]] = [(EXIT_CODE_KEY, str(code)), (MESSAGE_KEY, _ascii(message))]
    if isinstance(error, TorporError):
        md.append((CLASS_KEY, type(error).__name__))
    if hint:
        md.append((HINT_KEY, _ascii(hint)))
    return status, code, _one_line(line), tuple(md)


def error_from_rpc(status: grpc.StatusCode | None, details: str | None,
                   metadata: Iterable[tuple[str, str | bytes]] | None) -> TorporError:
    """Rebuild the TorporError a torpord handler raised; an RPC that failed without torpor's
    metadata (torpord down, refused, timed out) is a SidecarError."""
    md = {k: (v.decode(errors="replace") if isinstance(v, bytes) else v)
          for k, v in (metadata or ())}
    if EXIT_CODE_KEY not in md:
        what = status.name if status is not None else "no status"
        return errors.SidecarError(f"torpord: {details or what} ({what})",
                                   hint="is torpord running? 'torpor doctor' checks")
    try:
        code = int(md[EXIT_CODE_KEY])
    except ValueError:
        code = ExitCode.ERROR
    message = md.get(MESSAGE_KEY) or details or "torpord failed"
    named = {c.__name__: c for c in (TorporError, *ERROR_OF_EXIT.values())}
    cls = named.get(md.get(CLASS_KEY, ""), ERROR_OF_EXIT.get(code, TorporError))
    err = cls(message, hint=md.get(HINT_KEY) or None)
    if type(err).exit_code != code:
        err.exit_code = code
    return err


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _ascii(text: str) -> str:
    """Metadata values must be printable ASCII."""
    return _one_line(text).encode("ascii", "backslashreplace").decode("ascii")
