"""The agent's mover (agent/src/mover.c, vmm.c) against the fake libcuda, whose device memory
holds data: prepare moves the movable memory into the files it is given (or, given none, into
the agent's own memory) and releases it, resume re-creates and reloads it bit-exact; failures
at each step leave the program's memory as it was. The protocol: agent/PROTOCOL.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import wait_for
from tests.unit.test_agent import Probe, gpu, probe  # noqa: F401  (fixtures)

MIB = 1 << 20


def ctl_recv(sock: Path, line: str, fds: list[int] = (), timeout: float = 30.0
             ) -> tuple[dict, list[int]]:
    """One command with file descriptors attached (SCM_RIGHTS), on a fresh connection: its
    reply and the descriptors that came with it (`detach hold`'s)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        if fds:
            socket.send_fds(s, [line.encode() + b"\n"], list(fds))
        else:
            s.sendall(line.encode() + b"\n")
        buf, got = b"", []
        while not buf.endswith(b"\n"):
            data, fds_in, _, _ = socket.recv_fds(s, 65536, 256)
            got += fds_in
            assert data, f"agent hung up; got {buf!r}"
            buf += data
    return json.loads(buf), got


def ctl_fds(sock: Path, line: str, fds: list[int] = (), timeout: float = 30.0) -> dict:
    """ctl_recv's reply; any descriptors that came with it closed."""
    reply, got = ctl_recv(sock, line, fds, timeout)
    for fd in got:
        os.close(fd)
    return reply


class Files:
    """n data files in a private directory, opened for a prepare or a resume."""

    def __init__(self, directory: Path, n: int):
        directory.mkdir(mode=0o700, exist_ok=True)
        self.paths = [directory / f"gpu-memory-{k}.bin" for k in range(n)]

    def open(self, write: bool) -> list[int]:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY
        return [os.open(p, flags | os.O_CLOEXEC, 0o600) for p in self.paths]

    def send(self, sock: Path, line: str, write: bool) -> dict:
        fds = self.open(write)
        try:
            return ctl_fds(sock, line, fds)
        finally:
            for fd in fds:
                os.close(fd)


def _program(p: Probe, own: str = "vmm") -> dict:
    """A program holding movable memory (two VMM-served cuMemAllocs, its own VMM mapping made
    by the probe's command `own`: vmm, or vmmfd for one exportable) and an allocation below
    the threshold; each filled with its own pattern."""
    assert p.call("init dlsym")["rc"] == 0
    mem = {"big": (p.call(f"@alloc {64 * MIB} dlsym")["ptr"], 64 * MIB),
           "odd": (p.call(f"@alloc {3 * MIB + 5} proc")["ptr"], 3 * MIB + 5),
           "small": (p.call("@alloc 4096 dlsym")["ptr"], 4096)}
    v = p.call(f"@{own} {8 * MIB}")
    mem["own"] = (v["ptr"], v["size"])
    for seed, (ptr, n) in enumerate(mem.values(), 1):
        assert p.call(f"@fill {ptr} {n} {seed}")["rc"] == 0
    return {"mem": mem, "handle": v["handle"]}


def _intact(p: Probe, mem: dict) -> None:
    for seed, (name, (ptr, n)) in enumerate(mem.items(), 1):
        r = p.call(f"@check {ptr} {n} {seed}")
        assert r["rc"] == 0 and r["ok"], (name, r)


@contextlib.contextmanager
def failing(gpu, call: str, how: str):
    """The fake's fail/<call> ("<CUresult> [pid] [after=N]", fakegpu.py) while the block runs."""
    f = gpu.state_dir / "fail" / call
    f.write_text(how + "\n")
    try:
        yield
    finally:
        f.unlink()


def _gpu_mem(gpu, p: Probe) -> int:
    return gpu.state(p.pid)["mem"]


def test_prepare_moves_memory_out_and_resume_brings_it_back(gpu, probe, tmp_path):
    p = probe()
    prog = _program(p)
    st = p.status()
    movable = 64 * MIB + 4 * MIB + 8 * MIB           # 3 MiB + 5 rounded to the 2 MiB granule
    assert (st["movable_allocations"], st["movable_bytes"]) == (3, movable)
    held = _gpu_mem(gpu, p)
    files = Files(tmp_path / "data", 3)

    r = files.send(p.sock, "prepare 5000", write=True)
    assert r["ok"] and r["bytes"] == movable and r["allocations"] == 3, r
    assert r["in_memory"] is False, r
    assert set(r["phases"]) == {"staging", "copy", "release"}, r
    assert 0 <= r["phases"]["staging"] <= r["phases"]["copy"] <= r["seconds"], r
    # chunks start at multiples of 4 MiB in their file (the gaps are holes): at least every
    # byte, at most a chunk's padding more for each chunk
    assert movable <= sum(r["files"]) <= movable + r["chunks"] * 4 * MIB and len(r["files"]) == 3
    assert sum(os.stat(f).st_blocks * 512 for f in files.paths) < movable + r["chunks"] * MIB
    assert [os.path.getsize(f) for f in files.paths] == r["files"]
    assert _gpu_mem(gpu, p) == held - movable       # the GPU memory is released
    st = p.status()
    assert (st["state"], st["gate"], st["moved_allocations"]) == ("prepared", "closed", 3)
    assert p.ctl("open")["ok"] is False             # only a resume may open it now

    held_check = p.send(f"@check {prog['mem']['big'][0]} {MIB} 1")   # waits at the gate
    assert p.ctl("detach") == {"ok": True}
    assert p.status()["state"] == "detached"
    assert p.ctl("abort")["error"] == "detached: resume with the data files"
    assert not p.done(held_check)

    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] and r["bytes"] == movable, r
    assert set(r["phases"]) == {"import", "recreate", "staging", "copy"}, r
    assert r["held"] is False and r["phases"]["import"] == 0, r      # nothing was held
    assert r["phases"]["recreate"] + r["phases"]["copy"] <= r["seconds"] + 0.002, r
    assert p.result(held_check)["ok"]
    assert _gpu_mem(gpu, p) == held
    st = p.status()
    assert (st["state"], st["gate"], st["movable_allocations"]) == ("running", "open", 3)
    _intact(p, prog["mem"])

    # the program's own handle keeps its value across the re-creation, and frees as usual
    own_ptr, own_size = prog["mem"]["own"]
    assert p.call(f"@retain {own_ptr}")["handle"] == prog["handle"]
    assert p.call(f"@release {prog['handle']}")["rc"] == 0       # the retain's reference
    assert p.call(f"@vmmfree {own_ptr} {prog['handle']} {own_size}")["rc"] == 0
    big, _ = prog["mem"]["big"]
    assert p.call(f"@free {big} dlsym")["rc"] == 0
    assert _gpu_mem(gpu, p) == held - own_size - 64 * MIB


