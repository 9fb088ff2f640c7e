"""torpor's CRIU plugin (packaging/criu-plugin) on a real GPU: a PyTorch program dumped and
restored by plain `criu dump` / `criu restore -d` with the plugin in CRIU's plugin directory
(--libdir) and torpord on the real driver, no torpor CLI in the loop; it continues bit-exact
against a reference run. And with torpord down, the dump is refused and the program steps on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.conftest import GPU_SKIP, gpu_uuid, wait_for
from tests.gpu.test_gpu import _bit_exact

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")]
ROOT = Path(__file__).resolve().parents[2]
CRIU = os.environ.get("TORPOR_CRIU") or "/usr/local/sbin/criu"


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torpor_env) -> dict[str, str]:
    """The plugin built into tmp_path/plugins, a helper wrapper, and CRIU's environment."""
    monkeypatch.delenv("TORPOR_LIBCUDA", raising=False)     # the real driver, for torpord too
    d = tmp_path / "plugins"
    r = subprocess.run(["make", "-s", "-C", str(ROOT / "packaging" / "criu-plugin"),
                        f"BUILD={d}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    helper = tmp_path / "torpor-criu-helper"
    helper.write_text(f'#!/bin/sh\nexec {sys.executable} -m torpor.criu_plugin "$@"\n')
    helper.chmod(0o755)
    return {**os.environ, "TORPOR_CRIU_HELPER": str(helper), "PLUGINS": str(d)}


@pytest.fixture
def torpord(plugin):
    from torpor import config
    from torpor.sidecar import client as sidecar_client
    from torpor.sidecar.client import ensure_running
    cfg = config.load()
    ensure_running(cfg)
    yield cfg
    for daemon in sidecar_client._started:
        daemon.terminate()
        daemon.wait(timeout=30)
    sidecar_client._started.clear()


def _criu(env: dict[str, str], action: str, images: Path, *args: str):
    images.mkdir(mode=0o700, exist_ok=True)
    return subprocess.run([CRIU, action, *args, "-D", str(images), "-o", f"{action}.log", "-v4",
                           "--libdir", env["PLUGINS"], "--shell-job"], env=env,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)


def _log(images: Path, action: str) -> str:
    return (images / f"{action}.log").read_text(errors="replace")[-4000:]


def test_plain_criu_with_the_plugin_continues_bit_exact(plugin, torpord, programs, tmp_path):
    from torpor.sidecar.client import Client
    ref = programs("ref", 1.0, max_steps=40)
    prog = programs("prog", 1.0)
    prog.wait_ready()
    prog.wait_step(5)
    images = tmp_path / "ck"
    r = _criu(plugin, "dump", images, "-t", str(prog.pid))
    assert r.returncode == 0, _log(images, "dump")
    prog.proc.wait(timeout=60)
    assert "locked and checkpointed by torpord" in _log(images, "dump")
    m = json.loads((images / "torpor-criu.json").read_text())
    assert [p["pid"] for p in m["processes"]] == [prog.pid]
    assert [g["uuid"] for g in m["gpus"]] == [gpu_uuid()]

    def closed() -> bool:
        with Client(torpord) as c:
            return not c.list().operations
    wait_for(closed, 60, "the dump's operation to end")
    at = prog.step()
    r = _criu(plugin, "restore", images, "-d")
    assert r.returncode == 0, _log(images, "restore")
    assert "restored and unlocked" in _log(images, "restore")
    prog.wait_step(at + 10, pid=prog.pid)
    _bit_exact(ref, prog, 39)


def test_torpord_down_the_dump_is_refused_and_the_program_steps_on(plugin, programs, tmp_path):
    prog = programs("prog", 1.0)
    prog.wait_ready()
    prog.wait_step(3)
    images = tmp_path / "ck"
    r = _criu(plugin, "dump", images, "-t", str(prog.pid))
    assert r.returncode != 0
    assert "dump refused, the program keeps running" in _log(images, "dump")
    at = prog.step()
    prog.wait_step(at + 5)
