"""The agent's index with zero parts (store/fingerprints.py, issue 20): version 2 marks a part
that read all zero on the GPU with `z`; version 1 (before zero parts) is still read; an index
is untrusted (the program controls its agent), so a `z` in version 1, a part named twice, or a
zero part outside the data files is refused. A zero part needs no filling and packs as zeros
(no chunk, nothing read, no fingerprint)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torpor import agent_data
from torpor.errors import DamagedRecordsError
from torpor.store import Store, fingerprints
from torpor.store.fingerprints import PART

FP = "0123456789abcdef0123456789abcdef"
FP2 = "fedcba9876543210fedcba9876543210"
SIZES = [3 * PART, PART + 100]


def _text(header: str, *lines: str) -> str:
    return "\n".join([header, *lines]) + "\n"


def test_version_1_is_still_read():
    parts = fingerprints.parse(_text("torpor-gpu-fingerprints 1",
                                     f"0 0 {PART} {PART} {FP} 0",
                                     f"0 {PART} {PART} {PART} {FP2} 1"), "old", SIZES)
    assert [(p.skipped, p.zero) for p in parts] == [(False, False), (True, False)]


def test_version_2_names_zero_parts_and_round_trips():
    text = _text("torpor-gpu-fingerprints 2", f"0 0 {PART} {PART} {FP} 0",
                 f"0 {PART} {PART} {PART} {FP2} 1", f"0 {2 * PART} 100 {PART} {FP} z",
                 f"1 {PART} 100 100 {FP} z")
    parts = fingerprints.parse(text, "new", SIZES)
    assert [(p.skipped, p.zero) for p in parts] == [(False, False), (True, False),
                                                    (False, True), (False, True)]
    assert fingerprints.dump(parts) == text


@pytest.mark.parametrize("header, line", [
    ("torpor-gpu-fingerprints 1", f"0 0 {PART} {PART} {FP} z"),    # z before zero parts
    ("torpor-gpu-fingerprints 2", f"0 0 {PART} {PART} {FP} Z"),
    ("torpor-gpu-fingerprints 2", f"0 0 {PART} {PART} {FP} zz"),
    ("torpor-gpu-fingerprints 2", f"2 0 {PART} {PART} {FP} z"),     # no file 2
    ("torpor-gpu-fingerprints 2", f"0 {3 * PART} {PART} {PART} {FP} z"),   # past its end
    ("torpor-gpu-fingerprints 2", f"0 100 {PART} {PART} {FP} z"),   # not at a part
    ("torpor-gpu-fingerprints 2", f"0 0 {PART + 1} {PART + 1} {FP} z"),   # longer than one
    ("torpor-gpu-fingerprints 2", f"0 0 0 {PART} {FP} z"),          # empty
    ("torpor-gpu-fingerprints 2", f"0 0 {PART} {PART} - z"),        # no fingerprint
    ("torpor-gpu-fingerprints 3", f"0 0 {PART} {PART} {FP} 0"),     # a version to come
])
def test_a_bad_zero_record_is_refused(header, line):
    with pytest.raises(DamagedRecordsError):
        fingerprints.parse(_text(header, line), "bad", SIZES)


@pytest.mark.parametrize("second", [f"0 0 {PART} {PART} {FP} z", f"0 0 {PART} {PART} {FP2} 1",
                                    f"0 0 100 {PART} {FP} 0"])
def test_a_part_named_twice_is_refused(second):
    """A zero record beside a copied or skipped one for the same part: which is it? Refused."""
    with pytest.raises(DamagedRecordsError, match="line 3"):
        fingerprints.parse(_text("torpor-gpu-fingerprints 2", f"0 0 {PART} {PART} {FP} 0",
                                 second), "twice", SIZES)


def test_zero_parts_pack_as_zeros_and_need_no_filling(tmp_path: Path):
    """given(): a zero part is zeros (no chunk, nothing read) whatever the store's fingerprints
    say; it has no fingerprint in the pack; has_skipped/fill leave its hole alone."""
    prog = tmp_path / agent_data.DATA_DIR / "1234"
    prog.mkdir(parents=True)
    for k, size in enumerate(SIZES):
        with open(prog / agent_data.file_name(k), "wb") as f:
            f.truncate(size)
    parts = [fingerprints.Part(0, 0, PART, PART, FP, False, True),
             fingerprints.Part(0, PART, PART, PART, FP2, False, False),
             fingerprints.Part(1, PART, 100, 100, FP, False, True)]
    (prog / agent_data.INDEX).write_text(fingerprints.dump(parts))
    refs = {FP: ["a" * 64, PART]}       # the store "knows" the zero part's fingerprint: no matter
    assert fingerprints.given(parts, refs, 0) == {0: [None, PART]}
    assert fingerprints.given(parts, refs, 1) == {1: [None, 100]}
    assert not fingerprints.has_skipped(prog)
    store = Store(tmp_path / "store", workers=1)
    fds = [os.open(prog / agent_data.file_name(k), os.O_RDWR) for k in range(2)]
    try:
        assert fingerprints.fill(store, prog, fds, SIZES, "uid:0") == 0
    finally:
        for fd in fds:
            os.close(fd)
    packed = fingerprints.pack_arguments(store, tmp_path, refs)
    zero_file = packed[f"{agent_data.DATA_DIR}/1234/{agent_data.file_name(0)}"]
    assert zero_file["given"] == {0: [None, PART]}
    assert zero_file["fingerprints"] == [[1, FP2]]   # the copied part's alone
    assert packed[f"{agent_data.DATA_DIR}/1234/{agent_data.file_name(1)}"] == {
        "given": {1: [None, 100]}, "fingerprints": [],
        "host_fingerprints": []}   # no stream: nothing the host named for this file
