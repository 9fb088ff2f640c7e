import os
import subprocess
import sys
import textwrap

import pytest

from torpor.errors import BusyError
from torpor.journal import Journal


def test_claims_are_exclusive_and_released(cfg):
    j = Journal(cfg)
    op = j.begin("checkpoint", [111, 222])
    with pytest.raises(BusyError, match="PID 222 is busy"):
        j.begin("checkpoint", [333, 222])
    j.begin("suspend", [333]).close()  # 333 was released by the refused attempt
    assert list(j.orphans()) == []     # op's owner (us) holds its lock: not an orphan
    op.close()
    j.begin("checkpoint", [111, 222]).close()
    assert not list(j.dir.glob("*.json"))


def test_state_files_are_private(cfg):
    j = Journal(cfg)
    op = j.begin("checkpoint", [5])
    assert oct(cfg.journal_dir.stat().st_mode & 0o777) == "0o700"
    (entry,) = j.dir.glob("*.json")
    assert oct(entry.stat().st_mode & 0o777) == "0o600"
    op.close()


def test_entry_of_a_killed_owner_is_an_orphan(cfg, torpor_env):
    code = textwrap.dedent("""
        import os, signal
        from torpor import config
        from torpor.journal import Journal
        op = Journal(config.load()).begin("checkpoint", [4242])
        op.phase("checkpoint", gpu_map={"GPU-a": "GPU-b"})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **torpor_env))
    assert proc.returncode == -9
    j = Journal(cfg)
    found = list(j.orphans())
    assert len(found) == 1
    entry, fd = found[0]
    assert entry.pids == [4242] and entry.phase == "checkpoint" and entry.gpu_map == {"GPU-a": "GPU-b"}
    j.begin("x", [4242]).close()  # the dead owner's PID claim died with it
    j.forget(entry, fd)
    assert list(j.orphans()) == []


def test_unreadable_entry_is_set_aside(cfg):
    j = Journal(cfg)
    (j.dir / "bad.json").write_text("{")
    assert list(j.orphans()) == []
    assert (j.dir / "bad.unreadable").exists()


def test_suspended_records(cfg):
    j = Journal(cfg)
    j.mark_suspended(77, {"gpus": ["GPU-a"]})
    assert j.suspended() == {77: {"gpus": ["GPU-a"]}}
    j.clear_suspended(77)
    assert j.suspended() == {}


def test_a_reused_pid_is_not_the_claimed_process(cfg):
    j = Journal(cfg)
    op = j.begin("checkpoint", [os.getpid()])
    assert op.entry.same_process(os.getpid())
    op.entry.starts[str(os.getpid())] += 1  # as if the PID now belonged to a later process
    assert not op.entry.same_process(os.getpid())
    assert op.entry.same_process(999999)     # never seen (e.g. before CRIU restored it)
    op.close()
