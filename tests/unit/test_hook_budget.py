"""torpor-hook's own waits fit inside the timeout the runtime gives it: a hook the runtime kills
at its timeout fails the container's create, which torpor's registration must never do."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torpor_hook
from torpor import oci
from torpor.sidecar import client

ROOT = Path(__file__).resolve().parents[2]


def test_the_hooks_worst_case_is_well_inside_the_runtimes_timeout():
    given = min(inspect.signature(oci.add_hooks).parameters["timeout_s"].default,
                json.loads((ROOT / "packaging/oci-hooks.d/torpor.json").read_text())
                ["hook"]["timeout"])
    ping = inspect.signature(client.ping).parameters["timeout"].default
    worst = ping + torpor_hook.START_WAIT_S + torpor_hook.CALL_TIMEOUT_S
    assert worst <= 0.7 * given, (worst, given)   # room for Python's start and the imports
