"""torpor-runtime's markers (torpor.runtime.markers): one per (runtime root, container id),
so that a container id living under two roots (containerd namespaces, podman and ctr side by
side) keeps each container's marker whatever the other does; an earlier torpor's markers
(named by the id alone) still count. The front's side of the name: test_runtime_front.py."""

from __future__ import annotations

import json
import os

import pytest

from torpor.runtime import argv, markers

CID = "c0ffee0123456789"


def inv(root: str | None, command: str = "create", cid: str = CID) -> argv.Invocation:
    return argv.parse([*(["--root", root] if root is not None else []), command, cid])


def names(cfg) -> list[str]:
    d = markers.marker_dir(cfg)
    return sorted(os.listdir(d)) if d.exists() else []


@pytest.mark.parametrize("text, key", [
    ("", "cbf29ce484222325"), ("a", "af63dc4c8601ec8c"), ("foobar", "85944171f73967e8"),
])
def test_root_key_is_fnv1a_64(text, key):
    # the published FNV-1a 64 test vectors (roots already normal): the front computes the same
    assert markers.root_key(text) == key


def test_root_key_hashes_the_bytes_argv_held():
    assert markers.root_key(os.fsdecode(b"/r\xff")) != markers.root_key("/r")
    assert markers.root_key("/é") == markers.root_key(os.fsdecode("/é".encode()))


def test_no_root_and_an_empty_root_are_runcs_default_root(cfg):
    assert markers.root_of_invocation(inv(None)) == markers.root_of_invocation(inv("")) == ""
    assert markers.write(cfg, inv(None))
    assert names(cfg) == [f"{CID}@cbf29ce484222325"]
    assert markers.present(cfg, inv(""))


def test_each_root_has_its_own_marker(cfg):
    """GPU container X under /a, then X under /b: /b's marker must neither replace /a's nor,
    at /b's delete, take it away (/a's delete would then go straight to runc, leaving its
    agent directory and torpord's record behind)."""
    assert markers.write(cfg, inv("/a"))
    assert markers.write(cfg, inv("/b"))
    a, b = markers.path(cfg, CID, "/a"), markers.path(cfg, CID, "/b")
    assert a != b and json.loads(a.read_text()) == {"roots": ["/a"]}
    assert json.loads(b.read_text()) == {"roots": ["/b"]}
    assert a.stat().st_mode & 0o777 == 0o600
    assert markers.marker_dir(cfg).stat().st_mode & 0o777 == 0o700
    assert markers.remove(cfg, inv("/b", "delete"))
    assert markers.present(cfg, inv("/a", "delete")) and a.exists() and not b.exists()
    assert not markers.present(cfg, inv("/b", "delete"))
    assert not markers.remove(cfg, inv("/b", "delete"))
    assert markers.remove(cfg, inv("/a", "delete"))
    assert names(cfg) == []


def test_a_root_without_a_marker_sees_none(cfg):
    markers.write(cfg, inv("/a"))
    assert not markers.present(cfg, inv("/b"))
    assert not markers.present(cfg, inv(None))
    assert not markers.present(cfg, inv("/a", cid="other"))


def test_two_roots_whose_keys_collide_share_one_marker_until_the_last_goes(cfg, monkeypatch):
    monkeypatch.setattr(markers, "root_key", lambda root: "0" * 16)
    markers.write(cfg, inv("/a"))
    markers.write(cfg, inv("/b"))
    markers.write(cfg, inv("/a"))    # again: listed once
    (only,) = names(cfg)
    marker = markers.marker_dir(cfg) / only
    assert json.loads(marker.read_text()) == {"roots": ["/a", "/b"]}
    assert markers.present(cfg, inv("/a")) and markers.present(cfg, inv("/b"))
    assert not markers.present(cfg, inv("/c"))     # the file is there, the root is not
    assert not markers.remove(cfg, inv("/c", "delete"))
    assert markers.remove(cfg, inv("/a", "delete"))
    assert json.loads(marker.read_text()) == {"roots": ["/b"]}   # /b's marker stays
    assert markers.remove(cfg, inv("/b", "delete"))
    assert names(cfg) == []


def legacy(cfg, root: str, cid: str = CID):
    """A marker as torpor wrote it before markers were named by their root too."""
    d = markers.marker_dir(cfg)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    (d / cid).write_text(json.dumps({"root": root}) + "\n")
    return d / cid


def test_an_earlier_torpors_marker_counts_for_its_root_only(cfg):
    """A container created before the upgrade keeps its marker: its delete (its root) still
    removes it; another root's delete of the same id leaves it."""
    old = legacy(cfg, "/a")
    assert markers.present(cfg, inv("/a", "delete"))
    assert not markers.present(cfg, inv("/b", "delete"))
    assert not markers.remove(cfg, inv("/b", "delete")) and old.exists()
    assert markers.remove(cfg, inv("/a", "delete"))
    assert names(cfg) == []


