"""Issue 18, item 4, as it was found: `ln -s /root-only/dir /tmp/x` as a user, then root's
`torpor checkpoint PID -D /tmp/x/ck` wrote into /root-only/dir (fs.protected_symlinks=0)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.fakes.fakegpu import RUNNING
from tests.integration.conftest import needs_criu
from tests.unit.test_files_paths import (  # noqa: F401  (fixtures)
    _user_link, root_only, sticky, unprotected_symlinks)

pytestmark = needs_criu


def test_a_users_link_does_not_steer_roots_checkpoint_or_restore(
        torpor, gpu, tmp_path, sticky, root_only, unprotected_symlinks):
    link = _user_link(sticky, root_only)
    with gpu.spawn() as prog:
        proc = torpor.run("checkpoint", str(prog.pid), "-D", str(link / "ck"))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1
        assert "x is a symbolic link owned by uid 65534" in proc.stderr, proc.stderr
        assert list(root_only.iterdir()) == []
        assert gpu.state(prog.pid)["state"] == RUNNING
        images = root_only / "ck"            # a checkpoint root made, reached through the link
        torpor.json("checkpoint", str(prog.pid), "-D", str(images), "--leave-running")
    proc = torpor.run("restore", "-D", str(link / "ck"))
    assert proc.returncode == 2 and "only root's links" in proc.stderr, proc.stderr
    assert os.lstat(link).st_uid == 65534 and Path(images / "torpor.json").is_file()
