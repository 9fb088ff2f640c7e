"""The mover's tuning (agent/src/mover_tune.c, issue 20 item 4): every variant that
bench/mover_sweep.py measures on the GPU host moves a program's memory out and back bit-exact
here first, on the fake libcuda, into files and into the agent's own memory, with zero parts
and with memory on two GPUs; a variant that changes how the data is checked still refuses
damaged data; a bad value is ignored with a warning, the mover unchanged.
"""

from __future__ import annotations

import re

import pytest

from tests.unit.test_agent import gpu, probe  # noqa: F401  (fixtures)
from tests.unit.test_agent_mover import Files, _intact, _program, ctl_fds, failing

MIB = 1 << 20

# what bench/mover_sweep.py runs (its VARIANTS), and a few combinations more
VARIANTS = {
    "default": {},
    "buffers4": {"TORPOR_AGENT_MOVER_BUFFERS": "4"},
    "buffers8-workers3": {"TORPOR_AGENT_MOVER_BUFFERS": "8", "TORPOR_AGENT_MOVER_WORKERS": "3"},
    "direct": {"TORPOR_AGENT_MOVER_SINK": "direct"},
    "direct-whole": {"TORPOR_AGENT_MOVER_SINK": "direct-whole"},
    "hostcheck": {"TORPOR_AGENT_MOVER_CHECK": "host"},
    "direct-gpucheck": {"TORPOR_AGENT_MOVER_SINK": "direct", "TORPOR_AGENT_MOVER_CHECK": "gpu",
                        "TORPOR_AGENT_MOVER_BUFFERS": "3"},
    "direct-whole-gpucheck": {"TORPOR_AGENT_MOVER_SINK": "direct-whole",
                              "TORPOR_AGENT_MOVER_CHECK": "gpu"},
    "gpucheck-buffers4": {"TORPOR_AGENT_MOVER_CHECK": "gpu", "TORPOR_AGENT_MOVER_BUFFERS": "4"},
    "region-huge": {"TORPOR_AGENT_MOVER_REGION_HUGE": "1", "TORPOR_AGENT_MOVER_WORKERS": "2"},
    "no-presize": {"TORPOR_AGENT_MOVER_PRESIZE": "0"},
    "stage-chunk": {"TORPOR_AGENT_MOVER_STAGE": "chunk"},    # part is the default
    "write-block": {"TORPOR_AGENT_MOVER_WRITE": "block"},    # part is the default
    "stage-chunk-write-block-hostcheck": {"TORPOR_AGENT_MOVER_STAGE": "chunk",
                                          "TORPOR_AGENT_MOVER_WRITE": "block",
                                          "TORPOR_AGENT_MOVER_CHECK": "host"},
    "stage-part-hostcheck-buffers3": {"TORPOR_AGENT_MOVER_STAGE": "part",
                                      "TORPOR_AGENT_MOVER_CHECK": "host",
                                      "TORPOR_AGENT_MOVER_BUFFERS": "3"},
    "stage-part-buffers8-workers2": {"TORPOR_AGENT_MOVER_STAGE": "part",
                                     "TORPOR_AGENT_MOVER_BUFFERS": "8",
                                     "TORPOR_AGENT_MOVER_WORKERS": "2"},
}


def _with_zeros(p) -> tuple[int, int]:
    """A 40 MiB allocation, bytes written at its start and past its middle, zeros between:
    zero parts inside a chunk, between parts that move."""
    n = 40 * MIB
    ptr = p.call(f"@alloc {n} dlsym")["ptr"]
    assert p.call(f"@fill {ptr} {MIB + 77} 11")["rc"] == 0
    assert p.call(f"@fill {ptr + 13 * MIB} {5 * MIB} 12")["rc"] == 0
    return ptr, n


