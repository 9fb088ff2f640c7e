"""TORPOR_AGENT_MOVER_STAGE=part (review of 0c6cada): odd layouts (allocations not multiples of
4 MiB, many in one chunk, pieces spanning parts, zero parts between), 1-2 GPUs, 2-8 buffers, 1-3
sinks, files, memory and the stream, bit-exact out and back; that the part path really runs;
failures half-way leave the program resumable."""

from __future__ import annotations

import pytest

from tests.unit.test_agent import gpu, probe  # noqa: F401  (fixtures)
from tests.unit.test_agent_mover import Files, ctl_fds, failing

MIB = 1 << 20

# (bytes, [(offset, length)] filled (the rest zero)); None: whole
LAYOUT = [
    (2 * MIB, None),
    (6 * MIB, [(0, MIB)]),                      # a zero part after 2 MiB of data?
    (4096, None),
    (10 * MIB, [(5 * MIB, 3 * MIB + 11)]),
    (2 * MIB, []),                              # all zero
    (14 * MIB, [(0, 100), (13 * MIB, MIB)]),
    (3 * MIB + 5, None),
    (30 * MIB, [(0, 2 * MIB), (20 * MIB, 2 * MIB + 1)]),
    (6 * MIB, None),
    (2 * MIB, [(MIB, 7)]),
    (50 * MIB, None),
]


def _layout(p, dev_cmds):
    segs = []
    seed = 20
    for cmd in dev_cmds:
        if cmd is not None:
            assert p.call(cmd)["rc"] == 0
        for n, fills in LAYOUT:
            ptr = p.call(f"@alloc {n} dlsym")["ptr"]
            fills = [(0, n)] if fills is None else fills
            at = 0
            for off, ln in sorted(fills):
                if off > at:
                    segs.append((ptr + at, off - at, -1))
                seed += 1
                assert p.call(f"@fill {ptr + off} {ln} {seed}")["rc"] == 0
                segs.append((ptr + off, ln, seed))
                at = off + ln
            if at < n:
                segs.append((ptr + at, n - at, -1))
    return segs


def _check(p, segs):
    for ptr, n, seed in segs:
        r = p.call(f"@check {ptr} {n} {seed}")
        assert r["ok"], (hex(ptr), n, seed, r)


@pytest.mark.parametrize("ngpu", [1, 2])
@pytest.mark.parametrize("check", ["host", "gpu"])
@pytest.mark.parametrize("buffers,nsinks", [(2, 1), (3, 2), (5, 3), (8, 2)])
@pytest.mark.parametrize("sink", ["files", "memory"])
def test_stage_part_odd_layouts(gpu, probe, tmp_path, sink, buffers, nsinks, check, ngpu):
    env = {"TORPOR_AGENT_MOVER_STAGE": "part", "TORPOR_AGENT_MOVER_BUFFERS": str(buffers),
           "TORPOR_AGENT_MOVER_CHECK": check, "TORPOR_AGENT_FP_CHECK": "1",
           "TORPOR_AGENT_MOVER_WORKERS": str(nsinks)}
    p = probe(env=env)
    cmds = ["init dlsym"] + (["ctx 1 dlsym"] if ngpu == 2 else [])
    segs = _layout(p, cmds)
    movable = p.status()["movable_bytes"]
    files = Files(tmp_path / "data", nsinks)
    for rnd in range(2):
        r = files.send(p.sock, "prepare 5000", write=True) if sink == "files" \
            else ctl_fds(p.sock, "prepare 5000")
        assert r["ok"], r
        assert r["bytes"] + r["zero"]["bytes"] == movable and r["zero"]["bytes"] > 0, r
        assert p.ctl("detach")["ok"]
        (gpu.state_dir / "dirty").write_text("")
        back = files.send(p.sock, "resume", write=False) if sink == "files" \
            else ctl_fds(p.sock, "resume")
        assert back["ok"] and back["bytes"] == r["bytes"], (rnd, back)
        (gpu.state_dir / "dirty").unlink()
        _check(p, segs)


