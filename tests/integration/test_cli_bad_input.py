"""What an adversarial sweep of the command lines found (tests/adhoc_clifuzz), with real CRIU and
a fake GPU: each case is one line on stderr, a documented exit code, and the program runs on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.fakes.fakegpu import RUNNING
from tests.integration.conftest import needs_criu

pytestmark = needs_criu


def _torpor(torpor, *args: str, cwd=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torpor.cli.main", *args], env=torpor.env,
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          stdin=subprocess.DEVNULL, **kw)


def test_a_relative_images_dir_is_checkpointed_into(torpor, gpu, tmp_path):
    """`torpor checkpoint PID -D ck` failed every dump (exit 8): CRIU found its log file
    relative to another directory than its images."""
    with gpu.spawn() as prog:
        proc = _torpor(torpor, "--json", "checkpoint", str(prog.pid), "-D", "ck",
                       "--leave-running", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["images_dir"] == str(tmp_path / "ck")
        assert (tmp_path / "ck" / "torpor.json").is_file()
        assert gpu.state(prog.pid)["state"] == RUNNING
        prog.wait_tick(prog.tick() + 2)


def test_a_stderr_nobody_reads_ends_the_progress_not_the_checkpoint(torpor, gpu, tmp_path):
    """`torpor checkpoint ... 2>&1 | head -c1`: the first progress line raised
    BrokenPipeError and the checkpoint failed (exit 1); one between the dump and the seal
    would have failed a checkpoint that had ended its program."""
    r, w = os.pipe()
    os.close(r)
    with gpu.spawn() as prog:
        try:
            proc = subprocess.run([sys.executable, "-m", "torpor.cli.main", "--json", "checkpoint",
                                   str(prog.pid), "-D", str(tmp_path / "ck"), "--leave-running"],
                                  env=torpor.env, stdout=subprocess.PIPE, stderr=w,
                                  stdin=subprocess.DEVNULL, timeout=120)
        finally:
            os.close(w)
        assert proc.returncode == 0
        assert json.loads(proc.stdout)["manifest"]["processes"][0]["cuda"]
        assert gpu.state(prog.pid)["state"] == RUNNING
        prog.wait_tick(prog.tick() + 2)


def test_a_checkpoint_into_a_full_file_system_is_refused_before_the_program_is_touched(
        torpor, gpu, tmp_path):
    """No room even for the draft manifest: "internal error: OSError: No space left on
    device", exit 1; now exit 8 (the program runs as before) and an empty directory."""
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(full)], check=True)
    try:
        fd = os.open(full / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        with gpu.spawn() as prog:
            proc = _torpor(torpor, "checkpoint", str(prog.pid), "-D", str(full / "ck"))
            assert proc.returncode == 8, proc.stderr
            assert proc.stderr.splitlines()[-1] == (
                f"torpor: error: cannot write into {full / 'ck'}: No space left on device; "
                "nothing was done to the program")
            assert list((full / "ck").iterdir()) == []
            assert gpu.state(prog.pid)["state"] == RUNNING
            prog.wait_tick(prog.tick() + 2)
            assert [c.call for c in gpu.calls() if c.call != "get_state"] == []
    finally:
        subprocess.run(["umount", "-l", str(full)])


def test_a_program_killed_during_the_lock_is_not_reported_rolled_back(torpor, gpu, tmp_path):
    """Someone kills the program while torpor waits in the driver's lock: that was "lock
    failed: ...; 1 process(es) rolled back to running", exit 8 (the program runs as before),
    of a program that was gone."""
    import threading
    import time
    with gpu.spawn() as prog:
        # torpor's start takes about 0.5 s on a loaded 2-core machine: the kill at 2 s comes
        # well after it and well before the lock's end
        gpu.delay("lock", 6000, prog.pid)
        threading.Timer(2.0, prog.kill).start()
        t0 = time.monotonic()
        proc = _torpor(torpor, "checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"))
        assert time.monotonic() - t0 > 2.0      # the kill came during the lock
        assert proc.returncode == 3, proc.stderr
        last = proc.stderr.splitlines()[-1]
        assert last.startswith("torpor: error: lock failed: ") and last.endswith(
            f"; 0 process(es) rolled back to running; PID(s) {prog.pid} ended during it")
