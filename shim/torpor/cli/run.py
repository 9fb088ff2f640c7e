"""torpor run: start a program with torpor's in-process agent preloaded.

    torpor run [--agent-dir DIR] -- COMMAND [ARGS...]

The program runs as it would without torpor (torpor execs it: same PID, same stdio, its exit
code is the command's). The agent wraps its CUDA driver calls, tracks its allocations and
answers on DIR/agent-<pid>.sock once the program first calls the driver; a program that never
does runs exactly as without it. 'torpor checkpoint' and 'torpor suspend' of the program then
have the agent move its GPU memory into files first, which is much faster than the driver's
checkpoint for large allocations.
"""

from __future__ import annotations

import argparse
import os
import shutil

from .. import agent
from ..errors import NotFoundError, UsageError
from ..files import private_dir
from .context import Context, path_arg

NEEDS_RECOVERY = False


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help=__doc__.split(":")[1].splitlines()[0].strip(),
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent-dir", type=path_arg, default=None,
                   help=f"where the agent's socket goes (default $TORPOR_AGENT_DIR or "
                        f"{agent.DEFAULT_DIR})")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]")


def run(args: argparse.Namespace, ctx: Context) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("no command given: torpor run -- COMMAND [ARGS...]")
    exe = shutil.which(cmd[0])
    if exe is None:
        raise NotFoundError(f"command not found: {cmd[0]}")
    # absolute (as --agent-dir is): the agent binds its socket when the program first calls
    # the driver, from wherever the program's current directory is by then
    agent_dir = args.agent_dir or path_arg(os.environ.get("TORPOR_AGENT_DIR")
                                           or str(agent.DEFAULT_DIR))
    private_dir(agent_dir)
    env = agent.preload_env(dict(os.environ), agent_dir, ctx.cfg.libcuda)
    os.umask(ctx.user_umask)  # the caller's umask, not torpor's private one
    os.execve(exe, cmd, env)
