"""A failed CRIU dump, one rule for CPU and GPU trees (issue 18, item 10): exit 8, the program
runs as before, and the same -D DIR is taken again by the retry (only the failed dump's
dump.log was left in it)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import alive, needs_criu

pytestmark = needs_criu

CPU_PROGRAM = "import time\nheap = bytearray(8 << 20)\nwhile True:\n    time.sleep(0.05)\n"


@pytest.fixture
def small(tmp_path: Path):
    """A 1 MiB tmpfs: too small for any dump."""
    d = tmp_path / "small"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(d)],
                   check=True)
    yield d
    subprocess.run(["umount", "-l", str(d)])


@pytest.fixture
def cpu_program():
    proc = subprocess.Popen([sys.executable, "-c", CPU_PROGRAM], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
    time.sleep(0.5)
    yield proc
    proc.kill()
    proc.wait()


def _fails_then_retries(torpor, pid: int, small: Path, expect: str) -> None:
    ck = small / "ck"
    proc = torpor.run("checkpoint", str(pid), "-D", str(ck))
    assert proc.returncode == 8, proc.stderr
    assert "dump failed" in proc.stderr and expect in proc.stderr, proc.stderr
    assert "0 process" not in proc.stderr
    assert alive(pid)
    assert [p.name for p in ck.iterdir()] == ["dump.log"]    # CRIU's word on why, kept
    subprocess.run(["mount", "-o", "remount,size=512m", str(small)], check=True)
    proc = torpor.run("checkpoint", str(pid), "-D", str(ck), "--leave-running")
    assert proc.returncode == 0, proc.stderr
    assert (ck / "torpor.json").is_file() and alive(pid)


def test_a_cpu_programs_failed_dump_is_exit_8_and_the_directory_is_taken_again(
        torpor, small, cpu_program):
    _fails_then_retries(torpor, cpu_program.pid, small,
                        "the program was left running (no GPU state to roll back)")


def test_a_gpu_programs_failed_dump_is_exit_8_and_the_directory_is_taken_again(
        torpor, gpu, small):
    with gpu.spawn() as prog:
        _fails_then_retries(torpor, prog.pid, small, "1 process(es) rolled back to running")
