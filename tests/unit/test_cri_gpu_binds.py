"""integration/cri_gpu.cover: the binds a CRI container gets for a host tree must show the tree
and drag in no mount the spec does not name (CRI binds are recursive; CRIU cannot dump a
submount runc did not declare external: the GPU host's /usr/local/nvidia under /usr)."""

from __future__ import annotations

from pathlib import Path

from integration.cri_gpu import cover


def _tree(top: Path) -> None:
    for d in ("bin", "lib/x", "local/bin", "local/nvidia/lib64", "share"):
        (top / d).mkdir(parents=True)
    (top / "local" / "README").write_text("x")
    (top / "lib64").symlink_to("lib")


def test_a_tree_with_nothing_mounted_below_is_one_bind(tmp_path):
    _tree(tmp_path / "usr")
    assert cover(str(tmp_path / "usr"), {str(tmp_path), "/proc"}) == [str(tmp_path / "usr")]


def test_a_submount_is_bound_on_its_own_and_its_parents_split_around_it(tmp_path):
    usr = tmp_path / "usr"
    _tree(usr)
    nvidia = str(usr / "local" / "nvidia")
    got = cover(str(usr) + "/", {str(tmp_path), nvidia})
    assert got == [str(usr / p) for p in ("bin", "lib", "local/README", "local/bin",
                                          "local/nvidia", "share")]
    # no bind holds the submount below it; the symbolic link (a bind would follow it) is left out
    assert not [b for b in got if nvidia.startswith(b + "/")]
    assert str(usr / "lib64") not in got


def test_a_file_mounted_over_is_bound_as_that_file(tmp_path):
    usr = tmp_path / "usr"
    _tree(usr)
    lib = usr / "lib" / "x" / "libcuda.so.1"
    lib.write_text("")
    got = cover(str(usr), {str(lib)})
    assert str(lib) in got and str(usr / "lib") not in got and str(usr / "bin") in got


def test_the_cdi_spec_names_each_gpu_and_the_driver_nodes_as_the_host_has_them(tmp_path):
    """nvidia.com/gpu=<index>: the GPU's node by its minor (not its index) with the host's
    major/minor, NVIDIA_VISIBLE_DEVICES its UUID; the control nodes the host has, for all."""
    import json
    import os
    import stat

    from integration.cri_gpu import write_cdi_spec
    dev = tmp_path / "dev"
    dev.mkdir()
    for name, minor in (("nvidia3", 3), ("nvidiactl", 255)):
        os.mknod(dev / name, stat.S_IFCHR | 0o600, os.makedev(195, minor))
    os.mknod(dev / "nvidia-uvm", stat.S_IFCHR | 0o600, os.makedev(509, 0))
    spec = json.loads(write_cdi_spec(tmp_path / "cdi", [(3, "GPU-abc")], dev).read_text())
    assert spec["kind"] == "nvidia.com/gpu"
    (gpu,) = spec["devices"]
    assert gpu["name"] == "0"
    assert gpu["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=GPU-abc"]
    (node,) = gpu["containerEdits"]["deviceNodes"]
    assert (node["path"], node["hostPath"], node["major"], node["minor"]) == \
        ("/dev/nvidia3", str(dev / "nvidia3"), 195, 3)
    control = {n["path"]: (n["major"], n["minor"]) for n in spec["containerEdits"]["deviceNodes"]}
    assert control == {"/dev/nvidiactl": (195, 255), "/dev/nvidia-uvm": (509, 0)}
