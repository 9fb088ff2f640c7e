"""A GPU container checkpoint whose torpord dies after the dump (issue 18's fault suite found
it): the checkpoint is complete, so torpor-runtime seals it and succeeds (podman exports it)
instead of reporting a failure for a container it stopped; a torpord is started for the
journal entry's recovery. In process, with test_runtime_flows.py's fake runc and client."""

from __future__ import annotations

import pytest

from tests.unit.test_runtime_flows import checkpoint_argv, world, write_spec  # noqa: F401
from torpor import manifest
from torpor.errors import NotFoundError, SidecarError, TorporError
from torpor.runtime import main as rt_main


@pytest.mark.parametrize("leave_running", [False, True], ids=["stop", "leave-running"])
@pytest.mark.parametrize("lost", [NotFoundError("no open operation 'op-1' (torpord "
                                                "restarted)"),
                                  SidecarError("torpord: connection refused")],
                         ids=["restarted", "gone"])
def test_a_torpord_lost_after_the_dump_leaves_a_complete_checkpoint(world, capsys, lost,
                                                                    leave_running):
    write_spec(world["bundle"], gpu=True)
    client = world["client"]

    def gone(**kw):
        client.calls.append(("lost", kw))
        raise lost
    client.finish = lambda op_id: gone(op_id=op_id)
    client.restore_and_unlock = gone
    extra = ("--leave-running",) if leave_running else ()
    assert rt_main.main(checkpoint_argv(world["images"], *extra)) == 0
    assert [n for n, _ in client.calls] == ["ensure", "lock_and_checkpoint", "lost", "ensure"]
    assert (world["images"] / manifest.MANIFEST).is_file()      # sealed
    assert "the checkpoint is complete" in capsys.readouterr().err


def test_other_failures_after_the_dump_still_fail(world):
    write_spec(world["bundle"], gpu=True)
    client = world["client"]

    def broken(**kw):
        raise TorporError("CUDA_ERROR_UNKNOWN")
    client.restore_and_unlock = broken
    assert rt_main.main(checkpoint_argv(world["images"], "--leave-running")) != 0


@pytest.mark.parametrize("staged", [False, True])
def test_a_torpord_lost_before_a_staged_write_out_is_not_called_complete(monkeypatch, capsys,
                                                                         torpor_env, staged):
    """Lost after the dump with the GPU data staged in host memory: the write-out, not this
    warning, says what the checkpoint is (pause.after: no checkpoint, marked damaged). The
    warning called it complete, and the next line said the opposite."""
    from torpor import config
    from torpor.runtime import checkpoint as rt_checkpoint

    class Lost:
        def restore_and_unlock(self, **kw):
            raise SidecarError("torpord: connection refused")
    monkeypatch.setattr(rt_checkpoint, "ensure_running", lambda cfg: None)
    assert rt_checkpoint._end(config.load(), Lost(), "c1", "op-1", True, staged=staged) is None
    err = capsys.readouterr().err
    assert "torpord lost the operation op-1 after the dump" in err, err
    assert ("the checkpoint is complete" in err) is not staged, err
