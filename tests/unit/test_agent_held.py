"""Held GPU memory through a leave-running checkpoint (issue 20, short pauses; agent/src/mover.c
"held", agent/PROTOCOL.md): with TORPOR_AGENT_VMM_EXPORT=1 the agent creates its VMM memory
exportable, and a prepare exports every movable allocation to a descriptor before releasing
it; `detach hold` hands the descriptors to torpor, and `resume held=N` imports them at the
same addresses: every byte back, nothing copied. Anything wrong with them, and the resume
copies back from the files as before. Against the fake libcuda, whose exported descriptors
are the handles' memfds: the memory lives while one is open.
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest

from tests.integration.conftest import wait_for
from tests.unit.test_agent import Probe, gpu, probe  # noqa: F401  (fixtures)
from tests.unit.test_agent_mover import (MIB, Files, _gpu_mem, _intact, _program, ctl_recv,
                                         failing)

EXPORT = {"TORPOR_AGENT_VMM_EXPORT": "1"}
MOVABLE = 3            # _program's big, odd and own allocations (small stays with the driver)


def resume_with(p: Probe, files: Files, line: str, held: list[int] = ()) -> dict:
    data = files.open(write=False)
    try:
        return ctl_recv(p.sock, line, data + list(held))[0]
    finally:
        for fd in data:
            os.close(fd)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def nfds(p: Probe) -> int:
    return len(os.listdir(f"/proc/{p.pid}/fd"))


def fds_back(p: Probe, before: int) -> None:
    """The agent's descriptors (data files, held ones, the client's connection, which it closes
    once it sees the hang-up) are all closed again: the program has `before` open (the fake's
    handles have a memfd each: fewer while their memory is released; and memory taken back
    from held descriptors keeps a duplicate of each, KEPT, for the next hold)."""
    deadline = time.monotonic() + 10
    while nfds(p) != before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert nfds(p) == before, os.listdir(f"/proc/{p.pid}/fd")


KEPT = MOVABLE   # after a held resume: the duplicates kept, one an allocation (vmm.c)


def nothing_copied(gpu, p: Probe, before: dict) -> None:
    """No data crossed "PCIe" since before: only the fingerprint kernel's table and lanes (a
    few hundred bytes a part), which check the memory taken back (mover.c, hold_import)."""
    after = gpu.copies(p.pid)
    assert after["memset"] == before["memset"], (before, after)
    for way in ("htod", "dtoh"):
        assert after[way] - before[way] < MIB, (way, before, after)


def prepared(gpu, p: Probe, tmp_path: Path, own: str = "vmmfd", n: int = 2):
    prog = _program(p, own)
    files = Files(tmp_path / "data", n)
    before = nfds(p)
    r = files.send(p.sock, "prepare 5000", write=True)
    assert r["ok"], r
    return prog, files, before, r


def free_two(gpu, p: Probe, prog: dict) -> None:
    """cuMemFree of a served allocation, the program's own release of its handle: the GPU
    has that much memory less in use."""
    mem = _gpu_mem(gpu, p)
    big, _ = prog["mem"]["big"]
    assert p.call(f"@free {big} dlsym")["rc"] == 0
    own_ptr, own_size = prog["mem"]["own"]
    assert p.call(f"@vmmfree {own_ptr} {prog['handle']} {own_size}")["rc"] == 0
    assert _gpu_mem(gpu, p) == mem - 64 * MIB - own_size


def taken_back(gpu, p: Probe, tmp_path: Path):
    """A prepare that holds, `detach hold`, and the resume that maps the memory back: the
    program's memory is imported handles now, each with its kept descriptor."""
    prog, files, before, r = prepared(gpu, p, tmp_path)
    r, held = ctl_recv(p.sock, "detach hold")
    r = resume_with(p, files, f"resume held={MOVABLE}", held)
    close_all(held)
    assert r["ok"] and r["held"] is True, r
    return prog, files, before