def test_a_program_on_two_gpus_has_both_moved_with_the_movers_spread_over_them(gpu, probe,
                                                                              tmp_path):
    """Issue 6: one program, memory on two GPUs. Both GPUs' memory goes out and comes back,
    and the movers start on different GPUs (the chunks are sorted by device: taken in order,
    every mover would copy from GPU 0 first, one PCIe link at a time)."""
    import re

    p = probe({"TORPOR_AGENT_VMM_EXPORT": "0"})   # copied back, not held (held memory would come back without a copy)
    assert p.call("init dlsym")["rc"] == 0
    mem = {0: p.call(f"@alloc {128 * MIB} dlsym")["ptr"]}
    assert p.call("ctx 1 dlsym")["rc"] == 0          # the program's second GPU
    mem[1] = p.call(f"@alloc {128 * MIB} dlsym")["ptr"]
    for dev, ptr in mem.items():
        assert p.call(f"@fill {ptr} {128 * MIB} {dev + 7}")["rc"] == 0
    files = Files(tmp_path / "data", 2)
    r = files.send(p.sock, "prepare 5000", write=True)
    assert r["ok"] and r["bytes"] == 256 * MIB and r["allocations"] == 2, r
    starts = dict(re.findall(r"mover (\d+): \d+ chunks, from device (\d+)'s", p.stderr()))
    assert starts == {"0": "0", "1": "1"}, p.stderr()[-2000:]
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] and r["bytes"] == 256 * MIB, r
    for dev, ptr in mem.items():
        assert p.call(f"@check {ptr} {128 * MIB} {dev + 7}")["ok"], dev


