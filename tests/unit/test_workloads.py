"""workloads.py: JAX (XLA) programs are told apart, and never checkpointed into images the
driver cannot restore."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from torpor import workloads
from torpor.errors import ExitCode, PreflightError

MAPPER = """
import mmap, sys, time
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("mapped", flush=True)
time.sleep(60)
"""


@pytest.fixture
def mapping(tmp_path: Path):
    """A process with `name` mapped, as a loaded shared library is."""
    procs = []

    def start(name: str) -> int:
        lib = tmp_path / name
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_bytes(b"\0" * 4096)
        p = subprocess.Popen([sys.executable, "-c", MAPPER, str(lib)], stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "mapped"
        return p.pid
    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_process_with_jaxlib_mapped_runs_xla(mapping):
    assert workloads.runs_xla(mapping("site-packages/jaxlib/xla_extension.so"))
    assert workloads.runs_xla(mapping("jax_plugins/xla_cuda13/xla_cuda_plugin.so"))


def test_other_programs_do_not(mapping):
    assert not workloads.runs_xla(mapping("site-packages/torch/lib/libtorch_cuda.so"))
    assert not workloads.runs_xla(999_999_999)   # no such process


def test_a_checkpoint_that_would_end_a_jax_program_without_agent_is_refused(mapping):
    pid = mapping("jaxlib/xla_extension.so")
    with pytest.raises(PreflightError) as e:
        workloads.refuse_unrestorable([pid], [], leave_running=False, warn=print)
    assert e.value.exit_code == ExitCode.PREFLIGHT
    assert "torpor run" in e.value.line() and str(pid) in e.value.line()


def test_under_the_agent_or_left_running_it_goes_ahead(mapping):
    pid = mapping("jaxlib/xla_extension.so")
    workloads.refuse_unrestorable([pid], [pid], leave_running=False, warn=print)   # agent
    said: list[str] = []
    workloads.refuse_unrestorable([pid], [], leave_running=True, warn=said.append)
    assert said and "will not restore" in said[0]


def test_driver_path_note_tells_how_to_get_the_agent():
    """A checkpoint's or suspend's progress line for programs not under the agent: bare ones
    are told `torpor run`, containers the annotation; none when every one has its agent."""
    bare = workloads.driver_path_note([10, 11], [11], container=False)
    assert bare.startswith("driver path for PID 10 ") and "`torpor run -- CMD`" in bare
    both = workloads.driver_path_note([10, 11], [], container=False)
    assert "PIDs 10, 11" in both
    box = workloads.driver_path_note([10], [], container=True)
    assert "org.torpor.agent" in box and "torpor run" not in box
    assert workloads.driver_path_note([10, 11], [10, 11], container=False) == ""