def test_held_memory_comes_back_without_a_copy(gpu, probe, tmp_path):
    p = probe(EXPORT)
    prog, files, before, r = prepared(gpu, p, tmp_path)
    assert r["held"] == MOVABLE and r["hold_seconds"] >= 0, r
    assert r["bytes"] > 0                          # the files are written all the same
    # while prepared the agent holds the data files and a descriptor an allocation (the
    # fake's handles, released, closed their own memfds)
    # (the agent closes the connection of the prepare a moment after the client's hang-up)
    fds_back(p, before + 2 - MOVABLE + MOVABLE)

    r, held = ctl_recv(p.sock, "detach hold")
    assert r == {"ok": True, "held": MOVABLE} and len(held) == MOVABLE, r
    assert p.status()["state"] == "detached"
    fds_back(p, before - MOVABLE)                  # none of them left in the program (the dump)

    # nothing comes from the files (emptied) nor crosses "PCIe" (copies fail, counts stay)
    for path in files.paths:
        path.write_bytes(b"")
    copies = gpu.copies(p.pid)
    with failing(gpu, "cuMemcpyHtoDAsync_v2", f"2 {p.pid}"), \
            failing(gpu, "cuMemsetD8Async", f"2 {p.pid}"):
        r = resume_with(p, files, f"resume held={MOVABLE}", held)
    close_all(held)
    assert r["ok"] and r["held"] is True and r["bytes"] == 0, r
    assert set(r["phases"]) == {"import", "recreate", "staging", "copy"}, r
    nothing_copied(gpu, p, copies)
    assert "nothing copied" in p.stderr()
    st = p.status()
    assert (st["state"], st["gate"], st["movable_allocations"]) == ("running", "open", MOVABLE)
    _intact(p, prog["mem"])
    fds_back(p, before + KEPT)

    # a second round: the imported handles are the allocations' now, and a driver does not
    # export an imported handle (the H200 did not; nor does the fake): the agent hands out
    # duplicates of the descriptors it took them back from, so it holds again, copying nothing
    files2 = Files(tmp_path / "again", 2)
    r = files2.send(p.sock, "prepare 5000", write=True)
    assert r["ok"] and r["held"] == MOVABLE, r
    r, held = ctl_recv(p.sock, "detach hold")
    assert r == {"ok": True, "held": MOVABLE} and len(held) == MOVABLE, r
    fds_back(p, before - MOVABLE)        # its kept ones closed with the drop: none in the dump
    copies = gpu.copies(p.pid)
    r = resume_with(p, files2, f"resume held={MOVABLE}", held)
    close_all(held)
    assert r["ok"] and r["held"] is True, r
    nothing_copied(gpu, p, copies)
    _intact(p, prog["mem"])
    fds_back(p, before + KEPT)

    # a suspend (no hold asked) copies, and the re-created handles keep nothing
    files3 = Files(tmp_path / "third", 2)
    assert files3.send(p.sock, "prepare 5000", write=True)["ok"]
    r, held = ctl_recv(p.sock, "detach")
    assert r["ok"] and held == [], r
    assert files3.send(p.sock, "resume", write=False)["held"] is False
    _intact(p, prog["mem"])
    fds_back(p, before)

    # and they free as any: cuMemFree of a served one, the program's own through its handle
    free_two(gpu, p, prog)
    assert p.status()["movable_allocations"] == 1
    fds_back(p, before - 2)


def test_memory_taken_back_frees_with_its_kept_descriptor(gpu, probe, tmp_path):
    """After a held resume each allocation keeps the descriptor it came back from: cuMemFree
    and the program's own release close it with the memory, so none of it outlives the
    program's free."""
    p = probe(EXPORT)
    prog, files, before = taken_back(gpu, p, tmp_path)
    fds_back(p, before + KEPT)
    free_two(gpu, p, prog)
    fds_back(p, before + KEPT - 4)       # two handles' memfds and their two kept descriptors


def test_a_held_resume_frees_like_any(gpu, probe, tmp_path):
    """cuMemFree and the program's own release right after a held resume (the imported handle
    is the allocation's now), and the GPU memory counted as before the prepare."""
    p = probe(EXPORT)
    prog, files, before = taken_back(gpu, p, tmp_path)
    mem = _gpu_mem(gpu, p)
    for name in ("big", "odd"):
        assert p.call(f"@free {prog['mem'][name][0]} dlsym")["rc"] == 0, name
    own_ptr, own_size = prog["mem"]["own"]
    assert p.call(f"@retain {own_ptr}")["handle"] == prog["handle"]    # the value it knows
    assert p.call(f"@release {prog['handle']}")["rc"] == 0
    assert p.call(f"@vmmfree {own_ptr} {prog['handle']} {own_size}")["rc"] == 0
    assert _gpu_mem(gpu, p) == mem - 64 * MIB - 4 * MIB - own_size
    st = p.status()
    assert (st["movable_allocations"], st["movable_bytes"]) == (0, 0)
    fds_back(p, before - MOVABLE)                  # their handles are gone too


def test_held_descriptors_closed_before_the_resume_copy_from_the_files(gpu, probe, tmp_path):
    p = probe(EXPORT)
    prog, files, before, r = prepared(gpu, p, tmp_path)
    r, held = ctl_recv(p.sock, "detach hold")
    assert r["held"] == MOVABLE
    close_all(held)                                # the memory is gone with them
    copies = gpu.copies(p.pid)
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] and r["held"] is False and r["bytes"] > 0, r
    assert gpu.copies(p.pid)["htod"] > copies["htod"]
    _intact(p, prog["mem"])
    fds_back(p, before)


