"""torpord's command line: bad values are refused before it serves (exit 2), a socket it cannot
bind is one line (exit 1), never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _torpord(torpor_env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torpor.sidecar.daemon", "--foreground", *args],
                          env={**os.environ, **torpor_env}, capture_output=True, text=True,
                          timeout=30, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args", [["--op-timeout", "nan"], ["--op-timeout", "inf"],
                                  ["--op-timeout", "0"], ["--op-timeout", "1e400"],
                                  ["--socket", ""], ["--config", ""]])
def test_a_bad_value_is_refused_before_torpord_serves(torpor_env, args):
    """--op-timeout nan or inf was taken (an open operation, its program locked on the GPU,
    was never rolled back); --socket "" bound onto the current directory and ended in a
    traceback, exit 1."""
    proc = _torpord(torpor_env, *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(f"torpord: error: argument {args[0]}: ")


@pytest.mark.skipif(os.geteuid() != 0, reason="torpord runs as root only")
def test_a_socket_path_it_cannot_bind_is_one_line(torpor_env, tmp_path):
    (tmp_path / "adir").mkdir()
    proc = _torpord(torpor_env, "--socket", str(tmp_path / "adir"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].endswith("ERROR cannot serve: Address already in use")
