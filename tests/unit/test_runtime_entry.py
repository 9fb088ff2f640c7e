"""torpor-runtime-py's entry: main()'s exit status, its error line on stderr and in --log,
then out at once (os._exit: no interpreter teardown between the flow's last step and the
status the engine reads)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_entry_exits_with_mains_status_and_its_words_flushed(tmp_path):
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)    # a config that is no regular file: main() says so and returns 2
    log = tmp_path / "runtime.log"
    env = {**os.environ, "TORPOR_CONFIG": str(fifo)}
    p = subprocess.run([sys.executable, "-c", "from torpor.runtime.main import entry; entry()",
                        "--log", str(log), "delete", "c1"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "not a regular file" in p.stderr
    assert "not a regular file" in log.read_text()


def test_the_installed_torpor_runtime_py_is_the_entry():
    from importlib.metadata import entry_points
    eps = [e for e in entry_points(group="console_scripts") if e.name == "torpor-runtime-py"]
    assert [e.value for e in eps] == ["torpor.runtime.main:entry"]
