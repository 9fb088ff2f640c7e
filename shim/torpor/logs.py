"""One logging set-up for every entry point (torpor, torpord, torpor-runtime, torpor-hook).

Each logs to a file of its own in the state directory (0700), and to stderr where its caller
reads it: `torpor --debug`, `torpord --foreground`, TORPOR_DEBUG for torpor-runtime, always for
the hook (the runtime shows a hook's stderr).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from .errors import TorporError
from .files import private_dir

FORMAT = "%(asctime)s %(process)d %(levelname)s %(message)s"


def _private_file(path: Path) -> None:
    """The log file, created 0600 whatever the umask (torpor-hook and torpord keep their
    caller's: the hook's log was 0644); one left readable by others is made 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


class _NoTraceback(logging.Formatter):
    """A record's message without its traceback: for a stderr that shows one line per error
    (the runtime shows torpor-hook's stderr), the traceback staying in the log file."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return super().format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def setup(state_dir: Path, file_name: str | None, *, level: int = logging.INFO,
          fmt: str = FORMAT, file_level: int | None = None, stderr: bool = False,
          stderr_level: int | None = None, stderr_formatted: bool = False,
          stderr_tracebacks: bool = True, must: bool = False) -> None:
    """The root logger at level, writing to stderr (given stderr; formatted as the file only
    with stderr_formatted; without tracebacks unless stderr_tracebacks) and to
    state_dir/file_name (None: no file). A log file that cannot be opened, or whose
    state_dir private_dir refuses, is left out, unless must (then the OSError or
    UsageError): torpor-hook and torpor-runtime's create must never stop a container for
    want of a log."""
    root = logging.getLogger()
    root.setLevel(level)
    formatter = logging.Formatter(fmt)
    if stderr:
        h = logging.StreamHandler(sys.stderr)
        if stderr_level is not None:
            h.setLevel(stderr_level)
        if stderr_formatted:
            h.setFormatter(formatter if stderr_tracebacks else _NoTraceback(fmt))
        elif not stderr_tracebacks:
            h.setFormatter(_NoTraceback())
        root.addHandler(h)
    if file_name is None:
        return
    try:
        private_dir(state_dir)
        _private_file(state_dir / file_name)
        # UTF-8 whatever the locale, and never an error: a message quotes argv and paths,
        # which may hold bytes that are no UTF-8 (os.fsdecode's surrogates); a strict
        # handler printed "--- Logging error ---" and a traceback on stderr instead
        fh = logging.FileHandler(state_dir / file_name, encoding="utf-8",
                                 errors="backslashreplace")
    except (OSError, TorporError):   # TorporError: a state_dir others could change, refused
        if must:
            raise
        return
    fh.setFormatter(formatter)
    if file_level is not None:
        fh.setLevel(file_level)
    root.addHandler(fh)
