"""OCI specs: GPU detection, moving a spec to other GPUs, hooks; runc's argv as runtimes give it."""

from __future__ import annotations

import copy
import json

import pytest

from torpor import oci
from torpor.errors import UsageError
from torpor.gpus import Gpu, Inventory
from torpor.runtime import argv
from tests import hostile

GIB = 1 << 30
A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
INV = Inventory("580", [Gpu(0, A, "NVIDIA H200", 141 * GIB, 140 * GIB, 0),
                        Gpu(1, B, "NVIDIA H200", 141 * GIB, 140 * GIB, 1)], [])
SAVED = [{"uuid": A, "name": "NVIDIA H200", "memory_total": 141 * GIB, "index": 0, "minor": 0},
         {"uuid": B, "name": "NVIDIA H200", "memory_total": 141 * GIB, "index": 1, "minor": 1}]


def dev(minor):
    return {"path": f"/dev/nvidia{minor}", "type": "c", "major": 195, "minor": minor,
            "fileMode": 0o666, "uid": 0, "gid": 0}


def gpu_spec(minors=(0,), visible=None, cdi=None):
    spec = {"ociVersion": "1.0.2", "process": {"env": ["PATH=/usr/bin", "HOME=/root"]},
            "linux": {"devices": [dev(m) for m in minors] + [
                {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}],
                "resources": {"devices": [{"allow": False, "access": "rwm"}] + [
                    {"allow": True, "type": "c", "major": 195, "minor": m, "access": "rwm"}
                    for m in [*minors, 255]]}},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "annotations": {}}
    if visible is not None:
        spec["process"]["env"].append(f"NVIDIA_VISIBLE_DEVICES={visible}")
    if cdi is not None:
        spec["annotations"]["cdi.k8s.io/gpu"] = cdi
    return spec


def test_detect_devices_env_and_cdi():
    assert not oci.detect({"process": {"env": ["PATH=/bin"]}})
    assert not oci.detect(gpu_spec(minors=(), visible="void"))
    assert oci.detect(gpu_spec(minors=(1,))).minors == [1]
    use = oci.detect(gpu_spec(minors=(), visible=f"{B}"))
    assert use.visible == [B] and use.uuids(INV) == [B] and use.uuids(None) == [B]
    use = oci.detect(gpu_spec(minors=(), cdi="nvidia.com/gpu=1,other.com/x=0"))
    assert use.cdi == ["1"] and use.uuids(INV) == [B]
    assert oci.detect(gpu_spec(minors=(0, 1))).uuids(INV) == [A, B]
    # /dev/nvidiactl alone (no GPU device) is not a GPU
    assert not oci.detect({"linux": {"devices": [{"path": "/dev/nvidiactl"}]}})


@pytest.mark.parametrize("spec", [
    {}, {"linux": None}, {"linux": {"devices": "x"}}, {"linux": {"devices": [1, None, "a"]}},
    {"process": "x"}, {"process": {"env": [3, None]}}, {"annotations": ["x"]},
])
def test_detect_takes_malformed_specs(spec):
    assert not oci.detect(spec)


def test_rewrite_moves_every_reference():
    spec = gpu_spec(minors=(0,), visible=A, cdi="nvidia.com/gpu=0")
    spec["mounts"].append({"destination": "/dev/nvidia0", "source": "/dev/nvidia0",
                           "type": "bind"})
    changes = oci.rewrite(spec, oci.moves({A: B}, SAVED, INV))
    assert [d["path"] for d in spec["linux"]["devices"]] == ["/dev/nvidia1", "/dev/nvidiactl"]
    assert spec["linux"]["devices"][0]["minor"] == 1
    rules = [(r.get("minor")) for r in spec["linux"]["resources"]["devices"] if r["allow"]]
    assert rules == [1, 255]
    assert f"NVIDIA_VISIBLE_DEVICES={B}" in spec["process"]["env"]
    assert spec["annotations"]["cdi.k8s.io/gpu"] == "nvidia.com/gpu=1"
    assert spec["mounts"][1]["source"] == spec["mounts"][1]["destination"] == "/dev/nvidia1"
    assert len(changes) == 6


