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
