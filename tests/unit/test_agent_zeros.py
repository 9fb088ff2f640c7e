"""Zero memory never crosses PCIe (issue 20, item 2; agent/src/fingerprint_parts.c): the agent on
the fake libcuda, whose kernel flags the segments that read all zero as the PTX does and which
counts every byte copied between host and device (fakegpu.FakeGpu.copies). A 4 MiB part that
reads all zero is neither copied nor written (a hole in a file, no room in the agent's memory,
no chunk in the store's stream); a resume re-creates it with cuMemsetD8Async, checked with the
fake's `dirty` knob on (new GPU memory holds 0xA5 bytes, as a real GPU's holds garbage).
"""

from __future__ import annotations

import os
import socket
import threading

import pytest

from tests.unit.test_agent import gpu, probe  # noqa: F401  (fixtures)
from tests.unit.test_agent_mover import Files, ctl_fds
from tests.unit.test_agent_stream import _prepare_streamed, _resume_streamed
from torpor import agent_data
from torpor.agent import AgentClient, AgentError
from torpor.store import fingerprints, stream
from torpor.store.store import Store

MIB = 1 << 20
PART = 4 * MIB
CHUNK = 32 * MIB          # mover.h: a chunk is one CHUNK-aligned window of device addresses
SIZE = 64 * MIB
# (offset, length, pattern): what the program wrote; the rest of its 64 MiB stays zeros
WRITTEN = [(0, 6 * MIB, 3), (40 * MIB + 12345, 100, 4)]


def _program(p) -> int:
    assert p.call("init dlsym")["rc"] == 0
    ptr = p.call(f"@alloc {SIZE} dlsym")["ptr"]
    for off, n, pat in WRITTEN:
        assert p.call(f"@fill {ptr + off} {n} {pat}")["rc"] == 0
    return ptr


def _parts(ptr: int) -> list[tuple[int, int]]:
    """The agent's parts of one allocation alone: each window's chunk cut into PART-byte
    parts from its first byte (mover.c plan_build, fingerprint_parts.c segs_build), as
    (offset in the allocation, length)."""
    out = []
    window = ptr // CHUNK
    while window * CHUNK < ptr + SIZE:
        start, end = max(window * CHUNK, ptr), min((window + 1) * CHUNK, ptr + SIZE)
        out += [(a - ptr, min(PART, end - a)) for a in range(start, end, PART)]
        window += 1
    return out


def _moved(ptr: int) -> int:
    """The bytes of the parts the program wrote into."""
    return sum(n for off, n in _parts(ptr)
               if any(o < off + n and off < o + length for o, length, _ in WRITTEN))


def _intact(p, ptr: int) -> None:
    """Every byte as the program left it: its patterns, and zeros everywhere else."""
    at = 0
    for off, n, pat in sorted(WRITTEN):
        if off > at:
            r = p.call(f"@check {ptr + at} {off - at} -1")
            assert r["ok"], (at, r)
        r = p.call(f"@check {ptr + off} {n} {pat}")
        assert r["ok"], (off, r)
        at = off + n
    r = p.call(f"@check {ptr + at} {SIZE - at} -1")
    assert r["ok"], (at, r)


def _delta(gpu, pid: int, before: dict) -> dict:
    now = gpu.copies(pid)
    return {k: now[k] - before[k] for k in now}


