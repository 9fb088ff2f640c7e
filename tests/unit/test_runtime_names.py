"""What torpor keeps per container on the host is named by (runtime root, id), as its marker is:
the agent socket directory <run_dir>/agents/<id>@<root key> and torpord's record. One id under
two roots (containerd namespaces; podman and ctr side by side), both GPU containers under the
agent: each has its own directory (both main processes are nspid 1, so one directory would hold
one agent-1.sock for two programs) and its own record, and the delete of one leaves the
other's. Containers an earlier torpor created (agents/<id>, a record by the id alone) keep
working. torpord's side of the names: test_sidecar_service.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import torpor_hook
from tests.unit.test_runtime_flows import (CID, Exec, checkpoint_argv, world,  # noqa: F401
                                           write_spec)
from torpor import oci
from torpor.runtime import lifecycle, libc, markers
from torpor.runtime import main as rt_main
from torpor.runtime.argv import parse
from torpor.sidecar import client as sidecar_client
from torpor.sidecar.containers import Containers


def name(root: str) -> str:
    return f"{CID}@{markers.root_key(root)}"


@pytest.fixture
def agent_fits(monkeypatch):
    """The agent loads in any container here (runtime/libc.py is tested on its own)."""
    monkeypatch.setattr(lifecycle.libc, "agent_fit",
                        lambda spec, bundle, library: libc.Fit(True, "glibc (test)"))


def create(world, root: str, tmp_path: Path) -> dict:
    """torpor-runtime --root root create of a GPU container CID; its spec as runc gets it."""
    bundle = tmp_path / f"bundle-{markers.root_key(root)}"
    bundle.mkdir()
    write_spec(bundle, gpu=True)
    argv = ["--root", root, "create", "--bundle", str(bundle), CID]
    with pytest.raises(Exec):
        rt_main.main(argv)
    return json.loads((bundle / "config.json").read_text())


class Torpord:
    """torpord's client for lifecycle.delete, over a real container registry."""

    def __init__(self, cfg: Any):
        self.containers = Containers(cfg.state_dir / "containers")
        self.unregistered: list[str] = []
        cfg.socket_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.socket_path.touch()      # "torpord runs"

    def register(self, name: str) -> None:
        self.containers.put({"id": name, "pids": []})

    def names(self) -> list[str]:
        return sorted(r["id"] for r in self.containers.all())

    def __call__(self, cfg: Any, timeout: Any = None) -> "Torpord":
        return self

    def __enter__(self) -> "Torpord":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def unregister_container(self, name: str, missing_ok: bool = False) -> bool:
        self.unregistered.append(name)
        return self.containers.remove(name)


@pytest.fixture
def torpord(cfg, monkeypatch) -> Torpord:
    t = Torpord(cfg)
    monkeypatch.setattr(sidecar_client, "Client", t)
    return t


def delete(cfg, world, root: str) -> int:
    inv = parse(["--root", root, "delete", CID])
    return lifecycle.delete(cfg, lifecycle.Runtime(str(world["runc"].path), inv), inv)


def test_one_id_under_two_roots_gets_two_agent_directories(world, agent_fits, tmp_path, cfg):
    a, b = create(world, "/run/a", tmp_path), create(world, "/run/b", tmp_path)
    dirs = cfg.run_dir / "agents"
    assert oci.agent_host_dir(a) == str(dirs / name("/run/a"))
    assert oci.agent_host_dir(b) == str(dirs / name("/run/b"))
    assert sorted(p.name for p in dirs.iterdir()) == sorted([name("/run/a"), name("/run/b")])
    for p in dirs.iterdir():
        assert p.stat().st_mode & 0o777 == 0o700
    # what torpor-hook reads from the state to register each by its own name
    for spec, root in ((a, "/run/a"), (b, "/run/b")):
        assert spec["annotations"][oci.ROOT_KEY_ANNOTATION] == markers.root_key(root)
        assert oci.name_in_state({"id": CID, "annotations": spec["annotations"]}) == name(root)


def test_spellings_of_one_root_name_one_agent_directory(world, agent_fits, tmp_path, cfg):
    spec = create(world, "/run//a/", tmp_path)
    assert oci.agent_host_dir(spec) == str(cfg.run_dir / "agents" / name("/run/a"))
    assert lifecycle.agent_name(cfg, parse(["--root", "/run/./a", "state", CID])) == \
        name("/run/a")


