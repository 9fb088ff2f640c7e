"""Root's client takes torpord's root door (private/root.sock) only when something listens
there: a torpord killed leaves the socket file behind, and a client that took it failed
("connect failed") where the public socket, or a torpord started anew, answers."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from torpor import config
from torpor.sidecar import root_socket
from torpor.sidecar.client import Client

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root's clients only")


def _cfg(tmp_path: Path) -> config.Config:
    return config.load(env={"TORPOR_RUN_DIR": str(tmp_path / "run"),
                            "TORPOR_STATE_DIR": str(tmp_path / "state"),
                            "TORPOR_CONFIG": str(tmp_path / "none.toml")})


def _bind(path: Path, listen: bool) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    if listen:
        s.listen(1)
    return s


def test_a_stale_root_door_is_passed_by(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    stale = _bind(root_socket(cfg.run_dir), listen=False)
    stale.close()                                    # the file stays, nobody listens
    assert root_socket(cfg.run_dir).is_socket()
    with Client(cfg) as c:
        assert c.target == cfg.socket_path.absolute()


def test_a_live_root_door_is_taken(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    live = _bind(root_socket(cfg.run_dir), listen=True)
    try:
        with Client(cfg) as c:
            assert c.target == root_socket(cfg.run_dir)
        with Client(cfg, socket_path=str(tmp_path / "other.sock")) as c:   # named: as named
            assert c.target == tmp_path / "other.sock"
    finally:
        live.close()
