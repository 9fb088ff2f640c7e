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
import subprocess
from pathlib import Path

import pytest

from torpor import copier, fdbag
from torpor.agent import AgentClient, held_fds
from tests.unit.test_agent import AGENT_DIR, Probe, gpu  # noqa: F401  (fixtures)
from tests.unit.test_agent_defer import COPIER, new_plan, ready_copier  # noqa: F401
from tests.unit.test_agent_held import (EXPORT, _kept, close_all, one_file,
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

    def start(env: dict[str, str] = EXPORT, own: bool = False) -> tuple[Probe, list[int]]:
        prefix = []
        if os.geteuid() == 0 and shutil.which("prlimit"):
            prefix = ["prlimit", "--nofile=16384:16384", "--"]
        p = Probe(gpu, tmp_path, env, prefix)
        started.append(p)
        assert p.call("init dlsym")["rc"] == 0
        made = [p.call(f"@vmmfd {2 * MIB}") if own else p.call(f"@alloc {2 * MIB} dlsym")
                for _ in range(N)]
        ptrs = [m["ptr"] for m in made]
        p.handles = [m.get("handle") for m in made]
        for k in FILLED:
            assert p.call(f"@fill {ptrs[k]} {2 * MIB} {k + 1}")["rc"] == 0
        assert p.status()["holdable_bag"] is True
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
        r = files.send(p.sock, "prepare 5000 bag", write=True)
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
    assert files.send(p.sock, "prepare 5000 bag", write=True)["held"] == N
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
        r = ctl_fds(p.sock, "prepare 5000 defer bag", data + [plan])
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
    r = files.send(p.sock, "prepare 5000 bag", write=True)
    assert r["ok"] and r["held"] == N, r
    with AgentClient(p.sock) as a:
        held = a.detach_hold()
    data = files.open(write=False)
    try:
        with AgentClient(p.sock) as a:
            assert a.resume(data, held=held)["held"] is True
    finally:
        close_all(data + held)


@pytest.fixture(scope="module")
def no_kcmp_agent(tmp_path_factory) -> Path:
    """The one-file test build (one_file_agent) that also finds kcmp refused, as under Docker's
    and Podman's default seccomp profiles (TORPOR_TEST_NO_KCMP in vmm.c, a test build only)."""
    build = tmp_path_factory.mktemp("no-kcmp")
    r = subprocess.run(["make", "-s", "-C", str(AGENT_DIR), f"BUILD={build}", "lib",
                        "EXTRA_CFLAGS=-DTORPOR_TEST_DRIVER_ONE_FILE -DTORPOR_TEST_NO_KCMP"],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"the no-kcmp test build failed: {r.stderr[-500:]}")
    return build / "libtorpor-agent.so"


@pytest.mark.parametrize("kcmp", [True, False], ids=["kcmp", "no kcmp"])
def test_with_the_driver_s_one_file_many_kept_descriptors_are_told_apart(
        gpu, many, tmp_path, one_file_agent, no_kcmp_agent, kcmp):
    """The real driver's descriptors are all one device node: what tells the kept ones apart is
    their open file descriptions, checked sorted by kcmp's order (thousands of allocations:
    not each against every other), and where a seccomp profile refuses kcmp, by their status
    flags, a bit of each one's index at a time. N of them hold again; one description put at
    another kept number (the program's doing) is found, and that prepare holds nothing."""
    p, ptrs = many(one_file(one_file_agent if kcmp else no_kcmp_agent))
    held_round(p, Files(tmp_path / "a", 1))
    held_round(p, Files(tmp_path / "b", 1))          # the kept ones, handed out: all distinct
    intact(p, ptrs)
    kept = _kept(p)
    assert len(kept) == N, len(kept)
    assert p.call(f"dup2 {kept[0]} {kept[N // 2]}")["rc"] == 0
    files = Files(tmp_path / "c", 1)
    r = files.send(p.sock, "prepare 5000 bag", write=True)
    assert r["ok"] and r["held"] == 0, r
    assert "is another kept one's too" in p.stderr(), p.stderr()[-2000:]
    assert ctl_recv(p.sock, "detach hold")[0]["held"] == 0
    assert files.send(p.sock, "resume", write=False)["ok"]
    intact(p, ptrs)


def test_a_bag_that_asks_for_a_pidfd_with_every_message_leaves_none_open():
    """Its maker (an agent in a container) may set SO_PASSPIDFD on the bag: the kernel would
    install a pidfd in the reader for each message read (Linux 6.5). The reader turns that off
    and closes any that came: nothing of it stays open in torpor."""
    if not hasattr(socket, "SO_PASSCRED"):
        pytest.skip("no unix credentials")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        b.setsockopt(socket.SOL_SOCKET, fdbag.SO_PASSPIDFD, 1)
    except OSError:
        pytest.skip("a kernel before SO_PASSPIDFD")
    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(50)]
    for fd in fds:
        socket.send_fds(a, [b"h"], [fd])
    close_all(fds)
    a.close()
    before = len(os.listdir("/proc/self/fd"))
    got = fdbag.unpack(b.fileno(), 50)
    close_all(got)
    assert len(os.listdir("/proc/self/fd")) == before
    b.close()


