"""What the CLI makes of what it is given (a red-team pass found each): one line and the
documented exit code, decided before anything is locked, dumped or restored."""

from __future__ import annotations

import errno
import json
import os

import pytest

from torpor.cli import main as cli
from tests.unit.test_cli_new_user import _main_in_process  # noqa: F401  (autouse)
from tests.unit.test_manifest import _sealed


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torpor: error: "), err
    assert "internal error" not in err and "Traceback" not in err
    return err


def test_verify_and_restore_agree_on_a_checkpoint_others_can_change(torpor_env, tmp_path,
                                                                    capsys):
    """`inspect --verify` said 0 for a directory made world-writable, which restore refuses."""
    d = _sealed(tmp_path)
    assert cli.main(["inspect", str(d), "--verify"]) == 0
    capsys.readouterr()
    os.chmod(d, 0o777)
    assert cli.main(["inspect", str(d), "--verify"]) == 2
    assert "only root can change" in _one_line(capsys)
    assert cli.main(["restore", "-D", str(d)]) == 2
    assert "only root can change" in _one_line(capsys)
    assert cli.main(["inspect", str(d)]) == 0     # what it holds may still be read
    capsys.readouterr()
    os.chmod(d, 0o700)
    (d / "torpor-store.json").write_text("{}")   # packed: its records as strictly as restore
    os.chmod(d / "torpor-store.json", 0o666)
    assert cli.main(["inspect", str(d), "--verify"]) == 9
    assert "torpor-store.json is owned by uid" in _one_line(capsys)


