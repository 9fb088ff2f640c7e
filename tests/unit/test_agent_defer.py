"""The deferred copy (issue 20, short pauses; agent/src/defer.c, agent/copier/copier.c,
agent/PROTOCOL.md "The deferred copy"): a `prepare ... defer` holds the program's memory and
writes the plan of the copy instead of copying; torpor-copier, a process of its own, imports
the held descriptors and fills the data files from the plan. Against the fake libcuda (its
exported descriptors are the handles' memfds, which another process maps): the files the
copier writes are the files a plain prepare writes, byte for byte, and a resume from them
alone (the held memory let go) gives the program every byte back. The copier takes nothing
in the plan on trust."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from torpor import copier
from tests.unit.test_agent import AGENT_DIR, Probe, build_agent, delay, gpu, probe  # noqa: F401
from tests.unit.test_agent_held import EXPORT, MOVABLE, close_all, fds_back, nfds, resume_with
from tests.unit.test_agent_mover import (MIB, Files, _intact, _program, ctl_fds, ctl_recv,
                                         failing)

COPIER = AGENT_DIR / "build" / "torpor-copier"
PART = 4 * MIB


def prepare_deferred(p: Probe, files: Files, plan: int) -> dict:
    data = files.open(write=True)
    try:
        return ctl_fds(p.sock, "prepare 5000 defer", data + [plan])
    finally:
        close_all(data)


def plan_text(plan: int) -> str:
    return os.pread(plan, 1 << 20, 0).decode()


def run_copier(gpu, plan: int, files: list[int], held: list[int], *extra: str
               ) -> tuple[int, dict]:
    build_agent()
    r = subprocess.run([str(COPIER), "--libcuda", gpu.libcuda, "--plan", str(plan),
                        "--files", ",".join(map(str, files)), "--held",
                        ",".join(map(str, held)), *extra],
                       pass_fds=[plan, *files, *held], capture_output=True, timeout=60,
                       env={**os.environ, **gpu.env()})
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {"stderr": r.stderr}


def new_plan(text: str = "") -> int:
    fd = os.memfd_create("plan", os.MFD_CLOEXEC)
    os.write(fd, text.encode())
    return fd


def test_a_deferred_copy_fills_the_files_a_plain_prepare_would(gpu, probe, tmp_path):
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    before = nfds(p)
    # what a plain prepare writes, for comparison: prepared and taken back (held)
    plain = Files(tmp_path / "plain", 2)
    r = plain.send(p.sock, "prepare 5000", write=True)
    assert r["ok"] and r["held"] == MOVABLE, r
    r, held = ctl_recv(p.sock, "detach hold")
    data = plain.open(write=False)
    assert ctl_fds(p.sock, f"resume held={MOVABLE}", data + held)["held"] is True
    close_all(data + held)

    files = Files(tmp_path / "deferred", 2)
    plan = new_plan()
    r = prepare_deferred(p, files, plan)
    assert r["ok"] and r["deferred"] is True and r["defer_error"] == "", r
    assert r["held"] == MOVABLE and r["bytes"] > 0, r
    # sized, not written: every byte is a hole until the copier has run
    assert [f.stat().st_size for f in files.paths] == r["files"]
    assert all(f.stat().st_blocks == 0 for f in files.paths)
    text = plan_text(plan)
    assert text.startswith("torpor-copy-plan 1\nfiles 2\nalloc 0 ") and text.endswith("end\n")
    assert text.count("\nalloc ") == MOVABLE
    assert "left to the copier" in p.stderr()

    # duplicates: the agent keeps its own until the copier has them too (detach release)
    r, held = ctl_recv(p.sock, "detach hold")
    assert r == {"ok": True, "held": MOVABLE, "release": True} and len(held) == MOVABLE, r
    data = files.open(write=False)
    rw = [os.open(f, os.O_RDWR | os.O_CLOEXEC) for f in files.paths]
    try:
        rc, out = run_copier(gpu, plan, rw, held)
    finally:
        close_all(rw)
    assert rc == 0 and out["ok"] is True, out
    assert out["allocations"] == MOVABLE and out["bytes"] > 0 and out["parts"] > 0, out
    assert ctl_fds(p.sock, "detach release") == {"ok": True}
    assert [f.read_bytes() for f in files.paths] == [f.read_bytes() for f in plain.paths]

    # the files alone bring it back (once torpor says the copier filled them), the held
    # memory let go first
    close_all(held)
    r = ctl_fds(p.sock, "resume drained", data)
    close_all(data)
    assert r["ok"] and r["held"] is False and r["bytes"] > 0, r
    _intact(p, prog["mem"])
    fds_back(p, before)      # the kept descriptors went with the deferred prepare's drop
    os.close(plan)


def test_a_copier_that_has_the_memory_finishes_through_sigterm_sigint_and_sighup(
        gpu, probe, tmp_path, ready_copier):
    """Once it has the held descriptors the copier may hold the only copy of the memory: a
    unit's stop, a shutdown's first round or a hang-up (SIGTERM, SIGINT, SIGHUP) does not end
    it; the files come out whole and the program gets every byte back from them. torpor's
    way: ready before the pause (--ctl), then handed its work."""
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    c = ready_copier()
    assert copier.ready(c, 30) is None
    files = Files(tmp_path / "d", 2)
    plan = new_plan()
    r = prepare_deferred(p, files, plan)
    assert r["ok"] and r["deferred"] is True, r
    r, held = ctl_recv(p.sock, "detach hold")
    rw = [os.open(f, os.O_RDWR | os.O_CLOEXEC) for f in files.paths]
    delay(gpu, "cuMemcpyDtoHAsync_v2", 100)   # a copy long enough to be signalled
    try:
        copier.hand(c, plan, rw, held)
        time.sleep(0.3)
        assert c.proc.poll() is None, "the copier ended before it was signalled"
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            c.proc.send_signal(sig)
        out = copier.wait(c, 60)
    finally:
        close_all(rw + [plan])
        (gpu.state_dir / "delay" / "cuMemcpyDtoHAsync_v2").unlink(missing_ok=True)
    assert out.get("ok") is True, out
    assert ctl_fds(p.sock, "detach release") == {"ok": True}
    close_all(held)
    data = files.open(write=False)
    r = ctl_fds(p.sock, "resume drained", data)
    close_all(data)
    assert r["ok"] and r["bytes"] > 0, r
    _intact(p, prog["mem"])


def _copy_with_deadline(gpu, p: Probe, tmp_path: Path, ready_copier, nfiles: int,
                        part_ms: int) -> tuple[dict, float, Files, list[int]]:
    """A deferred save handed to a copier with a 1 s --deadline, each copy to the host
    delayed part_ms: its reply, the seconds it took, the data files and the held descriptors
    (the caller's to close)."""
    c = ready_copier(deadline_s=1)
    assert copier.ready(c, 30) is None
    files, plan = Files(tmp_path / "d", nfiles), new_plan()
    r = prepare_deferred(p, files, plan)
    assert r["ok"] and r["deferred"] is True, r
    r, held = ctl_recv(p.sock, "detach hold")
    rw = [os.open(f, os.O_RDWR | os.O_CLOEXEC) for f in files.paths]
    delay(gpu, "cuMemcpyDtoHAsync_v2", part_ms)
    try:
        copier.hand(c, plan, rw, held)
        t = time.monotonic()
        out = copier.wait(c, 60)
    finally:
        close_all(rw + [plan])
        (gpu.state_dir / "delay" / "cuMemcpyDtoHAsync_v2").unlink(missing_ok=True)
    return out, time.monotonic() - t, files, held


def test_a_copier_stuck_past_its_deadline_ends_and_says_so(gpu, probe, tmp_path,
                                                            ready_copier):
    """No torpor left to kill a stuck copier (a recovery only waits for another's): no part
    written for its --deadline, it ends by itself, with one line, and lets the memory go."""
    p = probe(EXPORT)
    _program(p, "vmmfd")
    # every part far slower than a second
    out, took, _, held = _copy_with_deadline(gpu, p, tmp_path, ready_copier, 2, 2500)
    close_all(held)
    assert out == {"ok": False, "error": "no part written for its deadline: ended"}, out
    assert took < 10


def test_a_copier_slow_but_moving_is_not_cut_short_by_its_deadline(gpu, probe, tmp_path,
                                                                    ready_copier):
    """The deadline counts from the last part written, not from the go: a copy that takes
    several deadlines in all (a data file on a slow disk) but writes a part within each
    finishes, and the files give the program back."""
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    # a part every 0.3 s, one worker: seconds in all
    out, took, files, held = _copy_with_deadline(gpu, p, tmp_path, ready_copier, 1, 300)
    assert out["ok"] is True and took > 2, (out, took)
    assert ctl_fds(p.sock, "detach release") == {"ok": True}
    close_all(held)
    data = files.open(write=False)
    r = ctl_fds(p.sock, "resume drained", data)
    close_all(data)
    assert r["ok"] and r["held"] is False, r
    _intact(p, prog["mem"])


def test_a_prepare_that_cannot_defer_copies_and_says_why(gpu, probe, tmp_path):
    """Without held memory (TORPOR_AGENT_VMM_EXPORT=0) nothing can be left to a copier: the
    prepare copies as always, the files are whole, and its reply says why."""
    p = probe({"TORPOR_AGENT_VMM_EXPORT": "0"})
    prog = _program(p)
    files = Files(tmp_path / "d", 2)
    plan = new_plan()
    r = prepare_deferred(p, files, plan)
    os.close(plan)
    assert r["ok"] and r["deferred"] is False, r
    assert r["defer_error"] == "no held memory (TORPOR_AGENT_VMM_EXPORT=0)", r
    assert r["held"] == 0
    assert ctl_fds(p.sock, "detach")["ok"]
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] and r["bytes"] > 0, r
    _intact(p, prog["mem"])