@pytest.mark.parametrize("sink", ["files", "memory"])
def test_zero_parts_are_never_copied_and_a_resume_memsets_them(gpu, probe, tmp_path, sink):
    p = probe()
    ptr = _program(p)
    moved = _moved(ptr)
    assert moved <= 3 * PART                           # of 64 MiB
    files = Files(tmp_path / "data", 2)
    before = gpu.copies(p.pid)

    r = files.send(p.sock, "prepare 5000", True) if sink == "files" \
        else ctl_fds(p.sock, "prepare 5000")
    assert r["ok"], r
    assert r["bytes"] == moved and r["zero"]["bytes"] == SIZE - moved, r
    assert r["zero"]["parts"] == len(_parts(ptr)) - moved // PART - (moved % PART > 0)
    assert r["zero"]["error"] == ""
    copied = _delta(gpu, p.pid, before)
    # what crossed "PCIe" out: the parts written into, the kernel's flags (4 bytes each) and,
    # with the mover's GPU check (the default), each segment's fingerprint lanes: far below one
    # part of zeros (4 MiB)
    assert moved <= copied["dtoh"] <= moved + 128 * 1024, copied
    if sink == "files":   # the zero parts are holes: the files hold the data alone
        assert sum(os.stat(f).st_blocks * 512 for f in files.paths) <= moved + 2 * MIB
        assert sum(r["files"]) >= SIZE                # the files still span every part
    else:                 # the agent's memory holds the data alone
        assert p.status()["host_bytes"] <= moved + 2 * 2 * MIB, p.status()
    assert ctl_fds(p.sock, "detach")["ok"]

    (gpu.state_dir / "dirty").write_text("")          # re-created memory is not zeros
    before = gpu.copies(p.pid)
    back = files.send(p.sock, "resume", False) if sink == "files" \
        else ctl_fds(p.sock, "resume")
    assert back["ok"] and back["bytes"] == moved and back["zero_bytes"] == SIZE - moved, back
    copied = _delta(gpu, p.pid, before)
    # in: the data and (GPU check) the check kernel's table of segments; the zeros by memset
    assert moved <= copied["htod"] <= moved + 4096 and copied["memset"] == SIZE - moved, copied
    assert p.status()["state"] == "running"
    _intact(p, ptr)


@pytest.mark.parametrize("sink", ["files", "memory"])
def test_a_host_budget_counts_the_data_alone(gpu, probe, tmp_path, sink):
    """prepare ... host=N (a suspend's share of host memory): the 64 MiB allocation fits in a
    budget for its data alone; a budget below the data is refused before a byte is copied,
    the gate open again and the program untouched; a malformed budget is refused."""
    p = probe()
    ptr = _program(p)
    moved = _moved(ptr)
    files = Files(tmp_path / "data", 2)

    def prepare(arg: str) -> dict:
        return files.send(p.sock, f"prepare 5000 {arg}", True) if sink == "files" \
            else ctl_fds(p.sock, f"prepare 5000 {arg}")

    for bad in ("host=", "host=0", "host=-5", "host=12x", "host=99999999999999999999999"):
        r = prepare(bad)
        assert r["ok"] is False and "host=" in r["error"], (bad, r)
    before = gpu.copies(p.pid)
    r = prepare(f"host={moved - 1}")
    assert r["ok"] is False, r
    assert f"needs {moved} bytes of host memory ({SIZE - moved} bytes of zero parts" \
        in r["error"] and f"{moved - 1} bytes are available" in r["error"], r
    assert _delta(gpu, p.pid, before)["dtoh"] <= 128 * 1024     # the scan's flags alone
    assert p.status()["state"] == "running" and p.status()["gate"] == "open"
    _intact(p, ptr)
    r = prepare(f"host={moved}")                      # 64 MiB on the GPU, `moved` to host
    assert r["ok"] and r["bytes"] == moved, r
    assert ctl_fds(p.sock, "detach")["ok"]
    back = files.send(p.sock, "resume", False) if sink == "files" else ctl_fds(p.sock, "resume")
    assert back["ok"], back
    _intact(p, ptr)


def test_without_zero_detection_every_part_is_copied(gpu, probe, tmp_path):
    """TORPOR_AGENT_ZEROS=0: the mover as it was (what the figures above are measured against)."""
    p = probe(env={"TORPOR_AGENT_ZEROS": "0"})
    ptr = _program(p)
    before = gpu.copies(p.pid)
    r = ctl_fds(p.sock, "prepare 5000")
    assert r["ok"] and r["bytes"] == SIZE and r["zero"]["bytes"] == 0, r
    assert _delta(gpu, p.pid, before)["dtoh"] >= SIZE
    (gpu.state_dir / "dirty").write_text("")
    assert ctl_fds(p.sock, "resume")["ok"]
    _intact(p, ptr)