def test_rm_of_a_name_given_twice_removes_it_once(torpor_env, tmp_path, monkeypatch, capsys):
    from torpor.store import Store
    monkeypatch.setenv("TORPOR_STORE_DIR", str(tmp_path / "store"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    Store(tmp_path / "store").ingest_dir(src, "a")
    assert cli.main(["--json", "rm", "a", "a"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out) == {"removed": ["a"]}
    assert cli.main(["rm", "a"]) == 3
    assert "no snapshot a" in _one_line(capsys)


LONG = "/tmp/" + "a" * 300


@pytest.mark.parametrize("args", [["restore", "-D", LONG], ["checkpoint", "1", "-D", LONG],
                                  ["inspect", LONG, "--verify"], ["--config", LONG, "ps"],
                                  ["image", "build", "/tmp", "-o", LONG + "/x"],
                                  ["restore", "-D", "/tmp/" + "b/" * 2100]])
def test_a_path_too_long_is_a_usage_error_before_anything_runs(torpor_env, capsys, args):
    """A 300-character -D name was "internal error: OSError: [Errno 36] File name too long",
    exit 1."""
    assert cli.main(args) == 2
    assert "more than the" in _one_line(capsys)


def test_a_name_too_long_met_anywhere_is_a_usage_error_not_a_bug(torpor_env, capsys,
                                                                  monkeypatch):
    from torpor.cli import inspect

    def deep(path):
        raise OSError(errno.ENAMETOOLONG, "File name too long", f"{path}/{'c' * 300}")
    monkeypatch.setattr(inspect, "read_any", deep)
    assert cli.main(["inspect", "/tmp/x"]) == 2
    assert "File name too long: /tmp/x/ccc" in _one_line(capsys)


def test_a_config_that_is_a_device_is_one_line_not_a_hang(torpor_env, capsys):
    import signal
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("hung")))
    signal.alarm(10)
    try:
        assert cli.main(["--config", "/dev/zero", "ps"]) == 2
    finally:
        signal.alarm(0)
    assert "config /dev/zero is not a regular file" in _one_line(capsys)


@pytest.fixture
def sleeper():
    """A program to name as the one to checkpoint (never this test's own process)."""
    import subprocess
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("args", [["checkpoint", "PID", "-D", ""], ["restore", "-D", ""],
                                  ["inspect", ""], ["--config", "", "ps"]])
def test_an_empty_path_is_refused_not_taken_as_the_current_directory(torpor_env, capsys, args,
                                                                     sleeper, monkeypatch):
    from torpor.cli import checkpoint
    monkeypatch.setattr(checkpoint, "checkpoint", lambda *a, **kw: pytest.fail("it ran"))
    assert cli.main([str(sleeper) if a == "PID" else a for a in args]) == 2
    assert "an empty path" in _one_line(capsys)


@pytest.mark.parametrize("name", ["", "taken"])
def test_a_store_name_is_checked_before_the_program_is_touched(torpor_env, tmp_path, sleeper,
                                                                monkeypatch, capsys, name):
    """`--store ""` checkpointed into no store at all; `--store TAKEN` checkpointed (the
    program ended) and then failed: both are refused first, as `torpor rm ""` is."""
    from torpor.cli import checkpoint
    from torpor.flows import checkpoint as flow
    from torpor.store import Store
    monkeypatch.setenv("TORPOR_STORE_DIR", str(tmp_path / "store"))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    Store(tmp_path / "store").ingest_dir(tmp_path / "src", "taken")
    touched = []
    for module in (checkpoint, flow):   # nothing is checkpointed here, whatever happens
        monkeypatch.setattr(module, "checkpoint", lambda *a, **kw: touched.append(a))
    monkeypatch.setattr(flow.procs, "owner_uid", lambda pid: touched.append(pid))
    says = "snapshot taken exists already"
    if name == "":
        assert cli.main(["rm", ""]) == 2
        says = _one_line(capsys)      # the same rule, in the same words
    assert cli.main(["checkpoint", str(sleeper), "-D", str(tmp_path / "ck"), "--store", name]) == 2
    assert says in _one_line(capsys)
    assert touched == [] and not (tmp_path / "ck").exists()


def test_a_relative_path_from_a_removed_directory_is_one_line(torpor_env, tmp_path, capsys,
                                                             monkeypatch):
    """Path arguments are made absolute as they are parsed: with the current directory
    removed, getcwd() fails, and that must be a usage error, not a traceback."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert cli.main(["inspect", "ck"]) == 2
    assert "the current directory no longer exists" in _one_line(capsys)


def _run_with_stdout(torpor_env, how: str, *args: str):
    """torpor ARGS as a separate process whose stdout is closed (`>&-`) or a pipe nobody
    reads any more (`| head -c0`)."""
    import subprocess
    import sys
    env = {**os.environ, **torpor_env, "TORPOR_STORE_DIR": torpor_env["TORPOR_STATE_DIR"] + "s"}
    cmd = [sys.executable, "-m", "torpor.cli.main", *args]
    if how == "closed":
        return subprocess.run(["/bin/sh", "-c", 'exec "$@" >&-', "sh", *cmd], env=env,
                              stderr=subprocess.PIPE, text=True, timeout=60)
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(cmd, env=env, stdout=w, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    finally:
        os.close(w)


@pytest.mark.parametrize("how,args", [
    ("closed", ["ls"]), ("closed", ["--json", "ls"]), ("closed", ["ps"]),
    ("broken", ["gc"]), ("broken", ["--json", "gc"]), ("broken", ["rm", "nothing-here"])])
def test_a_stdout_that_takes_no_result_is_one_line_exit_1_not_an_internal_error(torpor_env,
                                                                                 how, args):
    """`torpor ls >&-` and `torpor ls | head -c0` were "internal error: AttributeError" and
    "internal error: BrokenPipeError" (and for a checkpoint, exit 1 read as one that did
    not happen): one line that says the command is done. A command that changes something
    says so for a broken pipe too."""
    proc = _run_with_stdout(torpor_env, how, *args)
    if args[-1] == "nothing-here" and proc.returncode == 3:   # rm refused before any output
        return
    assert proc.returncode == 1, proc
    assert proc.stderr.startswith("torpor: error: the command is done but its result could "
                                  "not be written to stdout: ") and proc.stderr.count("\n") == 1, \
        proc.stderr


@pytest.mark.parametrize("args", [["ls"], ["--json", "ls"], ["ps"], ["--json", "ps"]])
def test_a_reader_that_leaves_a_command_that_changes_nothing_ends_it_silently(torpor_env, args):
    """`torpor ps | head -1`: the reader left; ps, ls, inspect and doctor end there with no
    message, exit 141 (128 + SIGPIPE), as coreutils do; the log says why."""
    proc = _run_with_stdout(torpor_env, "broken", *args)
    assert proc.returncode == 141 and proc.stderr == "", proc
    with open(os.path.join(torpor_env["TORPOR_STATE_DIR"], "torpor.log")) as f:
        assert "the reader of stdout left" in f.read()


def test_a_closed_stdout_does_not_become_the_log(torpor_env):
    """With descriptor 1 closed, the first file torpor opens (its log) is descriptor 1:
    what is written to stdout, or done to it, must not reach the log."""
    _run_with_stdout(torpor_env, "closed", "ls")
    with open(os.path.join(torpor_env["TORPOR_STATE_DIR"], "torpor.log")) as f:
        log = f.read()
    assert "NAME" not in log and "could not be written to stdout: stdout is closed" in log


def test_a_path_through_a_file_is_a_usage_error_not_a_bug(torpor_env, tmp_path, capsys):
    """`restore -D FILE/sub`, `image push FIFO ...`, `run --agent-dir /dev/null` were
    "internal error: NotADirectoryError", exit 1."""
    (tmp_path / "afile").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    for args in (["restore", "-D", str(tmp_path / "afile" / "sub")],
                 ["image", "push", str(tmp_path / "fifo"), "localhost:1/r:t"],
                 ["run", "--agent-dir", "/dev/null", "--", "true"]):
        assert cli.main(args) == 2, args
        assert "Not a directory: " in _one_line(capsys)


def test_a_full_file_system_met_anywhere_is_one_line_exit_1(torpor_env, capsys, monkeypatch):
    from torpor.cli import inspect

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(inspect, "read_any", full)
    assert cli.main(["inspect", "/tmp/x"]) == 1
    assert "No space left on device: /tmp/x" in _one_line(capsys)


@pytest.mark.parametrize("text", [" {pid} ", "{pid}\n", "+{pid}", "0{pid}_0", "{arabic}",
                                  "9" * 5000])
def test_a_pid_is_decimal_ascii_digits(torpor_env, tmp_path, capsys, monkeypatch, sleeper,
                                       text):
    """int() took ' 5 ', '1_0' and Arabic-Indic digits: each named some process."""
    from torpor.cli import checkpoint
    monkeypatch.setattr(checkpoint, "checkpoint", lambda *a, **kw: pytest.fail("it ran"))
    arabic = "".join(chr(0x660 + int(d)) for d in str(sleeper))
    word = text.format(pid=sleeper, arabic=arabic)
    for args in (["checkpoint", word, "-D", str(tmp_path / "ck")], ["suspend", word],
                 ["resume", word]):
        assert cli.main(args) == 2
        assert "not a PID: '" in _one_line(capsys)


def _a_kernel_thread() -> int | None:
    from torpor import procs
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) > 1 and procs._kernel_thread(int(name)):
            return int(name)
    return None


@pytest.mark.parametrize("who", ["kernel thread", "torpor itself", "torpor's parent"])
def test_a_kernel_thread_or_torpors_own_tree_is_refused_before_criu_runs(torpor_env, tmp_path,
                                                                        capsys, monkeypatch,
                                                                        who):
    """`torpor checkpoint 2` walked kthreadd's 'tree' (every kernel thread) and ran CRIU on it;
    `torpor checkpoint $$` from a shell put torpor (and CRIU) in the tree it dumps: both
    failed only at CRIU's dump, exit 8."""
    from torpor.cli import checkpoint
    monkeypatch.setattr(checkpoint, "checkpoint", lambda *a, **kw: pytest.fail("it ran"))
    pid = {"kernel thread": _a_kernel_thread(), "torpor itself": os.getpid(),
           "torpor's parent": os.getppid()}[who]
    if pid is None or pid <= 1:
        pytest.skip("no such process visible here")
    assert cli.main(["checkpoint", str(pid), "-D", str(tmp_path / "ck")]) == 2
    assert ("a kernel thread" if who == "kernel thread" else "holds this torpor") \
        in _one_line(capsys)
    assert not (tmp_path / "ck").exists()


def test_run_gives_the_agent_an_absolute_socket_directory(torpor_env, tmp_path, monkeypatch):
    """TORPOR_AGENT_DIR=rel was handed on as it was: the agent binds its socket from the
    program's current directory at its first driver call, wherever the program went by then."""
    from torpor.cli import run
    seen = {}
    monkeypatch.setattr(run.os, "execve", lambda exe, argv, env: seen.update(env))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORPOR_AGENT_DIR", "rel")
    cli.main(["run", "--", "true"])
    assert seen["TORPOR_AGENT_DIR"] == str(tmp_path / "rel")


def test_image_build_of_a_missing_checkpoint_is_not_found_as_for_restore(torpor_env, tmp_path,
                                                                         capsys):
    """restore and inspect said exit 3 of a missing checkpoint, image build exit 2."""
    for args in (["restore", "-D", str(tmp_path / "none")], ["inspect", str(tmp_path / "none")],
                 ["image", "build", str(tmp_path / "none"), "-o", str(tmp_path / "out")]):
        assert cli.main(args) == 3, args
        _one_line(capsys)


def test_a_full_file_system_without_a_path_is_said_once(torpor_env, capsys, monkeypatch):
    """'No space left on device: [Errno 28] No space left on device' (image build -o FULL)."""
    from torpor.cli import inspect
    monkeypatch.setattr(inspect, "read_any", lambda path: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    assert cli.main(["inspect", "/tmp/x"]) == 1
    assert _one_line(capsys) == "torpor: error: No space left on device\n"


def test_a_demo_larger_than_the_hosts_memory_is_refused_first(torpor_env, capsys):
    """--mib 2**70 started the demo program, which died: exit 1, "exited while waiting"."""
    assert cli.main(["demo", "--cpu", "--mib", str(2**70)]) == 2
    assert "MiB of memory this host has available" in _one_line(capsys)
