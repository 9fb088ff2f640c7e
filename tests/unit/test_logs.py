"""logs.setup: the one logging set-up of torpor, torpord, torpor-runtime and torpor-hook."""

from __future__ import annotations

import logging

import pytest

from torpor import logs


@pytest.fixture
def root():
    r = logging.getLogger()
    saved = r.handlers[:], r.level
    r.handlers = []
    yield r
    for h in r.handlers:
        h.close()
    r.handlers, r.level = saved


def ours(root: logging.Logger) -> list[logging.Handler]:
    """The handlers logs.setup added (not pytest's capture)."""
    return [h for h in root.handlers if type(h).__module__ == "logging"]


def test_file_private_and_formatted(root, tmp_path):
    state = tmp_path / "state"
    logs.setup(state, "x.log", fmt="%(levelname)s|%(message)s", file_level=logging.INFO,
               level=logging.DEBUG)
    logging.getLogger("torpor.t").debug("hidden")
    logging.getLogger("torpor.t").warning("seen")
    for h in root.handlers:
        h.flush()
    assert (state / "x.log").read_text() == "WARNING|seen\n"
    assert state.stat().st_mode & 0o777 == 0o700 and root.level == logging.DEBUG


def test_stderr_only_and_unopenable_file(root, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    logs.setup(tmp_path / "f" / "state", "x.log", stderr=True)   # no file: left out
    assert [type(h) for h in ours(root)] == [logging.StreamHandler]
    with pytest.raises(OSError):
        logs.setup(tmp_path / "f" / "state", "x.log", must=True)
    for h in ours(root):
        root.removeHandler(h)
    logs.setup(tmp_path, None, stderr=True, stderr_formatted=True, fmt="F %(message)s")
    logging.getLogger("torpor.t").error("boom")
    assert capsys.readouterr().err.endswith("F boom\n")


def test_refused_state_dir_is_left_out(root, tmp_path):
    """A state_dir private_dir refuses (others could change it) is a log file that cannot be
    opened: left out, not a traceback, unless must."""
    from torpor.errors import UsageError
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    logs.setup(shared / "state", "x.log", stderr=True)
    assert [type(h) for h in ours(root)] == [logging.StreamHandler]
    with pytest.raises(UsageError, match="can be changed by"):
        logs.setup(shared / "state", "x.log", must=True)


def test_hook_with_a_refused_state_dir_lets_the_container_start(tmp_path):
    """torpor-hook's createRuntime failing fails the container's create: with a state_dir it
    may not log into, it still exits 0 (it used to end in a traceback, exit 1)."""
    import json
    import os
    import subprocess
    import sys
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"process": {"env": ["PATH=/bin"]}}))
    env = {**os.environ, "TORPOR_STATE_DIR": str(shared / "state"),
           "TORPOR_RUN_DIR": str(tmp_path / "run"), "TORPOR_CONFIG": str(tmp_path / "none")}
    state = {"ociVersion": "1.0.2", "id": "c1", "pid": os.getpid(), "status": "creating",
             "bundle": str(bundle)}
    out = subprocess.run([sys.executable, "-m", "torpor_hook", "createRuntime"],
                         input=json.dumps(state), env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not (shared / "state").exists()


def test_a_message_with_bytes_that_are_no_utf8_is_logged_not_a_logging_error(root, tmp_path,
                                                                           capsys):
    """A path or argv word with bytes that are no UTF-8 (os.fsdecode gives surrogates) made
    the log file's handler print '--- Logging error ---' and a traceback on stderr."""
    import os
    logs.setup(tmp_path / "state", "x.log")
    odd = os.fsdecode(b"/tmp/\xff\xfe")
    logging.getLogger("torpor.t").warning("torpor checkpoint 1 -D %s", odd)
    for h in root.handlers:
        h.flush()
    assert "Logging error" not in capsys.readouterr().err
    assert "-D /tmp/\\udcff\\udcfe" in (tmp_path / "state" / "x.log").read_text()


@pytest.mark.parametrize("before", [None, 0o644])
def test_the_log_file_is_0600_whatever_the_umask(root, tmp_path, before):
    """torpor-hook keeps its runtime's umask (022): its hooks.log was created 0644."""
    import os
    state = tmp_path / "state"
    if before is not None:
        state.mkdir(mode=0o700)
        (state / "x.log").write_text("old\n")
        os.chmod(state / "x.log", before)
    umask = os.umask(0o022)
    try:
        logs.setup(state, "x.log")
    finally:
        os.umask(umask)
    assert (state / "x.log").stat().st_mode & 0o777 == 0o600


def test_progress_on_a_stream_that_takes_no_more_lines_stops_quietly():
    """A say() that raised BrokenPipeError failed the operation it reported on."""
    import os
    from torpor.progress import Progress
    r, w = os.pipe()
    os.close(r)
    stream = os.fdopen(w, "w")
    p = Progress(stream, tick_s=0.01)
    with p.phase("dump", "x"):
        pass
    p.say("after")
    assert p.stream is None and "dump" in p.timings
    os.close(w)   # what the failed flush left in stream's buffer goes nowhere
