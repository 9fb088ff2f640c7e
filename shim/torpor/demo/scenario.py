"""`torpor demo`: a self-verifying program checkpointed, restored and checked, end to end.

The program (demo/program.py) keeps a buffer of known content on the GPU (or in host memory
without one) and verifies it continuously. The demo starts it, waits for a verified state,
checkpoints it (the program is stopped by the dump), restores it from the images, and waits
until the restored program has ticked on and verified its whole buffer again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .. import gpus, procs
from ..engine import Engine
from ..errors import NoDriverError, TorporError
from ..flows.process import checkpoint, restore
from ..progress import Progress


def _status(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _wait(what: str, path: Path, ok: Callable[[dict[str, Any]], bool], timeout: float,
          pid: int | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = _status(path)
        if st.get("last_error"):
            raise TorporError(f"demo program reported an error: {st['last_error']}")
        if st and ok(st):
            return st
        if pid is not None and not procs.alive(pid):
            raise TorporError(f"demo program (PID {pid}) exited while waiting for {what}")
        time.sleep(0.05)
    raise TorporError(f"demo program: timed out after {timeout:.0f} s waiting for {what}")


def gpu_available(engine: Engine) -> bool:
    if engine.driver_or_none() is None:
        return False
    try:
        return bool(gpus.discover().gpus)
    except NoDriverError:
        return False


def run(engine: Engine, *, cpu: bool = False, mib: int = 256, keep: Path | None = None,
        timeout: float = 300.0) -> dict[str, Any]:
    say = engine.progress.say
    use_gpu = not cpu and gpu_available(engine)
    work = Path(tempfile.mkdtemp(prefix="torpor-demo-", dir=engine.cfg.state_dir))
    images = keep or work / "checkpoint"
    status = work / "status.json"
    argv = [sys.executable, "-m", "torpor.demo.program", "--status", str(status),
            "--mib", str(mib), "--libcuda", engine.cfg.libcuda] + ([] if use_gpu else ["--cpu"])
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    say(f"demo: starting a {'GPU' if use_gpu else 'CPU'} program holding {mib} MiB "
        f"(work dir {work})")
    with open(work / "program.log", "wb") as out:
        prog = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, cwd=work,
                                env=env, start_new_session=True)
    pid, restored_root = prog.pid, None
    try:
        before = _wait("its first full verification", status,
                       lambda s: s.get("verified_ok") and s.get("verified_tick", -1) >= 0,
                       timeout, pid)
        say(f"demo: PID {pid} running on {before.get('device') or 'the CPU'}, tick "
            f"{before['tick']}, buffer verified")
        m = checkpoint(engine, pid, images)
        checkpoint_timings = dict(engine.progress.timings)  # the seal included
        prog.wait(timeout=30)  # the dump ended it; reap it so its PID is free again
        at = _status(status)
        r = restore(Engine(engine.cfg, Progress(engine.progress.stream)), images)
        restored_root = r["root_pid"]
        after = _wait("ticks after the restore", status,
                      lambda s: s.get("tick", 0) > at.get("tick", 0), timeout, restored_root)
        os.kill(restored_root, signal.SIGUSR1)  # verify the whole buffer now
        final = _wait("a full verification after the restore", status,
                      lambda s: s.get("verified_ok") and s.get("verified_tick", -1) > after["tick"],
                      timeout, restored_root)
        say(f"demo: restored PID {restored_root} ticked on ({at.get('tick')} -> {final['tick']}) "
            f"and verified all {mib} MiB")
        return {"mode": "gpu" if use_gpu else "cpu", "device": final.get("device"),
                "pid": pid, "restored_pid": restored_root, "mib": mib,
                "tick_at_checkpoint": at.get("tick"), "tick_verified_after": final["verified_tick"],
                "checkpoint": {"timings": {k: round(v, 4) for k, v in checkpoint_timings.items()},
                               "size": m["sizes"]["total"],
                               "gpu_memory": m["sizes"]["gpu_memory"]},
                "restore": {"timings": r["timings"]}, "images_dir": str(images) if keep else None}
    finally:
        for p in filter(None, (restored_root, pid)):
            try:
                os.killpg(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            prog.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(work, ignore_errors=True)