def test_defer_needs_a_plan_file(gpu, probe, tmp_path):
    p = probe(EXPORT)
    _program(p, "vmmfd")
    files = Files(tmp_path / "d", 1)
    data = files.open(write=True)
    try:
        r = ctl_fds(p.sock, "prepare 5000 defer", data)
    finally:
        close_all(data)
    assert not r["ok"] and "plan file" in r["error"], r
    assert p.status()["state"] == "running" and p.status()["gate"] == "open"


# -- the copier takes nothing in the plan on trust ----------------------------------------------

GOOD = ("torpor-copy-plan 1\nfiles 1\nalloc 0 2097152 " + "0" * 32 + "\n"
        "part 0 0 4096\nseg 0 0 4096\nend\n")


@pytest.mark.parametrize("plan,why", [
    ("", "cut short"),
    ("torpor-copy-plan 2\n", "not a copy plan"),
    (GOOD.replace("files 1", "files 2"), "files are not the 1 given"),
    (GOOD.replace("alloc 0 ", "alloc 1 "), "bad allocation"),
    (GOOD.replace("part 0 0 4096", "part 1 0 4096"), "whole part inside its file"),
    (GOOD.replace("part 0 0 4096", "part 0 4096 4096"), "whole part inside its file"),
    (GOOD.replace("part 0 0 4096", "part 0 8388608 4096"), "whole part inside its file"),
    (GOOD.replace("part 0 0 4096\nseg 0 0 4096", "part 0 0 8388608\nseg 0 0 4096"),
     "whole part inside its file"),
    (GOOD.replace("seg 0 0 4096", "seg 0 2097150 4096"), "outside its allocation"),
    (GOOD.replace("seg 0 0 4096", "seg 1 0 4096"), "outside its allocation"),
    (GOOD.replace("seg 0 0 4096", "seg 0 0 2048"), "cut short"),
    (GOOD.replace("seg 0 0 4096", "seg 0 0 4096 7"), "outside its allocation"),
    (GOOD.replace("end\n", "end\npart 0 0 4096\n"), "after its end"),
    (GOOD.replace("end\n", ""), "cut short"),
    (GOOD.replace("end\n", "end"), "newline"),
    (GOOD.replace("seg 0 0 4096", "seg 0 18446744073709551615 4096"), "outside"),
    (GOOD + "\0", "NUL"),
])
def test_the_copier_refuses_a_bad_plan_and_writes_nothing(gpu, tmp_path, plan, why):
    data = tmp_path / "data"
    data.write_bytes(b"\xaa" * (2 * PART))
    fd = os.open(data, os.O_RDWR)
    held = os.open("/dev/null", os.O_RDONLY)
    pfd = new_plan(plan)
    try:
        rc, out = run_copier(gpu, pfd, [fd], [held])
    finally:
        close_all([fd, held, pfd])
    assert rc == 1 and out["ok"] is False and why in out["error"], out
    assert data.read_bytes() == b"\xaa" * (2 * PART)


