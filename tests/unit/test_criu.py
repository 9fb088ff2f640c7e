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
