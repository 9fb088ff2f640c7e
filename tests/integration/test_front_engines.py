"""Real podman through torpor-runtime's native front (this venv's, not /usr/local/bin's): a
CPU container runs and goes with every call exec'd straight to runc; a container naming a GPU
goes through the Python side, which marks it at create and forgets it at delete.

The front is behind a wrapper that only adds TORPOR_DEBUG=1 (its routing line on stderr, kept
in a file) and a private TORPOR_RUN_DIR and TORPOR_STATE_DIR (podman passes the runtime none
of ours)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from integration.containers import Containerd, Podman
from tests.integration.conftest import needs_criu

FRONT = Path(sys.prefix) / "bin" / "torpor-runtime"
pytestmark = [needs_criu, pytest.mark.criu]


def wrapper(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(the wrapped front, its run_dir, its routing log)"""
    if not FRONT.exists() or FRONT.read_bytes()[:4] != b"\x7fELF":
        pytest.skip(f"{FRONT} is not the native front (./test.sh installs it)")
    run_dir, log = tmp_path / "run", tmp_path / "front.log"
    path = tmp_path / "torpor-runtime-wrapped"
    path.write_text(f"#!/bin/sh\nexport TORPOR_DEBUG=1 TORPOR_RUN_DIR='{run_dir}' "
                    f"TORPOR_STATE_DIR='{tmp_path}/state'\n"
                    f"exec '{FRONT}' \"$@\" 2>>'{log}'\n")
    path.chmod(0o755)
    return path, run_dir, log


@pytest.fixture
def wrapped(tmp_path: Path, podman_image: str) -> tuple[Podman, Path, Path]:
    if shutil.which("podman") is None:
        pytest.skip("needs podman (./install.sh)")
    path, run_dir, log = wrapper(tmp_path)
    return Podman(str(path)), run_dir, log


def routes(log: Path) -> list[tuple[str, str]]:
    """(command, where) for each call the front routed."""
    text = log.read_text() if log.exists() else ""
    return re.findall(r"torpor-runtime\(front\): (\S+) \S+: (runc|python)", text)


def run_rm(podman: Podman, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*podman.base, "run", "--rm", *Podman.RUN_ARGS, *extra,
                           "--mount", "type=bind,src=/usr,dst=/usr,ro=true", podman.ensure_image(),
                           "/usr/bin/sh", "-c", "echo hello from $0"],
                          capture_output=True, text=True, timeout=120)


def test_podman_run_rm_of_a_cpu_container_goes_straight_to_runc(wrapped):
    podman, run_dir, log = wrapped
    out = run_rm(podman)
    assert out.returncode == 0, out.stderr
    assert "hello from" in out.stdout
    r = routes(log)
    assert [c for c, _ in r][:2] == ["create", "start"] and ("delete", "runc") in r, r
    assert {where for _, where in r} == {"runc"}, r
    assert not (run_dir / "containers").exists() or not os.listdir(run_dir / "containers")


def test_podman_gpu_container_goes_through_python_and_its_marker_goes_with_it(wrapped,
                                                                              tmp_path):
    podman, run_dir, log = wrapped
    # a device node named like a GPU (/dev/null behind it): torpor.oci.detect says GPU 0;
    # no hooks (no torpord here), so only the marker tells later calls apart
    out = run_rm(podman, "--device", "/dev/null:/dev/nvidia0",
                 "--annotation", "org.torpor.hooks=off")
    assert out.returncode == 0, out.stderr
    r = routes(log)
    assert ("create", "python") in r and ("delete", "python") in r, r
    assert ("start", "python") in r, r      # the marker, between create and delete
    assert os.listdir(run_dir / "containers") == []   # delete removed it


def test_podman_container_python_declines_stays_with_runc_after_create(wrapped):
    podman, run_dir, log = wrapped
    out = run_rm(podman, "--env", "NVIDIA_VISIBLE_DEVICES=void")   # mentions, names no GPU
    assert out.returncode == 0, out.stderr
    r = routes(log)
    assert r[0] == ("create", "python"), r
    assert all(where == "runc" for c, where in r[1:]), r


def test_ctr_run_rm_of_a_cpu_container_goes_straight_to_runc(tmp_path):
    if shutil.which("containerd") is None or shutil.which("ctr") is None:
        pytest.skip("needs containerd and ctr (./install.sh)")
    path, run_dir, log = wrapper(tmp_path)
    ctrd = Containerd(str(path))
    try:
        name = f"tf{os.getpid()}"
        out = subprocess.run([ctrd.ctr, "--address", str(ctrd.address), "--namespace",
                              ctrd.namespace, "run", "--rm", "--runtime", Containerd.RUNTIME,
                              "--runc-binary", str(path), "--mount",
                              "type=bind,src=/usr,dst=/usr,options=bind:ro",
                              ctrd.ensure_image(), name, "/usr/bin/sh", "-c", "echo hi from ctr"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "hi from ctr" in out.stdout
    finally:
        ctrd.stop()
    r = routes(log)
    # containerd's shim passes --root /run/containerd/runc/<namespace>, --log, --log-format json
    assert ("create", "runc") in r and ("start", "runc") in r and ("delete", "runc") in r, r
    assert {where for _, where in r} == {"runc"}, r
