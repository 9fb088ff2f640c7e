"""A torpord that takes a call and never answers: the client gives up at its deadline with one
line (SidecarError, exit 10) instead of waiting for good, as torpor-runtime's calls would have
(podman restore hung once in the fault suite). torpor-runtime's deadline is work_timeout."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import pytest

from torpor import config
from torpor.errors import ExitCode, SidecarError
from torpor.sidecar import proto
from torpor.sidecar.client import DRIVER_MARGIN_S, Client, work_timeout


@pytest.fixture
def hung_torpord(tmp_path):
    """A gRPC server on torpord's service whose RestoreAndUnlock waits until the test ends."""
    _, pb_grpc = proto()
    release = threading.Event()

    class Hung(pb_grpc.TorporServicer):
        def RestoreAndUnlock(self, request, context):
            release.wait(30)
            context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    sock = tmp_path / "torpord.sock"
    srv = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_TorporServicer_to_server(Hung(), srv)
    assert srv.add_insecure_port(f"unix://{sock}") != 0
    srv.start()
    yield sock
    release.set()
    srv.stop(grace=0)


def test_a_call_torpord_never_answers_ends_at_the_deadline(torpor_env, hung_torpord):
    cfg = config.load()
    t0 = time.monotonic()
    with Client(cfg, hung_torpord, timeout=0.5) as c:
        with pytest.raises(SidecarError) as e:
            c.restore_and_unlock(pids=[12345])
    assert time.monotonic() - t0 < 5
    assert e.value.exit_code == ExitCode.SIDECAR
    assert "DEADLINE_EXCEEDED" in e.value.line() or "deadline" in e.value.line().lower()


def test_the_work_timeout_covers_a_lock_an_agent_move_and_a_whole_gpu(torpor_env):
    cfg = config.load()
    assert work_timeout(cfg) == cfg.lock_timeout_s + cfg.agent_timeout_s + DRIVER_MARGIN_S
    assert DRIVER_MARGIN_S >= 141e9 / 1.5e9      # an H200's memory at the driver's 1.5 GB/s
