"""flat.py: torpor-runtime's image directory flattened for containerd 2's CRI and put back at
restore; names read back are untrusted."""

import io
import os
import stat
import tarfile
from pathlib import Path, PurePosixPath

import pytest

from torpor import flat, manifest
from torpor.archive import verify_archive
from torpor.errors import CorruptCheckpointError, TorporError
from torpor.store import images as store_images
from unit.test_manifest import _manifest

SHA = "ab" * 32
TREE_FILES = {"torpor-gpu/4242/gpu-memory-0.bin": b"g0" * 100,
              "torpor-gpu/4242/gpu-memory-1.bin": b"g1" * 50,
              "torpor-gpu/4242/gpu-fingerprints.txt": b"fp\n",
              "torpor-gpu/77/gpu-memory-0.bin": b"",
              f"torpor-chunks/{SHA}": b"chunk"}


def _checkpoint(tmp_path: Path) -> Path:
    """A sealed checkpoint directory with both of torpor's trees beside CRIU's files."""
    d = tmp_path / "img"
    d.mkdir(mode=0o700)
    for name in ("inventory.img", "pstree.img", "pages-1.img"):
        (d / name).write_bytes(name.encode() * 7)
    for rel, data in TREE_FILES.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        (d / rel).write_bytes(data)
        (d / rel).chmod(0o600)
    manifest.write(d, _manifest(manifest.file_table(d, checksums=True)))
    return d


