"""The image store (issue 5) on a real GPU: a PyTorch training program and an inference program
(infer_program.py: random-init decoder, weights + KV cache), each under the agent, checkpointed
into the store twice (the first leaving it running), restored from the second, continuing
bit-exact beside an uninterrupted reference. What each checkpoint stored is printed (pytest -s)
and the second must reuse the first's unchanged GPU memory: the training program's bulk tensors
and the inference program's weights do not change between the two. The agents fingerprint
their GPU data on the GPU (TORPOR_AGENT_FP_CHECK: every part copied out is checked against the
CPU's fold of its bytes), and the second checkpoint's agent skips what the store has: it does
not cross PCIe.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.gpu.conftest import wait_for
from tests.gpu.test_agent_gpu import (AGENT_SKIP, GiB, agent_dir, agent_record,  # noqa: F401
                                      agent_status, bit_exact, progs, show, torpor,
                                      try_status, under_agent)
from tests.gpu.test_podman_gpu import _bit_exact as podman_bit_exact
from tests.gpu.test_podman_gpu import _started as podman_started
from tests.gpu.test_podman_gpu import containers, podman  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(AGENT_SKIP is not None, reason=AGENT_SKIP or "")]

GIB = 2.0
PACKED = {"torpor.json", "torpor-store.json", "torpor-chunks", "inventory.img", "pstree.img",
          "dump.log"}


@pytest.mark.parametrize("kind", ["torch", "infer"])
def test_store_checkpoint_twice_then_restore_bit_exact(torpor, progs, agent_dir, tmp_path,  # noqa: F811
                                                       kind):
    torpor.env["TORPOR_STORE_DIR"] = str(tmp_path / "store")
    ref = progs(kind, "ref", GIB)
    prog = progs(kind, "prog", GIB, agent=True, env={"TORPOR_AGENT_FP_CHECK": "1"})
    prog.wait_ready()
    prog.wait_step(5)
    under_agent(prog, agent_dir, GIB * GiB * 0.9)
    ck1, ck2 = tmp_path / "ck1", tmp_path / "ck2"
    one = torpor.json("checkpoint", str(prog.pid), "-D", str(ck1), "--store", "one",
                      "--leave-running", timeout=600)
    at = prog.wait_step(prog.step() + 5)
    two = torpor.json("checkpoint", str(prog.pid), "-D", str(ck2), "--store", "two",
                      timeout=600)
    prog.reap()
    first, second = one["stored"], two["stored"]
    show(f"{kind}: first checkpoint stored", first)
    show(f"{kind}: second checkpoint stored", second)
    for d in (ck1, ck2):
        assert {p.name for p in d.iterdir()} == PACKED, sorted(p.name for p in d.iterdir())
    moved1 = agent_record(one["manifest"], prog.pid)
    moved2 = agent_record(two["manifest"], prog.pid)
    show(f"{kind}: the agents' fingerprints", [moved1.get("fingerprints"),
                                               moved2.get("fingerprints")])
    fp1, fp2 = moved1["fingerprints"], moved2["fingerprints"]
    assert fp1["error"] == "" and fp1["parts"] > 0 and fp1["skipped"] == 0, fp1
    assert moved1["bytes"] >= GIB * GiB * 0.9
    # left running, the first wrote data files; the second, which ends the program, streamed
    # what changed straight into the store (store/stream.py)
    assert "streamed" not in moved1 and moved2["streamed"]["bytes"] == moved2["bytes"], moved2
    # unchanged GPU memory does not cross PCIe again: at most a quarter of the first moves
    assert fp2["skipped"] > 0 and moved2["bytes"] < moved1["bytes"] / 4, (moved1, moved2)
    assert first["logical"] >= GIB * GiB and first["new_bytes"] > 0
    # the GPU memory that did not change is not stored again (the agent's files keep their
    # layout, CRIU's pages are cut by address): at most a quarter of the first is new
    assert second["new_bytes"] < first["new_bytes"] / 4, (first, second)
    r = torpor.json("restore", "-D", str(ck2), timeout=600)
    show(f"{kind}: restore", r)
    assert r["cuda_pids"] == [prog.pid] and agent_record(r, prog.pid)
    assert agent_record(r, prog.pid).get("streamed") is True   # from the store to the GPU
    assert {p.name for p in ck2.iterdir()} == PACKED      # the unpacked copy is gone
    assert prog.step() >= at
    bit_exact(ref, prog)


def test_a_checkpoint_that_ends_the_program_streams_it_all_into_the_store(  # noqa: F811
        torpor, progs, agent_dir, tmp_path):
    """The first checkpoint into an empty store, ending the program: every byte of its GPU
    data goes through the ring into the store (none to data files), and the restore streams
    it all back onto the GPU, bit-exact."""
    torpor.env["TORPOR_STORE_DIR"] = str(tmp_path / "store")
    ref = progs("torch", "ref", GIB)
    prog = progs("torch", "prog", GIB, agent=True, env={"TORPOR_AGENT_FP_CHECK": "1"})
    prog.wait_ready()
    prog.wait_step(5)
    under_agent(prog, agent_dir, GIB * GiB * 0.9)
    ck = tmp_path / "ck"
    one = torpor.json("checkpoint", str(prog.pid), "-D", str(ck), "--store", "one",
                      timeout=600)
    prog.reap()
    moved = agent_record(one["manifest"], prog.pid)
    show("streamed checkpoint", {"agent": moved, "stored": one["stored"]})
    streamed = moved["streamed"]
    assert streamed["bytes"] == moved["bytes"] >= GIB * GiB * 0.9, moved
    assert streamed["new_chunks"] + streamed["reused_chunks"] + streamed["zero_chunks"] \
        == streamed["parts"] > 0
    assert one["stored"]["streamed"] == streamed["parts"]
    assert one["stored"]["new_bytes"] >= streamed["new_bytes"] > GIB * GiB / 2
    assert {p.name for p in ck.iterdir()} == PACKED
    at = prog.step()
    r = torpor.json("restore", "-D", str(ck), timeout=600)
    show("streamed restore", r)
    back = agent_record(r, prog.pid)
    assert back.get("streamed") is True and back["bytes"] >= GIB * GiB * 0.9, back
    assert prog.step() >= at
    bit_exact(ref, prog)


def test_sigkill_of_torpor_mid_stream_costs_the_program_nothing(torpor, progs,  # noqa: F811
                                                                agent_dir, tmp_path):
    """torpor killed while the agent streams 8 GiB into the store (seconds at the disk's
    speed): the agent sees the stream close, releases nothing and opens its gate at once; the
    program runs on bit-exact, the next torpor command finds nothing to recover beyond the
    journal entry, and gc removes the chunks no snapshot names."""
    from torpor.agent import AgentClient, AgentError
    gib = 8.0
    torpor.env["TORPOR_STORE_DIR"] = str(tmp_path / "store")
    ref = progs("torch", "ref", gib)
    prog = progs("torch", "prog", gib, agent=True)
    prog.wait_ready(600)
    prog.wait_step(5)
    under_agent(prog, agent_dir, gib * GiB * 0.9)
    t = torpor.start("checkpoint", str(prog.pid), "-D", str(tmp_path / "ck"), "--store", "one")
    chunks = tmp_path / "store" / "chunks"

    def streaming() -> bool:
        if t.poll() is not None:
            raise AssertionError(f"torpor checkpoint ended before its stream: {t.communicate()}")
        return chunks.is_dir() and sum(1 for _ in chunks.rglob("*")) > 100
    wait_for(streaming, 300, "the stream's first chunks in the store")
    try:
        with AgentClient.for_pid(prog.pid, agent_dir, timeout=0.2) as a:
            busy = a.status()
    except AgentError:
        busy = {"control": "busy (preparing)"}
    t.kill()
    out, err = t.communicate()
    print(f"\nkilled torpor checkpoint mid-stream (agent: {busy})\n{err[-2000:]}", flush=True)
    at = prog.step()
    wait_for(lambda: try_status(prog, agent_dir).get("gate") == "open", 60, "an open gate")
    st = agent_status(prog, agent_dir)
    assert st.get("state") == "running", st        # nothing was released: no resume owed
    prog.wait_step(at + 10, timeout=300)
    ps = torpor.run("ps", timeout=600)
    assert ps.returncode == 0, ps.stderr
    gc = torpor.json("gc", timeout=600)
    show("gc after the killed stream", gc)
    assert gc["removed"] and torpor.json("ls")["snapshots"] == [], gc
    bit_exact(ref, prog)


def test_podman_store_checkpoints_skip_what_the_store_has(podman, containers, tmp_path):  # noqa: F811
    """org.torpor.store=on, the agent preloaded: a checkpoint left running, then an export;
    the export's agent skipped what the first put into the store, and its import continues
    bit-exact."""
    from torpor import archive
    from torpor.oci import AGENT_ANNOTATION
    ref, tc = podman_started(containers, "store1", GIB, last=59, at_step=10,
                             annotations={AGENT_ANNOTATION: "on", "org.torpor.store": "on"},
                             env={"TORPOR_AGENT_FP_CHECK": "1"})
    podman.checkpoint(tc.name, leave_running=True)
    tc.wait_step(tc.step() + 3)
    arch = tmp_path / "store1.tar"
    podman.checkpoint(tc.name, export=arch, compress="none")
    m = archive.manifest_from_archive(arch)
    show("the export's agent", m.get("agent"))
    (rec,) = (m.get("agent") or {}).values()
    fp = rec.get("fingerprints", {})
    assert fp.get("parts", 0) > 0 and fp.get("skipped", 0) > fp["parts"] / 2, rec
    assert rec["bytes"] < GIB * GiB / 4, rec              # what changed crossed PCIe, no more
    at = tc.step()
    podman.rm(tc.name)
    log = Path(os.environ.get("TORPOR_STATE_DIR", "/var/lib/torpor")) / "runtime.log"
    seen = log.stat().st_size if log.exists() else 0
    podman.restore(import_=arch)
    with open(log) as f:      # torpor-runtime's own account of this restore
        f.seek(seen)
        said = f.read()
    print(f"\ntorpor-runtime on the import:\n{said[-3000:]}", flush=True)
    assert "they stream from the store" in said, said[-3000:]   # the GPU data, not unpacked
    tc.wait_step(at + 10)
    podman_bit_exact(ref, tc, 59)