@pytest.mark.parametrize("wrong", ["fewer", "duplicate", "swapped", "regular", "memfd"])
def test_wrong_descriptors_are_refused_and_the_files_used(gpu, probe, tmp_path, wrong):
    p = probe(EXPORT)
    prog, files, before, r = prepared(gpu, p, tmp_path)
    r, held = ctl_recv(p.sock, "detach hold")
    assert r["held"] == MOVABLE
    extra = []
    if wrong == "fewer":
        given = held[:-1]
    elif wrong == "duplicate":
        given = [held[0]] * MOVABLE
    elif wrong == "swapped":
        given = held[::-1]
    elif wrong == "regular":
        extra = [os.open(files.paths[0], os.O_RDONLY)]
        given = [held[0], extra[0], held[2]]
    else:                                          # another memory's descriptor, same size
        extra = [os.memfd_create("fake-cuda-mem.0")]
        os.ftruncate(extra[0], 64 * MIB)
        given = [extra[0], *held[1:]]
    copies = gpu.copies(p.pid)
    r = resume_with(p, files, f"resume held={len(given)}", given)
    close_all(held + extra)
    assert r["ok"] and r["held"] is False, r
    assert gpu.copies(p.pid)["htod"] > copies["htod"]
    assert p.stderr().count("held memory not taken back") == 1, p.stderr()[-2000:]
    _intact(p, prog["mem"])
    fds_back(p, before)


def test_memory_changed_while_held_is_not_kept_and_the_files_give_it_back(gpu, probe, tmp_path):
    """The real driver's exported descriptors are all one file (/dev/nvidiactl, opened anew
    for each export; measured on the H100, 2026-12-06): only the memory itself can say that
    each descriptor came back to its own allocation. Every fingerprinted part is read on the
    GPU after the import: memory that no longer matches (here: written while held) is not
    kept as it is, and the files give every byte back."""
    p = probe(EXPORT)
    prog, files, before, r = prepared(gpu, p, tmp_path)
    r, held = ctl_recv(p.sock, "detach hold")
    assert r["held"] == MOVABLE
    os.pwrite(held[0], b"\xab" * 4096, 4096)
    copies = gpu.copies(p.pid)
    r = resume_with(p, files, f"resume held={MOVABLE}", held)
    close_all(held)
    assert r["ok"] and r["held"] is False, r
    assert gpu.copies(p.pid)["htod"] - copies["htod"] > MIB
    assert "held memory not taken back (the memory taken back is not what was saved (1 of " \
        in p.stderr(), p.stderr()[-2000:]
    _intact(p, prog["mem"])


@pytest.mark.parametrize("call, how", [
    ("cuMemImportFromShareableHandle", "1 {pid} after=1"),   # the second import
    ("cuMemMap", "2 {pid} after=1 times=1")])                # the second one's mapping
def test_a_refused_import_or_map_falls_back_to_the_files(gpu, probe, tmp_path, call, how):
    """What was imported is let go again and the copy re-creates the memory; an import that
    could not be mapped is released again (the GPU's count says so)."""
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    mem = _gpu_mem(gpu, p)
    files = Files(tmp_path / "data", 2)
    before = nfds(p)
    assert files.send(p.sock, "prepare 5000", write=True)["held"] == MOVABLE
    r, held = ctl_recv(p.sock, "detach hold")
    with failing(gpu, call, how.format(pid=p.pid)):
        r = resume_with(p, files, f"resume held={MOVABLE}", held)
    close_all(held)
    assert r["ok"] and r["held"] is False, r
    assert "held memory not taken back (taking back" in p.stderr()
    _intact(p, prog["mem"])
    st = p.status()
    assert (st["movable_allocations"], st["moved_allocations"]) == (MOVABLE, 0)
    # every handle counted once, as before the prepare: what was imported was let go again,
    # and the copy re-created the memory
    assert _gpu_mem(gpu, p) == mem
    fds_back(p, before)


def test_abort_and_a_resume_while_prepared_take_the_agents_own_held_memory(gpu, probe,
                                                                           tmp_path):
    p = probe(EXPORT)
    prog, files, before, r = prepared(gpu, p, tmp_path)
    copies = gpu.copies(p.pid)
    r = p.ctl("abort")
    assert r["ok"] and r["held"] is True, r
    nothing_copied(gpu, p, copies)
    _intact(p, prog["mem"])
    fds_back(p, before + KEPT)
    # prepared again from the imported handles: held again through the kept descriptors
    r = Files(tmp_path / "two", 1).send(p.sock, "prepare", write=True)
    assert r["ok"] and r["held"] == MOVABLE, r
    assert p.ctl("abort")["held"] is True
    _intact(p, prog["mem"])
    fds_back(p, before + KEPT)


def _kept(p: Probe) -> list[int]:
    """The program's kept descriptors: the agent puts them high, 2 x HOLD_DIRECT under its soft
    limit of open files or 4096, whichever is lower (vmm.c's kept_floor), away from what the
    program opens."""
    soft = next(int(line.split()[3]) for line in open(f"/proc/{p.pid}/limits")
                if line.startswith("Max open files"))
    top = min(soft, 4096)
    assert top >= 800, soft        # else they go anywhere: not told apart this way
    return [int(fd) for fd in os.listdir(f"/proc/{p.pid}/fd") if int(fd) >= top - 400]