def _listing(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_encode_and_decode_round_trip():
    for rel in TREE_FILES:
        name = flat.encode(rel)
        assert "/" not in name and ".." not in name and name.startswith(rel.split("/")[0] + "+")
        assert flat.decode(name) == PurePosixPath(rel)
    assert flat.encode("torpor-gpu/123/gpu-memory-0.bin") == "torpor-gpu+123+gpu-memory-0.bin"
    for plain in ("pages-1.img", "torpor.json", "torpor-gpu", "torpor-store.json", "x+y"):
        assert flat.decode(plain) is None


@pytest.mark.parametrize("rel", ["pages-1.img", "torpor-gpu", "other/1/x", "torpor-gpu/../x",
                                 "torpor-gpu/a+b", "torpor-gpu/1/a..b", "torpor-gpu/.hidden",
                                 "torpor-gpu/1/x\0y", "torpor-gpu/" + "x" * 250])
def test_encode_refuses_what_has_no_flat_name(rel):
    with pytest.raises(TorporError):
        flat.encode(rel)


@pytest.mark.parametrize("name", ["torpor-gpu+..+x", "torpor-gpu+1+..", "torpor-gpu++x",
                                  "torpor-gpu+", "torpor-gpu+1+a..b", "torpor-gpu+/etc+x",
                                  "torpor-chunks+x\0y", "torpor-gpu+.+x", "torpor-gpu+1+x\n",
                                  "torpor-chunks+" + "a" * 250, "torpor-gpu+1+.hidden",
                                  "torpor-gpu+1+a b"])
def test_decode_refuses_hostile_names(name):
    with pytest.raises(CorruptCheckpointError, match="not a valid flat name"):
        flat.decode(name)


def test_flatten_then_unflatten_gives_the_same_checkpoint_back(tmp_path):
    d = _checkpoint(tmp_path)
    before = _listing(d)
    chunk = d / "torpor-chunks" / SHA
    os.link(chunk, tmp_path / "store-blob")   # a chunk hard-linked into a store
    inode = chunk.stat().st_ino
    assert flat.flatten(d) == len(TREE_FILES)
    assert all(p.is_file() for p in d.iterdir()), sorted(os.listdir(d))   # no directory left
    assert (d / f"torpor-chunks+{SHA}").stat().st_ino == inode   # renamed, never copied
    manifest.verify(d, manifest.read(d))       # readers find every file under its flat name
    assert flat.unflatten(d) == len(TREE_FILES)
    assert _listing(d) == before
    assert (d / "torpor-chunks" / SHA).stat().st_ino == inode
    manifest.verify(d, manifest.read(d))
    assert flat.unflatten(d) == 0              # an old layout (subdirectories): nothing to do


def test_unflatten_makes_private_directories_and_files(tmp_path):
    d = _checkpoint(tmp_path)
    flat.flatten(d)
    for p in d.iterdir():
        p.chmod(0o644)   # as containerd's os.Create left them
    os.umask(old := os.umask(0))
    flat.unflatten(d)
    os.umask(old)
    for rel in TREE_FILES:
        assert stat.S_IMODE((d / rel).stat().st_mode) == 0o600
    for sub in ("torpor-gpu", "torpor-gpu/4242", "torpor-chunks"):
        assert stat.S_IMODE((d / sub).stat().st_mode) == 0o700


def test_flatten_of_an_image_path_used_again_forgets_the_old_flat_files(tmp_path):
    d = _checkpoint(tmp_path)
    (d / "torpor-gpu+999+gpu-memory-0.bin").write_bytes(b"old")
    flat.remove_flat(d)
    assert not (d / "torpor-gpu+999+gpu-memory-0.bin").exists()
    assert (d / "pages-1.img").exists() and (d / "torpor-gpu").is_dir()


def test_flatten_refuses_links_and_collisions_and_changes_nothing(tmp_path):
    d = _checkpoint(tmp_path)
    before = _listing(d)
    (d / "torpor-gpu" / "4242" / "link").symlink_to("/etc/passwd")
    with pytest.raises(TorporError, match="not a regular file"):
        flat.flatten(d)
    (d / "torpor-gpu" / "4242" / "link").unlink()
    assert _listing(d) == before
    (d / "torpor-gpu+77+gpu-memory-0.bin").write_bytes(b"x")
    with pytest.raises(TorporError, match="exists already"):
        flat.flatten(d)
    (d / "torpor-gpu+77+gpu-memory-0.bin").unlink()
    assert _listing(d) == before


def _flat_dir(tmp_path: Path) -> Path:
    d = _checkpoint(tmp_path)
    flat.flatten(d)
    return d


def test_unflatten_refuses_a_symlink_under_a_flat_name(tmp_path):
    d = _flat_dir(tmp_path)
    target = tmp_path / "secret"
    target.write_bytes(b"host file")
    (d / "torpor-gpu+4242+gpu-memory-5.bin").symlink_to(target)
    before = sorted(os.listdir(d))
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        flat.unflatten(d)
    assert sorted(os.listdir(d)) == before   # refused before the first rename


def test_unflatten_refuses_a_fifo_or_a_directory_under_a_flat_name(tmp_path):
    d = _flat_dir(tmp_path)
    os.mkfifo(d / "torpor-gpu+4242+gpu-memory-6.bin")
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        flat.unflatten(d)   # and does not hang on it
    os.unlink(d / "torpor-gpu+4242+gpu-memory-6.bin")
    (d / "torpor-gpu+4242+gpu-memory-6.bin").mkdir()
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        flat.unflatten(d)


def test_unflatten_refuses_a_link_or_a_file_where_a_directory_should_be(tmp_path):
    d = _flat_dir(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (d / "torpor-gpu").symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match="not a directory"):
        flat.unflatten(d)
    assert list(outside.iterdir()) == []
    (d / "torpor-gpu").unlink()
    (d / "torpor-gpu").write_bytes(b"a file")
    with pytest.raises(CorruptCheckpointError, match="not a directory"):
        flat.unflatten(d)
    (d / "torpor-gpu").unlink()
    (d / "torpor-gpu+4242").write_bytes(b"a file that is also a folder")
    with pytest.raises(CorruptCheckpointError, match="both a file and a directory"):
        flat.unflatten(d)


def test_unflatten_refuses_a_collision_with_the_tree_layout(tmp_path):
    d = _flat_dir(tmp_path)
    (d / "torpor-gpu" / "4242").mkdir(parents=True)
    (d / "torpor-gpu" / "4242" / "gpu-memory-0.bin").write_bytes(b"other")
    with pytest.raises(CorruptCheckpointError, match="collision"):
        flat.unflatten(d)
    assert (d / "torpor-gpu" / "4242" / "gpu-memory-0.bin").read_bytes() == b"other"
    with pytest.raises(CorruptCheckpointError, match="both as a file of its folder and as a "
                                                     "flat file"):
        manifest.verify(d, manifest.read(d))


def test_unflatten_refuses_a_hostile_name_before_moving_anything(tmp_path):
    d = _flat_dir(tmp_path)
    (d / "torpor-gpu+..+x").write_bytes(b"x")
    before = sorted(os.listdir(d))
    with pytest.raises(CorruptCheckpointError, match="not a valid flat name"):
        flat.unflatten(d)
    assert sorted(os.listdir(d)) == before


def test_verify_of_a_flat_directory_checks_sizes_and_sums(tmp_path):
    d = _flat_dir(tmp_path)
    (d / "torpor-gpu+4242+gpu-memory-1.bin").write_bytes(b"short")
    with pytest.raises(CorruptCheckpointError, match="gpu-memory-1.bin has 5 bytes"):
        manifest.verify(d, manifest.read(d))
    (d / "torpor-gpu+4242+gpu-memory-1.bin").unlink()
    with pytest.raises(CorruptCheckpointError, match="torpor-gpu/4242/gpu-memory-1.bin is "
                                                     "missing"):
        manifest.verify(d, manifest.read(d))


def test_a_packed_checkpoint_flattened_verifies_and_unpacks_elsewhere(tmp_path):
    """A checkpoint packed into the store (its chunks hard links into it), flattened: the
    chunks stay the store's inodes, inspect --verify finds every chunk under its flat name, and
    another host's restore unflattens, imports each chunk and gets the files back."""
    from torpor.store import Store
    d = tmp_path / "ck"
    files = {"torpor.json": b'{"kind": "torpor-checkpoint"}', "inventory.img": b"inv",
             "pages-1.img": os.urandom(3 << 20),
             "torpor-gpu/7/gpu-memory-0.bin": os.urandom(1 << 20)}
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        (d / rel).write_bytes(data)
    store = Store(tmp_path / "store")
    store_images.pack(store, d, "one")
    inodes = {p.name: p.stat().st_ino for p in (d / "torpor-chunks").iterdir()}
    assert all((d / "torpor-chunks" / n).stat().st_nlink == 2 for n in inodes)   # linked
    flat.flatten(d)
    assert not (d / "torpor-chunks").exists()
    assert {n: (d / f"torpor-chunks+{n}").stat().st_ino for n in inodes} == inodes
    assert store_images.verify(d) == len(inodes)
    victim = d / f"torpor-chunks+{sorted(inodes)[0]}"
    data = victim.read_bytes()
    victim.unlink()                             # break the link: the store's blob stays whole
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CorruptCheckpointError):
        store_images.verify(d)
    victim.write_bytes(data)
    flat.unflatten(d)
    out = store_images.unpack(Store(tmp_path / "other"), d)
    assert {rel: (out / rel).read_bytes() for rel in files} == files


