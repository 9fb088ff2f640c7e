"""torpor's CRIU plugin (packaging/criu-plugin) with a real torpord and the fake driver: plain
`criu dump`/`criu restore -d` of a fake-GPU program, CRIU loading the plugin from its plugin
directory (--libdir, as an engine's CRIU loads it from /usr/lib/criu), no torpor CLI or
torpor-runtime in the loop. What it must do: lock and checkpoint through torpord before CRIU
stops the program and restore/unlock after CRIU let it go (same GPU, another GPU), leave
programs without CUDA and torpor's own checkpoints alone (never lock twice), and refuse the
dump with the program still running whenever torpord is missing or the dump fails."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.fakegpu import FakeGpu
from tests.integration.conftest import alive, needs_criu, wait_for
from tests.integration.torpord import (  # noqa: F401  (fixtures)
    Daemon, base, gpu, daemon)

pytestmark = [needs_criu, pytest.mark.criu]
ROOT = Path(__file__).resolve().parents[2]
CRIU = "/usr/local/sbin/criu" if os.access("/usr/local/sbin/criu", os.X_OK) else \
    (shutil.which("criu") or "criu")
RUNNING, LOCKED, CHECKPOINTED = 0, 1, 2


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("plugins")
    r = subprocess.run(["make", "-s", "-C", str(ROOT / "packaging" / "criu-plugin"),
                        f"BUILD={d}"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.fail(f"the plugin does not build:\n{r.stderr}")
    return d


class Criu:
    """criu dump/restore with the plugin directory, torpord's environment and a helper wrapper
    that records each run (base/helper.calls)."""

    def __init__(self, base: Path, daemon: Daemon, plugin_dir: Path):
        self.base, self.daemon, self.plugin_dir = base, daemon, plugin_dir
        self.calls = base / "helper.calls"
        self.helper = base / "torpor-criu-helper"
        self.helper.write_text(f'#!/bin/sh\necho "$1" >> {self.calls}\n'
                               f'exec {sys.executable} -m torpor.criu_plugin "$@"\n')
        self.helper.chmod(0o755)
        self.env = {**daemon.env, "TORPOR_CRIU_HELPER": str(self.helper)}
        self.env.pop("TORPOR_CRIU_PLUGIN", None)

    def helper_runs(self) -> list[str]:
        return self.calls.read_text().split() if self.calls.exists() else []

    def run(self, action: str, images: Path, *args: str, env: dict | None = None,
            ) -> subprocess.CompletedProcess:
        images.mkdir(mode=0o700, exist_ok=True)
        log = f"{action}.log"
        return subprocess.run([CRIU, action, *args, "-D", str(images), "-o", log, "-v4",
                               "--libdir", str(self.plugin_dir), "--shell-job"],
                              env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)

    @staticmethod
    def log(images: Path, action: str) -> str:
        return (images / f"{action}.log").read_text(errors="replace")


@pytest.fixture
def criu(base, daemon, plugin_dir) -> Criu:
    return Criu(base, daemon, plugin_dir)


def _lock_calls(gpu: FakeGpu, pid: int) -> list[str]:
    return [c.call for c in gpu.calls() if c.pid == pid and c.name == "CUDA_SUCCESS"
            and c.call in ("lock", "checkpoint", "restore", "unlock")]


def _no_open_ops(daemon: Daemon) -> bool:
    with daemon.client() as c:
        return not c.list().operations


def _dump_restore(criu: Criu, gpu: FakeGpu, images: Path, reaper: list[int],
                  env: dict | None = None, before_restore=lambda: None):
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    r = criu.run("dump", images, "-t", str(prog.pid))
    assert r.returncode == 0, Criu.log(images, "dump")[-3000:]
    prog.proc.wait(timeout=10)
    dump_log = Criu.log(images, "dump")
    assert "locked and checkpointed by torpord" in dump_log
    m = json.loads((images / "torpor-criu.json").read_text())
    assert stat.S_IMODE((images / "torpor-criu.json").stat().st_mode) == 0o600
    assert [p["pid"] for p in m["processes"]] == [prog.pid]
    assert m["gpus"] == [{"uuid": gpu.uuid(0), "name": gpu.gpus[0][1]}]  # placement reads it
    assert gpu.state(prog.pid)["state"] == CHECKPOINTED   # in host memory: in the image
    # the helper ends the operation (Finish) once that CRIU has exited
    wait_for(lambda: _no_open_ops(criu.daemon), what="the dump's operation to end")
    before_restore()
    r = criu.run("restore", images, "-d", env=env)
    reaper.append(prog.pid)
    assert r.returncode == 0, Criu.log(images, "restore")[-3000:]
    assert "restored and unlocked" in Criu.log(images, "restore")
    assert gpu.state(prog.pid)["state"] == RUNNING
    at = prog.tick()
    wait_for(lambda: prog.tick() > at + 2, what="the restored program to tick")
    assert _lock_calls(gpu, prog.pid) == ["lock", "checkpoint", "restore", "unlock"]
    return prog


def test_plain_criu_dumps_and_restores_a_gpu_program_on_the_same_gpu(criu, gpu, base, reaper):
    prog = _dump_restore(criu, gpu, base / "images", reaper)
    assert gpu.state(prog.pid)["gpu"] == gpu.uuid(0)
    assert criu.helper_runs() == ["lock", "check", "restore"]


def test_restore_onto_another_gpu_with_torpor_gpu_map(criu, gpu, base, reaper):
    env = {"TORPOR_GPU_MAP": f"{gpu.uuid(0)}={gpu.uuid(1)}"}
    prog = _dump_restore(criu, gpu, base / "images", reaper, env=env)
    assert gpu.state(prog.pid)["gpu"] == gpu.uuid(1)


def test_restore_on_a_host_without_the_gpu_places_it_on_another_of_its_model(criu, gpu, base,
                                                                            reaper):
    """torpor's placement rules (placement.plan) at the restore's init: GPU 0 is gone (another
    host), the program goes to another GPU of the same model."""
    gone = gpu.uuid(0)
    prog = _dump_restore(criu, gpu, base / "images", reaper,
                         before_restore=lambda: gpu.set_gpus(gpu.gpus[1:]))
    assert gpu.state(prog.pid)["gpu"] in [u for u, _, _ in gpu.gpus]
    assert gone not in [u for u, _, _ in gpu.gpus] and gpu.state(prog.pid)["gpu"] != gone


def test_restore_where_no_gpu_fits_is_refused_before_anything_starts(criu, gpu, base):
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    images = base / "images"
    r = criu.run("dump", images, "-t", str(prog.pid))
    assert r.returncode == 0, Criu.log(images, "dump")[-3000:]
    prog.proc.wait(timeout=10)
    wait_for(lambda: _no_open_ops(criu.daemon), what="the dump's operation to end")
    gpu.set_gpus([(u, "NVIDIA A100", total) for u, _, total in gpu.gpus])  # another model
    r = criu.run("restore", images, "-d")
    assert r.returncode != 0
    log = Criu.log(images, "restore")
    assert "nothing was restored" in log and "A100" in log
    assert not alive(prog.pid)
    assert criu.helper_runs() == ["lock", "check"]


def test_a_node_without_the_plugin_refuses_the_restore_before_anything_starts(criu, gpu, base):
    """The dump lists the plugin in CRIU's inventory (as CRIU's own plugins do): a CRIU that
    does not load it refuses the checkpoint instead of starting a program without its GPU."""
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    images = base / "images"
    r = criu.run("dump", images, "-t", str(prog.pid))
    assert r.returncode == 0, Criu.log(images, "dump")[-3000:]
    prog.proc.wait(timeout=10)
    wait_for(lambda: _no_open_ops(criu.daemon), what="the dump's operation to end")
    criu.plugin_dir = base / "no-plugins"
    criu.plugin_dir.mkdir()
    r = criu.run("restore", images, "-d")
    assert r.returncode != 0
    assert "torpor_plugin" in Criu.log(images, "restore")
    assert not alive(prog.pid) and criu.helper_runs() == ["lock"]


def test_leave_running_dump_resumes_the_gpu_program(criu, gpu, base, reaper):
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    reaper.append(prog.pid)
    images = base / "images"
    r = criu.run("dump", images, "-t", str(prog.pid), "-R")
    assert r.returncode == 0, Criu.log(images, "dump")[-3000:]
    wait_for(lambda: gpu.state(prog.pid)["state"] == RUNNING, what="RUNNING again")
    at = prog.tick()
    wait_for(lambda: prog.tick() > at + 2, what="the program to tick")
    assert _no_open_ops(criu.daemon)


def test_torpord_down_the_dump_fails_and_the_program_runs_on(criu, gpu, base, daemon, reaper):
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    reaper.append(prog.pid)
    daemon.stop()
    images = base / "images"
    r = criu.run("dump", images, "-t", str(prog.pid))
    assert r.returncode != 0
    log = Criu.log(images, "dump")
    assert "dump refused, the program keeps running" in log
    assert alive(prog.pid) and gpu.state(prog.pid)["state"] == RUNNING
    at = prog.tick()
    wait_for(lambda: prog.tick() > at + 2, what="the program to tick")
    assert _lock_calls(gpu, prog.pid) == []


@pytest.mark.parametrize("fault", ["3", "1"], ids=["dump-fails", "criu-killed"])
def test_a_dump_failing_after_the_lock_leaves_the_program_running(criu, gpu, base, reaper,
                                                                  fault):
    """CRIU_FAULT=3: dumping pages fails (fini says failed); 1: CRIU SIGKILLs itself mid-dump
    (no fini at all: the helper reads EOF). Either way torpord rolls back once CRIU is gone."""
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    reaper.append(prog.pid)
    images = base / "images"
    r = criu.run("dump", images, "-t", str(prog.pid), env={"CRIU_FAULT": fault})
    assert r.returncode != 0
    wait_for(lambda: alive(prog.pid) and gpu.state(prog.pid)["state"] == RUNNING,
             timeout=20, what="the program RUNNING again")
    at = prog.tick()
    wait_for(lambda: prog.tick() > at + 2, what="the program to tick")
    assert _lock_calls(gpu, prog.pid) == ["lock", "checkpoint", "restore", "unlock"]
    wait_for(lambda: _no_open_ops(criu.daemon), what="the operation to end")


def test_a_program_without_cuda_never_reaches_the_helper(criu, base, reaper):
    p = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, start_new_session=True)
    images = base / "images"
    r = criu.run("dump", images, "-t", str(p.pid))
    assert r.returncode == 0, Criu.log(images, "dump")[-3000:]
    p.wait(timeout=10)
    assert "maps libcuda: nothing to do" in Criu.log(images, "dump")
    assert not (images / "torpor-criu.json").exists()
    r = criu.run("restore", images, "-d")
    reaper.append(p.pid)
    assert r.returncode == 0, Criu.log(images, "restore")[-3000:]
    assert alive(p.pid)
    assert criu.helper_runs() == []


def _torpor_cli(criu: Criu, base: Path, *, plugin_env_off: bool) -> dict:
    """A torpor CLI checkpoint whose CRIU (TORPOR_CRIU: a wrapper) loads the plugin. The CLI
    points CRIU at an empty plugin directory and gives it TORPOR_CRIU_PLUGIN=off; the wrapper
    swaps that directory for the plugin's (as a CRIU that loads /usr/lib/criu regardless would:
    runc's, under torpor-runtime) and, unless plugin_env_off, takes the marker away."""
    wrapper = base / "criu-with-plugin"
    unset = "" if plugin_env_off else "unset TORPOR_CRIU_PLUGIN\n"
    keep = " ".join(f"{k}='{v}'" for k, v in criu.env.items()
                    if k.startswith(("TORPOR_", "FAKE_CUDA")) or k in ("PYTHONPATH",
                                                                        "LD_LIBRARY_PATH"))
    wrapper.write_text(f"#!/bin/sh\nexport {keep}\n{unset}prev=\n"
                       'for a; do shift; [ "$prev" = --libdir ] && '
                       f'a={criu.plugin_dir}; set -- "$@" "$a"; prev=$a; done\n'
                       f'exec {CRIU} "$@"\n')
    wrapper.chmod(0o755)
    return {**criu.env, "TORPOR_CRIU": str(wrapper)}


