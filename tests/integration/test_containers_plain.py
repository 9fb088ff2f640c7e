"""Real podman and containerd checkpoint/restore round trips of a CPU-only container.

The OCI runtime is runc unless TORPOR_TEST_RUNTIME names another runc-compatible binary
(e.g. /usr/local/bin/torpor-runtime): the same tests then prove that it round-trips too.
The workload (integration.containers.Counter) writes "<token> <n>" every 50 ms to a host
directory; a restore must continue it (same token, n beyond the checkpoint), not restart it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from integration.containers import Containerd, Counter, Podman
from tests.integration.conftest import needs_criu

RUNTIME = os.environ.get("TORPOR_TEST_RUNTIME", "runc")

pytestmark = [needs_criu, pytest.mark.criu]


def _runtime() -> str:
    if shutil.which(RUNTIME) is None:
        if "TORPOR_TEST_RUNTIME" in os.environ:
            raise AssertionError(f"TORPOR_TEST_RUNTIME={RUNTIME}: not found")
        pytest.skip(f"needs {RUNTIME} (./install.sh)")
    return RUNTIME


def _needs(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {' '.join(missing)} (./install.sh)")


@pytest.fixture(scope="module")
def podman(podman_image) -> Podman:
    _needs("podman")
    return Podman(_runtime())


@pytest.fixture(scope="module")
def containerd():
    _needs("containerd", "ctr")
    c = Containerd(_runtime())
    c.ensure_image()
    yield c
    c.stop()


@pytest.fixture
def name(request) -> str:
    test = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name.removeprefix("test_"))
    return f"torpor-{os.getpid()}-{test}"[:60].strip("-")  # ctr: [A-Za-z0-9]+ joined by ._-


def _samples(counter: Counter, seconds: float = 0.6) -> list[tuple[str, int]]:
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        v = counter.read()
        if v:
            out.append(v)
        time.sleep(0.02)
    return out


def _assert_continues(counter: Counter, token: str, floor: int) -> None:
    """The restored workload is the checkpointed process: same token, n > floor, counting."""
    counter.wait_beyond(floor, token=token, timeout=10)
    seen = _samples(counter)
    assert {t for t, _ in seen} == {token}, f"workload restarted: {seen}"
    ns = [n for _, n in seen]
    assert ns == sorted(ns) and ns[0] > floor, f"counter went backwards: floor {floor}, {ns}"
    assert ns[-1] > ns[0], f"counter stopped: {ns}"


def _forget(counter: Counter) -> None:
    """Drop values the original wrote past the checkpoint: a restore replays from it."""
    (counter.host_dir / "counter").unlink()


def _assert_stopped(counter: Counter) -> int:
    v = counter.read()
    time.sleep(0.3)
    assert counter.read() == v, "checkpointed workload still running"
    return v[1]


def test_podman_export_import(podman: Podman, name: str, tmp_path: Path):
    counter = Counter(tmp_path / "data")
    try:
        podman.run(name, counter.cmd, mounts=[counter.mount])
        token, before = counter.wait_beyond(5)
        podman.checkpoint(name, export=tmp_path / "ckpt.tar")
        assert podman.state(name) == "exited"
        at_checkpoint = _assert_stopped(counter)
        assert at_checkpoint >= before
        podman.rm(name)  # restore --import makes the container anew
        podman.restore(import_=tmp_path / "ckpt.tar")
        assert podman.state(name) == "running"
        _assert_continues(counter, token, at_checkpoint - 1)
    finally:
        podman.rm(name)


def test_podman_local_checkpoint(podman: Podman, name: str, tmp_path: Path):
    counter = Counter(tmp_path / "data")
    try:
        podman.run(name, counter.cmd, mounts=[counter.mount])
        token, _ = counter.wait_beyond(5)
        podman.checkpoint(name)
        at_checkpoint = _assert_stopped(counter)
        podman.restore(name)
        assert podman.state(name) == "running"
        _assert_continues(counter, token, at_checkpoint - 1)
    finally:
        podman.rm(name)


def test_podman_leave_running(podman: Podman, name: str, tmp_path: Path):
    counter = Counter(tmp_path / "data")
    try:
        podman.run(name, counter.cmd, mounts=[counter.mount])
        token, before = counter.wait_beyond(5)
        podman.checkpoint(name, export=tmp_path / "ckpt.tar", leave_running=True,
                          compress="zstd")
        assert podman.state(name) == "running"
        _assert_continues(counter, token, before)  # the original carries on
        podman.rm(name)
        _forget(counter)
        podman.restore(import_=tmp_path / "ckpt.tar")
        _assert_continues(counter, token, before)  # and so does its restored copy
    finally:
        podman.rm(name)


@pytest.mark.parametrize("leave_running", [False, True], ids=["stop", "leave-running"])
def test_containerd_checkpoint_restore(containerd: Containerd, name: str, tmp_path: Path,
                                       leave_running: bool):
    counter = Counter(tmp_path / "data")
    ref = f"localhost/torpor-checkpoint/{name}:1"
    try:
        containerd.run(name, counter.cmd, mounts=[counter.mount])
        assert containerd.state(name) == "running"
        token, before = counter.wait_beyond(5)
        containerd.checkpoint(name, ref, leave_running=leave_running)
        if leave_running:
            assert containerd.state(name) == "running"
            _assert_continues(counter, token, before)
            containerd.rm(name)
        else:
            assert containerd.state(name) == "absent"
            _assert_stopped(counter)
        # ctr resumes the task after its dump (and leave_running=False kills it only then):
        # the restore replays values written after the checkpoint; the floor is the value
        # read before it.
        _forget(counter)
        containerd.restore(ref, name)
        assert containerd.state(name) == "running"
        _assert_continues(counter, token, before)
    finally:
        containerd.rm(name)
        containerd.rm_image(ref)