def test_a_streamed_save_sends_no_zero_part_and_its_index_names_them(gpu, probe, tmp_path):
    p = probe(env={"TORPOR_AGENT_FP_CHECK": "1"})
    ptr = _program(p)
    moved = _moved(ptr)
    store = Store(tmp_path / "store", workers=2)
    data = tmp_path / "data"
    before = gpu.copies(p.pid)
    reply, intake = _prepare_streamed(p, store, data)
    stats = intake.finish()
    assert reply.get("bytes") == moved and reply["zero_bytes"] == SIZE - moved, reply
    assert stats.bytes == moved and stats.zero_chunks == 0, stats   # none went through the ring
    # the kernel's lanes come back with the fingerprints: 4 KiB a part
    assert _delta(gpu, p.pid, before)["dtoh"] <= moved + len(_parts(ptr)) * 4200
    sizes = reply["files"]
    index = fingerprints.read(data, sizes)
    zero = [x for x in index if x.zero]
    assert sum(x.length for x in zero) == SIZE - moved and not any(x.skipped for x in zero)
    assert (data / agent_data.INDEX).read_text().startswith("torpor-gpu-fingerprints 2\n")
    assert sum(s.length for s in fingerprints.read_streamed(data, sizes)) == moved
    # the pack records each zero part as zeros (no chunk, nothing read)
    for k in range(len(sizes)):
        given = fingerprints.given(index, {}, k)
        assert all(given[x.chunk] == [None, x.store_len] for x in zero if x.file == k)
    assert ctl_fds(p.sock, "detach")["ok"]

    (gpu.state_dir / "dirty").write_text("")
    before = gpu.copies(p.pid)
    back = _resume_streamed(p, store, data)           # the stream record's parts alone
    assert back["bytes"] == moved and back["zero_bytes"] == SIZE - moved, back
    # in: the data, and the kernel's segment table (16 bytes a part) for the check after it
    assert moved <= _delta(gpu, p.pid, before)["htod"] <= moved + 4096
    _intact(p, ptr)


def _feed_snapshot(p, store: Store, data, tamper=None) -> dict:
    """A restore's stream: every part of the data files as a snapshot names them (the
    streamed ones' chunks, zeros for the zero parts), each fed by stream.feed; tamper may
    change the list first."""
    sizes = [os.path.getsize(data / agent_data.file_name(k)) for k in range(2)]
    parts = [stream.Source(s.file, s.offset, s.ref)
             for s in fingerprints.read_streamed(data, sizes)]
    parts += [stream.Source(x.file, x.offset, [None, x.store_len])
              for x in fingerprints.read(data, sizes) if x.zero]
    if tamper:
        parts = tamper(parts)
    ring = stream.Ring(4)
    t = threading.Thread(target=lambda: _quiet(stream.feed, store, ring, parts, "test"))
    t.start()
    try:
        with AgentClient(p.sock) as a:
            return a.resume_stream(ring.agent_fds(), 30)
    finally:
        ring.handed()
        try:
            ring.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        t.join(10)
        ring.close()


def _quiet(fn, *args):
    try:
        fn(*args)
    except Exception:   # noqa: BLE001 - the agent's reply says what went wrong
        pass


