"""A checkpoint whose torpor died during CRIU's dump. CRIU outlives torpor (criu.run_criu):
recovery waits for it to end before it touches the tree, then seals what CRIU finished, and
never seals images a dump left half-written (the program gone with them): those are marked
damaged, with why. Real processes stand in for CRIU (its argv is what recovery looks for)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torpor import config, criu, manifest
from torpor import manifest_types as mt
from torpor.engine import Engine, recovery
from torpor.journal import Journal
from torpor.layout import REQUIRED_IMAGES


@pytest.fixture
def cfg(torpor_env):
    return config.load()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _draft(images: Path) -> None:
    images.mkdir(mode=0o700)
    (images / manifest.DUMP_LOG).write_text("(00.01) Dumping path for 3 fd via self 9\n")
    (images / "pages-1.img").write_bytes(b"\x01" * 4096)
    manifest.write_draft(images, manifest.draft(
        torpor_version="0", criu_version="4.2.1", driver=mt.Driver(None, None), root_pid=4242,
        shell_job=False, leave_running=False, gpus=[],
        processes=[mt.Process(4242, False, (), 0)]))


def _interrupted(cfg, images: Path, pids: list[int]) -> None:
    op = Journal(cfg).begin("checkpoint", [])
    op.phase("dump", pids=pids, images_dir=str(images))
    op.release()     # torpor died here


def _orphans(cfg) -> list:
    found = []
    for entry, fd in Journal(cfg).orphans():
        os.close(fd)    # its lock, or the next recovery takes the entry for a live one's
        found.append(entry.id)
    return found


def _fake_criu(images: Path, then: str, after_s: float) -> subprocess.Popen:
    """A process whose command line is a dump's into images; after after_s it does `then`
    (writes the images CRIU writes last, and its success line) and ends."""
    code = (f"import sys, time, pathlib\ntime.sleep({after_s})\nd = pathlib.Path(sys.argv[3])\n"
            f"{then}\n")
    proc = subprocess.Popen([sys.executable, "-c", code, "dump", "--images-dir", str(images)])
    deadline = time.monotonic() + 5     # Popen returns before exec has set its command line
    while proc.pid not in criu.dumping(images) and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


FINISH = ("[(d / n).write_bytes(b'img') for n in %r]\n"
          "open(d / 'dump.log', 'a').write('(00.50) Dumping finished successfully\\n')"
          % (REQUIRED_IMAGES,))


def test_a_program_gone_with_half_written_images_is_marked_damaged_not_sealed(cfg, tmp_path):
    images = tmp_path / "ck"
    _draft(images)
    _interrupted(cfg, images, [_dead_pid()])
    said = Engine(cfg).recover()
    assert not (images / manifest.MANIFEST).exists(), said
    assert (images / manifest.DAMAGED).exists(), said
    assert not (images / manifest.DRAFT).exists()
    assert any("damaged" in m and "before CRIU had written its images whole" in m
               for m in said), said
    with pytest.raises(Exception, match="damaged and can only be removed"):
        manifest.read(images)
    assert _orphans(cfg) == []


def test_a_program_criu_ended_after_writing_its_images_is_sealed(cfg, tmp_path):
    images = tmp_path / "ck"
    _draft(images)
    for name in REQUIRED_IMAGES:
        (images / name).write_bytes(b"img")
    _interrupted(cfg, images, [_dead_pid()])
    said = Engine(cfg).recover()
    assert (images / manifest.MANIFEST).exists(), said
    assert not (images / manifest.DAMAGED).exists()


def test_recovery_waits_for_the_dump_criu_left_running_and_seals_what_it_finished(cfg, tmp_path):
    images = tmp_path / "ck"
    _draft(images)
    _interrupted(cfg, images, [_dead_pid()])
    dump = _fake_criu(images, FINISH, after_s=1.5)
    (images / "dump.out").write_bytes(b"")      # its standard output, left by the dead torpor
    try:
        t0 = time.monotonic()
        said = Engine(cfg).recover()
        assert time.monotonic() - t0 >= 1.0, "recovery did not wait for CRIU"
        assert dump.wait(timeout=5) == 0
        assert manifest.read(images)["files"], said
        assert "dump.out" not in manifest.read(images)["files"]
        assert not (images / "dump.out").exists()
    finally:
        dump.kill()


def test_a_dump_still_running_keeps_the_entry_and_touches_nothing(cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(recovery, "CRIU_WAIT_S", 0.5)
    images = tmp_path / "ck"
    _draft(images)
    _interrupted(cfg, images, [_dead_pid()])
    dump = _fake_criu(images, FINISH, after_s=30)
    try:
        time.sleep(0.2)
        said = Engine(cfg).recover()
        assert any("still being dumped by CRIU" in m for m in said), said
        assert (images / manifest.DRAFT).exists() and (images / "pages-1.img").exists()
        assert not (images / manifest.DAMAGED).exists()
        assert len(_orphans(cfg)) == 1
    finally:
        dump.kill()
        dump.wait()
    said = Engine(cfg).recover()     # CRIU gone without a word: the images are not whole
    assert (images / manifest.DAMAGED).exists(), said
    assert _orphans(cfg) == []


def test_a_stopped_dump_criu_is_let_go_on(cfg, tmp_path):
    images = tmp_path / "ck"
    _draft(images)
    _interrupted(cfg, images, [_dead_pid()])
    dump = _fake_criu(images, FINISH, after_s=0.5)
    try:
        os.kill(dump.pid, signal.SIGSTOP)
        said = Engine(cfg).recover()
        assert dump.poll() == 0, said
        assert (images / manifest.MANIFEST).exists(), said
    finally:
        dump.kill()


def test_another_users_process_is_never_taken_for_a_dump_criu(cfg, tmp_path):
    """Anyone may start a process whose command line reads like CRIU's: recovery would wait
    for it, the program frozen, every torpor command ten seconds long."""
    images = tmp_path / "ck"
    _draft(images)
    _interrupted(cfg, images, [_dead_pid()])
    spoof = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "dump",
                              "--images-dir", str(images)], user=65534, group=65534)
    try:
        deadline = time.monotonic() + 5
        while b"--images-dir" not in Path(f"/proc/{spoof.pid}/cmdline").read_bytes() \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert criu.dumping(images) == []
        t0 = time.monotonic()
        said = Engine(cfg).recover()
        assert time.monotonic() - t0 < 5, said
        assert _orphans(cfg) == [] and (images / manifest.DAMAGED).exists(), said
    finally:
        spoof.kill()
        spoof.wait()
