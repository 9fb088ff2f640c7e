"""What every subcommand gets: config, engine, progress and the output format."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..config import Config
from ..engine import Engine
from ..errors import TorporError, UsageError, describe
from ..files import printable
from ..progress import Progress, human_bytes, human_rate


NAME_MAX = 255     # bytes in one name of a path (Linux's file systems)
PATH_MAX = 4096    # bytes in a path the kernel takes, its terminating NUL included


def path_arg(text: str) -> Path:
    """A path given on the command line (every path argument's argparse type), refused as it
    is parsed, before anything uses it: an empty one, and a name longer than any file system
    takes, are one line, exit 2, not the current directory or an OSError from deep inside a
    command (main() still turns one such OSError from elsewhere into the same). Returned
    absolute (from the current directory, links and '..' left as given)."""
    if not text:   # Path("") is the current directory: never what an empty argument meant
        raise UsageError("an empty path was given: name the directory or file "
                         "('.' for the current directory)")
    raw = os.fsencode(text)
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        raise UsageError(f"path {printable(text, 60)}: a name in it is {len(longest)} bytes "
                         f"long, more than the {NAME_MAX} a file name may have")
    if len(raw) >= PATH_MAX:
        raise UsageError(f"path {printable(text, 60)} is {len(raw)} bytes long, more than the "
                         f"{PATH_MAX - 1} a path may have")
    # absolute: CRIU resolves a relative --images-dir and --log-file from different places
    # (a relative -D failed every dump, exit 8), and the journal and recovery (which finds a
    # dumping CRIU by its --images-dir) may run from another directory
    try:
        return Path(text).absolute()
    except FileNotFoundError:   # getcwd(): the current directory was removed
        raise UsageError(f"path {printable(text, 60)} is relative but the current directory "
                         "no longer exists: give an absolute path") from None


@dataclasses.dataclass
class Context:
    cfg: Config
    json: bool
    progress: Progress
    user_umask: int = 0o022   # the caller's, for programs torpor starts (torpor's own is 077)
    _engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(self.cfg, self.progress)
        return self._engine

    def emit(self, obj: Any, human: str) -> None:
        """Print the result: JSON with --json, else the human text. A stdout that takes no
        result (closed, a pipe whose reader left, a full disk) is one TorporError, exit 1,
        that says the command itself is done: it was an internal error (BrokenPipeError),
        which a script could take for a checkpoint or restore that did not happen."""
        out = sys.stdout
        try:
            if out is None:   # started with descriptor 1 closed (`>&-`)
                raise OSError(errno.EBADF, "stdout is closed")
            if self.json:
                json.dump(obj, out, indent=2, sort_keys=True, default=str)
                out.write("\n")
            else:
                out.write(human.rstrip("\n") + "\n")
            out.flush()
        except OSError as e:
            _drop_stdout()
            raise ResultNotWritten(f"the command is done but its result could not be written "
                                   f"to stdout: {describe(e)}",
                                   reader_gone=e.errno == errno.EPIPE) from e


class ResultNotWritten(TorporError):
    """emit's stdout took no result; reader_gone: a pipe whose reader left (EPIPE), which
    main lets a command that changes nothing end on silently (ExitCode.READER_GONE)."""

    def __init__(self, message: str, *, reader_gone: bool):
        super().__init__(message)
        self.reader_gone = reader_gone


def _drop_stdout() -> None:
    """What is left in stdout's buffer goes to /dev/null: the interpreter's flush at exit
    would otherwise fail again and print 'Exception ignored ... BrokenPipeError'."""
    try:
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(null, 1, inheritable=False)
        os.close(null)
    except OSError:
        pass


def agent_line(moved: dict[str, dict[str, Any]], verb: str = "moved") -> str:
    """One line on what the programs' agents moved ("" when none did); their own seconds, the
    programs' copies running side by side."""
    if not moved:
        return ""
    total = sum(int(r.get("bytes", 0)) for r in moved.values())
    seconds = max(float(r.get("seconds", 0.0)) for r in moved.values())
    skipped = sum(int((r.get("fingerprints") or {}).get("skipped_bytes", 0))
                  for r in moved.values())
    zeros = sum(int(r.get("zero_bytes", 0)) for r in moved.values())
    if not total and not seconds and not skipped and not zeros:
        return ""   # agents that had nothing to give back (resumed already)
    streamed = any(r.get("streamed") for r in moved.values())
    return (f"the agent {verb} {human_bytes(total)} of GPU memory of {len(moved)} program(s) "
            + ("through the image store's stream " if streamed else "")
            + f"in {seconds:.2f} s ({human_rate(total, seconds)})"
            + (f"; {human_bytes(skipped)} more the image store had already stayed where it "
               "was (GPU fingerprints)" if skipped else "")
            + (f"; {human_bytes(zeros)} read all zero on the GPU and "
               + ("were memset there" if verb == "gave back" else "never crossed PCIe")
               if zeros else "") + "\n")


def timing_lines(timings: dict[str, float]) -> str:
    if not timings:
        return ""
    width = max(len(printable(k, 40)) for k in [*timings, "total"])
    rows = [f"  {printable(k, 40):<{width}}  {v:8.2f} s" for k, v in timings.items()]
    rows.append(f"  {'total':<{width}}  {sum(timings.values()):8.2f} s")
    return "\n".join(rows)
