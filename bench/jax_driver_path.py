#!/usr/bin/env python3
"""Which JAX/XLA feature keeps a JAX program from coming back on the driver path (issue 18,
item 9): the same jitted program (tests/gpu/jax_program.py) under several XLA settings, each
`torpor checkpoint PID -D DIR` (driver lock + checkpoint + CRIU dump) then `torpor restore -D
DIR`, and whether it continues bit-exact against an uninterrupted run with the same settings.
The variants each turn one XLA feature off. Writes JSON:

    python3 bench/jax_driver_path.py --out results/jax_driver_path-h200-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "gpu" / "jax_program.py"
sys.path.insert(0, str(ROOT))
from tests.gpu.compare_steps import compare  # noqa: E402

BASE = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.02"}
VARIANTS = {
    "default": {},
    "no-preallocate": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "platform-allocator": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
    "no-command-buffers": {"XLA_FLAGS": BASE["XLA_FLAGS"] + " --xla_gpu_enable_command_buffer="},
    "platform+no-command-buffers": {
        "XLA_PYTHON_CLIENT_ALLOCATOR": "platform",
        "XLA_FLAGS": BASE["XLA_FLAGS"] + " --xla_gpu_enable_command_buffer="},
}


def torpor(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torpor.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return False


def status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def start(work: Path, name: str, env: dict, max_steps: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PROGRAM), "--gib", "0.25", "--steps-file",
                             str(work / f"{name}.steps"), "--status",
                             str(work / f"{name}.json"), "--max-steps", str(max_steps)],
                            env=env, stdin=subprocess.DEVNULL,
                            stdout=open(work / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def trial(name: str, extra: dict, root: Path) -> dict:
    work = root / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, **BASE, **extra}
    ref, prog = start(work, "ref", env, max_steps=60), start(work, "prog", env)
    out: dict = {"variant": name, "env": extra}
    try:
        if not wait(lambda: status(work / "prog.json").get("step", 0) >= 10, 240):
            out["error"] = "program did not start: " + (work / "prog.log").read_text()[-800:]
            return out
        t = time.monotonic()
        ck = torpor("--json", "checkpoint", str(prog.pid), "-D", str(work / "ck"), env=env)
        out["checkpoint_s"] = round(time.monotonic() - t, 2)
        if ck.returncode != 0:
            out["error"] = "checkpoint: " + ck.stderr.strip().splitlines()[-1]
            return out
        prog.wait(timeout=30)
        at = status(work / "prog.json").get("step", 0)
        t = time.monotonic()
        rs = torpor("--json", "restore", "-D", str(work / "ck"), env=env)
        out["restore_s"] = round(time.monotonic() - t, 2)
        if rs.returncode != 0:
            out["error"] = "restore: " + rs.stderr.strip().splitlines()[-1]
            return out
        ok = wait(lambda: status(work / "prog.json").get("step", 0) >= at + 20, 120)
        wait(lambda: status(work / "ref.json").get("done"), 120)
        n, mismatch = compare(str(work / "ref.steps"), str(work / "prog.steps"))
        out.update(continued=ok, common_steps=n, bit_exact=ok and mismatch is None,
                   mismatch=mismatch)
        return out
    finally:
        for p in (ref, prog):
            try:
                os.killpg(p.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        pid = status(work / "prog.json").get("pid")
        if pid:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, PermissionError):
                pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="/var/tmp/torpor-jax")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = []
    for name in args.variants:
        r = trial(name, VARIANTS[name], Path(args.root))
        print(json.dumps(r), flush=True)
        results.append(r)
    Path(args.out).write_text(json.dumps({"benchmark": "jax_driver_path",
                                          "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                                          "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
