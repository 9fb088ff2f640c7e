"""One error family and the exit codes, in one place.

Every error torpor raises on purpose is a TorporError; `main()` prints its message as one
line on stderr and exits with its exit code. Tracebacks go to the log (or the terminal with
--debug), never to the operator by default.
"""

from __future__ import annotations

import errno


class ExitCode:
    """Documented exit codes of the `torpor` command (README, "Exit codes")."""

    OK = 0
    ERROR = 1            # anything not covered below
    USAGE = 2            # bad arguments or bad input (argparse uses 2 too)
    NOT_FOUND = 3        # no such process, directory, archive or GPU
    NO_DRIVER = 4        # no NVIDIA driver / no checkpoint API where one is needed
    CRIU = 5             # CRIU missing, too old, or its dump/restore failed
    BUSY = 6             # another torpor operation holds these processes
    PREFLIGHT = 7        # restore refused before starting (GPU model, memory, driver)
    ROLLED_BACK = 8      # a phase failed and the program was rolled back to RUNNING; also a
                         # --store checkpoint the store had no room for (complete, not packed)
    CORRUPT = 9          # a checkpoint failed verification (manifest, checksums)
    SIDECAR = 10         # torpord unreachable or refused the request
    INTERRUPTED = 130    # Ctrl-C; the program was rolled back first
    READER_GONE = 141    # a command that changes nothing (ps, ls, inspect, doctor) whose
                         # stdout's reader left early (`torpor ps | head -1`): silent, as
                         # coreutils die of SIGPIPE (128 + 13)


class TorporError(Exception):
    """An error with a message fit for an operator, and an exit code."""

    exit_code = ExitCode.ERROR

    def __init__(self, message: str, *, exit_code: int | None = None, hint: str | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        self.hint = hint

    def line(self) -> str:
        """The one line an operator sees: messages quote untrusted names (a manifest's keys,
        paths from an archive), so no control character or escape survives here."""
        msg = str(self)
        msg = f"{msg} ({self.hint})" if self.hint else msg
        return "".join(c if c.isprintable() else " " if c in "\n\r\t" else "?" for c in msg)


def describe(e: BaseException) -> str:
    """An error in a few words, for a message that goes on to say what became of things: an
    OSError's text without its path (the message names it), a Ctrl-C as "interrupted"."""
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def no_space(e: BaseException) -> bool:
    """Was e caused by a full filesystem (ENOSPC, or a quota: EDQUOT), however it was wrapped
    (raise ... from, or raised while handling it)?"""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class UsageError(TorporError):
    exit_code = ExitCode.USAGE


class HostMemoryError(UsageError):
    """A suspend refused before anything was locked or moved: the host has not the memory
    the GPU memory would take there."""


class NotFoundError(TorporError):
    exit_code = ExitCode.NOT_FOUND


class NoDriverError(TorporError):
    exit_code = ExitCode.NO_DRIVER


class CriuError(TorporError):
    """CRIU failed. cut_short: it did not end on its own (a signal, or torpor's timeout killed
    it), so the cleanup CRIU does after a failure did not run."""
    exit_code = ExitCode.CRIU

    def __init__(self, message: str, *, cut_short: bool = False, **kw):
        super().__init__(message, **kw)
        self.cut_short = cut_short


class BusyError(TorporError):
    exit_code = ExitCode.BUSY


class PreflightError(TorporError):
    exit_code = ExitCode.PREFLIGHT


class RolledBackError(TorporError):
    """A phase failed; every process was brought back to RUNNING before this was raised."""

    exit_code = ExitCode.ROLLED_BACK


class CorruptCheckpointError(TorporError):
    exit_code = ExitCode.CORRUPT


class DamagedRecordsError(CorruptCheckpointError):
    """A checkpoint's own records of where its GPU data is (its agent's fingerprint index, its
    stream record) are malformed: nothing can make that checkpoint whole, so no retry is left
    waiting for it (store_packing.py marks it damaged instead)."""


class SidecarError(TorporError):
    exit_code = ExitCode.SIDECAR
