"""flows/writeout.py's parts: the copy (holes kept, fsynced), the throttle, the room check,
and how a failed or orphaned write-out is marked (never sealed)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from torpor import config, manifest, procs
from torpor.errors import CorruptCheckpointError, UsageError
from torpor.flows import writeout
from torpor.layout import DAMAGED, DRAFT, DUMP_LOG, WRITING

MIB = 1 << 20


def _sparse(path: Path) -> bytes:
    """1 MiB of data, a 7 MiB hole, 1 MiB of data, a 3 MiB hole at the end."""
    a, b = os.urandom(MIB), os.urandom(MIB)
    with open(path, "wb") as f:
        f.write(a)
        f.seek(8 * MIB)
        f.write(b)
        f.truncate(12 * MIB)
    return a + bytes(7 * MIB) + b + bytes(3 * MIB)


def test_copy_keeps_the_bytes_and_the_holes(tmp_path):
    want = _sparse(tmp_path / "src")
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        t = writeout.Throttle(0)
        assert writeout._copy(src, dst, t) == 2 * MIB     # the data only
        assert t.done == 2 * MIB
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dst").read_bytes() == want
    st = os.stat(tmp_path / "dst")
    if st.st_blocks * 512 >= 12 * MIB:     # a filesystem without holes cannot show them
        pytest.skip("no sparse files here")
    assert st.st_blocks * 512 <= 3 * MIB


def test_the_throttle_holds_its_rate_over_threads():
    t = writeout.Throttle(8e6)
    assert t.chunk == 800_000                       # a tenth of a second's worth
    start = time.monotonic()
    import threading
    threads = [threading.Thread(target=lambda: [t.take(1_000_000) for _ in range(2)])
               for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert time.monotonic() - start >= 0.45          # 4 MB at 8 MB/s
    assert writeout.Throttle(0).chunk == writeout.COPY_CHUNK


def test_room_is_bounded_by_memory_and_the_staging_filesystem(tmp_path, monkeypatch):
    from torpor import agent_data
    monkeypatch.setattr(agent_data, "_private_mount_namespace", lambda: False)
    monkeypatch.setattr(procs, "mem_available", lambda: 10 * (1 << 30))
    have, bound = writeout.room(tmp_path / "shm", tmpfs=False)   # tmp_path's own filesystem
    assert bound in ("MemAvailable", f"free space in {tmp_path}")
    monkeypatch.setattr(procs, "mem_available", lambda: writeout.HEADROOM + 5 * MIB)
    assert writeout.room(tmp_path / "shm", tmpfs=True) == (5 * MIB, "MemAvailable")
    monkeypatch.setattr(procs, "mem_available", lambda: 1 << 60)   # the disk is smaller
    if os.geteuid() == 0:
        assert writeout.room(tmp_path / "shm", tmpfs=True)[1] == "MemAvailable"
    # where no huge-page tmpfs can be mounted, the room of the filesystem beneath counts
    monkeypatch.setattr(agent_data, "_private_mount_namespace", lambda: True)
    assert writeout.room(tmp_path / "shm", tmpfs=True)[1] == f"free space in {tmp_path}"
    monkeypatch.setattr(procs, "mem_available", lambda: None)
    have, bound = writeout.room(tmp_path / "shm", tmpfs=False)
    assert bound.startswith("free space in") and have > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown)")
def test_room_never_looks_into_another_users_suspend_dir(tmp_path, monkeypatch):
    """A user's entry at suspend_dir (made first, in /dev/shm) is taken back before any
    staging (agent_data.claim_suspend_dir): the room is that of a new directory there (a
    huge-page tmpfs gets all of memory), not of whatever their entry leads to."""
    from torpor import agent_data
    monkeypatch.setattr(agent_data, "_private_mount_namespace", lambda: False)
    monkeypatch.setattr(procs, "mem_available", lambda: 1 << 60)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x").write_text("")
    (tmp_path / "shm").symlink_to(elsewhere)
    os.lchown(tmp_path / "shm", 65534, 65534)
    seen, usage = [], shutil.disk_usage
    monkeypatch.setattr(writeout.shutil, "disk_usage", lambda p: seen.append(p) or usage(p))
    assert writeout.room(tmp_path / "shm", tmpfs=True)[1] == "MemAvailable"
    assert writeout.room(tmp_path / "shm", tmpfs=False)[1] == f"free space in {tmp_path}"
    assert seen == [tmp_path]


def _images(tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    (d / "torpor-gpu" / "7").mkdir(parents=True, mode=0o700)
    (d / "torpor-gpu" / "7" / "gpu-memory-0.bin").write_bytes(b"x" * 100)
    (d / "pages-1.img").write_bytes(b"p" * 100)
    (d / DUMP_LOG).write_text("Dumping finished successfully\n")
    (d / DRAFT).write_text("{}")
    writeout.begin(d)
    return d


def test_a_failed_write_out_leaves_a_directory_marked_damaged(tmp_path):
    d = _images(tmp_path)
    why = writeout.abandon(d, OSError(28, "No space left on device"))
    assert "No space left on device" in why and why.startswith("incomplete")
    assert sorted(p.name for p in d.iterdir()) == [DUMP_LOG, DAMAGED]
    assert os.stat(d / DAMAGED).st_mode & 0o777 == 0o600
    with pytest.raises(CorruptCheckpointError, match="damaged.*incomplete"):
        manifest.read(d)


def test_recovery_never_seals_a_write_out_its_torpor_left(tmp_path):
    d = _images(tmp_path)
    assert writeout.abandoned_by_dead(d) is True
    assert sorted(p.name for p in d.iterdir()) == [DUMP_LOG, DAMAGED]
    assert "torpor died" in (d / DAMAGED).read_text()
    other = tmp_path / "other"
    other.mkdir()
    (other / DRAFT).write_text("{}")
    assert writeout.abandoned_by_dead(other) is False and (other / DRAFT).exists()


def test_the_settings(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("writeout_rate_mbps = 200\nleave_running_staging = false\n")
    cfg = config.load(f, env={})
    assert cfg.writeout_rate_mbps == 200.0 and cfg.leave_running_staging is False
    assert config.load(tmp_path / "c.toml", env={}).writeout_rate_mbps == 200.0
    assert config.Config().leave_running_staging is True       # the default: staged
    f.write_text("writeout_rate_mbps = -1\n")
    with pytest.raises(UsageError, match="writeout_rate_mbps"):
        config.load(f, env={})
    assert WRITING.startswith(".")                              # not a file of the checkpoint


def test_the_staged_copy_gives_its_memory_back_as_it_goes(tmp_path):
    """release: every range copied is punched out of the staged file (host memory back as
    the write-out goes); the copy is still whole."""
    want = _sparse(tmp_path / "src")
    src = os.open(tmp_path / "src", os.O_RDWR)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        assert writeout._copy(src, dst, writeout.Throttle(0), release=True) == 2 * MIB
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dst").read_bytes() == want
    st = os.stat(tmp_path / "src")
    assert st.st_size == 12 * MIB
    if st.st_blocks:    # fine only where the filesystem cannot punch holes at all
        probe = tmp_path / "probe"
        probe.write_bytes(os.urandom(MIB))
        fd = os.open(probe, os.O_RDWR)
        try:
            os.fsync(fd)
            writeout._release(fd, 0, MIB)
        finally:
            os.close(fd)
        assert os.stat(probe).st_blocks > 0, f"{st.st_blocks} blocks of the copy left staged"
        pytest.skip("no hole punching on this filesystem")


@pytest.mark.parametrize("agent_dir,how", [(None, "'torpor run -- CMD'"),
                                           (Path("/run/x"), "org.torpor.agent=off")])
def test_a_program_without_an_agent_is_told_how_to_get_one(monkeypatch, agent_dir, how):
    """A bare program hears of `torpor run`; a container of the annotation that opted it out."""
    said: list[str] = []

    class Engine:
        cfg = config.Config()

        class progress:
            say = said.append
    monkeypatch.setattr(writeout, "staged_need", lambda *a: ({}, 0))
    assert writeout.staging(Engine(), [1], 0, agent_dir) is None  # type: ignore[arg-type]
    assert len(said) == 1 and how in said[0] and "whole dump" in said[0], said
