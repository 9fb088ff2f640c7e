"""store/images.py without CRIU: a checkpoint directory packed into the store and written back,
and process.restore_any's side of it (what it restores from, what it removes, what it says)."""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path

import pytest

from torpor import process
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


def test_restore_any_restores_from_the_unpacked_copy_then_removes_it(sealed, tmp_path, cfg,
                                                                     monkeypatch):
    images.pack(Store(tmp_path / "store"), sealed, "one")
    seen = []

    def restore(engine, images_dir, **kw):
        seen.append((images_dir, (images_dir / "pages-1.img").read_bytes() == FILES["pages-1.img"]
                     and kw["verify"] is False))     # the chunks' sha256 did the checking
        raise CorruptCheckpointError(f"{images_dir}: the manifest's CUDA processes are missing")
    monkeypatch.setattr(process, "restore", restore)
    engine = Engine(dataclasses.replace(cfg, store_dir=tmp_path / "store"), Progress(io.StringIO()))
    with pytest.raises(CorruptCheckpointError) as e:
        process.restore_any(engine, sealed, verify=True)
    (unpacked, intact), = seen
    assert intact and unpacked.parent == sealed and not unpacked.exists()
    assert str(e.value).startswith(f"{sealed}: ") and images.UNPACKED_PREFIX not in str(e.value)


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