@pytest.mark.parametrize("plugin_env_off", [True, False], ids=["env-marker", "driver-state"])
def test_a_torpor_cli_checkpoint_with_the_plugin_present_locks_once(criu, gpu, base, reaper,
                                                                    plugin_env_off):
    """env-marker: the plugin sees TORPOR_CRIU_PLUGIN=off and stays out; driver-state: without
    the marker the helper finds the program already CHECKPOINTED by the CLI and skips."""
    env = _torpor_cli(criu, base, plugin_env_off=plugin_env_off)
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    images = base / "cli-images"
    r = subprocess.run([sys.executable, "-m", "torpor.cli.main", "checkpoint", str(prog.pid),
                        "-D", str(images)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    prog.proc.wait(timeout=10)
    assert _lock_calls(gpu, prog.pid) == ["lock", "checkpoint"]
    dump_log = (images / "dump.log").read_text(errors="replace")
    if plugin_env_off:
        assert "TORPOR_CRIU_PLUGIN=off" in dump_log and criu.helper_runs() == []
    else:
        assert "left alone: skip" in dump_log and criu.helper_runs() == ["lock"]
    r = subprocess.run([sys.executable, "-m", "torpor.cli.main", "restore", "-D", str(images)],
                       env=env, capture_output=True, text=True, timeout=120)
    reaper.append(prog.pid)
    assert r.returncode == 0, r.stderr
    assert gpu.state(prog.pid)["state"] == RUNNING
    assert _lock_calls(gpu, prog.pid) == ["lock", "checkpoint", "restore", "unlock"]


def test_a_tampered_manifest_refuses_the_restore_before_anything_starts(criu, gpu, base):
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    images = base / "images"
    r = criu.run("dump", images, "-t", str(prog.pid))
    assert r.returncode == 0, Criu.log(images, "dump")[-3000:]
    prog.proc.wait(timeout=10)
    wait_for(lambda: _no_open_ops(criu.daemon), what="the dump's operation to end")
    m = images / "torpor-criu.json"
    m.write_text(m.read_text().replace('"version": 1', '"version": 99'))
    r = criu.run("restore", images, "-d")
    assert r.returncode != 0
    assert "nothing was restored" in Criu.log(images, "restore")
    assert not alive(prog.pid)


def test_a_program_under_the_agent_moves_its_gpu_memory_through_the_images(base, gpu,
                                                                           plugin_dir, reaper):
    """The agent's path: torpord has the program's agent write its GPU memory into
    <images>/torpor-gpu/<pid>/ before the lock, the archive carries it, and after the
    restore the (restored) agent reads every byte back."""
    from tests.integration.test_agent_cli import Program
    program = Program(gpu, base)
    reaper.append(program.pid)
    d = Daemon(base, gpu)
    d.env["TORPOR_AGENT_DIR"] = str(program.agents)
    d.start()
    try:
        criu = Criu(base, d, plugin_dir)
        images = base / "images"
        r = criu.run("dump", images, "-t", str(program.pid))
        assert r.returncode == 0, Criu.log(images, "dump")[-3000:]
        program.proc.wait(timeout=10)
        assert program.log() == ["agent status", "agent prepare", "agent detach"]
        entry = json.loads((images / "torpor-criu.json").read_text())["agents"][str(program.pid)]
        assert entry["bytes"] == 5 << 20 and entry["nspid"] == program.pid
        files = sorted((images / "torpor-gpu" / str(program.pid)).iterdir())
        assert [f.stat().st_size for f in files] == entry["files"]
        wait_for(lambda: _no_open_ops(d), what="the dump's operation to end")
        r = criu.run("restore", images, "-d")
        assert r.returncode == 0, Criu.log(images, "restore")[-3000:]
        assert program.log() == ["agent status", "agent resume"]
        st = program.status()
        assert st["state"] == "running" and st["gate"] == "open" and st["intact"] is True
        assert gpu.state(program.pid)["state"] == RUNNING
    finally:
        d.stop()


def test_stock_runc_under_podman_checkpoints_and_restores_a_fake_gpu_container(
        criu, gpu, base, podman_image):
    """No torpor-runtime: podman with stock runc, whose CRIU loads the plugin. podman hands the
    runtime none of its environment, so podman's runtime is a two-line wrapper that sets what a
    node has by default (the plugin in CRIU's /usr/lib/criu: CRIU_LIBS_DIR here; torpord's
    socket and the helper: this test's) and execs /usr/sbin/runc: runc hands it to CRIU. The
    export carries torpor-criu.json; the restored container runs on, on the same GPU."""
    if shutil.which("podman") is None or shutil.which("runc") is None:
        pytest.skip("needs podman and runc")
    from integration.containers import Podman
    from tests.integration.test_containers_gpu import DRIVER_PATH, Workload, fake_nodes
    env = {k: v for k, v in criu.env.items()
           if k.startswith(("TORPOR_", "FAKE_CUDA")) or k in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    env["CRIU_LIBS_DIR"] = str(criu.plugin_dir)
    runc = base / "runc-with-node-env"
    runc.write_text("#!/bin/sh\n" + "".join(f"export {k}='{v}'\n" for k, v in env.items())
                    + f'exec {shutil.which("runc")} "$@"\n')
    runc.chmod(0o755)
    podman = Podman(str(runc))
    name = f"tcp-{base.name[-6:].lower()}"
    nodes = fake_nodes(base)
    w = Workload(gpu, "w")
    podman.run(name, w.argv, mounts=w.mounts,
               env={**w.env, "NVIDIA_VISIBLE_DEVICES": gpu.uuid(0)},
               devices=[f"{nodes[0]}:/dev/nvidia0", f"{nodes[255]}:/dev/nvidiactl"],
               annotations=DRIVER_PATH)
    try:
        w.wait_ticking()
        archive = base / "ck.tar"
        podman.checkpoint(name, export=archive, compress="none")
        assert criu.helper_runs() == ["lock"]
        assert w.entry()["state"] == CHECKPOINTED
        import tarfile
        with tarfile.open(archive) as tf:
            assert "checkpoint/torpor-criu.json" in tf.getnames()
        tick = w.tick()
        podman.rm(name)
        wait_for(lambda: _no_open_ops(criu.daemon), what="the dump's operation to end")
        podman.restore(import_=archive)
        assert criu.helper_runs() == ["lock", "check", "restore"]
        w.wait_ticking(tick + 2)
        assert w.entry()["state"] == RUNNING and w.entry()["gpu"] == gpu.uuid(0)
    finally:
        podman.rm(name)


def test_the_install_option_puts_a_plugin_criu_loads_into_the_plugin_dir(base, criu, gpu,
                                                                        reaper):
    """packaging/criu-plugin/install.sh (./install.sh with TORPOR_INSTALL_CRIU_PLUGIN=1) into
    a scratch plugin directory: the plugin there is the one the dump loads; --uninstall
    removes it."""
    target = base / "criu-lib"
    env = {**os.environ, "TORPOR_CRIU_PLUGIN_DIR": str(target),
           "TORPOR_CRIU_HELPER": str(criu.helper), "TORPOR_INCLUDE_DIR": str(base / "include")}
    script = ROOT / "packaging" / "criu-plugin" / "install.sh"
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert (base / "include" / "criu" / "criu-plugin.h").exists()
    assert [p.name for p in target.iterdir()] == ["torpor_criu_plugin.so"]
    criu.plugin_dir = target
    prog = gpu.spawn(gpu_index=0, mem=64 << 20)
    reaper.append(prog.pid)
    images = base / "images"
    # no TORPOR_CRIU_HELPER: the helper path built into the plugin
    r = criu.run("dump", images, "-t", str(prog.pid), "-R", env={"TORPOR_CRIU_HELPER": ""})
    assert r.returncode == 0, Criu.log(images, "dump")[-3000:]
    assert "locked and checkpointed by torpord" in Criu.log(images, "dump")
    assert criu.helper_runs() == ["lock"]
    wait_for(lambda: gpu.state(prog.pid)["state"] == RUNNING, what="RUNNING again")
    r = subprocess.run(["bash", str(script), "--uninstall"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and not any(target.iterdir()), r.stderr


def test_torpor_runtime_with_the_plugin_present_locks_once(criu, gpu, base, podman_image):
    """torpor-runtime's own checkpoint with the plugin in CRIU's plugin directory: torpord's
    LockAndCheckpoint is open while runc's CRIU runs, so the plugin stays out (the runtime's
    TORPOR_CRIU_PLUGIN=off, or, with a torpor-runtime older than it, the helper finding the
    program in torpord's open operation): the driver sees one lock. Its restore has no
    torpor-criu.json: the plugin stays out of that too."""
    if shutil.which("podman") is None:
        pytest.skip("needs podman")
    from integration.containers import Podman
    from tests.integration.test_containers_gpu import Shim, _podman_workload
    shim = Shim(base, criu.daemon, gpu)
    shim.write(CRIU_LIBS_DIR=str(criu.plugin_dir), TORPOR_CRIU_HELPER=str(criu.helper))
    podman = Podman(str(shim.path))
    name = f"tcp-rt-{base.name[-6:].lower()}"
    w = _podman_workload(podman, gpu, base, name)
    try:
        w.wait_ticking()
        pid = w.host_pid()
        archive = base / "ck.tar"
        podman._p("container", "checkpoint", "--keep", "--export", str(archive),
                  "--compress", "none", name)           # --keep: CRIU's dump.log stays
        assert _lock_calls(gpu, pid) == ["lock", "checkpoint"]
        dump_log = (podman.bundle(name) / "dump.log").read_text(errors="replace")
        if criu.helper_runs():      # a torpor-runtime without the marker: the helper skipped
            assert criu.helper_runs() == ["lock"] and "left alone: skip" in dump_log
        else:
            assert "TORPOR_CRIU_PLUGIN=off" in dump_log
        tick = w.tick()
        podman.rm(name)
        podman.restore(import_=archive)
        w.wait_ticking(tick + 2)
        assert w.entry()["state"] == RUNNING
        assert criu.helper_runs() in ([], ["lock"])
    finally:
        podman.rm(name)


def test_a_tree_whose_gpu_program_is_a_child_of_a_plain_shell(criu, gpu, base, reaper):
    """The root maps no libcuda, its child does: the tree is locked from the root (PAUSE_DEVICES
    comes for it first), restored with every PID CRIU restored, the shell's among them."""
    argv, env, _ = gpu.container_workload("tree", 0, 64 << 20, base / "tree.status.json")
    env = {**os.environ, **gpu.env(), **{k: v for k, v in env.items() if k != "FAKE_CUDA_SCOPE"}}
    env.pop("FAKE_CUDA_SCOPE", None)
    shell = subprocess.Popen(["sh", "-c", '"$@" & wait', "sh", *argv], env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    status = base / "tree.status.json"

    def tick() -> int:
        try:
            return int(json.loads(status.read_text()).get("tick", -1))
        except (OSError, ValueError):
            return -1
    wait_for(lambda: tick() > 0, 20, "the child ticking")
    child = int((Path(f"/proc/{shell.pid}/task/{shell.pid}/children").read_text().split())[0])
    reaper.extend([shell.pid, child])
    images = base / "images"
    r = criu.run("dump", images, "-t", str(shell.pid))
    assert r.returncode == 0, Criu.log(images, "dump")[-3000:]
    shell.wait(timeout=10)

    def gone(pid: int) -> bool:     # the dumped child, reparented to us if we are a subreaper
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return not Path(f"/proc/{pid}").exists()
    wait_for(lambda: gone(child), what="the dumped child gone")
    assert [p["pid"] for p in json.loads((images / "torpor-criu.json").read_text())
            ["processes"]] == [child]
    wait_for(lambda: _no_open_ops(criu.daemon), what="the dump's operation to end")
    at = tick()
    r = criu.run("restore", images, "-d")
    assert r.returncode == 0, Criu.log(images, "restore")[-3000:]
    assert f"GPU state of PIDs {shell.pid},{child} restored" in Criu.log(images, "restore")
    wait_for(lambda: tick() > at + 2, what="the restored child ticking")
    assert gpu.state(child)["state"] == RUNNING


def test_stock_runc_under_containerd_cri_checkpoints_and_restores_a_fake_gpu_container(
        criu, gpu, base):
    """The kubelet's flow with no torpor-runtime (a node whose runtime handler cannot change):
    containerd 2's CRI with stock runc as the pod's handler, whose CRIU loads the plugin.
    CheckpointContainer (the container runs on) writes the kubelet's archive with
    torpor-criu.json; CreateContainer from it in a new pod and StartContainer restore the
    program with its GPU state on the same GPU, the driver's calls through torpord."""
    from integration import cri as crimod
    if crimod.missing() is not None or shutil.which("runc") is None:
        pytest.skip(crimod.missing() or "needs runc")
    from integration.oci_registry import LayoutRegistry
    from tests.integration.test_cri import Node, _gpu_workload
    env = {k: v for k, v in criu.env.items()
           if k.startswith(("TORPOR_", "FAKE_CUDA")) or k in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    env["CRIU_LIBS_DIR"] = str(criu.plugin_dir)          # as the node's /usr/lib/criu
    runc = base / "runc-with-node-env"
    runc.write_text("#!/bin/sh\n" + "".join(f"export {k}='{v}'\n" for k, v in env.items())
                    + f'exec {shutil.which("runc")} "$@"\n')
    runc.chmod(0o755)
    cdi = base / "cdi"
    cdi.mkdir()
    with LayoutRegistry({"torpor-busybox": crimod.BUSYBOX_TAR}) as reg:
        d = crimod.Containerd2(base / "c2", str(runc), cdi_dirs=[cdi],
                               registries=[f"localhost:{reg.port}"])
        c = crimod.Cri(d.socket)
        try:
            image = reg.ref("torpor-busybox", "1")
            c.pull(image)
            node = Node(d, c, image, base, cdi)
            w, spec = _gpu_workload(node, gpu)
            pod, cid = node.run("cuda", "torpor", spec)     # the handler: stock runc
            w.wait_ticking()
            host_pid = w.host_pid()
            archive = crimod.kubelet_archive(node.checkpoints, pod, "cuda")
            c.checkpoint(cid, archive)
            assert c.state(cid) == "CONTAINER_RUNNING"
            assert criu.helper_runs() == ["lock"]
            assert _lock_calls(gpu, host_pid)[:2] == ["lock", "checkpoint"]
            w.wait_ticking(w.tick() + 2)                     # runs on after the dump
            assert w.entry()["state"] == RUNNING
            import tarfile
            with tarfile.open(archive) as tf:
                names = tf.getnames()
            assert "checkpoint/torpor-criu.json" in names and "checkpoint/torpor.json" \
                not in names
            tick = w.tick()
            c.remove_pod(pod.id)
            wait_for(lambda: _no_open_ops(criu.daemon), what="the dump's operation to end")
            pod2, cid2 = node.run("cuda-restored", "torpor", spec, image=str(archive))
            new_pid = c.pid(cid2)
            assert new_pid != host_pid
            assert criu.helper_runs() == ["lock", "check", "restore"]
            w.wait_ticking(tick + 2)
            assert w.entry()["state"] == RUNNING and w.entry()["gpu"] == gpu.uuid(0)
        finally:
            try:
                c.remove_all()
            finally:
                c.close()
                d.stop()
