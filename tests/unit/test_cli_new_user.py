"""What a new user meets first (issue 18, item 10): one clear line and a documented exit code
where a traceback or an "internal error" was, --json anywhere, help for every command."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from torpor import config, doctor, gpus
from torpor.cli import main as cli
from torpor.errors import NoDriverError, UsageError

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setuid children)")


@pytest.fixture(autouse=True)
def _main_in_process():
    """cli.main() sets the umask, SIGTERM/SIGHUP handlers and log handlers: put them back."""
    umask = os.umask(0o022)
    os.umask(umask)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    root = logging.getLogger()
    before = list(root.handlers), root.level
    yield
    os.umask(umask)
    for s, h in handlers.items():
        signal.signal(s, h)
    for h in root.handlers[:]:
        if h not in before[0]:
            root.removeHandler(h)
            h.close()
    root.setLevel(before[1])


def _as_nobody(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    def drop() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    return subprocess.run([sys.executable, *args], env=env, cwd="/", capture_output=True,
                          text=True, timeout=60, preexec_fn=drop, stdin=subprocess.DEVNULL)


@pytest.fixture
def root_only_state(tmp_path: Path, torpor_env: dict[str, str]) -> dict[str, str]:
    """A state dir only root may write, reachable by others (as /var/lib/torpor is)."""
    os.chmod(tmp_path, 0o755)
    for parent in tmp_path.parents:
        if parent != Path("/") and parent.stat().st_mode & 0o001 == 0:
            os.chmod(parent, parent.stat().st_mode | 0o001)   # pytest's 0700 base: let others pass
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return {**os.environ, **torpor_env, "TORPOR_STATE_DIR": str(state)}


@needs_root
@pytest.mark.parametrize("command", [["ps"], ["ls"], ["gc"], ["checkpoint", "1", "-D", "/tmp/x"],
                                     ["resume", "1"]])
def test_a_non_root_user_is_told_what_is_needed(root_only_state, command):
    proc = _as_nobody(["-m", "torpor.cli.main", *command], root_only_state)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error" not in proc.stderr, proc.stderr
    assert f"torpor {command[0]} needs root: Permission denied" in lines[0]
    assert root_only_state["TORPOR_STATE_DIR"] in lines[0]      # where it was refused


@needs_root
def test_torpord_as_non_root_prints_one_line(root_only_state, tmp_path):
    proc = _as_nobody(["-m", "torpor.sidecar.daemon", "--foreground",
                       "--socket", str(tmp_path / "s.sock")], root_only_state)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "torpord: torpord must run as root (sudo torpord, or the torpord service)"]


def test_json_is_taken_before_or_after_any_subcommand():
    parser = cli.build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():  # type: ignore
        argv = {"checkpoint": ["1", "-D", "d"], "restore": ["-D", "d"], "suspend": ["1"],
                "resume": ["1"], "inspect": ["d"], "rm": ["n"], "run": [],
                "image": ["pull", "h:1/r", "-D", "d"]}.get(name, [])
        for args in ([name, "--json", *argv], ["--json", name, *argv], [name, *argv, "--json"]):
            if name == "run" and args[-1] == "--json" and args[0] == name:
                continue   # after run's COMMAND, --json is the program's
            assert parser.parse_args(args).json is True, args
        assert parser.parse_args([name, *argv]).json is False, name
    assert parser.parse_args(["run", "--", "prog", "--json"]).cmd == ["--", "prog", "--json"]


def test_every_command_has_help_without_pointers_into_the_source(capsys):
    parser = cli.build_parser()
    for name in parser._subparsers._group_actions[0].choices:  # type: ignore
        with pytest.raises(SystemExit):
            parser.parse_args([name, "--help"])
        text = capsys.readouterr().out
        description = text.split("\n\n")[1]
        assert len(description) > 40 and not description.startswith(("positional", "options")), \
            (name, text)
        assert ".py" not in text and ".md" not in text, (name, text)


def test_ps_without_a_gpu_lists_nothing_says_why_and_exits_0(torpor_env, capsys, monkeypatch):
    def no_nvml() -> None:
        raise NoDriverError("NVML unavailable: NVML Shared Library Not Found")
    monkeypatch.setattr(gpus, "discover", no_nvml)
    assert cli.main(["ps"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("(no GPU processes: ") and "NVML" in out
    assert cli.main(["ps", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["processes"] == [] and "NVML" in doc["reason"]


def test_restore_of_a_file_says_it_is_an_archive_and_what_to_do(torpor_env, tmp_path, capsys):
    tar = tmp_path / "train.tar"
    tar.write_bytes(b"\0" * 1024)
    assert cli.main(["restore", "-D", str(tar)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file (an archive?), not a checkpoint directory" in err
    assert f"podman container restore --import {tar}" in err and "tar -xf" in err


def test_a_config_named_on_the_command_line_must_exist(torpor_env, tmp_path, capsys):
    with pytest.raises(UsageError, match="config /missing.toml does not exist"):
        config.load(Path("/missing.toml"))
    assert cli.main(["--config", str(tmp_path / "none.toml"), "ps"]) == 2
    assert "does not exist" in capsys.readouterr().err
    config.load()     # $TORPOR_CONFIG (a file that is not there) or the default may be missing


def test_the_systemctl_hint_only_where_systemd_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "SYSTEMD", tmp_path / "run" / "systemd" / "system")
    assert "systemctl" not in doctor.torpord_hint() and "torpord" in doctor.torpord_hint()
    (tmp_path / "run" / "systemd" / "system").mkdir(parents=True)
    assert doctor.torpord_hint("restart").startswith("systemctl restart torpord")
