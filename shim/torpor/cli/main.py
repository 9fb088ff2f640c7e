"""`torpor`: parse arguments, run one subcommand, turn every TorporError into one line.

Exit codes are listed in torpor.errors.ExitCode (and the README). Tracebacks go to
<state_dir>/torpor.log, or to the terminal with --debug.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import traceback
from types import ModuleType

from .. import __version__, config, logs
from ..errors import ExitCode, TorporError
from ..files import printable
from ..progress import Progress
from . import checkpoint, demo, doctor, image, inspect, ps, restore, run, store, suspend
from .context import Context, ResultNotWritten, path_arg

COMMANDS: dict[str, ModuleType] = {
    "doctor": doctor, "ps": ps, "checkpoint": checkpoint, "restore": restore,
    "suspend": suspend, "resume": suspend, "inspect": inspect, "demo": demo, "run": run,
    "ls": store, "rm": store, "gc": store, "image": image,
}
# the commands that change nothing: a reader that stops reading their output early (`torpor
# ps | head -1`) ends them silently, as it ends coreutils; any other command that could not
# write its result says so (its work is done, and a script must not read it as not done)
READ_ONLY = frozenset({"doctor", "ps", "inspect", "ls"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torpor", description="GPU-aware checkpoint/restore for containers and processes.")
    parser.add_argument("--version", action="version", version=f"torpor {__version__}")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--debug", action="store_true", help="tracebacks and debug logs on stderr")
    parser.add_argument("--config", type=path_arg,
                        help="config file (default /etc/torpor/config.toml)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in dict.fromkeys(COMMANDS.values()):
        module.add_parser(sub)
    for command in sub.choices.values():  # --json before or after the subcommand alike
        command.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                             help="print the result as JSON")
    return parser


def _needs_root(e: PermissionError, command: str) -> str:
    """What a non-root user lacks, in one line, for a permission refused to them."""
    where = f" ({e.filename})" if e.filename else ""
    instead = ("give --agent-dir (or $TORPOR_AGENT_DIR) a directory you can write"
               if command == "run" else "as another user, point state_dir and store_dir, or "
               "$TORPOR_STATE_DIR and $TORPOR_STORE_DIR, at directories you can write")
    return f"torpor {command} needs root: {e.strerror or e}{where} (run it as root; {instead})"


def _setup_logging(cfg: config.Config, debug: bool) -> None:
    logs.setup(cfg.state_dir, "torpor.log", level=logging.DEBUG, file_level=logging.INFO,
               fmt="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
               stderr=debug, stderr_level=logging.DEBUG)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# OSErrors that are what a path given, or the host, is, not a bug of torpor's: a path through
# a file (-D FILE/x, a FIFO given as a directory), a name too long, a link loop (exit 2); a
# full or read-only file system (exit 1)
_BAD_PATH = (errno.ENAMETOOLONG, errno.ENOTDIR, errno.ELOOP)
_HOST = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _not_a_bug(e: Exception, command: str) -> tuple[str, int] | None:
    """The one line and exit code for an exception that is no bug of torpor's but bad input
    or a missing right (exit 2), or a full or read-only file system (exit 1), or None: a
    permission refused to a non-root user; a path that cannot be one (path_arg refuses the
    names too long as they are parsed)."""
    if isinstance(e, PermissionError) and os.geteuid() != 0:
        return _needs_root(e, command), ExitCode.USAGE
    if isinstance(e, OSError) and e.errno in _BAD_PATH + _HOST:
        line = (f"{e.strerror}: {printable(e.filename, 200)}" if e.filename
                else printable(e.strerror or e, 200))
        return line, ExitCode.USAGE if e.errno in _BAD_PATH else ExitCode.ERROR
    return None


def hold_std_fds() -> None:
    """/dev/null on each of descriptors 0-2 that torpor was started without (`>&-`): else
    the first file torpor opens (its log, a lock, a checkpoint's file) becomes its stdout or
    stderr, and a result or error line is written into it. Not inherited: the programs
    torpor starts (torpor run) get the descriptors as torpor got them."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            if null != fd:    # the lowest free descriptor: fd itself, unless a lower one is
                os.dup2(null, fd, inheritable=False)
                os.close(null)


def _tell(line: str) -> None:
    """The error line on stderr; a stderr that takes none changes no exit code."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):   # broken, closed, or None (2>&-)
        pass


def main(argv: list[str] | None = None) -> int:
    hold_std_fds()
    try:
        args = build_parser().parse_args(argv)
    except TorporError as e:   # a path argument refused as it was parsed (path_arg)
        _tell(f"torpor: error: {printable(e.line(), 4000)}")
        return e.exit_code
    debug = args.debug
    user_umask = os.umask(0o077)  # everything torpor writes holds, or describes, process memory
    logging.getLogger().addHandler(logging.NullHandler())  # no traceback before the log is set
    try:
        cfg = config.load(args.config)
        _setup_logging(cfg, debug)
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGHUP, _interrupt)
        ctx = Context(cfg=cfg, json=args.json, progress=Progress(None if args.quiet else sys.stderr),
                      user_umask=user_umask)
        module = COMMANDS[args.command]
        if getattr(module, "NEEDS_RECOVERY", False):
            for msg in ctx.engine.recover():
                ctx.progress.say(msg)
        logging.getLogger("torpor").info("torpor %s", " ".join(sys.argv[1:]))
        return int(module.run(args, ctx) or 0)
    except ResultNotWritten as e:
        if e.reader_gone and args.command in READ_ONLY:
            logging.getLogger("torpor").info("%s: the reader of stdout left", args.command)
            return ExitCode.READER_GONE
        logging.getLogger("torpor").error("%s", e)
        _tell(f"torpor: error: {printable(e.line(), 4000)}")
        return e.exit_code
    except TorporError as e:
        logging.getLogger("torpor").error("%s", e, exc_info=True)
        if debug:
            traceback.print_exc()
        _tell(f"torpor: error: {printable(e.line(), 4000)}")  # names from a checkpoint
        return e.exit_code
    except KeyboardInterrupt:
        _tell("torpor: interrupted")
        return ExitCode.INTERRUPTED
    except Exception as e:  # a bug: still one line, the traceback in the log
        known = _not_a_bug(e, args.command)
        if known:
            logging.getLogger("torpor").error("%s", e, exc_info=True)
            if debug:
                traceback.print_exc()
            _tell(f"torpor: error: {known[0]}")
            return known[1]
        logging.getLogger("torpor").critical("unexpected error", exc_info=True)
        if debug:
            traceback.print_exc()
        _tell(f"torpor: internal error: {type(e).__name__}: {printable(e, 4000)} (see --debug)")
        return ExitCode.ERROR


if __name__ == "__main__":
    sys.exit(main())
