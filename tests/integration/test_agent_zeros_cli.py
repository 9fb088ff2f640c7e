"""Zero memory never crosses PCIe (issue 20, item 2), end to end: `torpor run` preloads the C
agent into the fake CUDA program, whose one 256 MiB allocation holds a few MiB of data and zeros
everywhere else (a JAX arena in small). suspend/resume and checkpoint/restore (into files and
into the image store) give it back bit-exact, the `--json` figures say what moved ("bytes") and
what the agent found zero ("zero_bytes"), and the fake driver's own count of the bytes copied
between host and device (fakegpu.FakeGpu.copies) shows the zeros never were. The fake's `dirty`
knob makes re-created GPU memory hold 0xA5 bytes, so zeros that were not memset back show.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import needs_criu, wait_for
from torpor.agent import AgentClient

pytestmark = needs_criu
MIB = 1 << 20
SIZE = 256 * MIB
FILL = [(0, 5_000_000), (150_000_000, 3000)]   # what the program writes; zeros elsewhere
MOST = 3 * 4 * MIB + 8 * MIB                   # moved at most: the 4 MiB parts written into,
                                               # and slack for where windows cut them


class Zeros:
    """The program under the real agent (torpor run), its memory and what its fake driver
    copied."""

    def __init__(self, torpor, gpu, tmp_path: Path, reaper):
        from tests.fakes.fakegpu import PROGRAM
        self.gpu = gpu
        self.agents = tmp_path / "agents"
        self.status = tmp_path / "status.json"
        torpor.env["TORPOR_AGENT_DIR"] = str(self.agents)
        torpor.env["TORPOR_SUSPEND_DIR"] = str(tmp_path / "shm")
        torpor.env["TORPOR_STORE_DIR"] = str(tmp_path / "store")
        fills = [a for off, n in FILL for a in ("--fill", f"{off}:{n}")]
        with open(tmp_path / "program.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torpor.cli.main", "run", "--", sys.executable,
                 str(PROGRAM), "--mem", str(SIZE), "--status", str(self.status), "--lib",
                 gpu.libcuda, *fills],
                env=torpor.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True)
        self.pid = self.proc.pid
        reaper.append(self.pid)
        wait_for(lambda: self.status.exists()
                 and (self.agents / f"agent-{self.pid}.sock").exists(), 20,
                 "the program under the agent")
        with AgentClient.for_pid(self.pid, self.agents) as a:
            st = a.status()
        if st.get("movable_bytes", 0) < SIZE:
            pytest.skip("the fake driver serves no VMM memory: nothing for the agent to move")
        self.ptr = json.loads(self.status.read_text())["ptr"]

    def digest(self) -> str:
        """sha256 of the allocation, read from the program's memory (the fake's device memory
        is its memory)."""
        h = hashlib.sha256()
        with open(f"/proc/{self.pid}/mem", "rb") as mem:
            mem.seek(self.ptr)
            for _ in range(SIZE // (16 * MIB)):
                h.update(mem.read(16 * MIB))
        return h.hexdigest()

    def copies(self) -> dict:
        return self.gpu.copies(self.pid)

    def ticking(self) -> None:
        tick = json.loads(self.status.read_text())["tick"]
        wait_for(lambda: json.loads(self.status.read_text() or "{}").get("tick", 0) > tick + 2,
                 10, "the program ticking")


@pytest.fixture
def zeros(torpor, gpu, tmp_path, reaper):
    return Zeros(torpor, gpu, tmp_path, reaper)


def _moved_and_zero(entry: dict) -> tuple[int, int]:
    assert 0 < entry["bytes"] <= MOST, entry
    assert entry["bytes"] + entry["zero_bytes"] == SIZE, entry
    return entry["bytes"], entry["zero_bytes"]


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "files"])
def test_suspend_moves_only_the_data(torpor, zeros, gpu, tmp_path, in_process):
    config = tmp_path / "config.toml"
    config.write_text(f"suspend_in_process = {str(in_process).lower()}\n")
    torpor.env["TORPOR_CONFIG"] = str(config)
    before, copied = zeros.digest(), zeros.copies()
    r = torpor.json("suspend", str(zeros.pid))
    moved, zero = _moved_and_zero(r["agent"][str(zeros.pid)])
    out = zeros.copies()
    # the data, the zero scan's flags and (the mover's GPU check, its default) the parts'
    # fingerprint lanes: 4 KiB a 4 MiB part
    assert moved <= out["dtoh"] - copied["dtoh"] <= moved + (SIZE // (4 * MIB)) * 4200, \
        (out, copied)
    (gpu.state_dir / "dirty").write_text("")
    back = torpor.json("resume", str(zeros.pid))
    entry = back["agent"][str(zeros.pid)]
    assert (entry["bytes"], entry["zero_bytes"]) == (moved, zero), entry
    now = zeros.copies()
    # in: the data and the GPU check's table of segments; the zeros by memset
    assert moved <= now["htod"] - out["htod"] <= moved + 4096, now
    assert now["memset"] - out["memset"] == zero, now
    assert zeros.digest() == before
    zeros.ticking()


@pytest.mark.parametrize("store", [False, True], ids=["files", "store"])
def test_checkpoint_and_restore_move_only_the_data(torpor, zeros, gpu, tmp_path, store):
    before, copied = zeros.digest(), zeros.copies()
    images = tmp_path / "ck"
    ck = torpor.json("checkpoint", str(zeros.pid), "-D", str(images),
                     *(["--store", "one"] if store else []))
    zeros.proc.wait(timeout=10)
    entry = ck["manifest"]["agent"][str(zeros.pid)]
    moved, zero = _moved_and_zero(entry)
    out = zeros.copies()
    # the fingerprints' lanes come back too into the store: 4 KiB a 4 MiB part
    assert moved <= out["dtoh"] - copied["dtoh"] <= moved + (SIZE // (4 * MIB)) * 4200, out
    data = images / "torpor-gpu" / str(zeros.pid)
    if store:
        assert entry["streamed"]["bytes"] == moved, entry
        assert ck["stored"]["streamed"] == entry["streamed"]["parts"], ck["stored"]
    else:   # the zero parts are holes: the files hold the data alone
        disk = sum(f.stat().st_blocks * 512 for f in data.iterdir() if f.name.endswith(".bin"))
        assert disk <= moved + MIB, disk
    (gpu.state_dir / "dirty").write_text("")
    r = torpor.json("restore", "-D", str(images))
    entry = r["agent"][str(zeros.pid)]
    assert (entry["bytes"], entry["zero_bytes"]) == (moved, zero), entry
    now = zeros.copies()   # the restored program's counts go on from the checkpoint's
    assert moved <= now["htod"] - out["htod"] <= moved + 64 * 1024, (now, out)
    assert now["memset"] - out["memset"] == zero, now
    assert zeros.digest() == before
    zeros.ticking()