def test_an_allocation_that_goes_away_changes_only_its_own_chunk_in_the_store(gpu, probe,
                                                                              tmp_path):
    """The files' layout follows device addresses: when an allocation below the others goes
    away (an allocator segment freed between checkpoints), the others' bytes stay where the
    store finds them again. Packed back to back, every chunk after it shifted and the store
    kept nothing."""
    from torpor.store import Store, snapshot
    p = probe()
    assert p.call("init dlsym")["rc"] == 0
    big = p.call(f"@alloc {256 * MIB} dlsym")["ptr"]
    above = []                    # mmap fills the holes above the big one first
    for _ in range(64):
        low = p.call(f"@alloc {2 * MIB} dlsym")["ptr"]
        if low < big:
            break
        above.append(low)
    assert low < big, "no small allocation came below the big one"
    for ptr in above:
        assert p.call(f"@free {ptr} dlsym")["rc"] == 0
    for ptr, n, seed in ((big, 256 * MIB, 7), (low, 2 * MIB, 8)):
        assert p.call(f"@fill {ptr} {n} {seed}")["rc"] == 0
    store = Store(tmp_path / "store")
    for name in ("one", "two"):
        files = Files(tmp_path / name, 4)
        r = files.send(p.sock, "prepare 5000", write=True)
        assert r["ok"], r
        store.ingest_dir(tmp_path / name, name)
        assert files.send(p.sock, "resume", write=False)["ok"]
        assert p.call(f"@free {low} dlsym")["rc"] == 0 or name == "two"
    new = snapshot.new_bytes_by_file(store.load("two"), store.load("one"))
    # at most the one window the small allocation shared with the big one
    assert sum(new.values()) <= 32 * MIB, new
    assert p.call(f"@check {big} {256 * MIB} 7")["ok"]


def test_a_second_prepare_after_resume_and_abort(gpu, probe, tmp_path):
    p = probe()
    prog = _program(p)
    files = Files(tmp_path / "data", 2)
    for _ in range(2):
        assert files.send(p.sock, "prepare", write=True)["ok"]
        assert p.ctl("abort")["ok"]                # from the files the agent kept
        _intact(p, prog["mem"])


def test_a_damaged_file_is_refused_and_a_good_one_then_resumes(gpu, probe, tmp_path):
    p = probe()
    prog = _program(p)
    files = Files(tmp_path / "data", 2)
    assert files.send(p.sock, "prepare", write=True)["ok"]
    assert p.ctl("detach")["ok"]
    target = files.paths[1]
    good = target.read_bytes()
    target.write_bytes(good[:1000] + bytes([good[1000] ^ 1]) + good[1001:])
    r = files.send(p.sock, "resume", write=False)
    # refused by the GPU check (the default) or the host sums (TORPOR_AGENT_MOVER_CHECK=host)
    assert r["ok"] is False and re.search("checksum mismatch|do not match their fingerprints",
                                          r["error"]), r
    assert r.get("damaged") is True and "damaged" in r["error"], r   # torpor: exit 9
    assert (p.status()["state"], p.status()["gate"]) == ("detached", "closed")
    target.write_bytes(good[: len(good) // 2])       # a short file is refused up front
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] is False and "shorter" in r["error"] and r.get("damaged") is True, r
    target.write_bytes(good)
    assert files.send(p.sock, "resume", write=False)["ok"]
    _intact(p, prog["mem"])


@pytest.mark.parametrize("call", ["cuMemcpyDtoHAsync_v2", "cuMemRelease"])
def test_a_failed_prepare_leaves_the_memory_and_reopens_the_gate(gpu, probe, tmp_path, call):
    p = probe()
    prog = _program(p)
    # the second copy out fails; or releasing the second allocation (the files are complete
    # then: what was released is reloaded at once)
    with failing(gpu, call, f"2 {p.pid} after=1"):
        r = Files(tmp_path / "data", 1).send(p.sock, "prepare", write=True)
    assert r["ok"] is False, r
    st = p.status()
    assert (st["state"], st["gate"]) == ("running", "open")
    _intact(p, prog["mem"])
    assert Files(tmp_path / "again", 1).send(p.sock, "prepare", write=True)["ok"]
    assert p.ctl("abort")["ok"]
    _intact(p, prog["mem"])


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs")
def test_a_full_disk_fails_the_prepare_and_keeps_the_memory(gpu, probe, tmp_path):
    p = probe()
    prog = _program(p)
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(small)], check=True)
    try:
        r = Files(small / "data", 2).send(p.sock, "prepare", write=True)
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert r["ok"] is False and "No space left" in r["error"], r
    assert p.status()["state"] == "running"
    _intact(p, prog["mem"])


