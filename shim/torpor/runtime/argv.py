"""runc's command line, read without changing it: torpor-runtime passes argv on untouched.

    runc [global options] COMMAND [command options] CONTAINER_ID

Options take `--name value` or `--name=value` (urfave/cli, which runc uses, also accepts one
dash). Only options that take a value need listing: anything else is a flag. Unknown commands
pass through without being read at all.
"""

from __future__ import annotations

import dataclasses

GLOBAL_VALUES = {"log", "log-format", "root", "criu", "rootless"}
COMMAND_VALUES = {
    "checkpoint": {"image-path", "work-path", "parent-path", "page-server", "status-fd",
                   "manage-cgroups-mode", "empty-ns", "lsm-profile", "lsm-mount-context"},
    "restore": {"console-socket", "image-path", "work-path", "manage-cgroups-mode", "bundle", "b",
                "pid-file", "empty-ns", "lsm-profile", "lsm-mount-context"},
    "create": {"bundle", "b", "console-socket", "pid-file", "preserve-fds"},
    "run": {"bundle", "b", "console-socket", "pid-file", "preserve-fds"},
    "delete": set(),
}


@dataclasses.dataclass
class Invocation:
    argv: list[str]                       # everything after the program name, as given
    global_opts: dict[str, str | bool]
    global_args: list[str]                # the global options as given, to reuse for `state`
    command: str
    opts: dict[str, str | bool]
    positionals: list[str]

    @property
    def container_id(self) -> str:
        return self.positionals[-1] if self.positionals else ""

    def opt(self, *names: str) -> str | None:
        for n in names:
            v = self.opts.get(n)
            if isinstance(v, str):
                return v
        return None

    def flag(self, *names: str) -> bool:
        return any(self.opts.get(n) is True for n in names)

    @property
    def wants_help(self) -> bool:
        return self.flag("help", "h")


def _read(args: list[str], values: set[str], stop_at_positional: bool
          ) -> tuple[dict[str, str | bool], list[str], int]:
    """Options until the first positional (stop_at_positional) or the end; returns
    (options, positionals, index reached)."""
    opts: dict[str, str | bool] = {}
    positionals: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            positionals += args[i + 1:]
            return opts, positionals, len(args)
        if a.startswith("-") and a != "-":
            name, eq, value = a.lstrip("-").partition("=")
            if eq:
                opts[name] = value
            elif name in values and i + 1 < len(args):
                opts[name] = args[i + 1]
                i += 1
            else:
                opts[name] = True
        else:
            if stop_at_positional:
                return opts, positionals, i
            positionals.append(a)
        i += 1
    return opts, positionals, i


def parse(argv: list[str]) -> Invocation:
    global_opts, _, i = _read(argv, GLOBAL_VALUES, stop_at_positional=True)
    command = argv[i] if i < len(argv) else ""
    rest = argv[i + 1:] if command else []
    if command in COMMAND_VALUES:
        opts, positionals, _ = _read(rest, COMMAND_VALUES[command], stop_at_positional=False)
    else:
        opts, positionals = {}, list(rest)
    return Invocation(list(argv), global_opts, list(argv[:i]), command, opts, positionals)