def _kubelet_archive(d: Path, path: Path, extra: dict[str, bytes] | None = None) -> Path:
    """d as containerd 2's CRI puts it into the kubelet's archive: checkpoint/<file>, plain
    files only."""
    with tarfile.open(path, "w") as t:
        for f in sorted(d.iterdir()):
            t.add(f, arcname=f"checkpoint/{f.name}", recursive=False)
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def test_verify_archive_of_a_flat_checkpoint(tmp_path):
    d = _flat_dir(tmp_path)
    good = _kubelet_archive(d, tmp_path / "ck.tar")
    assert verify_archive(good)["root_pid"] == 10
    hostile = _kubelet_archive(d, tmp_path / "bad.tar", {"checkpoint/torpor-gpu+1+a..b": b"x"})
    with pytest.raises(CorruptCheckpointError, match="not a valid flat name"):
        verify_archive(hostile)
    twice = _kubelet_archive(d, tmp_path / "twice.tar",
                             {"checkpoint/torpor-gpu/77/gpu-memory-0.bin": b""})
    with pytest.raises(CorruptCheckpointError, match="in the archive twice"):
        verify_archive(twice)
    (d / "torpor-gpu+4242+gpu-memory-0.bin").write_bytes(b"G0" * 99)
    with pytest.raises(CorruptCheckpointError, match="torpor-gpu/4242/gpu-memory-0.bin has 198 "
                                                     "bytes"):
        verify_archive(_kubelet_archive(d, tmp_path / "short.tar"))
    (d / "pages-1.img").write_bytes(b"P" * len((d / "pages-1.img").read_bytes()))
    (d / "torpor-gpu+4242+gpu-memory-0.bin").write_bytes(b"g0" * 100)
    with pytest.raises(CorruptCheckpointError, match="pages-1.img checksum mismatch"):
        verify_archive(_kubelet_archive(d, tmp_path / "flipped.tar"))
