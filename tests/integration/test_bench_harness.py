"""The store benchmark's harness on a machine without a GPU (bench/store_e2e.py --kind cpu): the
driver path and the store path of one small CPU program, checkpointed with real CRIU, restored
and bit-exact, the figures and ratios written. Its figures mean nothing here; that the GPU
host's run will not fail on the harness is what this checks."""

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import needs_criu

ROOT = Path(__file__).resolve().parents[2]
pytestmark = needs_criu


def test_store_e2e_harness_runs_both_paths_bit_exact(torpor_env, tmp_path):
    out = tmp_path / "store_e2e.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "store_e2e.py"), "--kinds", "cpu",
                        "--sizes", "0.0625", "--steps-between", "5", "--root",
                        str(tmp_path / "root"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["driver"]["bit_exact"] and row["store"]["bit_exact"], row
    first, second = row["store"]["first"]["stored"], row["store"]["second"]["stored"]
    assert first["new_bytes"] > 0 and second["reused_chunks"] > 0, (first, second)
    # where the second's new bytes lie: the CPU program's heap, in CRIU's page image
    by_file = row["store"]["second_new_by_file"]
    assert by_file and any(f.startswith("pages-") for f in by_file), by_file
    # each operation's timings are its own: the restore's hold no checkpoint phase
    assert "dump" not in row["store"]["restore_timings"], row["store"]["restore_timings"]
    assert set(row["ratios"]) == {"checkpoint", "second_checkpoint", "image", "incremental",
                                  "restore", "ends_checkpoint", "ends_restore",
                                  "stream_vs_files_checkpoint", "stream_vs_files_restore"}
    # the first checkpoints that end the program, streamed and through files (the CPU
    # program has no agent: both take the same path here)
    assert set(row["ends"]) == {"stream", "files"}
    assert all(e["bit_exact"] and e["stored"]["new_bytes"] > 0 for e in row["ends"].values())
    assert not list((tmp_path / "root").iterdir())      # stores and images removed