def test_a_prepare_nobody_follows_up_resumes_by_itself(gpu, probe, tmp_path):
    p = probe({"TORPOR_AGENT_PREPARE_TIMEOUT_S": "1.5"})
    prog = _program(p)
    assert Files(tmp_path / "data", 2).send(p.sock, "prepare", write=True)["ok"]
    wait_for(lambda: p.status()["state"] == "running", timeout=15, what="the deadline resume")
    assert p.status()["gate"] == "open"
    _intact(p, prog["mem"])


def test_resume_on_a_full_gpu_answers_and_can_be_retried(gpu, probe, tmp_path):
    p = probe()
    prog = _program(p)
    files = Files(tmp_path / "data", 1)
    assert files.send(p.sock, "prepare", write=True)["ok"]
    assert p.ctl("detach")["ok"]
    other = probe()                                   # takes what p released, and more
    assert other.call("init dlsym")["rc"] == 0
    free = other.call("meminfo")["free"]
    hog = other.call(f"@alloc {free - 4 * MIB} dlsym")
    assert hog["rc"] == 0
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] is False and "no room" in r["error"], r
    assert p.status()["gate"] == "closed"
    assert other.call(f"@free {hog['ptr']} dlsym")["rc"] == 0
    assert files.send(p.sock, "resume", write=False)["ok"]
    _intact(p, prog["mem"])


def test_vmm_served_allocations_free_and_count_like_any(gpu, probe):
    p = probe()
    assert p.call("init dlsym")["rc"] == 0
    before = _gpu_mem(gpu, p)
    a = p.call(f"@alloc {16 * MIB} proc_v2")
    st = p.status()
    assert (st["allocations"], st["bytes"], st["movable_bytes"]) == (1, 16 * MIB, 16 * MIB)
    assert p.call(f"@range {a['ptr']}")["size"] == 16 * MIB
    assert p.call(f"@free {a['ptr']} dlsym")["rc"] == 0
    assert (p.status()["allocations"], p.status()["movable_bytes"]) == (0, 0)
    assert _gpu_mem(gpu, p) == before
    # below the threshold, or with the threshold at 0: the driver's own cuMemAlloc
    q = probe({"TORPOR_AGENT_VMM_MIN": "0"})
    assert q.call("init dlsym")["rc"] == 0
    q.call(f"@alloc {16 * MIB} dlsym")
    assert q.status()["movable_bytes"] == 0


# -- into the agent's own memory (a prepare without files: a suspend) -------------------------