def test_marking_the_same_root_again_replaces_an_earlier_torpors_marker(cfg):
    old = legacy(cfg, "/a")
    markers.write(cfg, inv("/b"))
    assert old.exists()                    # /a's container: not this one
    markers.write(cfg, inv("/a"))
    assert not old.exists()
    assert names(cfg) == sorted(markers.path(cfg, CID, r).name for r in ("/a", "/b"))


@pytest.mark.parametrize("content", [b"", b"not json", b"[]", b'{"root": 5}', b'{"roots": []}',
                                     b'{"roots": ["/a", 1]}'])
def test_a_marker_that_cannot_be_read_goes_at_the_next_delete_of_its_name(cfg, content):
    markers.write(cfg, inv("/a"))
    target = markers.path(cfg, CID, "/a")
    target.write_bytes(content)
    assert markers.present(cfg, inv("/a"))
    assert markers.remove(cfg, inv("/a", "delete"))
    assert not target.exists()
    old = legacy(cfg, "/a")
    old.write_bytes(content)
    assert markers.present(cfg, inv("/b"))      # an earlier torpor's: any root's, as before
    assert markers.remove(cfg, inv("/b", "delete"))
    assert not old.exists()


def test_write_replaces_an_unreadable_marker_and_never_fails(cfg):
    markers.write(cfg, inv("/a"))
    markers.path(cfg, CID, "/a").write_bytes(b"junk")
    assert markers.write(cfg, inv("/a"))
    assert json.loads(markers.path(cfg, CID, "/a").read_text()) == {"roots": ["/a"]}
    assert not markers.write(cfg, inv("/a", cid="bad/id"))
    assert not markers.remove(cfg, inv("/a", "delete", cid="bad/id"))


def test_remove_without_a_marker_directory_is_nothing(cfg):
    assert not markers.remove(cfg, inv("/a", "delete"))
    assert not markers.marker_dir(cfg).exists()


def test_a_delete_leaves_what_the_id_alone_keys_while_another_root_marks_that_id(cfg,
                                                                              tmp_path):
    """An earlier torpor named the agent socket directory (and torpord's record) by the
    container id alone: X under /b deleted while X under /a (created before the upgrade)
    runs must not take /a's agent directory (its agent would be unreachable); /a's own
    delete then removes it. Each root's own directory: test_runtime_names.py."""
    from torpor.runtime import lifecycle
    from torpor.runtime.runc import Runtime
    runc = tmp_path / "runc"
    runc.write_text("#!/bin/sh\nexit 0\n")
    runc.chmod(0o755)
    markers.write(cfg, inv("/a"))
    markers.write(cfg, inv("/b"))
    agent_dir = lifecycle.agent_dir(cfg, CID, {})     # the id alone: an earlier torpor's
    assert markers.other_roots(cfg, inv("/b", "delete")) == ["/a"]
    d = inv("/b", "delete")
    assert lifecycle.delete(cfg, Runtime(str(runc), d), d) == 0
    assert agent_dir.is_dir() and markers.present(cfg, inv("/a", "delete"))
    assert not markers.present(cfg, d)
    d = inv("/a", "delete")
    assert markers.other_roots(cfg, d) == []
    assert lifecycle.delete(cfg, Runtime(str(runc), d), d) == 0
    assert not agent_dir.exists() and names(cfg) == []


# ---- one root, many spellings --------------------------------------------------------------

@pytest.mark.parametrize("given, normal", [
    ("", ""), ("/", "/"), ("//", "/"), ("/.", "/"), ("/run/runc", "/run/runc"),
    ("/run/runc/", "/run/runc"), ("/run//runc", "/run/runc"), ("/run/./runc", "/run/runc"),
    ("//run/./runc/.//", "/run/runc"), ("/run/../runc/", "/run/../runc"),   # '..' stays
    ("run/", "run"), ("./run", "run"), (".", "."), ("./", "."), ("./.", "."), ("a", "a"),
    ("/run/..", "/run/.."), ("/r/.x/", "/r/.x"),
])
def test_roots_are_read_lexically(given, normal):
    assert markers.normalize_root(given) == normal
    assert markers.root_key(given) == markers.root_key(normal)
    assert markers.raw_key(given) == markers.root_key(normal) or given != normal


def test_spellings_of_one_root_share_its_marker(cfg):
    """An engine that writes /run/runc/ at create and /run/runc at delete (or the other way
    round) deletes the container it created: one marker for both spellings."""
    assert markers.write(cfg, inv("/run//runc/"))
    assert names(cfg) == [f"{CID}@{markers.root_key('/run/runc')}"]
    assert json.loads(markers.path(cfg, CID, "/run/runc").read_text()) == {"roots": ["/run/runc"]}
    for spelling in ("/run/runc", "/run/./runc", "/run/runc/."):
        assert markers.present(cfg, inv(spelling, "delete")), spelling
    assert not markers.present(cfg, inv("/run/../run/runc", "delete"))   # '..' is not resolved
    assert not markers.present(cfg, inv(None, "delete"))
    assert markers.other_roots(cfg, inv("/run/runc/", "delete")) == []
    assert markers.remove(cfg, inv("/run/runc", "delete"))
    assert names(cfg) == []