def test_rewrite_swaps_two_gpus_at_once():
    spec = gpu_spec(minors=(0, 1), visible="0,1")
    oci.rewrite(spec, oci.moves({A: B, B: A}, SAVED, INV))
    assert [d["minor"] for d in spec["linux"]["devices"][:2]] == [1, 0]
    assert "NVIDIA_VISIBLE_DEVICES=1,0" in spec["process"]["env"]


def test_rewrite_same_gpu_changes_nothing():
    spec = gpu_spec(minors=(0,), visible="all")
    before = copy.deepcopy(spec)
    assert oci.moves({A: A}, SAVED, INV) == []
    assert oci.rewrite(spec, []) == [] and spec == before


def test_load_save_keep_mode(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(gpu_spec()))
    (tmp_path / "config.json").chmod(0o644)
    spec = oci.load(tmp_path)
    oci.rewrite(spec, oci.moves({A: B}, SAVED, INV))
    oci.save(tmp_path, spec)
    assert oci.load(tmp_path)["linux"]["devices"][0]["path"] == "/dev/nvidia1"
    assert (tmp_path / "config.json").stat().st_mode & 0o777 == 0o644
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(UsageError, match="not an OCI spec"):
        oci.load(tmp_path)
    with pytest.raises(UsageError, match="no OCI spec"):
        oci.load(tmp_path / "nowhere")


def test_add_hooks_once():
    spec = gpu_spec()
    assert oci.add_hooks(spec, "/usr/local/bin/torpor-hook") == ["createRuntime", "poststop"]
    assert oci.add_hooks(spec, "/opt/torpor/venv/bin/torpor-hook") == []
    assert spec["hooks"]["createRuntime"][0]["args"] == ["torpor-hook", "createRuntime"]


def test_device_map_annotation():
    spec = gpu_spec()
    assert oci.device_map_annotation(spec) == []
    spec["annotations"][oci.DEVICE_MAP_ANNOTATION] = f"{A}={B}"
    assert oci.device_map_annotation(spec) == [f"{A}={B}"]


@pytest.mark.parametrize("line, command, cid, opts", [
    # podman
    ("--root /run/runc --systemd-cgroup checkpoint --image-path /b/checkpoint --work-path /b "
     "--leave-running --file-locks abc", "checkpoint", "abc",
     {"image-path": "/b/checkpoint", "work-path": "/b", "leave-running": True}),
    # conmon's restore
    ("--root=/run/runc restore --bundle /b --pid-file /b/pidfile --detach --image-path "
     "/b/checkpoint --work-path /b abc", "restore", "abc",
     {"bundle": "/b", "pid-file": "/b/pidfile", "detach": True}),
    # containerd's runc shim
    ("--root /run/containerd/runc/default --log /b/log.json --log-format json create --bundle "
     "/b --pid-file /b/init.pid c1", "create", "c1", {"bundle": "/b", "pid-file": "/b/init.pid"}),
    ("-root /r delete --force c1", "delete", "c1", {"force": True}),
    ("restore -d -b /b c2", "restore", "c2", {"d": True, "b": "/b"}),
])
def test_argv(line, command, cid, opts):
    inv = argv.parse(line.split())
    assert (inv.command, inv.container_id) == (command, cid)
    for k, v in opts.items():
        assert inv.opts[k] == v
    assert inv.argv == line.split()
    assert inv.global_args == line.split()[:len(inv.global_args)]
    assert command not in inv.global_args


def test_argv_other_commands_untouched():
    inv = argv.parse(["--log", "/x", "state", "c1"])
    assert inv.command == "state" and inv.global_opts["log"] == "/x" and inv.opts == {}
    assert argv.parse(["checkpoint", "--help"]).wants_help
    assert argv.parse(["--version"]).command == ""


