"""torpor-hook given what no runtime should give it: it exits 0 (a hook must never stop a
container) with one line on stderr (the runtime shows it), the traceback of a bug in hooks.log
only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _hook(torpor_env, stdin: bytes | None, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **torpor_env}
    cmd = [sys.executable, "-m", "torpor_hook", *args]
    if stdin is None:   # started with descriptor 0 closed
        cmd = ["/bin/sh", "-c", 'exec "$@" <&-', "sh", *cmd]
    return subprocess.run(cmd, env=env, input=stdin, capture_output=True, timeout=60)


@pytest.mark.parametrize("stdin", [b"[]", b"5", b"null", b'"x"', b"[" * 100000 + b"]" * 100000,
                                   b'{"bundle": "/"}', b'{"id": 5}', b'{"id": ""}',
                                   b'{"id": "c", "bundle": "/etc/passwd"}',
                                   b'{"id": "c", "bundle": "/nonexistent"}', None])
@pytest.mark.parametrize("stage", ["createRuntime", "poststop", None])
def test_a_state_that_is_no_container_state_is_one_line(torpor_env, stdin, stage):
    """A JSON list, number or null was "AttributeError: 'list' object has no attribute
    'get'" with a traceback on stderr; so were a missing OCI spec (a TorporError), a
    nesting too deep (RecursionError) and a closed stdin."""
    proc = _hook(torpor_env, stdin, *([stage] if stage else []))
    assert proc.returncode == 0
    err = proc.stderr.decode()
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "the container goes on without torpor's registration" in err \
        or stage == "poststop" and "torpord is not running" in err


def test_a_bug_leaves_its_traceback_in_the_log_not_on_stderr(torpor_env, tmp_path):
    """An unexpected error: one line on stderr, the traceback where an operator reads it."""
    code = ("import sys, torpor_hook\n"
            "torpor_hook.register = lambda state, cfg: 1 / 0\n"
            "sys.exit(torpor_hook.main(['createRuntime']))\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **torpor_env},
                          input=b'{"id": "c1", "bundle": "/"}', capture_output=True, timeout=60)
    assert proc.returncode == 0
    err = proc.stderr.decode()
    assert "Traceback" not in err and err.count("\n") == 1 and "division by zero" in err, err
    log = (tmp_path / "state" / "hooks.log").read_text()
    assert "Traceback" in log and "ZeroDivisionError" in log