def unnormalized(cfg, root: str, cid: str = CID):
    """A marker as torpor wrote it before it normalized roots: keyed by the root as given."""
    d = markers.marker_dir(cfg)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    m = d / f"{cid}@{markers.raw_key(root)}"
    m.write_text(json.dumps({"roots": [root]}) + "\n")
    return m


def test_a_marker_keyed_by_the_root_as_given_before_the_upgrade_is_still_found(cfg):
    """X created under "/r/" before the upgrade, deleted under "/r/" after it: its marker is
    found where it is, and goes with that delete."""
    old = unnormalized(cfg, "/r/")
    assert markers.raw_key("/r/") != markers.root_key("/r/")
    assert markers.present(cfg, inv("/r/", "delete"))
    assert not markers.present(cfg, inv("/q/", "delete"))
    assert markers.other_roots(cfg, inv("/r/", "delete")) == []
    assert markers.other_roots(cfg, inv("/q", "delete")) == ["/r/"]
    assert markers.remove(cfg, inv("/r/", "delete"))
    assert not old.exists() and names(cfg) == []


def test_marking_a_root_again_moves_its_unnormalized_marker_to_the_normal_name(cfg):
    old = unnormalized(cfg, "/r/")
    assert markers.write(cfg, inv("/r/"))
    assert not old.exists()
    assert names(cfg) == [markers.path(cfg, CID, "/r").name]
    assert markers.present(cfg, inv("/r/", "delete"))


# -- the process of a marked container (torpor checkpoint refuses it) ---------------------------

PODMAN_ID = "3f" * 32


@pytest.mark.parametrize("cgroup", [
    f"0::/machine.slice/libpod-{PODMAN_ID}.scope/container\n",          # podman, systemd, v2
    f"4:pids:/libpod_parent/libpod-{PODMAN_ID}\n1:name=systemd:/\n",    # podman, cgroupfs, v1
    f"0::/k8s.io/{PODMAN_ID}\n",                                         # containerd (ctr)
    f"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{PODMAN_ID}.scope\n",   # the CRI
])
def test_a_process_in_a_marked_container_is_found_by_its_cgroup(cfg, tmp_path, cgroup):
    assert markers.write(cfg, inv("/run/containerd/runc/k8s.io", cid=PODMAN_ID))
    proc = tmp_path / "proc"
    for pid, text in ((7, "0::/user.slice/user-0.slice/session-1.scope\n"), (8, cgroup)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(text)
    assert markers.container_of(cfg, [6, 7, 8], proc) == (8, PODMAN_ID)   # 6: gone
    assert markers.container_of(cfg, [6, 7], proc) is None


def test_an_unmarked_container_or_a_near_name_is_not_one_of_ours(cfg, tmp_path):
    assert markers.write(cfg, inv(None, cid="1"))    # a ctr id that a session's cgroup holds
    proc = tmp_path / "proc"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text(f"0::/user.slice/user-0.slice/session-1.scope\n"
                                       f"1:pids:/libpod_parent/libpod-{PODMAN_ID}\n")
    assert markers.container_of(cfg, [7], proc) is None
    assert markers.marked_ids(cfg) == {"1"}


def test_no_marker_directory_finds_no_container(cfg, tmp_path):
    assert markers.marked_ids(cfg) == set()
    assert markers.container_of(cfg, [os.getpid()]) is None


@pytest.mark.parametrize("cgroup", ["0::/system.slice/train.scope\n",                 # a unit
                                    "0::/slurmstepd.scope/job_1/step_0/train/task_0\n"])
@pytest.mark.parametrize("bare", [True, False], ids=["our-pid-namespace", "its-own"])
def test_a_short_id_in_a_bare_programs_cgroup_is_no_container(cfg, tmp_path, cgroup, bare):
    """ctr id "train" marked; a process whose cgroup names "train" is that container's only
    in a PID namespace of its own: in ours it is a bare program (a systemd unit, a batch
    step), and torpor checkpoint takes it."""
    assert markers.write(cfg, inv(None, cid="train"))
    proc = tmp_path / "proc"
    (proc / "7" / "ns").mkdir(parents=True)
    (proc / "self" / "ns").mkdir(parents=True)
    (proc / "self" / "ns" / "pid").symlink_to("/proc/self/ns/pid")
    if bare:
        (proc / "7" / "ns" / "pid").symlink_to("/proc/self/ns/pid")
    else:
        (proc / "7" / "ns" / "pid").write_text("")   # another inode: another namespace
    (proc / "7" / "cgroup").write_text(cgroup)
    assert markers.container_of(cfg, [7], proc) == (None if bare else (7, "train"))
