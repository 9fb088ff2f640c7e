"""Held memory past 200 allocations (agent/src/fdbag.h, shim/torpor/fdbag.py; agent/PROTOCOL.md
"Held memory"): PyTorch's expandable segments are one allocation every 20 MiB, so a program
with more than 4 GiB of them was copied out and back through a leave-running pause. Past
HOLD_DIRECT (200) the held descriptors travel as one bag, a SOCK_SEQPACKET socket whose queue
holds them: in `detach hold`'s reply, `resume held=N`, `hold N` and the copier's go. Against
the fake libcuda (its exported descriptors are the handles' memfds), through torpor's own
client (AgentClient, copier.hand) where torpor sends or receives them."""

from __future__ import annotations

import os
import resource
import shutil
import socket

import pytest

from torpor import copier, fdbag
from torpor.agent import AgentClient, held_fds
from tests.unit.test_agent import Probe, gpu  # noqa: F401  (fixtures)
from tests.unit.test_agent_defer import COPIER, new_plan, ready_copier  # noqa: F401
from tests.unit.test_agent_held import (EXPORT, _holds_nothing, _kept, close_all, one_file,
                                        one_file_agent)  # noqa: F401  (a fixture)
from tests.unit.test_agent_mover import MIB, Files, ctl_fds, ctl_recv

N = 260            # past HOLD_DIRECT (200) and past one of the bag's messages (240)
FILLED = (0, 1, 137, N - 1)   # allocations with data; the rest stay zero (no file space)