def test_no_kept_descriptor_stays_open_through_the_next_dump(gpu, probe, tmp_path):
    """An allocation taken back from its held descriptor that the next prepare does not move
    (the program unmapped it since, keeping its handle): its kept descriptor is closed with
    the others all the same, or the driver's checkpoint and CRIU's dump would meet it."""
    p = probe(EXPORT)
    prog, files, before = taken_back(gpu, p, tmp_path)
    assert len(_kept(p)) == KEPT
    own_ptr, own_size = prog["mem"]["own"]
    assert p.call(f"@unmap {own_ptr} {own_size}")["rc"] == 0      # its handle kept
    files2 = Files(tmp_path / "again", 2)
    r = files2.send(p.sock, "prepare 5000", write=True)
    assert r["ok"] and r["held"] == MOVABLE - 1, r
    assert _kept(p) == []          # the unmoved one's too
    r, held = ctl_recv(p.sock, "detach hold")
    assert _kept(p) == [] and len(held) == MOVABLE - 1
    r = resume_with(p, files2, f"resume held={MOVABLE - 1}", held)
    close_all(held)
    assert r["ok"] and r["held"] is True, r
    assert len(_kept(p)) == KEPT - 1   # the moved ones keep theirs again


def test_the_programs_own_export_of_memory_taken_back_still_works(gpu, probe, tmp_path):
    """The program exports its own cuMemCreate memory after a held resume (NCCL's IPC, a
    second process): the handle is an imported one now, which the driver refuses to export
    (so does the fake); the program gets a duplicate of the descriptor the memory came back
    from, that very memory, and the allocation is the program's shared memory from then on
    (not moved again)."""
    p = probe(EXPORT)
    prog, files, before = taken_back(gpu, p, tmp_path)
    r = p.call(f"@export {prog['handle']}")
    assert r["rc"] == 0 and r["fd"] >= 3, r
    st = os.stat(f"/proc/{p.pid}/fd/{r['fd']}")
    kept = {(s.st_dev, s.st_ino) for s in (os.stat(f"/proc/{p.pid}/fd/{fd}") for fd in _kept(p))}
    assert (st.st_dev, st.st_ino) in kept
    assert p.status()["movable_allocations"] == MOVABLE - 1
    assert "exported: stays with the driver's checkpoint" in p.stderr()


def test_a_forked_child_keeps_none_of_the_kept_descriptors(gpu, probe, tmp_path):
    """A child forked after a held resume (a DataLoader worker) would keep the parent's GPU
    memory alive for its whole life through the inherited kept descriptors, and be a process
    with descriptors CRIU cannot dump: the agent's fork handler closes them in the child."""
    p = probe(EXPORT)
    prog, files, before = taken_back(gpu, p, tmp_path)
    fds_back(p, before + KEPT)
    doc = p.call("forkfds")

    def memory(fd: str) -> bool:      # the fake's GPU memory: a memfd (its handles' and kept)
        try:
            return "memfd:" in os.readlink(f"/proc/{p.pid}/fd/{fd}")
        except FileNotFoundError:    # the probe's pipe, closed since
            return False
    parents = {fd for fd in doc["fds"] if memory(fd)}
    assert len(parents) == MOVABLE + KEPT, doc   # the handles' own and the kept duplicates
    gone = parents - set(doc["child_fds"])
    assert len(gone) == KEPT, doc        # the kept ones, and only those, closed in the child
    _intact(p, prog["mem"])
    fds_back(p, before + KEPT)           # the parent keeps its own


def test_a_resume_with_the_files_while_prepared_takes_the_held_memory(gpu, probe, tmp_path):
    p = probe(EXPORT)
    prog, files, before, r = prepared(gpu, p, tmp_path)
    copies = gpu.copies(p.pid)
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] and r["held"] is True, r
    nothing_copied(gpu, p, copies)
    _intact(p, prog["mem"])
    fds_back(p, before + KEPT)


def test_the_prepare_deadline_takes_the_held_memory_back(gpu, probe, tmp_path):
    p = probe({**EXPORT, "TORPOR_AGENT_PREPARE_TIMEOUT_S": "1.5"})
    prog, files, before, r = prepared(gpu, p, tmp_path)
    assert r["held"] == MOVABLE
    copies = gpu.copies(p.pid)
    wait_for(lambda: p.status()["state"] == "running", timeout=15, what="the deadline resume")
    nothing_copied(gpu, p, copies)
    assert "nothing copied" in p.stderr()
    _intact(p, prog["mem"])
    fds_back(p, before + KEPT)


