import io
import json
import tarfile

import pytest
import zstandard

from torpor.archive import read_any
from torpor.errors import CorruptCheckpointError, NotFoundError
from unit.test_manifest import _manifest  # noqa: E402  (tests/ is on sys.path via rootdir)


def _tar(path, members: dict[str, bytes], mode="w"):
    with tarfile.open(path, mode) as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


M = json.dumps(_manifest({})).encode()


@pytest.mark.parametrize("suffix,mode", [("tar", "w"), ("tar.gz", "w:gz"), ("tar.xz", "w:xz")])
def test_manifest_from_tar(tmp_path, suffix, mode):
    p = tmp_path / f"a.{suffix}"
    _tar(p, {"checkpoint/pages-1.img": b"x" * 100, "checkpoint/torpor.json": M}, mode)
    assert read_any(p)["root_pid"] == 10


def test_manifest_from_zstd_tar_prefers_the_shallowest(tmp_path):
    raw = tmp_path / "a.tar"
    decoy = json.dumps(dict(_manifest({}), root_pid=99)).encode()
    _tar(raw, {"checkpoint/deeper/torpor.json": decoy, "checkpoint/torpor.json": M})
    p = tmp_path / "a.tar.zst"
    p.write_bytes(zstandard.ZstdCompressor().compress(raw.read_bytes()))
    assert read_any(p)["root_pid"] == 10


def test_archive_errors(tmp_path):
    p = tmp_path / "none.tar"
    _tar(p, {"x": b"y"})
    with pytest.raises(NotFoundError, match="not a torpor checkpoint"):
        read_any(p)
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"\0garbage" * 100)
    with pytest.raises(CorruptCheckpointError):
        read_any(bad)
    trunc = tmp_path / "t.tar.zst"
    trunc.write_bytes(zstandard.ZstdCompressor().compress(b"x" * 10000)[:20])
    with pytest.raises(CorruptCheckpointError):
        read_any(trunc)
    with pytest.raises(NotFoundError):
        read_any(tmp_path / "missing.tar")


def test_nested_manifest_in_an_archive_is_corrupt_not_a_crash(tmp_path):
    p = tmp_path / "deep.tar"
    _tar(p, {"ck/torpor.json": b"[" * 100000 + b"]" * 100000})
    with pytest.raises(CorruptCheckpointError, match="nested too deeply"):
        read_any(p)


def test_a_fifo_named_as_archive_does_not_hang(tmp_path):
    import os
    from torpor.errors import UsageError
    p = tmp_path / "fifo.tar"
    os.mkfifo(p)
    with pytest.raises(UsageError, match="neither"):
        read_any(p)


def _archive_of(tmp_path, damage=None):
    from torpor import manifest
    from unit.test_manifest import _images
    d = _images(tmp_path)
    manifest.write(d, _manifest(manifest.file_table(d, checksums=True)))
    if damage:
        damage(d)
    p = tmp_path / "ck.tar.gz"
    with tarfile.open(p, "w:gz") as t:
        t.add(d, arcname="checkpoint")
    return p


def test_verify_archive_streams_members_against_the_file_table(tmp_path):
    from torpor.archive import verify_archive
    good = _archive_of(tmp_path / "a")
    assert verify_archive(good)['root_pid'] == 10

    def flip(d):
        data = bytearray((d / "pages-1.img").read_bytes())
        data[10] ^= 1
        (d / "pages-1.img").write_bytes(bytes(data))
    bad = _archive_of(tmp_path / "b", flip)
    with pytest.raises(CorruptCheckpointError, match="pages-1.img checksum mismatch"):
        verify_archive(bad)
    gone = _archive_of(tmp_path / "c", lambda d: (d / "sub" / "x.img").unlink())
    with pytest.raises(CorruptCheckpointError, match="sub/x.img is missing"):
        verify_archive(gone)
    extra = _archive_of(tmp_path / "d", lambda d: (d / "planted.img").write_bytes(b"x"))
    with pytest.raises(CorruptCheckpointError, match="planted.img is not listed"):
        verify_archive(extra)


def test_verify_archive_with_the_manifest_at_the_root_and_a_member_twice(tmp_path):
    from torpor import manifest
    from torpor.archive import verify_archive
    from unit.test_manifest import _images
    d = _images(tmp_path)
    manifest.write(d, _manifest(manifest.file_table(d, checksums=True)))
    p = tmp_path / "root.tar"
    with tarfile.open(p, "w") as t:
        for f in sorted(d.rglob("*")):
            t.add(f, arcname=str(f.relative_to(d)), recursive=False)
    assert verify_archive(p)["root_pid"] == 10
    with tarfile.open(p, "a") as t:   # a second pstree.img: extraction would take this one
        info = tarfile.TarInfo("pstree.img")
        info.size = 3
        t.addfile(info, io.BytesIO(b"bad"))
    with pytest.raises(CorruptCheckpointError, match="pstree.img is in the archive twice"):
        verify_archive(p)
