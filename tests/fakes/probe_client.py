"""Drives tests/fakes/agent_probe.py from a test: one command a line in, one JSON answer a line
out, matched by id (each command runs in a thread of its own in the probe, so a command held
in the driver or at the agent's gate does not hold the next)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Mapping, Sequence

PROBE = Path(__file__).resolve().parent / "agent_probe.py"


class ProbeProcess:
    """agent_probe.py started with `env` (under `prefix`, e.g. unshare), its stderr in log_path
    (else inherited): send() a command, result() its answer, call() both."""

    def __init__(self, libcuda: str, env: Mapping[str, str], log_path: Path | None = None,
                 prefix: Sequence[str] = (), script: Path = PROBE):
        self.log_path = log_path
        argv = [*prefix, sys.executable, str(script), "--lib", libcuda]
        log = open(log_path, "w") if log_path else None
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=dict(env))
        finally:
            if log:
                log.close()
        first = self.proc.stdout.readline()
        if not first:
            self.proc.wait(timeout=10)
            raise AssertionError(f"probe exited {self.proc.returncode}: {self.log()}")
        self.pid = json.loads(first)["pid"]
        self.results: dict[str, dict] = {}
        self.cond = threading.Condition()
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            doc = json.loads(line)
            with self.cond:
                self.results[doc["id"]] = doc
                self.cond.notify_all()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def send(self, cmd: str) -> str:
        self.next_id += 1
        cid = str(self.next_id)
        self.proc.stdin.write(f"{cid} {cmd}\n")
        self.proc.stdin.flush()
        return cid

    def done(self, cid: str) -> bool:
        with self.cond:
            return cid in self.results

    def result(self, cid: str, timeout: float = 15.0) -> dict:
        with self.cond:
            if not self.cond.wait_for(lambda: cid in self.results, timeout):
                raise AssertionError(f"no answer to command {cid}; log:\n{self.log()}")
            doc = self.results[cid]
        assert "error" not in doc, doc["error"]
        return doc

    def call(self, cmd: str, timeout: float = 15.0) -> dict:
        return self.result(self.send(cmd), timeout)

    def rc(self, cmd: str) -> int:
        return self.call(cmd)["rc"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("0 quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
