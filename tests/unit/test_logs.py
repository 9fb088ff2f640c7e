"""logs.setup: the one logging set-up of torpor, torpord, torpor-runtime and torpor-hook."""

from __future__ import annotations

import logging

import pytest

from torpor import logs


@pytest.fixture
def root():
    r = logging.getLogger()
    saved = r.handlers[:], r.level
    r.handlers = []
    yield r
    for h in r.handlers:
        h.close()
    r.handlers, r.level = saved


def ours(root: logging.Logger) -> list[logging.Handler]:
    """The handlers logs.setup added (not pytest's capture)."""
    return [h for h in root.handlers if type(h).__module__ == "logging"]


def test_file_private_and_formatted(root, tmp_path):
    state = tmp_path / "state"
    logs.setup(state, "x.log", fmt="%(levelname)s|%(message)s", file_level=logging.INFO,
               level=logging.DEBUG)
    logging.getLogger("torpor.t").debug("hidden")
    logging.getLogger("torpor.t").warning("seen")
    for h in root.handlers:
        h.flush()
    assert (state / "x.log").read_text() == "WARNING|seen\n"
    assert state.stat().st_mode & 0o777 == 0o700 and root.level == logging.DEBUG


def test_stderr_only_and_unopenable_file(root, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    logs.setup(tmp_path / "f" / "state", "x.log", stderr=True)   # no file: left out
    assert [type(h) for h in ours(root)] == [logging.StreamHandler]
    with pytest.raises(OSError):
        logs.setup(tmp_path / "f" / "state", "x.log", must=True)
    for h in ours(root):
        root.removeHandler(h)
    logs.setup(tmp_path, None, stderr=True, stderr_formatted=True, fmt="F %(message)s")
    logging.getLogger("torpor.t").error("boom")
    assert capsys.readouterr().err.endswith("F boom\n")