def test_host_ids_follow_user_and_mappings():
    assert oci.host_ids({}) == (0, 0)
    assert oci.host_ids({"process": {"user": {"uid": 1000, "gid": 100}}}) == (1000, 100)
    userns = {"process": {"user": {"uid": 0, "gid": 5}},
              "linux": {"uidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}],
                        "gidMappings": [{"containerID": 0, "hostID": 200000, "size": 10}]}}
    assert oci.host_ids(userns) == (100000, 200005)
    userns["process"]["user"]["gid"] = 50
    assert oci.host_ids(userns)[1] == 65534


@pytest.mark.parametrize("cid", ["c0ffee", "a.b_c-d", "x" * 128, ".hidden"])
def test_container_id_fit_to_name_a_file(cid):
    assert oci.validate_container_id(cid) == cid


@pytest.mark.parametrize("cid", ["", ".", "..", "a..b", "a/b", "x" * 129, "abc\n", "a\nb",
                                 "abc\r", "x" * 128 + "\n", "ab c", None])
def test_container_id_that_cannot_name_a_file_is_refused(cid):
    # "abc\n": re's "$" matches before a final newline; the native front (valid_id) refuses
    # it, and a marker or agent directory named "abc\n" would be left behind
    with pytest.raises(UsageError, match="bad container id"):
        oci.validate_container_id(cid)


LOAD = """
import resource, sys
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from torpor import oci
from torpor.errors import UsageError
try:
    oci.load(Path(sys.argv[1]))
except UsageError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_load_refuses_a_spec_that_would_block_or_fill_memory(tmp_path, kind):
    """config.json is the bundle's, whoever starts containers: a FIFO must not hang the
    engine's create, /dev/zero or a huge sparse file must not fill a root process's memory;
    each is one line (UsageError), and create then leaves the spec to runc."""
    import subprocess
    import sys
    spec = tmp_path / "config.json"
    hostile.plant(spec, kind, oci.MAX_SPEC)
    out = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path)], capture_output=True,
                         text=True, timeout=30)
    assert out.stdout.startswith("refused: cannot read the OCI spec"), out.stderr[-500:]
    assert ("larger than" if kind == "huge" else "not a regular file") in out.stdout


def test_save_keeps_the_mode_under_torpor_runtimes_umask(tmp_path):
    """torpor-runtime sets umask 077 before its flows: a 0644 config.json it rewrites at
    create (hooks, the agent) or restore stays 0644, as oci.save says."""
    import os
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gpu_spec()))
    path.chmod(0o644)
    old = os.umask(0o077)
    try:
        oci.save(tmp_path, oci.load(tmp_path))
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_rewrite_leaves_a_device_named_like_a_gpu_with_another_device_behind_it():
    """podman --device /dev/null:/dev/nvidia0 names /dev/null (c 1:3) like GPU 0: moving GPU 0
    to GPU 1 must not make it c 1:1 (/dev/mem) at /dev/nvidia1 in the restored container."""
    spec = gpu_spec(minors=())
    spec["linux"]["devices"].append({"path": "/dev/nvidia0", "type": "c", "major": 1,
                                     "minor": 3})
    before = copy.deepcopy(spec)
    changes = oci.rewrite(spec, oci.moves({A: B}, SAVED, INV))
    assert spec["linux"]["devices"] == before["linux"]["devices"], changes


@pytest.mark.parametrize("path", ["/dev/nvidia0\n", "/dev/nvidia\u0661", "/dev/nvidia0x"])
def test_only_a_plain_gpu_device_name_is_a_gpu(path):
    # re's "$" matches before a final newline and "\d" takes any script's digits
    assert not oci.detect({"linux": {"devices": [{"path": path, "major": 195, "minor": 1}]}})
