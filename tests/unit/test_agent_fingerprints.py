"""The agent's GPU fingerprints (agent/src/fingerprint.[ch], mover.c; PROTOCOL.md `prepare ...
fp`) against the fake libcuda, which runs the fingerprint kernel's fold on the CPU: a prepare
with an index lists a fingerprint for every 4 MiB part; a part whose fingerprint torpor names
as known is neither copied nor written (a hole in its file) and, on resume, is checked against
its fingerprint once torpor has filled it. tests/gpu runs the PTX itself (test_agent_gpu.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.unit.test_agent import gpu, probe  # noqa: F401  (fixtures)
from tests.unit.test_agent_mover import Files, ctl_fds, failing

MIB = 1 << 20
PART = 4 * MIB


def _prepare_fp(sock: Path, files: Files, known: list[str], index: Path) -> dict:
    """prepare with fingerprints: known (hex fingerprints) as 16-byte records."""
    known_path = index.with_suffix(".known")
    known_path.write_bytes(b"".join(bytes.fromhex(k) for k in known))
    return _send_closing(sock, "prepare 5000 fp", files.open(True) + [
        os.open(known_path, os.O_RDONLY | os.O_CLOEXEC),
        os.open(index, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)])


def _index(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    assert lines[0] == "torpor-gpu-fingerprints 2"
    out = []
    for line in lines[1:]:
        f, off, n, store_len, fp, flag = line.split()
        out.append({"file": int(f), "offset": int(off), "len": int(n),
                    "store_len": int(store_len), "fp": fp, "skip": flag == "1",
                    "zero": flag == "z"})
    return out


def _fill(files: Files, entries: list[dict], source: Files) -> None:
    """What torpor does from the store: the skipped parts' bytes written into their holes."""
    for e in entries:
        if e["skip"]:
            with open(source.paths[e["file"]], "rb") as src, \
                    open(files.paths[e["file"]], "r+b") as dst:
                src.seek(e["offset"])
                dst.seek(e["offset"])
                dst.write(src.read(e["len"]))


def _program(p, size_mib: int = 40) -> int:
    assert p.call("init dlsym")["rc"] == 0
    ptr = p.call(f"@alloc {size_mib * MIB} dlsym")["ptr"]
    assert p.call(f"@fill {ptr} {size_mib * MIB} 3")["rc"] == 0
    return ptr


def test_every_part_gets_a_fingerprint_and_unchanged_parts_are_not_moved_again(probe, tmp_path):
    p = probe(env={"TORPOR_AGENT_FP_CHECK": "1"})    # the CPU fold checked on every part too
    a = _program(p, 32)
    b = p.call(f"@alloc {8 * MIB} dlsym")["ptr"]
    assert p.call(f"@fill {b} {8 * MIB} 4")["rc"] == 0
    one = Files(tmp_path / "one", 2)
    r = _prepare_fp(p.sock, one, [], tmp_path / "one.fp")
    assert r["ok"], r
    first = _index(tmp_path / "one.fp")
    fps = r["fingerprints"]
    assert fps["error"] == "" and fps["skipped"] == 0
    # 40 MiB in parts of at most 4 MiB (more than ten where a window boundary cuts one)
    assert fps["parts"] == len(first) >= 10
    assert sum(e["len"] for e in first) == r["bytes"] == 40 * MIB
    assert len({e["fp"] for e in first}) == len(first)   # the pattern differs part to part
    assert all(e["offset"] % PART == 0 and e["len"] <= e["store_len"] <= PART for e in first)
    assert ctl_fds(p.sock, "abort")["ok"]

    # b changes; the store "has" every part of the first save
    assert p.call(f"@fill {b} {8 * MIB} 5")["rc"] == 0
    two = Files(tmp_path / "two", 2)
    r = _prepare_fp(p.sock, two, [e["fp"] for e in first], tmp_path / "two.fp")
    assert r["ok"], r
    second = _index(tmp_path / "two.fp")
    moved = sum(e["len"] for e in second if not e["skip"])
    assert r["bytes"] == moved and r["fingerprints"]["skipped_bytes"] == 40 * MIB - moved
    assert 8 * MIB <= moved <= 16 * MIB, second          # b's parts (and a part it shares)
    for e in second:                                     # skipped parts are holes: zeros
        with open(two.paths[e["file"]], "rb") as f:
            f.seek(e["offset"])
            assert (f.read(e["len"]).count(0) == e["len"]) == e["skip"]
    assert ctl_fds(p.sock, "detach")["ok"]

    # unfilled, the resume is refused and nothing is lost: filled, it comes back
    r = two.send(p.sock, "resume", write=False)
    skipped = r"of them supplied by the image store"
    assert not r["ok"] and "do not match their fingerprints" in r["error"], r
    assert f"{sum(e['skip'] for e in second)} {skipped}" in r["error"], r
    assert (p.status()["state"], p.status()["gate"]) == ("detached", "closed")
    _fill(two, second, one)
    assert two.send(p.sock, "resume", write=False)["ok"]
    assert p.call(f"@check {a} {32 * MIB} 3")["ok"]
    assert p.call(f"@check {b} {8 * MIB} 5")["ok"]