def test_prepare_without_files_keeps_the_memory_in_the_program(gpu, probe, tmp_path):
    p = probe()
    prog = _program(p)
    movable = p.status()["movable_bytes"]
    held = _gpu_mem(gpu, p)
    r = p.ctl("prepare 5000")
    assert r["ok"] and r["bytes"] == movable and r["in_memory"] is True, r
    assert r["files"] == [], r
    assert _gpu_mem(gpu, p) == held - movable                # released on the GPU ...
    st = p.status()
    assert (st["state"], st["gate"], st["in_memory"]) == ("prepared", "closed", True)
    assert st["host_bytes"] >= movable                       # ... held in the program
    held_check = p.send(f"@check {prog['mem']['big'][0]} {MIB} 1")   # waits at the gate
    assert p.ctl("detach") == {"ok": True}                   # the deadline is off; nothing to close
    assert p.status()["state"] == "detached"
    r = Files(tmp_path / "x", 1).send(p.sock, "resume", write=True)
    assert r["ok"] is False and "without files" in r["error"], r
    assert not p.done(held_check)
    r = p.ctl("resume")
    assert r["ok"] and r["bytes"] == movable, r
    assert p.result(held_check)["ok"]
    assert _gpu_mem(gpu, p) == held
    st = p.status()
    assert (st["state"], st["in_memory"], st["host_bytes"]) == ("running", False, 0)
    _intact(p, prog["mem"])
    # and again, undone with abort this time
    assert p.ctl("prepare")["ok"]
    assert p.ctl("abort")["ok"]
    _intact(p, prog["mem"])


def test_a_prepare_into_memory_nobody_follows_up_resumes_by_itself(gpu, probe):
    p = probe({"TORPOR_AGENT_PREPARE_TIMEOUT_S": "1.5"})
    prog = _program(p)
    assert p.ctl("prepare")["ok"]
    wait_for(lambda: p.status()["state"] == "running", timeout=15, what="the deadline resume")
    _intact(p, prog["mem"])


@pytest.mark.parametrize("call, after, error", [
    ("cuMemcpyDtoHAsync_v2", " after=1", "copy out"),       # the second copy out
    ("cuMemHostRegister_v2", "", "cuMemHostRegister")])     # every worker's staging
def test_a_failed_prepare_into_memory_releases_nothing(gpu, probe, call, after, error):
    """Nothing is released and the agent's regions are unmapped; workers that failed before
    the wait for every staging registration still arrive there, so none is left waiting."""
    p = probe()
    prog = _program(p)
    held = _gpu_mem(gpu, p)
    with failing(gpu, call, f"2 {p.pid}{after}"):
        r = p.ctl("prepare")
    assert r["ok"] is False and error in r["error"], r
    st = p.status()
    assert (st["state"], st["gate"], st["host_bytes"]) == ("running", "open", 0)
    assert _gpu_mem(gpu, p) == held
    assert p.ctl("prepare")["ok"] and p.ctl("resume")["ok"]
    _intact(p, prog["mem"])


def test_a_failed_reload_from_memory_can_be_retried(gpu, probe):
    p = probe()
    prog = _program(p)
    assert p.ctl("prepare")["ok"]
    assert p.ctl("detach")["ok"]
    with failing(gpu, "cuMemcpyHtoDAsync_v2", f"2 {p.pid} after=1"):
        r = p.ctl("resume")
    assert r["ok"] is False and "copy in" in r["error"], r
    assert (p.status()["state"], p.status()["gate"]) == ("detached", "closed")
    assert p.ctl("resume")["ok"]                             # the host copy is still there
    _intact(p, prog["mem"])



def test_a_prepare_counts_what_the_allocator_cache_gave_back(gpu, probe):
    """PyTorch's expandable segments give cached memory back by unmapping and releasing their
    own VMM handles: the prepare counts that as released, and it is not moved."""
    p = probe()
    prog = _program(p)
    spare = p.call(f"@vmm {16 * MIB}")                 # the cache: the program's own VMM
    assert p.call(f"cached {spare['ptr']} {spare['handle']} {spare['size']}")["rc"] == 0
    movable = p.status()["movable_bytes"]
    r = p.ctl("prepare")
    assert r["ok"] and r["cache_released"] == spare["size"], r
    assert r["bytes"] == movable - spare["size"], r
    assert p.ctl("resume")["ok"]
    _intact(p, prog["mem"])
