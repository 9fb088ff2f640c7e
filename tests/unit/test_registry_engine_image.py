"""The image of an engine's own checkpoint (runc through containerd's CRI or podman: no
torpor.json) must be one containerd 2 pulls: its config's optional "created" is absent or an
RFC 3339 time, never "" (containerd 2.1's PullImage failed on it: "parsing time \"\" as
\"2006-01-02T15:04:05Z07:00\"", seen rehearsing tests/gpu/test_cri_gpu.py's registry flow)."""

from __future__ import annotations

import io
import json
import tarfile
from datetime import datetime
from pathlib import Path

from torpor.registry import build


def _engine_archive(tmp_path: Path) -> Path:
    out = tmp_path / "checkpoint-pod_default-c-2026.tar"
    with tarfile.open(out, "w") as tar:
        for name, data in (("config.dump", b'{"name": "c"}'), ("spec.dump", b"{}"),
                           ("checkpoint/inventory.img", b"\0" * 64)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def test_an_engines_checkpoint_image_has_no_empty_created_time(tmp_path):
    r = build.build(_engine_archive(tmp_path), tmp_path / "out", name="c")
    blobs = tmp_path / "out" / "blobs" / "sha256"
    image = json.loads((blobs / r.digest[7:]).read_text())
    config = json.loads((blobs / image["config"]["digest"][7:]).read_text())
    assert config["rootfs"]["diff_ids"] == [image["layers"][0]["digest"]]
    if "created" in config:
        datetime.fromisoformat(config["created"].replace("Z", "+00:00"))