def test_filled_with_other_data_the_resume_is_refused(probe, tmp_path):
    p = probe({"TORPOR_AGENT_VMM_EXPORT": "0"})   # copied back, not held: the files are what is checked
    _program(p, 8)
    one = Files(tmp_path / "one", 1)
    assert _prepare_fp(p.sock, one, [], tmp_path / "one.fp")["ok"]
    first = _index(tmp_path / "one.fp")
    assert ctl_fds(p.sock, "abort")["ok"]
    two = Files(tmp_path / "two", 1)
    assert _prepare_fp(p.sock, two, [e["fp"] for e in first], tmp_path / "two.fp")["ok"]
    second = _index(tmp_path / "two.fp")
    with open(two.paths[0], "r+b") as f:                 # the right length, the wrong bytes
        for e in second:
            f.seek(e["offset"])
            f.write(b"\x01" * e["len"])
    r = ctl_fds(p.sock, "abort")
    assert not r["ok"] and f"{len(second)} reloaded chunk(s) do not match" in r["error"], r
    _fill(two, second, one)
    assert ctl_fds(p.sock, "abort")["ok"]


def test_without_the_fingerprint_kernel_everything_is_copied(gpu, probe, tmp_path):
    p = probe()
    ptr = _program(p, 8)
    one = Files(tmp_path / "one", 1)
    with failing(gpu, "cuModuleLoadData", "801"):     # CUDA_ERROR_NOT_SUPPORTED
        r = _prepare_fp(p.sock, one, ["00" * 16], tmp_path / "one.fp")
    assert r["ok"], r
    assert r["fingerprints"]["parts"] == 0 and "cuModuleLoadData" in r["fingerprints"]["error"]
    assert r["bytes"] == 8 * MIB and _index(tmp_path / "one.fp") == []
    assert ctl_fds(p.sock, "abort")["ok"]
    assert p.call(f"@check {ptr} {8 * MIB} 3")["ok"]


def _send_closing(sock: Path, line: str, fds: list[int]) -> dict:
    try:
        return ctl_fds(sock, line, fds)
    finally:
        for fd in fds:
            os.close(fd)


def test_fp_needs_its_two_files_and_a_bad_known_file_is_refused(probe, tmp_path):
    p = probe()
    ptr = _program(p, 8)
    one = Files(tmp_path / "one", 1)
    r = _send_closing(p.sock, "prepare 5000 fp", one.open(True))
    assert not r["ok"] and "known fingerprints" in r["error"], r
    bad = tmp_path / "bad.known"
    bad.write_bytes(b"x" * 17)
    r = _send_closing(p.sock, "prepare 5000 fp", one.open(True) + [
        os.open(bad, os.O_RDONLY), os.open(tmp_path / "i", os.O_RDWR | os.O_CREAT, 0o600)])
    assert not r["ok"] and "16-byte records" in r["error"], r
    assert p.status()["state"] == "running" and p.status()["gate"] == "open"
    assert p.call(f"@check {ptr} {8 * MIB} 3")["ok"]


def test_without_the_kernel_at_resume_the_stores_parts_are_checked_on_the_cpu(gpu, probe,
                                                                            tmp_path):
    """A GPU that cannot run the kernel at the resume (full after the re-creation, say) does
    not leave the program at a closed gate: the parts the store supplied are folded on the CPU
    from their files, and a hole is still caught."""
    p = probe()
    ptr = _program(p, 16)
    one = Files(tmp_path / "one", 1)
    assert _prepare_fp(p.sock, one, [], tmp_path / "one.fp")["ok"]
    first = _index(tmp_path / "one.fp")
    assert ctl_fds(p.sock, "abort")["ok"]
    two = Files(tmp_path / "two", 1)
    r = _prepare_fp(p.sock, two, [e["fp"] for e in first], tmp_path / "two.fp")
    assert r["ok"] and r["fingerprints"]["skipped"] == len(first), r
    second = _index(tmp_path / "two.fp")
    assert ctl_fds(p.sock, "detach")["ok"]
    with failing(gpu, "cuModuleLoadData", "801"):      # CUDA_ERROR_NOT_SUPPORTED
        r = two.send(p.sock, "resume", write=False)      # the holes are not filled yet
        assert not r["ok"] and f"{len(second)} reloaded chunk(s) do not match" in r["error"], r
        _fill(two, second, one)
        r = two.send(p.sock, "resume", write=False)
    assert r["ok"], r
    assert p.call(f"@check {ptr} {16 * MIB} 3")["ok"]
