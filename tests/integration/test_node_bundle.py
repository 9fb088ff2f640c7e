"""packaging/kubernetes/node-install.sh: the node bundle runs on its own libraries and loader,
checkpoints and restores a program with its own CRIU, registers containerd's runtime handler in
either config version without harming the rest of the config, and goes away cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.integration.conftest import TICKING, alive, needs_criu, read_count, wait_for

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "packaging" / "kubernetes" / "node-install.sh"
CLEAN = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}     # nothing of ours in the environment

V2_CONFIG = """version = 2
root = "/var/lib/containerd"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.9"
"""
V3_CONFIG = """version = 3
imports = ["/etc/containerd/other.toml"]

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
"""


def node_install(tmp: Path, action: str, **env: str) -> subprocess.CompletedProcess:
    e = {**CLEAN, "HOST_ROOT": "", "NODE_DIR": str(tmp / "node"),
         "CONTAINERD_DIR": str(tmp / "containerd"), "TORPOR_ETC": str(tmp / "etc"),
         "CONFIG": str(tmp / "configmap.toml"), "RESTART": "0",
         "SRC_PREFIX": str(Path(sys.executable).parent.parent), **env}
    return subprocess.run(["bash", str(INSTALL), action], env=e, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0 or not Path("/usr/local/sbin/criu").exists():
        pytest.skip("needs root and CRIU at /usr/local/sbin/criu (./install.sh)")
    tmp = tmp_path_factory.mktemp("node")
    (tmp / "containerd").mkdir()
    (tmp / "containerd" / "config.toml").write_text(V2_CONFIG)
    (tmp / "configmap.toml").write_text('oci_runtime = "runc"\n')
    for _ in range(3):                      # again and again: one version kept besides current
        r = node_install(tmp, "install")
        assert r.returncode == 0, r.stderr
    return tmp


def test_the_bundle_runs_on_its_own_loader_and_libraries(node: Path) -> None:
    bundle = node / "node"
    assert len(list((bundle / "versions").iterdir())) == 2
    assert (bundle / "current").is_symlink()
    out = subprocess.run(
        [str(bundle / "current" / "python" / "bin" / "python3"), "-c",
         "import sys, torpor, grpc, zstandard, xxhash, pycriu\n"
         "print(sys.executable)\n"
         "for line in open('/proc/self/maps'):\n"
         "    f = line.split()[-1]\n"
         "    if '.so' in f: print(f)"],
        env=CLEAN, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out[0] == str(bundle / "current" / "python" / "bin" / "python3")
    libs = out[1:]
    assert libs and all(os.path.realpath(f).startswith(str(bundle)) for f in libs), libs
    for cmd, want in (("torpor", "torpor "), ("criu", "Version: 4")):
        r = subprocess.run([str(bundle / "bin" / cmd), "--version"], env=CLEAN,
                           capture_output=True, text=True, timeout=60)
        assert want in r.stdout, r.stderr
    # torpor-runtime is the native front: what torpor has nothing to do with goes to the
    # runtime it wraps as it came (here echo stands for runc)
    r = subprocess.run([str(bundle / "bin" / "torpor-runtime"), "list", "--format", "json"],
                       env={**CLEAN, "TORPOR_OCI_RUNTIME": "/bin/echo"}, capture_output=True,
                       text=True, timeout=60)
    assert r.stdout == "list --format json\n", r.stderr
    # torpor's config on the node: the ConfigMap's, with the bundle's CRIU
    cfg = tomllib.loads((node / "etc" / "config.toml").read_text())
    assert cfg == {"oci_runtime": "runc", "criu": f"{bundle}/bin/criu"}


@needs_criu
def test_the_bundle_checkpoints_and_restores_a_program_with_its_own_criu(
        node: Path, tmp_path: Path, torpor_env: dict[str, str]) -> None:
    count = tmp_path / "count"
    prog = subprocess.Popen([sys.executable, "-c", TICKING, str(count)], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    torpor = node / "node" / "bin" / "torpor"
    env = {**CLEAN, **torpor_env}
    try:
        wait_for(lambda: read_count(count) > 3, what="the counter")
        r = subprocess.run([str(torpor), "checkpoint", str(prog.pid), "-D", str(tmp_path / "ck")],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        prog.wait(timeout=10)
        at_dump = read_count(count)
        r = subprocess.run([str(torpor), "restore", "-D", str(tmp_path / "ck")], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "CRIU 4" in r.stderr
        wait_for(lambda: read_count(count) > at_dump + 3, what="the restored counter")
        assert alive(prog.pid)
    finally:
        try:
            os.kill(prog.pid, 9)
        except ProcessLookupError:
            pass


def test_the_handler_goes_into_a_version_2_config_and_out_again(node: Path) -> None:
    conf = node / "containerd" / "config.toml"
    doc = tomllib.loads(conf.read_text())
    snippet = node / "containerd" / "conf.d" / "torpor.toml"
    assert doc["imports"] == [str(snippet)]           # once, however often installed
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"] == "registry.k8s.io/pause:3.9"
    handler = tomllib.loads(snippet.read_text())
    assert handler["version"] == 2
    torpor = handler["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["torpor"]
    assert torpor["runtime_type"] == "io.containerd.runc.v2"
    assert torpor["pod_annotations"] == ["org.torpor.*"]
    assert torpor["container_annotations"] == ["org.torpor.*", "checkpointImage"]
    assert torpor["options"]["BinaryName"] == str(node / "node" / "bin" / "torpor-runtime")
    assert (node / "containerd" / "config.toml.torpor-orig").read_text() == V2_CONFIG


def test_a_version_3_config_keeps_its_imports_and_uninstall_restores_it(tmp_path: Path) -> None:
    if not Path("/usr/local/sbin/criu").exists():
        pytest.skip("needs CRIU at /usr/local/sbin/criu (./install.sh)")
    (tmp_path / "containerd").mkdir()
    conf = tmp_path / "containerd" / "config.toml"
    conf.write_text(V3_CONFIG)
    r = node_install(tmp_path, "install", HANDLER="gpu-ckpt")
    assert r.returncode == 0, r.stderr
    snippet = tmp_path / "containerd" / "conf.d" / "torpor.toml"
    doc = tomllib.loads(conf.read_text())
    assert doc["imports"] == ["/etc/containerd/other.toml", str(snippet)]
    assert doc["plugins"]["io.containerd.cri.v1.images"]["snapshotter"] == "overlayfs"
    handler = tomllib.loads(snippet.read_text())
    assert handler["version"] == 3
    assert "gpu-ckpt" in handler["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]
    r = node_install(tmp_path, "uninstall")
    assert r.returncode == 0, r.stderr
    assert tomllib.loads(conf.read_text()) == tomllib.loads(V3_CONFIG)
    assert not snippet.exists() and not (tmp_path / "node").exists()


def test_the_criu_plugin_option_without_a_handler(tmp_path: Path) -> None:
    """A node whose runtime handler cannot change: CRIU_PLUGIN=1 HANDLER="" puts torpor's
    CRIU plugin, built against the bundle's helper, into the node's CRIU plugin directory;
    containerd's config is left as it was; a CRIU loads the plugin (a process without CUDA:
    nothing to do); uninstall takes it out again."""
    if os.geteuid() != 0 or not Path("/usr/local/sbin/criu").exists():
        pytest.skip("needs root and CRIU at /usr/local/sbin/criu (./install.sh)")
    (tmp_path / "containerd").mkdir()
    (tmp_path / "containerd" / "config.toml").write_text(V2_CONFIG)
    plugins = tmp_path / "usr-lib-criu"
    env = {"CRIU_PLUGIN": "1", "HANDLER": "", "CRIU_PLUGIN_DIR": str(plugins),
           "PLUGIN_SRC": str(ROOT / "packaging" / "criu-plugin")}
    r = node_install(tmp_path, "install", **env)
    assert r.returncode == 0, r.stderr
    assert "containerd left as it is" in r.stdout, r.stdout
    assert (tmp_path / "containerd" / "config.toml").read_text() == V2_CONFIG
    assert not (tmp_path / "containerd" / "conf.d").exists()
    so = plugins / "torpor_criu_plugin.so"
    helper = tmp_path / "node" / "bin" / "torpor-criu-helper"
    assert str(helper).encode() in so.read_bytes()         # the bundle's helper, baked in
    h = subprocess.run([str(helper), "check", "--images", str(tmp_path / "none")],
                       env=CLEAN, capture_output=True, text=True, timeout=60)
    assert h.returncode != 0 and "Traceback" not in h.stderr and h.stderr.strip(), h.stderr
    sleeper = subprocess.Popen(["sleep", "100"], start_new_session=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        images = tmp_path / "images"
        images.mkdir()
        d = subprocess.run([str(tmp_path / "node" / "bin" / "criu"), "dump", "-t",
                            str(sleeper.pid), "-D", str(images), "-L", str(plugins), "-v4",
                            "-o", "dump.log", "--shell-job"], env=CLEAN, capture_output=True,
                           text=True, timeout=120)
        log = (images / "dump.log").read_text(errors="replace")
        assert d.returncode == 0, log[-2000:]
        assert 'Plugin "torpor_plugin"' in log and "maps libcuda: nothing to do" in log, log[-2000:]
    finally:
        sleeper.kill()
        sleeper.wait()
    r = node_install(tmp_path, "uninstall", **env)
    assert r.returncode == 0, r.stderr
    assert not so.exists() and not (tmp_path / "node").exists()
    assert (tmp_path / "containerd" / "config.toml").read_text() == V2_CONFIG


@pytest.mark.parametrize("bad", [{"NODE_DIR": "relative/node"}, {"NODE_DIR": "/opt/../etc"},
                                 {"HANDLER": "Bad Handler"}, {"CRIU_PLUGIN": "yes"},
                                 {"CRIU_PLUGIN_DIR": "usr/lib/criu"}])
def test_bad_settings_are_refused_with_one_line(tmp_path: Path, bad: dict[str, str]) -> None:
    r = node_install(tmp_path, "install", **bad)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "error" in r.stderr
    assert not (tmp_path / "containerd").exists()