def test_held_is_the_default(gpu, probe, tmp_path):
    """No TORPOR_AGENT_VMM_EXPORT at all: the memory is exportable and held (the default since
    the H100 held it on 2026-12-06)."""
    p = probe()
    prog, _, _ = taken_back(gpu, p, tmp_path)
    assert "VMM allocations created exportable" in p.stderr()
    _intact(p, prog["mem"])


@pytest.mark.parametrize("env,own,holdable", [
    ({}, "vmmfd", True),                                # the default: all exportable
    ({"TORPOR_AGENT_VMM_EXPORT": "0"}, "vmmfd", False),  # turned off
    ({"TORPOR_AGENT_VMM_EXPORT": "off"}, "vmmfd", False),
    ({"TORPOR_AGENT_VMM_EXPORT": "FALSE"}, "vmmfd", False),
    ({"TORPOR_AGENT_VMM_EXPORT": "no"}, "vmmfd", False),
    ({"TORPOR_AGENT_VMM_EXPORT": ""}, "vmmfd", True),   # empty: as unset
    ({"TORPOR_AGENT_VMM_EXPORT": "yes"}, "vmmfd", True),
    ({}, "vmm", False),                                 # the program's own, not exportable
])
def test_status_says_whether_a_prepare_could_hold(gpu, probe, env, own, holdable):
    """status's "holdable" (torpor starts a copier only where it is not false): what a
    leave-running prepare would hold, asked before the pause."""
    p = probe(env)
    assert p.call("init dlsym")["rc"] == 0
    assert p.ctl("status")["holdable"] is False            # nothing movable yet
    _program(p, own)
    assert p.ctl("status")["holdable"] is holdable


@pytest.mark.parametrize("env,unmapped", [
    (EXPORT, True),                                        # its own handle, never mapped
    ({**EXPORT, "TORPOR_AGENT_MOVER_CHECK": "host"}, False),   # no GPU fingerprints
    (EXPORT, False),
])
def test_holdable_is_what_the_prepare_then_holds(gpu, probe, tmp_path, env, unmapped):
    """status's "holdable" agrees with the prepare that follows: a handle of the program's own
    that is not exportable but not mapped either is not moved, so it does not count; parts
    without GPU fingerprints (TORPOR_AGENT_MOVER_CHECK=host) cannot be held. (A review's
    demonstrations.)"""
    p = probe(env)
    _program(p, "vmmfd")
    if unmapped:
        assert p.call(f"@create {2 * MIB}")["rc"] == 0   # requestedHandleTypes 0, unmapped
    holdable = p.ctl("status")["holdable"]
    files = Files(tmp_path / "data", 2)
    r = files.send(p.sock, "prepare 5000", write=True)
    assert r["ok"], r
    p.ctl("abort")
    assert (r["held"] > 0) == holdable, (holdable, r["held"], r["hold_error"])


def test_holdable_stays_true_after_a_held_take_back(gpu, probe, tmp_path):
    """The periodic case: memory taken back from held descriptors is still holdable, and the
    next prepare holds it again."""
    p = probe(EXPORT)
    taken_back(gpu, p, tmp_path)
    assert p.ctl("status")["holdable"] is True
    files = Files(tmp_path / "data2", 2)
    r = files.send(p.sock, "prepare 5000", write=True)
    assert r["ok"] and r["held"] == MOVABLE, r
    p.ctl("abort")


def test_with_the_knob_at_0_nothing_is_held(gpu, probe, tmp_path):
    p = probe({"TORPOR_AGENT_VMM_EXPORT": "0"})
    prog, files, before, r = prepared(gpu, p, tmp_path)
    assert r["held"] == 0 and r["hold_error"] == "", r
    assert "nothing held" not in p.stderr()
    r, held = ctl_recv(p.sock, "detach hold")
    assert r == {"ok": True, "held": 0} and held == [], r
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] and r["held"] is False, r
    _intact(p, prog["mem"])
    fds_back(p, before)


def test_a_program_allocation_not_exportable_holds_nothing(gpu, probe, tmp_path):
    """All or nothing: the program's own cuMemCreate without POSIX descriptors is copied, so
    everything is."""
    p = probe(EXPORT)
    prog, files, before, r = prepared(gpu, p, tmp_path, own="vmm")
    assert r["held"] == 0, r
    assert "is not exportable (the program's own" in p.stderr()
    assert "is not exportable (the program's own" in r["hold_error"], r   # torpor's log too
    assert p.ctl("detach") == {"ok": True}
    r = resume_with(p, files, "resume")
    assert r["ok"] and r["held"] is False, r
    _intact(p, prog["mem"])
    fds_back(p, before)