def test_delete_under_one_root_leaves_the_others_directory_and_record(world, agent_fits,
                                                                     tmp_path, cfg, torpord):
    create(world, "/run/a", tmp_path)
    create(world, "/run/b", tmp_path)
    torpord.register(name("/run/a"))
    torpord.register(name("/run/b"))
    dirs = cfg.run_dir / "agents"
    assert delete(cfg, world, "/run/b") == 0
    assert [p.name for p in dirs.iterdir()] == [name("/run/a")]
    assert torpord.names() == [name("/run/a")]
    assert torpord.unregistered == [name("/run/b")]   # not the id alone: /run/a marks it
    assert markers.present(cfg, parse(["--root", "/run/a", "state", CID]))
    assert delete(cfg, world, "/run/a") == 0
    assert list(dirs.iterdir()) == [] and torpord.names() == []
    assert markers.other_roots(cfg, parse(["--root", "/run/a", "delete", CID])) == []


def legacy_container(cfg, root: str, bundle: Path) -> Path:
    """A GPU container under the agent as an earlier torpor created it: its marker and agent
    directory named by the id alone, that directory bound into it."""
    old = cfg.run_dir / "agents" / CID
    old.mkdir(parents=True, mode=0o700)
    (cfg.run_dir / "containers").mkdir(mode=0o700)
    (cfg.run_dir / "containers" / CID).write_text(json.dumps({"root": root}))
    bundle.mkdir(exist_ok=True)
    write_spec(bundle, gpu=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["mounts"] = [{"destination": oci.AGENT_DIR_IN_CONTAINER, "type": "bind",
                       "source": str(old), "options": ["bind", "rw"]}]
    (bundle / "config.json").write_text(json.dumps(spec))
    return old


def test_a_container_an_earlier_torpor_created_keeps_its_agent_directory(world, cfg):
    """Its checkpoint finds its agents where they are, in agents/<id>."""
    legacy_container(cfg, "/r", world["bundle"])
    assert rt_main.main(checkpoint_argv(world["images"])) == 0
    lock = world["client"].calls[1][1]
    assert lock["agent_container_id"] == CID


def test_a_new_container_beside_an_earlier_torpors_of_its_id_has_its_own(world, cfg,
                                                                         tmp_path):
    """X created by an earlier torpor under /old runs on; X created now under /r has the
    agent off: its checkpoint must not look for agents in the other's agents/<id>."""
    legacy_container(cfg, "/old", tmp_path / "old-bundle")
    write_spec(world["bundle"], gpu=True)
    assert rt_main.main(checkpoint_argv(world["images"])) == 0
    assert world["client"].calls[1][1]["agent_container_id"] == name("/r")


def _store_on(world, monkeypatch, tmp_path: Path) -> Path:
    """The container's checkpoints go into the image store at tmp_path/store."""
    monkeypatch.setenv("TORPOR_STORE_DIR", str(tmp_path / "store"))
    spec = json.loads((world["bundle"] / "config.json").read_text())
    spec.setdefault("annotations", {})["org.torpor.store"] = "on"
    (world["bundle"] / "config.json").write_text(json.dumps(spec))
    return tmp_path / "store"


def _packed_owner(world, store: Path) -> str:
    """Its checkpoint's snapshot's owner, which must be the owner torpord's agents were
    given fingerprints for (named by agent_container_id, fingerprints.owner_of)."""
    from torpor.store import Store, fingerprints
    assert rt_main.main(checkpoint_argv(world["images"])) == 0
    lock = world["client"].calls[1][1]
    (snap,) = Store(store).snapshots()
    assert snap.owner == fingerprints.owner_of(lock["agent_container_id"])
    return snap.owner


def test_a_containers_checkpoint_is_packed_under_its_root_keyed_name(world, monkeypatch,
                                                                    tmp_path):
    """Its fingerprints are its own, not every root's container of that id's."""
    write_spec(world["bundle"], gpu=True)
    assert _packed_owner(world, _store_on(world, monkeypatch, tmp_path)) \
        == f"container:{name('/r')}"


def test_an_earlier_torpors_container_keeps_its_ids_owner(world, cfg, monkeypatch, tmp_path):
    """agents/<id>: its snapshots packed before root keys stay its own."""
    legacy_container(cfg, "/r", world["bundle"])
    assert _packed_owner(world, _store_on(world, monkeypatch, tmp_path)) == f"container:{CID}"


def test_under_a_torpord_from_before_the_root_keys_the_pack_names_the_ids_owner(
        world, monkeypatch, tmp_path):
    """A torpord left running across the upgrade answers no store_owner and handed the
    agents container:<id>'s fingerprints: the pack names that owner, so that what they
    skipped resolves (under <id>@<key> it could not, and the checkpoint would lack it)."""
    from torpor.store import Store
    write_spec(world["bundle"], gpu=True)
    store = _store_on(world, monkeypatch, tmp_path)
    world["client"].answers_owner = False
    assert rt_main.main(checkpoint_argv(world["images"])) == 0
    assert world["client"].calls[1][1]["agent_container_id"] == name("/r")
    (snap,) = Store(store).snapshots()
    assert snap.owner == f"container:{CID}"


def test_the_pack_names_the_owner_torpord_answered(world, monkeypatch, tmp_path):
    """torpord decides whose fingerprints the agents get; the runtime packs under that, and
    refuses (the checkpoint kept, unpacked, one warning) an owner no torpord could make."""
    from torpor.store import Store
    write_spec(world["bundle"], gpu=True)
    store = _store_on(world, monkeypatch, tmp_path)
    world["client"]._owner = lambda n: "container:../etc"
    assert rt_main.main(checkpoint_argv(world["images"])) == 0
    assert Store(store).snapshots() == []
    assert (world["images"] / "torpor.json").exists()


def test_delete_of_an_earlier_torpors_container_removes_what_the_id_alone_names(world, cfg,
                                                                                torpord):
    old = legacy_container(cfg, "/r", world["bundle"])
    torpord.register(CID)
    assert delete(cfg, world, "/r") == 0
    assert not old.exists() and torpord.names() == []
    assert sorted(torpord.unregistered) == sorted([CID, name("/r")])


def test_what_the_id_alone_names_stays_while_another_root_marks_the_id(world, agent_fits,
                                                                       tmp_path, cfg, torpord):
    """An earlier torpor's X under /old runs on; X created now under /r is deleted: agents/X
    and the record X may be /old's, and stay until /old's own delete."""
    old = legacy_container(cfg, "/old", tmp_path / "old-bundle")
    torpord.register(CID)
    create(world, "/r", tmp_path)
    torpord.register(name("/r"))
    assert delete(cfg, world, "/r") == 0
    assert old.is_dir() and torpord.names() == [CID]
    assert not (cfg.run_dir / "agents" / name("/r")).exists()
    assert delete(cfg, world, "/old") == 0
    assert not old.exists() and torpord.names() == []


@pytest.mark.parametrize("annotations, want", [
    ({oci.ROOT_KEY_ANNOTATION: "0123456789abcdef"}, f"{CID}@0123456789abcdef"),
    ({}, CID),                                     # an earlier torpor's container, or not ours
    (None, CID),
])
def test_the_hook_registers_and_forgets_the_containers_name(cfg, tmp_path, monkeypatch,
                                                           annotations, want):
    bundle = tmp_path / "b"
    bundle.mkdir()
    write_spec(bundle, gpu=True)
    calls: list[tuple[str, str]] = []

    class Client:
        def __init__(self, *a: Any, **kw: Any):
            pass

        def __enter__(self) -> "Client":
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def register_container(self, name: str, *a: Any) -> None:
            calls.append(("register", name))

        def unregister_container(self, name: str, missing_ok: bool = False) -> bool:
            calls.append(("unregister", name))
            return True
    monkeypatch.setattr(sidecar_client, "Client", Client)
    monkeypatch.setattr(sidecar_client, "ensure_running", lambda cfg, wait_s=0: None)
    cfg.socket_path.parent.mkdir(parents=True, exist_ok=True)
    cfg.socket_path.touch()
    state = {"id": CID, "pid": 4242, "bundle": str(bundle), "annotations": annotations}
    assert want in torpor_hook.register(state, cfg)
    torpor_hook.unregister(state, cfg)
    assert calls == [("register", want), ("unregister", want)]


@pytest.mark.parametrize("key", ["0123456789ABCDEF", "../../x", "0123", 7])
def test_the_hook_registers_nothing_under_a_bad_key(cfg, tmp_path, key):
    with pytest.raises(Exception, match="bad container name"):
        oci.name_in_state({"id": CID, "annotations": {oci.ROOT_KEY_ANNOTATION: key}})


def test_ps_looks_for_a_containers_agent_in_the_directory_of_its_name(cfg):
    from torpor.cli import ps
    agents = cfg.run_dir / "agents"
    assert ps._container(cfg, name("/r")) == (CID, agents / name("/r"))
    assert ps._container(cfg, CID) == (CID, agents / CID)          # an earlier torpor's
    assert ps._container(cfg, "") == ("", None)
    assert ps._container(cfg, "../x") == ("../x", None)             # never outside agents/
