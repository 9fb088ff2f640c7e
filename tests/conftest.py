"""Shared fixtures: an isolated torpor state (config via environment) per test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.fakes.*


@pytest.fixture
def torpor_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """TORPOR_* variables pointing at private temporary directories, set in os.environ."""
    env = {
        "TORPOR_STATE_DIR": str(tmp_path / "state"),
        "TORPOR_RUN_DIR": str(tmp_path / "run"),
        "TORPOR_CONFIG": str(tmp_path / "no-config.toml"),
        "TORPOR_LIBCUDA": str(tmp_path / "no-libcuda.so.1"),
        "TORPOR_SUSPEND_TMPFS": "false",   # no mounts under tmp_path (tests that want one say so)
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def cfg(torpor_env: dict[str, str]):
    from torpor import config
    return config.load()


def torpor_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torpor.cli.main", *args]


def is_root() -> bool:
    return os.geteuid() == 0