def _zeros_intact(p, ptr: int) -> None:
    for off, n, pat in ((0, MIB + 77, 11), (MIB + 77, 12 * MIB - 77, -1), (13 * MIB, 5 * MIB, 12),
                        (18 * MIB, 22 * MIB, -1)):
        r = p.call(f"@check {ptr + off} {n} {pat}")
        assert r["ok"], (off, r)


@pytest.mark.parametrize("sink", ["files", "memory"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_moves_out_and_back_bit_exact(gpu, probe, tmp_path, variant, sink):
    env = VARIANTS[variant]
    p = probe(env=dict(env, TORPOR_AGENT_FP_CHECK="1"))
    prog = _program(p)
    zptr, _ = _with_zeros(p)
    movable = p.status()["movable_bytes"]
    files = Files(tmp_path / "data", 3)
    for rnd in range(2):            # twice: a second save reuses nothing stale
        r = files.send(p.sock, "prepare 5000", write=True) if sink == "files" \
            else ctl_fds(p.sock, "prepare 5000")
        assert r["ok"], r
        assert r["bytes"] + r["zero"]["bytes"] == movable and r["zero"]["bytes"] > 0, r
        assert p.ctl("detach")["ok"]
        (gpu.state_dir / "dirty").write_text("")      # re-created memory is not zeros
        back = files.send(p.sock, "resume", write=False) if sink == "files" \
            else ctl_fds(p.sock, "resume")
        assert back["ok"] and back["bytes"] == r["bytes"], (rnd, back)
        (gpu.state_dir / "dirty").unlink()
        _intact(p, prog["mem"])
        _zeros_intact(p, zptr)
    log = p.stderr()
    if env:
        assert "mover: tuned:" in log, log[-2000:]
    if "direct" in env.get("TORPOR_AGENT_MOVER_SINK", ""):
        how = "whole" if env["TORPOR_AGENT_MOVER_SINK"] == "direct-whole" else "chunk by chunk"
        assert re.search(rf"straight into its (region|data file) .* registered {how}", log), \
            log[-2000:]
        assert "staged" in log and not re.search(r"mover \d+: .*staged from here|: staged$", log,
                                                 re.M), log[-2000:]
        counts = re.findall(r"mover \d+: (\d+) chunks straight, (\d+) staged", log)
        assert counts and all(b == "0" for _, b in counts), counts   # none fell back ...
        assert sum(int(a) for a, _ in counts) >= 4 * r["chunks"] // 2, counts   # ... all went
    else:
        assert "straight into" not in log
    if env.get("TORPOR_AGENT_MOVER_CHECK", "gpu") == "gpu":  # the default: fingerprinted
        assert r["fingerprints"]["parts"] > 0, r
    else:
        assert r["fingerprints"]["parts"] == 0, r


@pytest.mark.parametrize("variant", ["default", "buffers4", "direct", "hostcheck", "stage-chunk",
                                     "stage-part-hostcheck-buffers3"])
def test_two_gpus_every_variant(gpu, probe, tmp_path, variant):
    """Each worker's chunks change GPU on the way (mover_workers.c worker_chunk): a slot is
    reused only once the copy that used it, on its own device's stream, is over."""
    p = probe(env={**VARIANTS[variant], **{"TORPOR_AGENT_VMM_EXPORT": "0"}})   # copied back, not held
    assert p.call("init dlsym")["rc"] == 0
    mem = {0: p.call(f"@alloc {96 * MIB} dlsym")["ptr"]}
    assert p.call("ctx 1 dlsym")["rc"] == 0
    mem[1] = p.call(f"@alloc {96 * MIB} dlsym")["ptr"]
    for dev, ptr in mem.items():
        assert p.call(f"@fill {ptr} {96 * MIB} {dev + 7}")["rc"] == 0
    files = Files(tmp_path / "data", 2)
    assert files.send(p.sock, "prepare 5000", write=True)["ok"]
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] and r["bytes"] == 192 * MIB, r
    for dev, ptr in mem.items():
        assert p.call(f"@check {ptr} {96 * MIB} {dev + 7}")["ok"], dev


@pytest.mark.parametrize("sink", ["staged", "direct"])
def test_gpu_check_refuses_a_damaged_file_by_its_fingerprints(gpu, probe, tmp_path, sink):
    """TORPOR_AGENT_MOVER_CHECK=gpu: no host sums, but a byte changed in a data file is still
    found (the reload's fingerprints on the GPU), and the good file then resumes."""
    p = probe(env={"TORPOR_AGENT_MOVER_CHECK": "gpu", "TORPOR_AGENT_MOVER_SINK": sink})
    prog = _program(p)
    files = Files(tmp_path / "data", 2)
    r = files.send(p.sock, "prepare", write=True)
    assert r["ok"] and r["fingerprints"]["parts"] > 0, r
    assert p.ctl("detach")["ok"]
    target = files.paths[1]
    good = target.read_bytes()
    target.write_bytes(good[:1000] + bytes([good[1000] ^ 1]) + good[1001:])
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] is False and "do not match their fingerprints" in r["error"], r
    target.write_bytes(good)
    assert files.send(p.sock, "resume", write=False)["ok"]
    _intact(p, prog["mem"])