def test_the_copier_refuses_a_file_not_open_for_writing(gpu, tmp_path):
    data = tmp_path / "data"
    data.write_bytes(b"\0" * PART)
    fd = os.open(data, os.O_RDONLY)
    pfd = new_plan(GOOD)
    try:
        rc, out = run_copier(gpu, pfd, [fd], [fd])
    finally:
        close_all([fd, pfd])
    assert rc == 1 and "open for writing" in out["error"], out


@pytest.mark.parametrize("args", [[], ["--plan", "99"], ["--bogus", "1"], ["--files"]])
def test_the_copier_refuses_bad_usage(args):
    build_agent()
    r = subprocess.run([str(COPIER), *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.startswith("usage:"), r.stderr


# -- until the copier has run, the held memory is the only copy of the data ----------------------

def deferred(gpu, p: Probe, tmp_path: Path, fault: tuple[str, str] | None = None
             ) -> tuple[Files, dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    files, plan = Files(tmp_path / "d", 2), new_plan()
    try:
        if fault:
            with failing(gpu, *fault):
                return files, prepare_deferred(p, files, plan)
        return files, prepare_deferred(p, files, plan)
    finally:
        os.close(plan)


def test_a_release_that_fails_in_a_deferred_prepare_keeps_the_memory(gpu, probe, tmp_path):
    """The second allocation's release fails (after its unmap): the prepare fails, and every
    allocation is the program's again, mapped, every byte as it was."""
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    _, r = deferred(gpu, p, tmp_path, ("cuMemRelease", f"2 {p.pid} after=1 times=1"))
    assert r["ok"] is False, r
    st = p.status()
    assert (st["state"], st["gate"]) == ("running", "open"), st
    _intact(p, prog["mem"])


def test_a_refused_import_changes_nothing_and_the_next_try_takes_it_back(gpu, probe, tmp_path):
    """The files are holes: an import refused half-way lets go what it imported and
    changes nothing else (no copy from the files), for abort and for torpor's resume held=N
    alike; the next try takes the memory back."""
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    _, r = deferred(gpu, p, tmp_path)
    assert r["deferred"] is True, r
    with failing(gpu, "cuMemImportFromShareableHandle", f"1 {p.pid} after=1 times=1"):
        r = ctl_fds(p.sock, "abort")
    assert not r["ok"] and "nothing changed" in r["error"], r
    r = ctl_fds(p.sock, "abort")
    assert r["ok"] and r["held"] is True, r
    _intact(p, prog["mem"])

    files, r = deferred(gpu, p, tmp_path / "again")
    r, held = ctl_recv(p.sock, "detach hold")
    assert ctl_fds(p.sock, "detach release")["ok"]
    with failing(gpu, "cuMemImportFromShareableHandle", f"1 {p.pid} after=1 times=1"):
        r = resume_with(p, files, f"resume held={MOVABLE}", held)
    assert not r["ok"] and "nothing changed" in r["error"], r
    r = resume_with(p, files, "resume", [])           # the files: not until drained
    assert not r["ok"] and "not in the files yet" in r["error"], r
    r = resume_with(p, files, f"resume held={MOVABLE}", held)
    close_all(held)
    assert r["ok"] and r["held"] is True, r
    _intact(p, prog["mem"])


def test_held_memory_that_does_not_match_is_let_go_again_and_changes_nothing(gpu, probe,
                                                                             tmp_path):
    """Until the copier has filled the files the held memory is the only copy: an import whose
    memory does not match its fingerprints (the driver's descriptors are all one file: a
    descriptor given back for the wrong allocation; here the memory written while held) is
    let go again and nothing changes; the next try with the right memory takes it back."""
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    files, r = deferred(gpu, p, tmp_path)
    assert r["deferred"] is True, r
    r, held = ctl_recv(p.sock, "detach hold")
    assert ctl_fds(p.sock, "detach release")["ok"]
    saved = os.pread(held[0], 4096, 4096)
    os.pwrite(held[0], b"\xab" * 4096, 4096)
    r = resume_with(p, files, f"resume held={MOVABLE}", held)
    assert not r["ok"] and "nothing changed" in r["error"], r
    assert "is not what was saved (1 of " in r["error"], r
    assert p.status()["gate"] != "open"
    os.pwrite(held[0], saved, 4096)
    r = resume_with(p, files, f"resume held={MOVABLE}", held)
    close_all(held)
    assert r["ok"] and r["held"] is True, r
    _intact(p, prog["mem"])


def test_a_torpor_gone_before_the_release_leaves_the_memory_with_the_agent(gpu, probe,
                                                                           tmp_path):
    """torpor dies between `detach hold` and `detach release` (its duplicates close with
    it): the agent still holds the memory, and the next torpor's resume (files, nothing
    held) takes it back from there."""
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    files, r = deferred(gpu, p, tmp_path)
    r, held = ctl_recv(p.sock, "detach hold")
    close_all(held)
    r = resume_with(p, files, "resume", [])
    assert r["ok"] and r["held"] is True, r
    _intact(p, prog["mem"])


def test_an_abort_before_the_release_takes_the_memory_back(gpu, probe, tmp_path):
    """Detached after a deferred save, its own descriptors not yet released (torpor died
    between `detach hold` and `detach release`): an abort takes the memory back."""
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    deferred(gpu, p, tmp_path)
    r, held = ctl_recv(p.sock, "detach hold")
    close_all(held)
    r = ctl_fds(p.sock, "abort")
    assert r["ok"] and r["held"] is True, r
    _intact(p, prog["mem"])


def test_a_failed_load_from_unfilled_files_leaves_the_held_memory_to_take_back(gpu, probe,
                                                                               tmp_path):
    """`drained` said, but the files are holes (a copier that lied, or a recovery after one
    that failed) and the import is refused: the load from the files fails its check, and what
    it re-created goes again, so the held memory still comes back."""
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    files, _ = deferred(gpu, p, tmp_path)
    r, held = ctl_recv(p.sock, "detach hold")
    assert ctl_fds(p.sock, "detach release")["ok"]
    with failing(gpu, "cuMemImportFromShareableHandle", f"1 {p.pid} after=0 times=1"):
        r = resume_with(p, files, f"resume held={MOVABLE} drained", held)
    assert not r["ok"], r
    r = resume_with(p, files, f"resume held={MOVABLE}", held)
    close_all(held)
    assert r["ok"] and r["held"] is True, r
    _intact(p, prog["mem"])


def test_held_descriptors_given_back_are_kept_for_the_next_resume(gpu, probe, tmp_path):
    """A torpor that cannot keep a deferred save's descriptors (its rollback failed) gives
    them back (`hold N`): the agent checks they are its own and keeps them, and the next
    resume (a recovery's: files, nothing held, not drained) takes the memory back."""
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    files, _ = deferred(gpu, p, tmp_path)
    r, held = ctl_recv(p.sock, "detach hold")
    assert ctl_fds(p.sock, "detach release")["ok"]
    wrong = [os.open("/dev/null", os.O_RDONLY) for _ in held]
    r = ctl_fds(p.sock, f"hold {MOVABLE}", wrong)
    close_all(wrong)
    assert not r["ok"] and "not the file exported" in r["error"], r
    r = ctl_fds(p.sock, f"hold {MOVABLE}", held)
    assert r == {"ok": True, "held": MOVABLE}, r
    assert not ctl_fds(p.sock, f"hold {MOVABLE}", held)["ok"]      # once
    close_all(held)
    r = resume_with(p, files, "resume", [])
    assert r["ok"] and r["held"] is True, r
    _intact(p, prog["mem"])


# -- the copier ready before the pause (copier.prestart: --ctl) ----------------------------------

@pytest.fixture
def ready_copier(gpu, monkeypatch):
    """copier.prestart's copiers: this build's binary, in the fake GPU's environment."""
    build_agent()
    monkeypatch.setattr(copier, "BINARY", COPIER)
    for k, v in gpu.env().items():
        monkeypatch.setenv(k, v)
    started: list[copier.Copier] = []

    def start(devices=None, deadline_s: float = 0) -> copier.Copier:
        started.append(copier.prestart(gpu.libcuda, [gpu.uuid(0)] if devices is None
                                       else devices, deadline_s=deadline_s))
        return started[-1]
    yield start
    for c in started:
        copier.discard(c)


def test_a_copier_ready_before_the_pause_fills_the_files_once_handed_them(gpu, probe,
                                                                           tmp_path,
                                                                           ready_copier):
    """Its context made while the program runs, the copier waits; handed the plan, the files
    and the held descriptors over its socket, it fills the files a resume then reads."""
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    c = ready_copier()
    assert copier.ready(c, 30) is None
    assert c.proc.poll() is None            # waiting for its go
    files, plan = Files(tmp_path / "d", 2), new_plan()
    r = prepare_deferred(p, files, plan)
    assert r["ok"] and r["deferred"] is True, r
    r, held = ctl_recv(p.sock, "detach hold")
    rw = [os.open(f, os.O_RDWR | os.O_CLOEXEC) for f in files.paths]
    try:
        copier.hand(c, plan, rw, held)
    finally:
        close_all(rw + [plan])
    out = copier.wait(c, 60)
    assert out["ok"] is True and out["allocations"] == MOVABLE and out["bytes"] > 0, out
    assert ctl_fds(p.sock, "detach release") == {"ok": True}
    close_all(held)
    data = files.open(write=False)
    r = ctl_fds(p.sock, "resume drained", data)
    close_all(data)
    assert r["ok"] and r["held"] is False, r
    _intact(p, prog["mem"])


def test_a_copier_without_room_for_its_context_is_not_ready_and_says_why(gpu, ready_copier):
    with failing(gpu, "cuDevicePrimaryCtxRetain", "2"):    # CUDA_ERROR_OUT_OF_MEMORY
        c = ready_copier()
        why = copier.ready(c, 30)
    assert why == "a context on GPU 0: CUresult 2", why
    assert c.proc.returncode is not None     # gone, reaped


@pytest.mark.parametrize("devices,why", [(["GPU-not-hex"], "no reply"),
                                         (["GPU-" + "0" * 32], "does not show"),
                                         ([], "no GPU of the program's has a context here"),
                                         (["MIG-0a1b"], "no GPU of the program's")])
def test_a_copier_named_a_gpu_it_cannot_find_is_not_ready(gpu, ready_copier, devices, why):
    c = ready_copier(devices)
    assert why in copier.ready(c, 30)


def test_a_ready_copier_never_handed_anything_ends_on_its_own(gpu, ready_copier):
    """torpor's prepare copied after all, or torpor is gone: the socket closes, the copier ends
    (it holds nothing)."""
    c = ready_copier()
    assert copier.ready(c, 30) is None
    c.ctl.close()
    c.ctl = None
    out = copier.wait(c, 30)
    assert out == {"ok": False, "error": "no plan came: torpor copied in the program or went "
                   "away"}, out


@pytest.mark.parametrize("text,extra", [("go 1 3", 0), ("go 1 1 x", 0), ("go 0 1", 0),
                                        ("go 1 1", 1), ("stop", 0)])
def test_a_ready_copier_refuses_a_malformed_go_and_writes_nothing(gpu, ready_copier, tmp_path,
                                                                  text, extra):
    """The go's descriptors must be exactly what its text counts: else nothing is copied,
    nothing written, and every descriptor that came along is closed."""
    data = tmp_path / "data"
    data.write_bytes(b"\xaa" * PART)
    fd = os.open(data, os.O_RDWR)
    pfd = new_plan(GOOD)
    held = os.open("/dev/null", os.O_RDONLY)
    c = ready_copier()
    assert copier.ready(c, 30) is None
    try:
        socket.send_fds(c.ctl, [text.encode()], [pfd, fd, held] + [held] * extra)
    finally:
        close_all([fd, pfd, held])
    out = copier.wait(c, 30)
    assert out["ok"] is False and "malformed" in out["error"], out
    assert data.read_bytes() == b"\xaa" * PART


# -- the deadline while a deferred save's memory is the agent's alone ---------------------------

def _frozen_for(p: Probe, seconds: float) -> dict:
    """The agent's status after seconds with nobody connecting (the deadline must fire by
    itself, not at the next client's wake-up)."""
    import time
    time.sleep(seconds)
    return p.status()


def test_the_deadline_takes_back_memory_a_dead_torpor_left_with_the_agent(gpu, probe,
                                                                         tmp_path):
    """torpor died after `detach hold`, before `detach release`: the agent holds the only copy,
    detached, its gate closed. The prepare deadline gives the program its memory back without
    anyone connecting."""
    p = probe({**EXPORT, "TORPOR_AGENT_PREPARE_TIMEOUT_S": "1.5"})
    prog = _program(p, "vmmfd")
    deferred(gpu, p, tmp_path)
    r, held = ctl_recv(p.sock, "detach hold")
    assert r["ok"] and r.get("release") is True, r
    close_all(held)                      # torpor died: its duplicates closed with it
    st = _frozen_for(p, 6)               # 4 x the deadline
    assert (st["state"], st["gate"]) == ("running", "open"), st
    _intact(p, prog["mem"])


def test_the_deadline_takes_back_memory_given_back_by_hold_n(gpu, probe, tmp_path):
    """A torpor whose rollback failed gave the descriptors back (`hold N`) and went: the
    deadline takes the memory back by itself."""
    p = probe({**EXPORT, "TORPOR_AGENT_PREPARE_TIMEOUT_S": "1.5"})
    prog = _program(p, "vmmfd")
    deferred(gpu, p, tmp_path)
    r, held = ctl_recv(p.sock, "detach hold")
    assert ctl_fds(p.sock, "detach release")["ok"]
    r = ctl_fds(p.sock, f"hold {MOVABLE}", held)
    close_all(held)
    assert r == {"ok": True, "held": MOVABLE}, r
    st = _frozen_for(p, 6)
    assert (st["state"], st["gate"]) == ("running", "open"), st
    _intact(p, prog["mem"])


def test_a_stream_resume_of_a_deferred_save_is_taken_from_the_store(gpu, probe, tmp_path):
    """A restored checkpoint's agent was dumped deferred; its packed checkpoint comes back
    through the image store's stream, which only a pack of the filled files fed: `resume
    stream` needs no `drained`. Here the stream ends at once: the load fails as a short stream
    does, not as a refusal to read holes, and the held memory still comes back."""
    from torpor.store import stream
    p = probe(EXPORT)
    prog = _program(p, "vmmfd")
    files, r = deferred(gpu, p, tmp_path)
    assert r["deferred"] is True, r
    r, held = ctl_recv(p.sock, "detach hold")
    ring = stream.Ring(4)
    try:
        ring.sock.shutdown(socket.SHUT_RDWR)   # no part: the stream ends short
        out = ctl_fds(p.sock, "resume stream", ring.agent_fds())
        ring.handed()
    finally:
        ring.close()
    assert out["ok"] is False and "not in the files yet" not in out["error"], out
    assert ctl_fds(p.sock, f"resume held={MOVABLE}", held)["held"] is True
    close_all(held)
    _intact(p, prog["mem"])
