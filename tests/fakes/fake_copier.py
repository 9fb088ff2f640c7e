#!/usr/bin/env python3
"""A stand-in for torpor-copier (agent/copier/copier.c) where the GPU memory is the fake
agent's (tests/fakes/fake_agent.py): its held descriptors are memfds holding the bytes.
The same command line and protocol as `--ctl`: the ready line, then the go ("go F H" and
SCM_RIGHTS [plan, F files, H held]), then the plan's parts copied, one JSON line.
FAKE_COPIER_FAIL=<error>, or a file $FAKE_CUDA_STATE_DIR/fail/torpor-copier holding it (the
fake driver's fault files, for a copier torpord starts): it fails after the go, writing
nothing. FAKE_COPIER_DELAY_S: it waits that long after the go."""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def main(argv: list[str]) -> int:
    args = dict(zip(argv[::2], argv[1::2]))
    ctl = socket.socket(fileno=int(args["--ctl"]))
    print(json.dumps({"ready": True, "devices": 1, "seconds": 0.0}), flush=True)
    msg, fds, _flags, _ = socket.recv_fds(ctl, 64, 1 + 16 + 200)
    if not msg:
        print(json.dumps({"ok": False, "error": "no plan came"}), flush=True)
        return 1
    _, f, h = msg.decode().split()
    plan, files, held = fds[0], fds[1:1 + int(f)], fds[1 + int(f):]
    assert len(held) == int(h)
    time.sleep(float(os.environ.get("FAKE_COPIER_DELAY_S", "0")))
    fail = os.environ.get("FAKE_COPIER_FAIL", "")
    try:
        with open(os.path.join(os.environ.get("FAKE_CUDA_STATE_DIR", "/nonexistent"), "fail",
                               "torpor-copier")) as f:
            fail = f.read().strip() or "failed"
    except OSError:
        pass
    if fail:
        print(json.dumps({"ok": False, "error": fail}), flush=True)
        return 1
    text = os.pread(plan, 64 << 20, 0).decode().splitlines()
    copied = parts = 0
    out, at = b"", None
    for line in text[2:] + ["end"]:
        word, *nums = line.split()
        if word in ("part", "end") and at is not None:
            os.pwrite(files[at[0]], out, at[1])
            copied, parts = copied + len(out), parts + 1
            out, at = b"", None
        if word == "part":
            at = (int(nums[0]), int(nums[1]))
        elif word == "seg":
            k, off, length = map(int, nums)
            out += os.pread(held[k], length, off)
    print(json.dumps({"ok": True, "bytes": copied, "parts": parts, "allocations": len(held),
                      "seconds": 0.01, "setup_seconds": 0.0, "copy_seconds": 0.01}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