def test_a_driver_refusing_exportable_memory_is_asked_once(gpu, probe, tmp_path):
    p = probe(EXPORT)
    assert p.call("init dlsym")["rc"] == 0
    with failing(gpu, "cuMemCreate", f"801 {p.pid} times=1"):
        a = p.call(f"@alloc {16 * MIB} dlsym")
    b = p.call(f"@alloc {16 * MIB} dlsym")
    assert a["rc"] == 0 and b["rc"] == 0
    assert p.status()["movable_allocations"] == 2     # still served from VMM
    assert p.stderr().count("the driver refuses exportable VMM memory") == 1
    assert p.call(f"@fill {a['ptr']} {16 * MIB} 3")["rc"] == 0
    files = Files(tmp_path / "data", 1)
    r = files.send(p.sock, "prepare", write=True)
    assert r["ok"] and r["held"] == 0, r
    assert files.send(p.sock, "resume", write=False)["ok"]
    assert p.call(f"@check {a['ptr']} {16 * MIB} 3")["ok"]


def test_a_client_gone_before_detach_hold_answers_holds_nothing(gpu, probe, tmp_path):
    p = probe(EXPORT)
    prog, files, before, r = prepared(gpu, p, tmp_path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(p.sock))
        s.sendall(b"detach hold\n")
    wait_for(lambda: p.status()["state"] == "detached", timeout=10, what="the detach")
    fds_back(p, before - MOVABLE)                  # sent or not, the agent kept none
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] and r["held"] is False, r
    _intact(p, prog["mem"])
    fds_back(p, before)


def test_held_is_refused_when_malformed(gpu, probe, tmp_path):
    p = probe(EXPORT)
    prog, files, before, r = prepared(gpu, p, tmp_path)
    for line in ("resume held=0", "resume held=x", "resume held=8193", "detach keep"):
        assert p.ctl(line)["error"] == "unknown command", line
    r = resume_with(p, files, "resume held=9")           # 2 files, no held descriptors
    assert r["ok"] is False and "held=N takes" in r["error"], r
    assert p.status()["state"] == "prepared"
    assert p.ctl("abort")["held"] is True
    _intact(p, prog["mem"])
    fds_back(p, before + KEPT)