@pytest.mark.parametrize("check,error", [("host", "checksum mismatch"),
                                         ("gpu", "do not match their fingerprints")])
def test_staged_a_part_at_a_time_a_damaged_file_is_refused(gpu, probe, tmp_path, check, error):
    """TORPOR_AGENT_MOVER_STAGE=part: each part is checked as it comes back (host sums) or
    after the reload (fingerprints); a changed byte in the middle of a part is found, the
    program's memory is not half-loaded into a resumed program, and the good file resumes."""
    p = probe(env={"TORPOR_AGENT_MOVER_STAGE": "part", "TORPOR_AGENT_MOVER_CHECK": check})
    prog = _program(p)
    files = Files(tmp_path / "data", 2)
    assert files.send(p.sock, "prepare", write=True)["ok"]
    assert p.ctl("detach")["ok"]
    target = files.paths[1]
    good = target.read_bytes()
    at = len(good) // 2 + 12345
    target.write_bytes(good[:at] + bytes([good[at] ^ 2]) + good[at + 1:])
    r = files.send(p.sock, "resume", write=False)
    assert r["ok"] is False and error in r["error"], r
    target.write_bytes(good)
    assert files.send(p.sock, "resume", write=False)["ok"]
    _intact(p, prog["mem"])


def test_staging_a_part_at_a_time_is_for_staged_sinks_only(gpu, probe, tmp_path):
    p = probe(env={"TORPOR_AGENT_MOVER_STAGE": "part", "TORPOR_AGENT_MOVER_SINK": "direct"})
    prog = _program(p)
    files = Files(tmp_path / "data", 2)
    assert files.send(p.sock, "prepare 5000", write=True)["ok"]
    assert files.send(p.sock, "resume", write=False)["ok"]
    _intact(p, prog["mem"])
    log = p.stderr()
    assert "TORPOR_AGENT_MOVER_STAGE=part is for a staged sink, not direct: ignored" in log, log
    assert "staged a chunk at a time" in log, log[-2000:]


def test_gpu_check_without_the_kernel_after_the_reload_checks_on_the_cpu(gpu, probe, tmp_path):
    """The kernel cannot run after the reload (the GPU full, say): the parts nobody summed are
    checked on the CPU from their sink, so a damaged file is still refused."""
    p = probe(env={"TORPOR_AGENT_MOVER_CHECK": "gpu"})
    prog = _program(p)
    files = Files(tmp_path / "data", 2)
    assert files.send(p.sock, "prepare", write=True)["ok"]
    assert p.ctl("detach")["ok"]
    target = files.paths[0]
    good = target.read_bytes()
    target.write_bytes(good[:5000] + bytes([good[5000] ^ 4]) + good[5001:])
    with failing(gpu, "cuLaunchKernel", f"701 {p.pid}"):   # LAUNCH_OUT_OF_RESOURCES
        r = files.send(p.sock, "resume", write=False)
        assert r["ok"] is False and "do not match their fingerprints" in r["error"], r
        assert "checked on the CPU" in p.stderr()
        target.write_bytes(good)
        assert files.send(p.sock, "resume", write=False)["ok"]
    _intact(p, prog["mem"])


