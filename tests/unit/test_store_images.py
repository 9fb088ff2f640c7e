"""store/images.py without CRIU: a checkpoint directory packed into the store and written back,
and process.restore_any's side of it (what it restores from, what it removes, what it says)."""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from torpor import procs
from torpor.flows import process
from torpor.flows import restore as flows_restore
from torpor.engine import Engine
from torpor.errors import CorruptCheckpointError
from torpor.progress import Progress
from torpor.store import Store, images

FILES = {"torpor.json": b'{"kind": "torpor-checkpoint"}\n', "inventory.img": b"inventory",
         "pages-1.img": os.urandom(5 << 20),
         "torpor-gpu/7/gpu-memory-0.bin": bytes(4 << 20) + b"tail"}


@pytest.fixture
def sealed(tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    for rel, data in FILES.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        (d / rel).write_bytes(data)
    return d


def test_pack_leaves_a_self_contained_directory_and_unpack_gives_the_files_back(sealed, tmp_path):
    store = Store(tmp_path / "store")
    doc, stats = images.pack(store, sealed, "one")
    assert sorted(p.name for p in sealed.iterdir()) == ["inventory.img", "torpor-chunks",
                                                       "torpor-store.json", "torpor.json"]
    assert stats.zero_chunks == 1 and images.verify(sealed) == stats.new_chunks
    other = Store(tmp_path / "other")                   # another host: chunks come from DIR
    out = images.unpack(other, sealed)
    assert out.parent == sealed and out.name.startswith(images.UNPACKED_PREFIX)
    assert {rel: (out / rel).read_bytes() for rel in FILES} == FILES


@pytest.fixture
def shm_dir():
    d = Path(tempfile.mkdtemp(prefix="torpor-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("where", ["host memory", "disk suspend_dir", "too large for memory"])
def test_restore_any_restores_from_the_unpacked_copy_then_removes_it(sealed, tmp_path, cfg,
                                                                     monkeypatch, shm_dir, where):
    images.pack(Store(tmp_path / "store"), sealed, "one")
    seen = []

    gpu_file = "torpor-gpu/7/gpu-memory-0.bin"

    def restore(engine, images_dir, **kw):
        seen.append((images_dir, (images_dir / "pages-1.img").read_bytes() == FILES["pages-1.img"]
                     and kw["verify"] is False     # the chunks' sha256 did the checking
                     # the agent's data streams from the store (store/stream.py): not unpacked
                     and kw["in_store"] == {gpu_file: len(FILES[gpu_file])}
                     and kw["packed"] == sealed and not (images_dir / gpu_file).exists()))
        raise CorruptCheckpointError(f"{images_dir}: the manifest's CUDA processes are missing")
    monkeypatch.setattr(flows_restore, "restore", restore)
    suspend_dir = tmp_path / "suspend" if where == "disk suspend_dir" else shm_dir / "torpor"
    if where == "too large for memory":   # the copy may take half of what is available
        unpacked = sum(len(v) for rel, v in FILES.items() if rel != gpu_file)
        monkeypatch.setattr(procs, "mem_available", lambda: 2 * unpacked - 1)
    engine = Engine(dataclasses.replace(cfg, store_dir=tmp_path / "store", suspend_dir=suspend_dir),
                    Progress(io.StringIO()))
    with pytest.raises(CorruptCheckpointError) as e:
        process.restore_any(engine, sealed, verify=True)
    (unpacked, intact), = seen
    assert intact and unpacked.parent == (suspend_dir if where == "host memory" else sealed)
    assert not unpacked.exists()
    assert str(e.value).startswith(f"{sealed}: ") and images.UNPACKED_PREFIX not in str(e.value)


def test_a_dead_restores_copy_is_removed_and_a_running_ones_kept(sealed, tmp_path, shm_dir):
    images.pack(Store(tmp_path / "store"), sealed, "one")
    dead = subprocess.Popen(["true"])
    dead.wait()
    running = subprocess.Popen(["sleep", "60"])
    try:
        for pid in (dead.pid, running.pid):
            (shm_dir / f"{images.UNPACKED_PREFIX}{pid}-0123456789ab" / "x").mkdir(parents=True)
        out = images.unpack(Store(tmp_path / "store"), sealed, shm_dir)
        assert sorted(p.name for p in shm_dir.iterdir()) == sorted(
            [out.name, f"{images.UNPACKED_PREFIX}{running.pid}-0123456789ab"])
    finally:
        running.kill()
        running.wait()


def test_unpack_in_place_puts_the_files_back_and_the_directory_is_ordinary_again(sealed, tmp_path):
    images.pack(Store(tmp_path / "store"), sealed, "one")
    other = Store(tmp_path / "other")
    images.unpack_in_place(other, sealed)
    assert {rel: (sealed / rel).read_bytes() for rel in FILES} == FILES
    assert not images.is_packed(sealed) and not (sealed / images.CHUNKS).exists()
    assert not list(sealed.glob(f"{images.UNPACKED_PREFIX}*"))
    assert "one" in Store(tmp_path / "store").backend.snapshots()


def test_unpack_in_place_never_writes_through_a_planted_link(sealed, tmp_path):
    images.pack(Store(tmp_path / "store"), sealed, "one")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (sealed / "torpor-gpu").symlink_to(elsewhere)       # as a crafted archive could hold
    with pytest.raises(CorruptCheckpointError, match="not a directory"):
        images.unpack_in_place(Store(tmp_path / "store"), sealed)
    assert list(elsewhere.iterdir()) == [] and images.is_packed(sealed)
