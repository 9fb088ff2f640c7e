"""criu.py: the arguments torpor gives CRIU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torpor import criu


@pytest.fixture
def bin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    monkeypatch.setitem(criu.CLEAN_ENV, "PATH", str(d))
    return d


def test_connections_taken_along_use_nftables_where_iptables_is_missing(bin_dir: Path):
    # the GPU host has no iptables: CRIU's default lock failed every --tcp-established dump
    assert criu.network_lock_args(True) == ["--network-lock", "nftables"]


def test_connections_taken_along_keep_criu_default_lock_where_iptables_is_installed(bin_dir: Path):
    tool = bin_dir / "iptables-restore"
    tool.write_text("#!/bin/sh\n")
    os.chmod(tool, 0o755)
    assert criu.network_lock_args(True) == []


def test_no_lock_arguments_without_connections_to_take(bin_dir: Path):
    assert criu.network_lock_args(False) == []


# --- why CRIU failed, in one line (red-team pass: a harmless rlimit line came first, and a
# --- CRIU killed by a signal was quoted as whatever lines its log ended with) -------------

DUMP_LOG = """\
(00.000000) Version: 4.2.1 (gitid 0)
(00.020185) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.021000) Warn  (criu/kerndat.c:1): kerndat: no timens
(00.030000) Seizing 4242
(00.031000) Error (criu/sk-inet.c:199): inet: Connected TCP socket, consider using --tcp-established option.
(00.031100) Error (criu/cr-dump.c:1700): Dump files (pid: 4242) failed with -1
(00.031200) Error (criu/cr-dump.c:1701): Dumping tree of 4242 failed
(00.031300) Error (criu/cr-dump.c:1702): one error too many
(00.050032) Error (criu/cr-dump.c:1975): Dumping FAILED.
"""


def _log(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "dump.log"
    path.write_text(text)
    return path


def test_the_first_real_errors_are_quoted_not_a_harmless_one_nor_the_verdict(tmp_path: Path):
    said = criu.log_errors(_log(tmp_path, DUMP_LOG))
    assert said.startswith("inet: Connected TCP socket"), said
    assert "rlimit" not in said and "one error too many" not in said and "FAILED" not in said
    assert said.count(" | ") == 2


def test_warnings_when_no_error_says_why_and_a_restored_tasks_lines_read_alike(tmp_path: Path):
    log = _log(tmp_path, DUMP_LOG.splitlines()[1] + "\n"
               "(00.049698) Warn  (criu/seize.c:63): Failed to open /proc/3999999/comm\n"
               "(00.050032) Error (criu/cr-dump.c:1975): Dumping FAILED.\n")
    assert criu.log_errors(log) == "Failed to open /proc/3999999/comm"
    log = _log(tmp_path, "(00.071563)   6892: Error (criu/files-reg.c:2200): File x has bad "
               "mode\n(00.1) Error (criu/cr-restore.c:2500): Restoring FAILED.\n")
    assert criu.log_errors(log) == "File x has bad mode"
    log = _log(tmp_path, DUMP_LOG.splitlines()[1] + "\n(00.2) Error (c.c:1): Dumping FAILED.\n")
    assert criu.log_errors(log) == "Dumping FAILED."
    assert criu.log_errors(_log(tmp_path, "a\nb\nsome error here\nc\n")) == "some error here"


def _fake_criu(tmp_path: Path, body: str) -> criu.Criu:
    tool = tmp_path / "criu"
    tool.write_text("#!/bin/sh\n"
                    'while [ "$1" != --log-file ]; do shift; done; log="$2"\n' + body)
    os.chmod(tool, 0o755)
    return criu.Criu(str(tool), (4, 2))


def test_a_criu_killed_by_a_signal_is_said_so(tmp_path: Path):
    from torpor.config import Config
    from torpor.errors import CriuError
    tool = _fake_criu(tmp_path, 'printf "(00.1) Warn  (a.c:1): a warning\\nrandom\\n" > "$log"\n'
                      "kill -KILL $$\n")
    images = tmp_path / "ck"
    images.mkdir()
    with pytest.raises(CriuError) as e:
        criu.dump(tool, Config(state_dir=tmp_path / "state"), 4242, images, leave_running=False,
                  shell_job=False)
    assert str(e.value) == ("criu dump failed: CRIU was killed by signal 9 (SIGKILL) "
                            f"(log: {images / 'dump.log'})")


def test_a_refused_tcp_connection_still_gets_its_hint(tmp_path: Path):
    from torpor.config import Config
    from torpor.errors import CriuError
    (tmp_path / "log.txt").write_text(DUMP_LOG)
    tool = _fake_criu(tmp_path, f'cat {tmp_path / "log.txt"} > "$log"\nexit 1\n')
    images = tmp_path / "ck"
    images.mkdir()
    with pytest.raises(CriuError) as e:
        criu.dump(tool, Config(state_dir=tmp_path / "state"), 4242, images, leave_running=False,
                  shell_job=False)
    assert str(e.value).startswith("criu dump failed: inet: Connected TCP socket")
    assert "tcp_established = true" in str(e.value) and "rlimit" not in str(e.value)