def test_gpu_check_from_memory_without_the_kernel_checks_the_region(gpu, probe):
    p = probe(env={"TORPOR_AGENT_MOVER_CHECK": "gpu"})
    prog = _program(p)
    zptr, _ = _with_zeros(p)
    assert ctl_fds(p.sock, "prepare 5000")["ok"]
    with failing(gpu, "cuLaunchKernel", f"701 {p.pid}"):
        r = ctl_fds(p.sock, "resume")
        assert r["ok"], r
        assert "checked on the CPU" in p.stderr()
    _intact(p, prog["mem"])
    _zeros_intact(p, zptr)


@pytest.mark.parametrize("name,value", [
    ("TORPOR_AGENT_MOVER_BUFFERS", "1"), ("TORPOR_AGENT_MOVER_BUFFERS", "9"),
    ("TORPOR_AGENT_MOVER_BUFFERS", "4x"), ("TORPOR_AGENT_MOVER_WORKERS", "0"),
    ("TORPOR_AGENT_MOVER_WORKERS", "17"), ("TORPOR_AGENT_MOVER_SINK", "Direct"),
    ("TORPOR_AGENT_MOVER_CHECK", "none"), ("TORPOR_AGENT_MOVER_REGION_HUGE", "yes"),
    ("TORPOR_AGENT_MOVER_PRESIZE", "no"), ("TORPOR_AGENT_MOVER_STAGE", "parts"),
    ("TORPOR_AGENT_MOVER_WRITE", "whole")])
def test_a_bad_value_is_ignored_with_a_warning(gpu, probe, tmp_path, name, value):
    p = probe(env={name: value})
    prog = _program(p)
    files = Files(tmp_path / "data", 2)
    r = files.send(p.sock, "prepare 5000", write=True)
    assert r["ok"], r
    assert files.send(p.sock, "resume", write=False)["ok"]
    _intact(p, prog["mem"])
    log = p.stderr()
    assert f"{name}={value} is" in log and "ignored" in log, log[-2000:]
    assert "mover: tuned:" not in log and "straight into" not in log


def _pmd_mapped_kib(path) -> int:
    """How much of path, mapped and read whole, the kernel maps with 2 MiB pages (smaps'
    ShmemPmdMapped): its huge pages on a tmpfs."""
    import mmap
    import os
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        m = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            sum(m[off] for off in range(0, size, 4096))        # fault every page in
            start = None
            for line in open("/proc/self/smaps"):
                if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                    start = line if str(path) in line else None
                elif start and line.startswith("ShmemPmdMapped:"):
                    return int(line.split()[1])
        finally:
            m.close()
    return 0


