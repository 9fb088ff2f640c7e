"""criu.dump_stats: CRIU's stats-dump, read with pycriu, as the pause reports it; anything it
cannot read is no stats, never an error (it only informs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor import criu

pycriu = pytest.importorskip("pycriu")


def _write(path: Path, dump: dict) -> None:
    from pycriu import images
    with open(path / "stats-dump", "wb") as f:
        images.dump({"magic": "STATS", "entries": [{"dump": dump}]}, f)


def test_the_stats_in_seconds(tmp_path):
    _write(tmp_path, {"freezing_time": 180, "frozen_time": 556295, "memdump_time": 549072,
                      "memwrite_time": 533523, "pages_scanned": 51947, "pages_skipped_parent": 0,
                      "irmap_resolve": 0, "pages_lazy": 0,
                      "pages_written": 51877})
    assert criu.dump_stats(tmp_path) == {"frozen_s": 0.5563, "memdump_s": 0.5491,
                                         "memwrite_s": 0.5335, "pages_written": 51877}


@pytest.mark.parametrize("content", [None, b"", b"\x00" * 40, b"garbage" * 100])
def test_no_or_a_damaged_file_is_no_stats(tmp_path, content):
    if content is not None:
        (tmp_path / "stats-dump").write_bytes(content)
    assert criu.dump_stats(tmp_path) is None


def test_a_restore_stats_file_is_no_dump_stats(tmp_path):
    from pycriu import images
    with open(tmp_path / "stats-dump", "wb") as f:
        images.dump({"magic": "STATS", "entries": [{"restore": {
            "pages_compared": 1, "pages_skipped_cow": 0, "forking_time": 5,
            "restore_time": 7}}]}, f)
    assert criu.dump_stats(tmp_path) is None


def test_stats_older_than_the_dump_are_an_earlier_dumps(tmp_path):
    """podman's --work-path outlives checkpoints: a stats-dump written before this pause
    began is an earlier dump's, not this one's."""
    import os
    import time
    _write(tmp_path, {"freezing_time": 1, "frozen_time": 2, "memdump_time": 1,
                      "memwrite_time": 1, "pages_scanned": 1, "pages_skipped_parent": 0,
                      "irmap_resolve": 0, "pages_lazy": 0, "pages_written": 1})
    now = time.time()
    os.utime(tmp_path / "stats-dump", (now - 60, now - 60))
    assert criu.dump_stats(tmp_path, since=now - 5) is None
    assert criu.dump_stats(tmp_path, since=now - 120)["pages_written"] == 1


def test_a_fifo_or_a_huge_file_is_not_read(tmp_path):
    import os
    os.mkfifo(tmp_path / "stats-dump")
    assert criu.dump_stats(tmp_path) is None        # never waited on
    (tmp_path / "stats-dump").unlink()
    (tmp_path / "stats-dump").write_bytes(b"\x00" * (1 << 20))
    assert criu.dump_stats(tmp_path) is None