@pytest.fixture(autouse=True)
def room_for_descriptors():
    """This process takes N descriptors out of a bag at a time, several times over."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 16384) if hard != resource.RLIM_INFINITY else 16384
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def many(gpu, tmp_path):
    """many() -> a program under the agent with N exportable allocations of 2 MiB, some
    filled, and their pointers; room in its descriptor table for them (each of the fake's
    handles is a memfd, and each export another)."""
    started: list[Probe] = []

    def start(env: dict[str, str] = EXPORT) -> tuple[Probe, list[int]]:
        prefix = []
        if os.geteuid() == 0 and shutil.which("prlimit"):
            prefix = ["prlimit", "--nofile=16384:16384", "--"]
        p = Probe(gpu, tmp_path, env, prefix)
        started.append(p)
        assert p.call("init dlsym")["rc"] == 0
        ptrs = [p.call(f"@alloc {2 * MIB} dlsym")["ptr"] for _ in range(N)]
        for k in FILLED:
            assert p.call(f"@fill {ptrs[k]} {2 * MIB} {k + 1}")["rc"] == 0
        assert p.status()["holdable"] is True
        return p, ptrs
    yield start
    for p in started:
        p.close()


def intact(p: Probe, ptrs: list[int]) -> None:
    for k in FILLED:
        r = p.call(f"@check {ptrs[k]} {2 * MIB} {k + 1}")
        assert r["rc"] == 0 and r["ok"], (k, r)


def test_a_bag_carries_more_than_one_message_can_and_keeps_their_order(tmp_path):
    files = [os.open(tmp_path / f"f{k}", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
             for k in range(600)]
    try:
        bag = fdbag.pack(files)
        try:
            got = fdbag.unpack(bag, 600)
        finally:
            os.close(bag)
        try:
            assert [os.fstat(a).st_ino for a in got] == [os.fstat(a).st_ino for a in files]
            assert not any(os.get_inheritable(fd) for fd in got)
        finally:
            close_all(got)
    finally:
        close_all(files)


def test_a_bag_that_holds_another_number_is_refused_and_leaves_nothing_open(tmp_path):
    before = len(os.listdir("/proc/self/fd"))
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(300)]
    bag = fdbag.pack(fds)
    close_all(fds)
    with pytest.raises(fdbag.BagError, match="more than 299"):
        fdbag.unpack(bag, 299)
    os.close(bag)
    bag = fdbag.pack([0] * 10)
    with pytest.raises(fdbag.BagError, match="holds 10 descriptors, not 11"):
        fdbag.unpack(bag, 11)
    os.close(bag)
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("what", ["file", "stream", "open"])
def test_what_is_no_bag_is_refused_without_blocking(tmp_path, what):
    if what == "file":
        bag = os.open("/dev/null", os.O_RDONLY)
        other = None
    else:
        kind = socket.SOCK_STREAM if what == "stream" else socket.SOCK_SEQPACKET
        a, b = socket.socketpair(socket.AF_UNIX, kind)
        socket.send_fds(a, [b"h"], [0])
        bag, other = b.detach(), a   # "open": the other end still open, still filling it
    try:
        with pytest.raises(fdbag.BagError):
            fdbag.unpack(bag, 2)
    finally:
        os.close(bag)
        if other is not None:
            other.close()


def test_more_than_200_held_allocations_come_back_without_a_copy(gpu, many, tmp_path):
    """detach hold sends a bag ("bag": true), torpor's client unpacks it, its resume sends one
    back; twice in a row (the second hands out the kept descriptors: a sorted check of their
    descriptions, not one against every other)."""
    p, ptrs = many()
    for round in range(2):
        files = Files(tmp_path / f"data{round}", 2)
        r = files.send(p.sock, "prepare 5000", write=True)
        assert r["ok"] and r["held"] == N, r
        with AgentClient(p.sock) as a:
            held = a.detach_hold()
        assert len(held) == N
        copies = gpu.copies(p.pid)
        data = files.open(write=False)
        try:
            with AgentClient(p.sock) as a:
                r = a.resume(data, held=held)
        finally:
            close_all(data + held)
        assert r["held"] is True and r["bytes"] == 0, r
        # no data crossed "PCIe": only the fingerprint kernel's lanes, ~4 KiB a part, that
        # check the memory taken back (a copy would be 2 MiB an allocation)
        after = gpu.copies(p.pid)
        assert after["memset"] == copies["memset"], (copies, after)
        for way in ("htod", "dtoh"):
            assert after[way] - copies[way] < N * 8 * 1024, (way, copies, after)
        intact(p, ptrs)
    assert p.status()["state"] == "running"


def test_the_reply_of_detach_hold_carries_one_bag(gpu, many, tmp_path):
    p, _ = many()
    files = Files(tmp_path / "d", 1)
    assert files.send(p.sock, "prepare 5000", write=True)["held"] == N
    r, got = ctl_recv(p.sock, "detach hold")
    assert r == {"ok": True, "held": N, "bag": True} and len(got) == 1, r
    held = fdbag.unpack(got[0], N)
    close_all(got)
    data = files.open(write=False)
    try:
        # the bag short of one, and not a bag at all: refused, nothing done
        with held_fds(held[:-1]) as short:
            r = ctl_fds(p.sock, f"resume held={N}", data + short)
        assert not r["ok"] and f"not {N}" in r["error"], r
        r = ctl_fds(p.sock, f"resume held={N}", data + [data[0]])
        assert not r["ok"] and "SOCK_SEQPACKET" in r["error"], r
        assert p.status()["state"] == "detached"
        with held_fds(held) as bag:
            r = ctl_fds(p.sock, f"resume held={N}", data + bag)
        assert r["ok"] and r["held"] is True, r
    finally:
        close_all(data + held)


def test_a_deferred_copy_of_more_than_200_allocations(gpu, many, tmp_path, ready_copier):
    """The copier gets its held descriptors in a bag (copier.hand) and fills the files from
    them; hold N gives a bag back to the agent (a rollback's give_back), and the deadline-less
    resume takes the memory from there."""
    p, ptrs = many()
    c = ready_copier()
    assert copier.ready(c, 30) is None
    files, plan = Files(tmp_path / "d", 2), new_plan()
    data = files.open(write=True)
    try:
        r = ctl_fds(p.sock, "prepare 5000 defer", data + [plan])
    finally:
        close_all(data)
    assert r["ok"] and r["deferred"] is True and r["held"] == N, r
    with AgentClient(p.sock) as a:
        held = a.detach_hold()
        assert a.release_owed and len(held) == N
    rw = [os.open(f, os.O_RDWR | os.O_CLOEXEC) for f in files.paths]
    try:
        copier.hand(c, plan, rw, held)
    finally:
        close_all(rw + [plan])
    out = copier.wait(c, 60)
    assert out["ok"] is True and out["allocations"] == N and out["bytes"] >= len(FILLED) * 2 * MIB, out
    assert ctl_fds(p.sock, "detach release") == {"ok": True}

    # given back to the agent in a bag, as a failed rollback does: the agent checks and keeps
    with held_fds(held) as bag:
        r = ctl_fds(p.sock, f"hold {N}", bag)
    assert r == {"ok": True, "held": N}, r
    close_all(held)
    r = ctl_fds(p.sock, "abort")
    assert r["ok"] and r["held"] is True, r
    intact(p, ptrs)


def held_round(p: Probe, files: Files) -> None:
    r = files.send(p.sock, "prepare 5000", write=True)
    assert r["ok"] and r["held"] == N, r
    with AgentClient(p.sock) as a:
        held = a.detach_hold()
    data = files.open(write=False)
    try:
        with AgentClient(p.sock) as a:
            assert a.resume(data, held=held)["held"] is True
    finally:
        close_all(data + held)


def test_with_the_driver_s_one_file_many_kept_descriptors_are_told_apart(gpu, many, tmp_path,
                                                                         one_file_agent):
    """The real driver's descriptors are all one device node: what tells the kept ones apart is
    their open file descriptions, checked sorted by kcmp's order (thousands of allocations:
    not each against every other). N of them hold again; one description put at another kept
    number (the program's doing) is found, and that prepare holds nothing."""
    p, ptrs = many(one_file(one_file_agent))
    held_round(p, Files(tmp_path / "a", 1))
    held_round(p, Files(tmp_path / "b", 1))          # the kept ones, handed out: all distinct
    intact(p, ptrs)
    kept = _kept(p)
    assert len(kept) == N, len(kept)
    assert p.call(f"dup2 {kept[0]} {kept[N // 2]}")["rc"] == 0
    _holds_nothing(p, Files(tmp_path / "c", 1), "is another kept one's too")
    intact(p, ptrs)