@pytest.mark.parametrize("presize", ["1", "0"])
def test_data_files_on_a_within_size_tmpfs_get_huge_pages(gpu, probe, tmp_path, presize):
    """suspend_dir is a tmpfs mounted huge=within_size (agent_data.HUGE_TMPFS_OPTIONS), where
    a write gets huge pages only inside the file's size. The mover sizes its files before it
    writes them: without that (TORPOR_AGENT_MOVER_PRESIZE=0, the mover before, which also wrote
    1 MiB at a time: TORPOR_AGENT_MOVER_WRITE=block; Linux 6.18) hardly one 2 MiB page."""
    import subprocess
    mnt = tmp_path / "huge"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=within_size,size=1g", "tmpfs",
                       str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        if presize == "1":   # what the kernel gives a file written the mover's way right now
            control = mnt / "control"
            with open(control, "wb") as f:
                f.truncate(64 * MIB)
                for _ in range(64):
                    f.write(b"\x5a" * MIB)
            got = _pmd_mapped_kib(control) * 1024
            control.unlink()
            if got < 60 * MIB:   # memory too fragmented now (a loaded machine): not the mover
                pytest.skip(f"the kernel gave a sized file {got >> 20} MiB of huge pages of 64")
        # sized last, the mover before wrote 1 MiB at a time too (4 MiB appends get huge pages)
        p = probe(env={"TORPOR_AGENT_MOVER_PRESIZE": presize} if presize == "1" else
                  {"TORPOR_AGENT_MOVER_PRESIZE": "0", "TORPOR_AGENT_MOVER_WRITE": "block"})
        assert p.call("init dlsym")["rc"] == 0
        ptr = p.call(f"@alloc {128 * MIB} dlsym")["ptr"]
        assert p.call(f"@fill {ptr} {128 * MIB} 5")["rc"] == 0
        files = Files(mnt / "data", 2)
        r = files.send(p.sock, "prepare 5000", write=True)
        assert r["ok"] and r["bytes"] == 128 * MIB, r
        huge = sum(_pmd_mapped_kib(f) for f in files.paths) * 1024
        assert (huge >= 120 * MIB) if presize == "1" else (huge <= 16 * MIB), (huge, r["files"])
        assert files.send(p.sock, "resume", write=False)["ok"]
        assert p.call(f"@check {ptr} {128 * MIB} 5")["ok"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _write_calls(pid: int) -> int:
    """The write system calls (write, pwrite, sendmsg...) pid's threads have made so far
    (/proc/PID/io's syscw: its exited threads' too)."""
    for line in open(f"/proc/{pid}/io"):
        if line.startswith("syscw:"):
            return int(line.split()[1])
    raise AssertionError("no syscw in /proc/PID/io")


def test_a_saved_part_goes_to_its_file_in_one_write(gpu, probe, tmp_path):
    """The suspend_dir's tmpfs zeroes what a write leaves of a new huge page (and the next
    write overwrites it); a part is huge-page aligned in its file, so the mover writes each in
    one pwrite (TORPOR_AGENT_MOVER_WRITE=part, the default), and 1 MiB at a time only when
    asked (block): 128 MiB in 32 writes, not 128. Both counted the same way, so the log's and
    the replies' writes fall out of the difference."""
    writes = {}
    for write in ("part", "block"):
        p = probe(env=None if write == "part" else {"TORPOR_AGENT_MOVER_WRITE": write})
        assert p.call("init dlsym")["rc"] == 0
        ptr = p.call(f"@alloc {128 * MIB} dlsym")["ptr"]
        assert p.call(f"@fill {ptr} {128 * MIB} 7")["rc"] == 0
        files = Files(tmp_path / f"data-{write}", 2)
        before = _write_calls(p.pid)
        r = files.send(p.sock, "prepare 5000", write=True)
        writes[write] = _write_calls(p.pid) - before
        assert r["ok"] and r["bytes"] == 128 * MIB, r
        assert files.send(p.sock, "resume", write=False)["ok"]
        assert p.call(f"@check {ptr} {128 * MIB} 7")["ok"]
    assert writes["part"] >= 32 and 80 <= writes["block"] - writes["part"] <= 112, writes


def test_the_prepare_progress_counts_written_bytes_not_sized_files(tmp_path):
    """The agent sizes its files before writing them: the prepare's progress (engine/agents.py)
    counts what is allocated, so a file sized but not yet written is not reported as moved."""
    import os
    from torpor.files import tree_size
    d = tmp_path / "data"
    d.mkdir()
    with open(d / "gpu-memory-0.bin", "wb") as f:
        f.truncate(64 * MIB)
        f.write(b"x" * MIB)
        f.flush()
        os.fsync(f.fileno())
    assert tree_size(d) == 64 * MIB
    assert MIB <= tree_size(d, allocated=True) < 4 * MIB