def test_a_child_forked_while_a_command_is_in_flight_keeps_none_of_its_descriptors(
        gpu, probe, tmp_path):
    """Descriptors the agent received with a line not yet complete (a resume's held memory,
    in flight): a child forked then must not keep them (GPU memory alive for its life)."""
    import socket
    import time
    p = probe(EXPORT)
    _program(p, "vmmfd")
    sent = [os.memfd_create("in-flight") for _ in range(2)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(p.sock))
        socket.send_fds(s, [b"resume held=2"], sent)    # no newline: the line is pending
        close_all(sent)

        def in_flight() -> set[str]:
            return {fd for fd in os.listdir(f"/proc/{p.pid}/fd")
                    if "in-flight" in _link(p.pid, fd)}
        deadline = time.monotonic() + 10
        while len(in_flight()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        parents = in_flight()
        assert len(parents) == 2, parents
        doc = p.call("forkfds")
        assert not parents & set(doc["child_fds"]), doc


def _link(pid: int, fd: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


def test_the_memory_a_prepare_exports_is_never_inherited(gpu, probe, tmp_path):
    """The driver's exported descriptors, held by the agent while prepared, may come
    inheritable: a child the program spawns then (posix_spawn, vfork: no fork handler runs)
    would keep its GPU memory alive. The agent makes them close-on-exec."""
    p = probe(EXPORT)
    prepared(gpu, p, tmp_path)
    memory = [fd for fd in os.listdir(f"/proc/{p.pid}/fd") if "fake-cuda-mem" in _link(p.pid, fd)]
    assert len(memory) >= MOVABLE, memory
    for fd in memory:
        flags = next(int(line.split()[1], 8) for line in
                     open(f"/proc/{p.pid}/fdinfo/{fd}") if line.startswith("flags:"))
        assert flags & os.O_CLOEXEC, (fd, oct(flags))


# -- the real driver's descriptors: all one file -------------------------------------------------

@pytest.fixture(scope="module")
def one_file_agent(tmp_path_factory) -> Path:
    """The agent built so that the fake's exported memfds stat as the real driver's descriptors
    do, every one the same device node (/dev/nvidiactl, opened anew for each export:
    TORPOR_TEST_DRIVER_ONE_FILE in glibc_compat.h, a test build only)."""
    import subprocess
    from tests.unit.test_agent import AGENT_DIR
    build = tmp_path_factory.mktemp("one-file")
    r = subprocess.run(["make", "-s", "-C", str(AGENT_DIR), f"BUILD={build}", "lib",
                        "EXTRA_CFLAGS=-DTORPOR_TEST_DRIVER_ONE_FILE"], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"the one-file test build failed: {r.stderr[-500:]}")
    return build / "libtorpor-agent.so"


def one_file(lib: Path) -> dict:
    return {**EXPORT, "LD_PRELOAD": str(lib)}


def _held_round(gpu, p: Probe, files: Files, prog: dict) -> None:
    """After a prepare that held: `detach hold`, and the resume that maps it all back with no
    copy, every byte intact."""
    r, held = ctl_recv(p.sock, "detach hold")
    copies = gpu.copies(p.pid)
    r = resume_with(p, files, f"resume held={MOVABLE}", held)
    close_all(held)
    assert r["ok"] and r["held"] is True, r
    nothing_copied(gpu, p, copies)
    _intact(p, prog["mem"])


def _holds_nothing(p: Probe, files: Files, why: str) -> None:
    """A prepare that holds nothing (the agent's log says why), and its program back from the
    files."""
    r = files.send(p.sock, "prepare 5000", write=True)
    assert r["ok"] and r["held"] == 0, r
    assert why in p.stderr(), p.stderr()[-2000:]
    assert ctl_recv(p.sock, "detach hold")[0]["held"] == 0
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] and r["held"] is False, r


def test_with_the_driver_s_one_file_the_memory_is_held_and_comes_back(gpu, probe, tmp_path,
                                                                        one_file_agent):
    """Told apart by their files, the driver's descriptors held nothing (the H100 run of
    2026-12-06); taken back in their order and checked by their memory, they hold."""
    p = probe(one_file(one_file_agent))
    prog, files, before, r = prepared(gpu, p, tmp_path)
    assert r["held"] == MOVABLE and r["hold_error"] == "", r
    _held_round(gpu, p, files, prog)


def _sizes(held: list[int]) -> list[int]:
    return [os.fstat(fd).st_size for fd in held]


@pytest.mark.parametrize("wrong", ["duplicate", "swapped"])
def test_with_the_driver_s_one_file_wrong_descriptors_are_not_kept(gpu, probe, tmp_path,
                                                                    one_file_agent, wrong):
    """One file tells nothing: a descriptor given twice is refused by its open file
    description (one memory would be mapped at two allocations), descriptors out of order by
    the memory's fingerprints; either way the files give every byte back, and once the held
    descriptors are closed the GPU holds what it held before the prepare."""
    p = probe(one_file(one_file_agent))
    prog = _program(p, "vmmfd")
    mem = _gpu_mem(gpu, p)
    files = Files(tmp_path / "data", 2)
    assert files.send(p.sock, "prepare 5000", write=True)["held"] == MOVABLE
    r, held = ctl_recv(p.sock, "detach hold")
    sizes = _sizes(held)
    big = sizes.index(max(sizes))
    other = (big + 1) % MOVABLE
    given = list(held)
    if wrong == "duplicate":
        given[other] = held[big]
    else:
        given[other], given[big] = held[big], held[other]
    r = resume_with(p, files, f"resume held={MOVABLE}", given)
    close_all(held)
    assert r["ok"] and r["held"] is False, r
    # out of order, a smaller memory does not map where a bigger one was (or its bytes differ)
    why = ("is a duplicate of another",) if wrong == "duplicate" else \
        ("is not what was saved", "held memory not taken back (taking back")
    assert any(w in p.stderr() for w in why), p.stderr()[-2000:]
    _intact(p, prog["mem"])
    assert _gpu_mem(gpu, p) == mem
    st = p.status()
    assert (st["state"], st["gate"], st["moved_allocations"]) == ("running", "open", 0), st


def _two_held(p: Probe, tmp_path: Path, cmd: str = "@alloc", seeds=()) -> tuple:
    """Two 4 MiB allocations (cmd: "@alloc", served by the agent, or "@vmmfd", the program's
    own, exportable), filled with seeds if given, prepared and held: their pointers (or the
    probe's replies for @vmmfd), the data files, and the held descriptors in their order."""
    assert p.call("init dlsym")["rc"] == 0
    made = [p.call(f"{cmd} {4 * MIB}" + (" dlsym" if cmd == "@alloc" else "")) for _ in "ab"]
    a, b = (m["ptr"] for m in made) if cmd == "@alloc" else made
    for ptr, seed in zip((a, b) if cmd == "@alloc" else (), seeds):
        assert p.call(f"@fill {ptr} {4 * MIB} {seed}")["rc"] == 0
    files = Files(tmp_path / "data", 1)
    r = files.send(p.sock, "prepare 5000", write=True)
    assert r["ok"] and r["held"] == 2, r
    r, held = ctl_recv(p.sock, "detach hold")
    return a, b, files, held


def test_a_descriptor_given_twice_for_two_zero_allocations_is_refused(gpu, probe, tmp_path,
                                                                      one_file_agent):
    """Two allocations of the same bytes (zeros: fresh pools, a JAX arena) have the same
    fingerprints: only the descriptors' open file descriptions tell one memory given twice
    from two; mapped at both, a write to one would show in the other."""
    p = probe(one_file(one_file_agent))
    a, b, files, held = _two_held(p, tmp_path)
    r = resume_with(p, files, "resume held=2", [held[0], held[0]])
    close_all(held)
    assert r["ok"] and r["held"] is False, r
    assert "descriptor 1 is a duplicate of another" in p.stderr(), p.stderr()[-2000:]
    assert p.call(f"@fill {a} {4 * MIB} 1")["rc"] == 0
    assert p.call(f"@fill {b} {4 * MIB} 2")["rc"] == 0
    assert p.call(f"@check {a} {4 * MIB} 1")["ok"], "a's bytes are b's: one memory at both"


def test_two_allocations_of_one_size_given_back_swapped_are_told_by_their_memory(
        gpu, probe, tmp_path, one_file_agent):
    """Same size, same file: each maps where the other was; only the fingerprints read on
    the GPU tell, and the files give each its own bytes back."""
    p = probe(one_file(one_file_agent))
    a, b, files, held = _two_held(p, tmp_path, seeds=(1, 2))
    r = resume_with(p, files, "resume held=2", held[::-1])
    close_all(held)
    assert r["ok"] and r["held"] is False, r
    # every part is wrong; how many parts two 4 MiB allocations touch (2 or 3) depends on
    # where the driver placed them in the 32 MiB windows, as on a GPU
    bad = re.search(r"the memory taken back is not what was saved \((\d+) of (\d+) parts",
                    p.stderr())
    assert bad and bad[1] == bad[2] and int(bad[1]) >= 2, p.stderr()[-2000:]
    assert p.call(f"@check {a} {4 * MIB} 1")["ok"] and p.call(f"@check {b} {4 * MIB} 2")["ok"]


def test_with_the_driver_s_one_file_periodic_checkpoints_hold_every_time(gpu, probe, tmp_path,
                                                                          one_file_agent):
    """Memory taken back is an imported handle, which the driver does not export again (nor
    does the fake): the agent keeps a duplicate of each descriptor it took memory back from
    and hands that out at the next prepare. The driver's are all one device node: a mark on
    the kept one's description (O_APPEND) is what tells it, so each checkpoint holds."""
    p = probe(one_file(one_file_agent))
    prog, files, before = taken_back(gpu, p, tmp_path)
    assert len(_kept(p)) == KEPT
    for n in range(2):
        again = Files(tmp_path / f"again{n}", 2)
        r = again.send(p.sock, "prepare 5000", write=True)
        assert r["ok"] and r["held"] == MOVABLE, r
        _held_round(gpu, p, again, prog)
        assert len(_kept(p)) == KEPT


def test_with_the_driver_s_one_file_a_kept_number_the_program_reuses_is_not_handed_out(
        gpu, probe, tmp_path, one_file_agent):
    """The program puts a descriptor of its own, the same device node, at a kept one's number:
    without the mark it would pass for the kept one, and the next prepare would hand out that
    other memory as this allocation's (for a deferred copy: the only copy, freed). It is not
    kept any more: nothing is held (all or nothing), and the files have every byte."""
    p = probe(one_file(one_file_agent))
    prog, files, before = taken_back(gpu, p, tmp_path)
    kept = _kept(p)
    assert len(kept) == KEPT
    other = p.call(f"@vmmfd {4 * MIB}")                 # the program's own, never held
    fd = p.call(f"@export {other['handle']}")["fd"]
    assert p.call(f"dup2 {fd} {kept[0]}")["rc"] == 0
    _holds_nothing(p, Files(tmp_path / "again", 2), "is another file now: not kept")
    _intact(p, prog["mem"])


def test_with_the_driver_s_one_file_another_kept_description_at_a_kept_number_is_not_handed_out(
        gpu, probe, tmp_path, one_file_agent):
    """The program's own export of memory taken back (NCCL's, PyTorch's IPC) gets a duplicate
    of its kept description, mark and all; put at another allocation's kept number it would
    pass for that one's, and the next prepare would hand out b's memory as a's (both zeros,
    one size: one fingerprint; for a deferred copy, a's only copy freed). A kept description
    that is another kept one's too is not handed out: nothing held, the files have it all."""
    p = probe(one_file(one_file_agent))
    a, b, files, held = _two_held(p, tmp_path, "@vmmfd")
    r = resume_with(p, files, "resume held=2", held)
    close_all(held)
    assert r["ok"] and r["held"] is True, r
    kept = _kept(p)
    assert len(kept) == 2, kept
    fd = p.call(f"@export {b['handle']}")["fd"]   # b is the program's shared memory now
    for k in kept:                                # a's number gets b's description (b's own
        assert p.call(f"dup2 {fd} {k}")["rc"] == 0   # number: the same, as it was)
    _holds_nothing(p, Files(tmp_path / "again", 1), "is another kept one's too")
    assert p.call(f"@fill {a['ptr']} {4 * MIB} 1")["rc"] == 0
    assert p.call(f"@fill {b['ptr']} {4 * MIB} 2")["rc"] == 0
    assert p.call(f"@check {a['ptr']} {4 * MIB} 1")["ok"], "a's bytes are b's"