@pytest.mark.parametrize("stage,ok", [("chunk", True), ("part", False)])
def test_stage_part_really_copies_a_part_at_a_time(gpu, probe, tmp_path, stage, ok):
    """64 MiB, one file: two chunks, 16 parts. The 9th copy out fails: a chunk-staged save
    makes 2 copies and succeeds, a part-staged one makes 16 and fails."""
    p = probe(env={"TORPOR_AGENT_MOVER_STAGE": stage, "TORPOR_AGENT_MOVER_CHECK": "host",
                   "TORPOR_AGENT_ZEROS": "0"})
    assert p.call("init dlsym")["rc"] == 0
    ptr = p.call(f"@alloc {64 * MIB} dlsym")["ptr"]
    assert p.call(f"@fill {ptr} {64 * MIB} 5")["rc"] == 0
    files = Files(tmp_path / "data", 1)
    with failing(gpu, "cuMemcpyDtoHAsync_v2", f"1 {p.pid} after=8"):
        r = files.send(p.sock, "prepare 5000", write=True)
    assert r["ok"] is ok, r
    if ok:
        assert files.send(p.sock, "resume", write=False)["ok"]
    assert p.call(f"@check {ptr} {64 * MIB} 5")["ok"]


@pytest.mark.parametrize("call", ["cuMemcpyHtoDAsync_v2", "cuStreamSynchronize"])
@pytest.mark.parametrize("sink", ["files", "memory"])
def test_stage_part_load_failing_half_way_then_resumes(gpu, probe, tmp_path, call, sink):
    p = probe(env={"TORPOR_AGENT_MOVER_STAGE": "part", "TORPOR_AGENT_MOVER_BUFFERS": "3",
                   "TORPOR_AGENT_MOVER_WORKERS": "2",
                   "TORPOR_AGENT_VMM_EXPORT": "0"})   # the load is tested: not held
    segs = _layout(p, ["init dlsym"])
    files = Files(tmp_path / "data", 2)
    r = files.send(p.sock, "prepare 5000", write=True) if sink == "files" \
        else ctl_fds(p.sock, "prepare 5000")
    assert r["ok"], r
    with failing(gpu, call, f"1 {p.pid} after=9"):
        back = files.send(p.sock, "resume", write=False) if sink == "files" \
            else ctl_fds(p.sock, "resume")
    assert back["ok"] is False, back
    back = files.send(p.sock, "resume", write=False) if sink == "files" \
        else ctl_fds(p.sock, "resume")
    assert back["ok"], back
    _check(p, segs)


def test_stage_part_short_file_refused(gpu, probe, tmp_path):
    p = probe(env={"TORPOR_AGENT_MOVER_STAGE": "part", "TORPOR_AGENT_MOVER_CHECK": "host"})
    segs = _layout(p, ["init dlsym"])
    files = Files(tmp_path / "data", 2)
    assert files.send(p.sock, "prepare 5000", write=True)["ok"]
    # which file holds which chunk follows where the fake driver put the memory (it varies with
    # the pid): damage the last non-zero byte of a file that has one. A zero part's place in
    # its file is never read back, so the last part may be all zeros; the last non-zero byte
    # is always in a part that moved (damaging every part in turn is slow)
    path = next(f for f in files.paths if f.read_bytes().rstrip(b"\0"))
    good = path.read_bytes()
    last = len(good.rstrip(b"\0")) - 1
    path.write_bytes(good[:last] + bytes([good[last] ^ 0x80]) + good[last + 1:])
    back = files.send(p.sock, "resume", write=False)
    assert back["ok"] is False and "checksum mismatch" in back["error"], back
    path.write_bytes(good)
    assert files.send(p.sock, "resume", write=False)["ok"]
    _check(p, segs)


@pytest.mark.parametrize("nfiles,slots,buffers", [(1, 1, 2), (2, 2, 3), (3, 5, 8)])
def test_stage_part_streamed_odd_layout(gpu, probe, tmp_path, nfiles, slots, buffers):
    from tests.unit.test_agent_stream import _prepare_streamed, _resume_streamed
    from torpor.store.store import Store
    p = probe(env={"TORPOR_AGENT_FP_CHECK": "1", "TORPOR_AGENT_MOVER_STAGE": "part",
                   "TORPOR_AGENT_MOVER_BUFFERS": str(buffers)})
    segs = _layout(p, ["init dlsym"])
    store = Store(tmp_path / "store", workers=2)
    data = tmp_path / "data"
    reply, intake = _prepare_streamed(p, store, data, nfiles=nfiles, slots=slots)
    intake.finish()
    assert reply.get("bytes"), reply
    assert ctl_fds(p.sock, "detach")["ok"]
    (gpu.state_dir / "dirty").write_text("")
    back = _resume_streamed(p, store, data, nfiles=nfiles, slots=slots)
    (gpu.state_dir / "dirty").unlink()
    assert back["bytes"] == reply["bytes"], back
    _check(p, segs)