def test_a_restore_feeds_zero_parts_as_records_alone_and_data_for_one_is_refused(
        gpu, probe, tmp_path):
    p = probe()
    ptr = _program(p)
    moved = _moved(ptr)
    store = Store(tmp_path / "store", workers=2)
    data = tmp_path / "data"
    reply, intake = _prepare_streamed(p, store, data)
    intake.finish()
    assert reply.get("zero_bytes") == SIZE - moved, reply
    assert ctl_fds(p.sock, "detach")["ok"]
    (gpu.state_dir / "dirty").write_text("")

    # a zero part's chunk given as data (another part's chunk): refused, nothing lost
    def data_for_zero(parts):
        real = next(s for s in parts if s.ref[0] is not None)
        return [stream.Source(s.file, s.offset, real.ref)
                if s.ref[0] is None and s.ref[1] == real.ref[1] else s for s in parts]
    with pytest.raises(AgentError, match="saved as zeros"):
        _feed_snapshot(p, store, data, data_for_zero)
    assert p.status()["state"] == "detached"

    # a part twice (its zeros record repeated): refused
    with pytest.raises(AgentError, match="twice"):
        _feed_snapshot(p, store, data, lambda parts: parts + [
            next(s for s in parts if s.ref[0] is None)])
    assert p.status()["state"] == "detached"

    # a zeros record for a part the program does not have (past its file; another length;
    # no such file): refused
    for file, offset, length in ((0, 1 << 40, PART), (0, 0, PART + 1), (7, 0, PART)):
        with pytest.raises(AgentError, match="not this program's"):
            _feed_snapshot(p, store, data, lambda parts: parts + [
                stream.Source(file, offset, [None, length])])
        assert p.status()["state"] == "detached"

    before = gpu.copies(p.pid)
    back = _feed_snapshot(p, store, data)
    assert back["bytes"] == moved and back["zero_bytes"] == SIZE - moved, back
    assert moved <= _delta(gpu, p.pid, before)["htod"] <= moved + 4096
    _intact(p, ptr)


def test_zeros_from_the_store_for_a_part_not_saved_as_zeros_are_checked(gpu, probe, tmp_path):
    """A part the agent did not find zero (TORPOR_AGENT_ZEROS=0 here; an unaligned one) that the
    store holds as zeros comes as a record alone too: zeros through the staging buffer, checked
    against the part's checksum, so zeros for a part that held data are refused."""
    p = probe(env={"TORPOR_AGENT_ZEROS": "0"})
    ptr = _program(p)
    store = Store(tmp_path / "store", workers=2)
    data = tmp_path / "data"
    reply, intake = _prepare_streamed(p, store, data)
    stats = intake.finish()
    assert reply.get("bytes") == SIZE and stats.zero_chunks > 0, (reply, stats)
    assert ctl_fds(p.sock, "detach")["ok"]
    (gpu.state_dir / "dirty").write_text("")

    def zeros_for_data(parts):
        return [stream.Source(s.file, s.offset, [None, s.ref[1]]) for s in parts]
    with pytest.raises(AgentError, match="checksum"):
        _feed_snapshot(p, store, data, zeros_for_data)
    assert p.status()["state"] == "detached"
    back = _feed_snapshot(p, store, data)
    assert back["bytes"] == SIZE, back
    _intact(p, ptr)


def test_the_figures_and_the_cli_line_say_what_stayed_zero():
    """The client takes zero_bytes from a prepare's "zero" block or a resume's "zero_bytes"
    (anything but a count is 0: the agent runs inside the program); the CLI's line says it."""
    from torpor.agent import _zeros
    from torpor.cli.context import agent_line
    assert _zeros({"zero": {"bytes": 5}}) == _zeros({"zero_bytes": 5}) == {"zero_bytes": 5}
    for bad in ({"zero": {"bytes": True}}, {"zero_bytes": -1}, {"zero_bytes": "9"},
                {"zero": 3}, {"zero_bytes": 1 << 70}, {}):
        assert _zeros(bad) == {"zero_bytes": 0}, bad
    moved = {"1": {"bytes": MIB, "seconds": 0.5, "zero_bytes": 8 << 30}}
    assert "; 8.00 GiB read all zero on the GPU and never crossed PCIe" in agent_line(moved)
    assert "8.00 GiB read all zero on the GPU and were memset there" in \
        agent_line(moved, "gave back")
    assert "zero" not in agent_line({"1": {"bytes": MIB, "seconds": 0.5}})