def test_a_client_that_takes_no_bag_gets_at_most_200_held(gpu, many, tmp_path):
    """A torpor before bags drops a reply that says more than 200 held (a deferred one then
    fails its checkpoint): the agent holds past 200 only for a prepare that says `bag`, and
    its status says both ways (holdable, holdable_bag) and how many it could (hold_max)."""
    p, ptrs = many()
    st = p.status()
    assert (st["holdable"], st["holdable_bag"], st["hold_max"]) == (False, True, 8192), st
    files = Files(tmp_path / "d", 1)
    r = files.send(p.sock, "prepare 5000", write=True)
    assert r["ok"] and r["held"] == 0 and "takes no bag" in r["hold_error"], r
    assert ctl_recv(p.sock, "detach hold")[0] == {"ok": True, "held": 0}
    assert files.send(p.sock, "resume", write=False)["ok"]
    intact(p, ptrs)


def test_a_program_without_room_for_the_descriptors_holds_nothing(gpu, tmp_path):
    """Holding N allocations takes N descriptors in the program at the export and 2 N at the
    held resume (those given back and one kept for each): a program whose limit on open files
    leaves no room for that holds nothing and says why, rather than meet its limit half-way
    (its own opens failing)."""
    if os.geteuid() != 0 or not shutil.which("prlimit"):
        pytest.skip("prlimit as root")
    p = Probe(gpu, tmp_path, EXPORT, ["prlimit", "--nofile=700:700", "--"])
    try:
        assert p.call("init dlsym")["rc"] == 0
        ptrs = [p.call(f"@alloc {2 * MIB} dlsym")["ptr"] for _ in range(N)]
        for k in FILLED:
            assert p.call(f"@fill {ptrs[k]} {2 * MIB} {k + 1}")["rc"] == 0
        files = Files(tmp_path / "d", 1)
        r = files.send(p.sock, "prepare 5000 bag", write=True)
        assert r["ok"] and r["held"] == 0 and "limit on open files (700)" in r["hold_error"], r
        assert files.send(p.sock, "resume", write=False)["ok"]
        intact(p, ptrs)
    finally:
        p.close()


@pytest.mark.parametrize("kcmp", [True, False], ids=["kcmp", "no kcmp"])
def test_with_the_driver_s_one_file_one_impostor_above_its_original_is_not_handed_out(
        gpu, many, tmp_path, one_file_agent, no_kcmp_agent, kcmp):
    """The program's own export of memory taken back (b's: b is shared now, never moved again)
    is a duplicate of b's kept description; put at the next kept number up, another
    allocation's, it would pass for that one's. The check must mark the impostor, not only
    b's own (which the prepare never hands out): with kcmp, and by the status flags."""
    p, ptrs = many(one_file(one_file_agent if kcmp else no_kcmp_agent), own=True)
    held_round(p, Files(tmp_path / "a", 1))
    kept = sorted(_kept(p))
    assert len(kept) == N, len(kept)
    b = 100
    fd = p.call(f"@export {p.handles[b]}")["fd"]
    ino = os.stat(f"/proc/{p.pid}/fd/{fd}").st_ino    # the fake's memory: one memfd each
    mine = [k for k in kept if os.stat(f"/proc/{p.pid}/fd/{k}").st_ino == ino]
    assert len(mine) == 1, (ino, mine)
    above = kept[kept.index(mine[0]) + 1]
    assert p.call(f"dup2 {fd} {above}")["rc"] == 0
    files = Files(tmp_path / "c", 1)
    r = files.send(p.sock, "prepare 5000 bag", write=True)
    assert r["ok"] and r["held"] == 0, r
    assert "is another kept one's too" in p.stderr(), p.stderr()[-2000:]
    assert files.send(p.sock, "resume", write=False)["ok"]
    intact(p, ptrs)
