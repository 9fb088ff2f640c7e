"""A small Python fake of the in-process agent's control socket (agent/PROTOCOL.md), for
testing torpor's side without the C agent: prepare / detach / resume / abort / status with
data-file fds received by socket.recv_fds, the "GPU memory" a byte pattern striped over the
files in chunks with a checksum each. It also checks what torpor sends: every fd a regular
file, empty and read-write for prepare, read-only for resume, and (given a FakeDriver) that no
resume comes while the driver holds the program locked (the real agent would block).

    agent = FakeAgent(sock_dir / f"agent-{os.getpid()}.sock", log=events).start()
    agent.fail["prepare"] = "out of memory"      # answer {"ok":false,"error":...}
    agent.raw["detach"] = b"garbage\\n"           # answer this instead
    agent.hang.add("prepare")                    # never answer
    agent.before_host_budget = True              # parse prepare as agents older than host=N
    agent.stop()

Also a program (python fake_agent.py DIR LOG [--bytes N] [--lib FAKE_LIBCUDA] [--ticks FILE],
main()): serves
agent-<its pid>.sock in DIR until killed, logging to LOG; `agent.fail` etc. come from
<socket>.faults.json if present.
Events ("agent prepare 1234", "driver lock 1234") go to a shared list or file in call order.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import socket
import stat
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

CHUNK = 1 << 20
PART = 4 << 20                              # the stream's slot: one image-store chunk
RECORD = struct.Struct("<IIQQQ")            # slot, file, offset, length, store length
END = 0xFFFFFFFF
ZERO = 0xFFFFFFFE                           # a load's record of zeros: no slot holds them


def pattern(nbytes: int, seed: int) -> bytes:
    block = hashlib.sha256(f"torpor-fake-gpu-{seed}".encode()).digest() * 2048   # 64 KiB
    return (block * (nbytes // len(block) + 1))[:nbytes]


class Damaged(AssertionError):
    """A resume's data file is not what was saved to it: the reply says "damaged", as the
    C agent's does (agent/PROTOCOL.md)."""


class Events:
    """An ordered event log shared by the fake agent(s) and the fake driver: a list, mirrored
    in a file (appends are atomic) when one is given, so that a program can add to it."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self._items: list[str] = []
        self._lock = threading.Lock()

    def add(self, text: str) -> None:
        with self._lock:
            self._items.append(text)
            if self.path is not None:
                with open(self.path, "a") as f:
                    f.write(text + "\n")

    def __call__(self) -> list[str]:
        if self.path is not None and self.path.exists():
            return self.path.read_text().splitlines()
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            if self.path is not None:
                self.path.unlink(missing_ok=True)


class FakeAgent:
    def __init__(self, path: Path, memory: int = 3 * CHUNK + 12345, log: Events | None = None,
                 driver: Any = None, pid: int | None = None):
        self.path = Path(path)
        self.pid = pid or os.getpid()
        self.log = log or Events()
        self.driver = driver                   # FakeDriver: resume refused while it holds a lock
        self.original = pattern(memory, self.pid)
        self.memory: bytes | None = self.original  # None while moved out
        self.state, self.gate = "running", "open"
        self.kept: list[int] = []              # the prepare's fds, until detach
        self.held: list[bytes] | None = None   # a prepare without files: the chunks, in memory
        self.host_budget: int | None = None    # the last prepare's host=N
        self.before_host_budget = False        # an agent preloaded before host=N existed
        self.sums: list[str] = []
        self.sizes: list[int] = []             # the data files' sizes at the prepare
        # held GPU memory (agent/PROTOCOL.md "Held memory", the real agent's default): export=N
        # cuts the memory into N "allocations", each a memfd the prepare keeps and `detach
        # hold` sends; 0 (the fake's default): an agent that cannot hold (status "holdable")
        self.export = 0
        self.hold_error = ""   # with export 0: why a prepare held nothing (the C agent's reply)
        self.exported: list[int] = []          # the memfds, while the agent has them
        self.exported_ids: list[tuple[int, int]] = []   # (st_dev, st_ino) of each, as sent
        self.deferred = False                  # the last prepare left its copy to a copier
        self.resumed_held: bool | None = None  # the last resume: mapped back (True) or copied
        self._out_fds: list[int] = []          # sent with the next reply, then closed
        self.fail: dict[str, str] = {}
        self.raw: dict[str, bytes] = {}
        self.hang: set[str] = set()
        self.seen: list[dict[str, Any]] = []   # per command with fds: what each fd was
        self.faults_file = self.path.with_name(self.path.name + ".faults.json")
        self._stop = threading.Event()
        self._idle = threading.Event()          # set while no connection is being served
        self._idle.set()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.path.unlink(missing_ok=True)
        self.sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self.sock.listen(4)
        self.sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fake-agent")

    def start(self) -> "FakeAgent":
        self._thread.start()
        return self

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Until the connection being served is closed on this side too: a client's close
        reaches the server thread a moment later, so its descriptor for the connection
        outlives the client's by that much."""
        assert self._idle.wait(timeout), "the fake agent still serves a connection"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        self.path.unlink(missing_ok=True)
        for fd in self.kept:
            os.close(fd)
        self.kept = []

    # -- serving ------------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._idle.clear()
            try:
                self._serve_one(conn)
            finally:
                self._idle.set()

    def _serve_one(self, conn: socket.socket) -> None:
        self.conn = conn   # the connection served now (a test's handler may write to it)
        with conn:
            conn.settimeout(0.1)
            buf, fds = b"", []
            while not self._stop.is_set():
                try:
                    data, new_fds, _flags, _addr = socket.recv_fds(conn, 4096, 32)
                except socket.timeout:
                    continue
                except OSError:
                    break
                if not data:
                    break
                buf += data
                fds += new_fds
                while b"\n" in buf:
                    line, _, buf = buf.partition(b"\n")
                    reply = self._command(line.decode(), fds)
                    fds = []
                    if reply is None:    # hang: no answer on this connection, ever
                        buf = b""
                        self._drain(conn)
                        break
                    if self._out_fds:
                        out, self._out_fds = self._out_fds, []
                        try:
                            sent = socket.send_fds(conn, [reply], out)
                            if sent < len(reply):
                                conn.sendall(reply[sent:])
                        except OSError:   # the client went: nothing is held
                            pass
                        finally:
                            for fd in out:
                                os.close(fd)
                    else:
                        conn.sendall(reply)
            for fd in fds:
                os.close(fd)

    def _drain(self, conn: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                if not conn.recv(4096):
                    return
            except socket.timeout:
                continue
            except OSError:
                return

    def _load_faults(self) -> None:
        try:
            doc = json.loads(self.faults_file.read_text())
        except (OSError, ValueError):
            return
        self.fail = dict(doc.get("fail", {}))
        self.raw = {k: v.encode() for k, v in doc.get("raw", {}).items()}
        self.hang = set(doc.get("hang", []))

    def _command(self, line: str, fds: list[int]) -> bytes | None:
        self._load_faults()
        cmd, _, arg = line.partition(" ")
        self.log.add(f"agent {cmd} {self.pid}")
        if fds:
            self.seen.append({"cmd": cmd, "fds": [self._describe(fd) for fd in fds]})
        if cmd in self.hang:   # once: the next one is answered
            self.hang.discard(cmd)
            for fd in fds:
                os.close(fd)
            return None
        if cmd in self.raw:
            for fd in fds:
                os.close(fd)
            return self.raw[cmd]
        if cmd in self.fail:
            for fd in fds:
                os.close(fd)
            return self._reply(ok=False, error=self.fail[cmd])
        handler = getattr(self, f"_do_{cmd}", None)
        if handler is None:
            for fd in fds:
                os.close(fd)
            return self._reply(ok=False, error="unknown command")
        try:
            return self._reply(**handler(arg, fds))
        except Damaged as e:
            return self._reply(ok=False, error=str(e), damaged=True)
        except (AssertionError, OSError) as e:
            return self._reply(ok=False, error=str(e))

    @staticmethod
    def _reply(**doc: Any) -> bytes:
        return (json.dumps(doc) + "\n").encode()

    @staticmethod
    def _describe(fd: int) -> dict[str, Any]:
        import fcntl
        st = os.fstat(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        try:   # a container does not see the host's path
            dir_mode: int | None = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
        except OSError:
            dir_mode = None
        return {"regular": stat.S_ISREG(st.st_mode), "size": st.st_size,
                "mode": stat.S_IMODE(st.st_mode), "access": fcntl.fcntl(fd, fcntl.F_GETFL)
                & os.O_ACCMODE, "path": path, "dir_mode": dir_mode}

    # -- the commands -------------------------------------------------------------------------
    def _do_status(self, arg: str, fds: list[int]) -> dict[str, Any]:
        return {"pid": self.pid, "state": self.state, "gate": self.gate, "in_flight": 0,
                "waiting": 0, "allocations": 1, "bytes": len(self.original),
                "movable_allocations": 1, "movable_bytes": len(self.original), "contexts": 1,
                "holdable": self.export > 0,
                "intact": self.intact}   # the fake's own: every byte back

    def _do_close(self, arg: str, fds: list[int]) -> dict[str, Any]:
        self.gate = "closed"
        return {"ok": True}

    def _do_open(self, arg: str, fds: list[int]) -> dict[str, Any]:
        self.gate = "open"
        return {"ok": True}

    def _do_prepare(self, arg: str, fds: list[int]) -> dict[str, Any]:
        if arg.split()[-1:] == ["defer"]:   # the plan comes last (PROTOCOL.md "The deferred copy")
            assert fds, "defer without a plan"
            plan, fds = fds[-1], fds[:-1]
            try:
                return self._prepare_deferred(arg.rsplit(" ", 1)[0], fds, plan)
            finally:
                os.close(plan)
        return self._prepare(arg, fds)

    def _prepare_deferred(self, arg: str, fds: list[int], plan: int) -> dict[str, Any]:
        """As the C agent's defer.c: with held memory, the files laid out and sized (holes),
        the plan written, the memory held by its exports alone, nothing copied; else a
        plain prepare and why not."""
        if not self.export:
            return {**self._prepare(arg, fds), "deferred": False,
                    "defer_error": "no held memory (TORPOR_AGENT_VMM_EXPORT=0)"}
        self.log.add(f"agent prepare-defer {self.pid}")
        reply = self._prepare(arg, fds, write=False)
        assert self.original is not None
        n = len(fds)
        size = len(self.original)
        step = -(-size // self.export)
        lines = ["torpor-copy-plan 1", f"files {n}"]
        lines += [f"alloc {k} {min(step, size - k * step)} {'0' * 32}"
                  for k in range(self.export)]
        for f in range(n):   # file f holds chunks f, f + n, ... back to back (_prepare)
            chunks = list(range(f, -(-size // CHUNK), n))
            for at in range(0, len(chunks) * CHUNK, PART):
                part = chunks[at // CHUNK:(at + PART) // CHUNK]
                length = sum(min(CHUNK, size - c * CHUNK) for c in part)
                lines.append(f"part {f} {at} {length}")
                for c in part:
                    lo, hi = c * CHUNK, min(size, (c + 1) * CHUNK)
                    while lo < hi:   # a chunk may straddle two allocations
                        k = lo // step
                        end = min(hi, (k + 1) * step)
                        lines.append(f"seg {k} {lo - k * step} {end - lo}")
                        lo = end
        os.pwrite(plan, ("\n".join(lines) + "\nend\n").encode(), 0)
        self.deferred = True
        return {**reply, "deferred": True, "defer_error": ""}

    def _prepare(self, arg: str, fds: list[int], write: bool = True) -> dict[str, Any]:
        t = time.monotonic()
        if self.before_host_budget:   # its parser (agent/src/control.c before host=N): after
            rest = [w for w in arg.split() if w not in ("fp", "stream")]   # fp and stream,
            if len(rest) > 1 or (rest and not rest[0].isdigit()):          # one number
                for fd in fds:
                    os.close(fd)
                return {"ok": False, "error": "bad timeout"}
        fingerprints = None
        stream: list[int] = []
        if arg.split()[-1:] == ["stream"]:   # the ring and the socket come last
            assert arg.split()[-2:] == ["fp", "stream"], "a stream without fingerprints"
            stream, fds = fds[-2:], fds[:-2]
            arg = arg.rsplit(" ", 1)[0]
            self.log.add(f"agent prepare-stream {self.pid}")
        if arg.split()[-1:] == ["fp"]:
            # The C agent fingerprints on the GPU; this fake has none: it says so, as the C
            # agent does without its kernel, and writes an index of no parts.
            known, index = fds[-2:]
            fds = fds[:-2]
            assert self._describe(index)["regular"] and self._describe(known)["regular"]
            os.pwrite(index, b"torpor-gpu-fingerprints 1\n", 0)
            os.close(known)
            os.close(index)
            fingerprints = {"parts": 0, "skipped": 0, "skipped_bytes": 0, "seconds": 0.0,
                            "error": "the fake agent has no GPU to fingerprint on"}
            self.log.add(f"agent prepare-fp {self.pid}")
        words = arg.split()
        self.host_budget = next((int(w[5:]) for w in words if w.startswith("host=")), None)
        need = sum(len(c) for c in (self.memory[i:i + CHUNK] for i in
                                    range(0, len(self.memory or b""), CHUNK)) if any(c))
        if self.host_budget is not None and need > self.host_budget:   # as the C agent
            for fd in [*fds, *stream]:
                os.close(fd)
            return {"ok": False, "error": f"its GPU data needs {need} bytes of host memory "
                                          f"(0 bytes of zero parts stay on the GPU); "
                                          f"{self.host_budget} bytes are available for it"}
        try:
            assert self.state == "running", f"already {self.state}"
            assert 0 <= len(fds) <= 16, f"{len(fds)} files"
            for fd in fds:
                d = self._describe(fd)
                assert d["regular"] and d["size"] == 0 and d["access"] == os.O_RDWR, \
                    f"not an empty read-write regular file: {d}"
            assert self.memory is not None
            self.sums = []
            self.held = None if fds else []
            content = [bytearray() for _ in fds]   # what each file gets
            for i in range(0, len(self.memory), CHUNK):
                chunk = self.memory[i:i + CHUNK]
                if self.held is not None:
                    self.held.append(chunk)
                else:
                    k = (i // CHUNK) % len(fds)
                    content[k] += chunk
                self.sums.append(hashlib.sha256(chunk).hexdigest())
            for fd, data in zip(fds, content):
                if stream or not write:             # the ring's, or the copier's: holes
                    os.ftruncate(fd, len(data))
                else:
                    os.pwrite(fd, data, 0)
            if stream:
                self._stream_out(content, *stream)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        finally:
            for fd in stream:
                os.close(fd)
        held = self._export() if fds and self.export else 0
        self.kept, self.memory = list(fds), None
        self.state, self.gate = "prepared", "closed"
        self.sizes = [os.fstat(fd).st_size for fd in fds]
        return {"ok": True, "bytes": len(self.original), "chunks": len(self.sums),
                "allocations": 1, "cache_released": 0, "seconds": time.monotonic() - t,
                "in_memory": not fds, "files": list(self.sizes), "held": held,
                **({"hold_error": self.hold_error} if fds and not held and self.hold_error
                   else {}),
                **({"fingerprints": fingerprints} if fingerprints else {}),
                **({"streamed": True} if stream else {})}

    # -- the image store's stream (agent/PROTOCOL.md "Streaming"), in 4 MiB parts -------------
    def _stream_out(self, content: list[bytearray], ring_fd: int, sock_fd: int) -> None:
        ring = mmap.mmap(ring_fd, os.fstat(ring_fd).st_size)
        sock = socket.socket(fileno=os.dup(sock_fd))
        sock.settimeout(30)
        try:
            for k, data in enumerate(content):
                for off in range(0, len(data), PART):
                    msg = sock.recv(4)
                    assert msg, "the image store stopped taking GPU data"
                    (slot,) = struct.unpack("<I", msg)
                    piece = data[off:off + PART]
                    ring[slot * PART:slot * PART + len(piece)] = piece
                    sock.send(RECORD.pack(slot, k, off, len(piece), len(piece)))
            sock.send(RECORD.pack(END, 0, 0, 0, 0))
            while (msg := sock.recv(4)) and struct.unpack("<I", msg)[0] != END:
                pass                                # slots handed back meanwhile
            assert msg, "the image store did not take the GPU data: torpor closed the stream"
        finally:
            ring.close()
            sock.close()

    def _stream_in(self, ring_fd: int, sock_fd: int) -> list[bytearray]:
        ring = mmap.mmap(ring_fd, os.fstat(ring_fd).st_size)
        sock = socket.socket(fileno=os.dup(sock_fd))
        sock.settimeout(30)
        content = [bytearray(n) for n in self.sizes]
        got = set()
        try:
            while msg := sock.recv(RECORD.size + 1):
                slot, k, off, length, _ = RECORD.unpack(msg)
                n = min(length, self.sizes[k] - off)
                got.add((k, off))
                if slot == ZERO:                    # zeros: no slot (content is zeros)
                    continue
                content[k][off:off + n] = ring[slot * PART:slot * PART + n]
                sock.send(struct.pack("<I", slot))
        finally:
            ring.close()
            sock.close()
        missing = sum(1 for k, n in enumerate(self.sizes) for off in range(0, n, PART)
                      if (k, off) not in got)
        assert not missing, f"the image store's stream ended {missing} part(s) short"
        return content

    def _export(self) -> int:
        """The memory as self.export memfds (the GPU's, held by their descriptors)."""
        assert self.memory is not None
        n = self.export
        step = -(-len(self.memory) // n)
        self.exported_ids = []   # this save's, as the C agent checks them (not an earlier one's)
        for k in range(n):
            fd = os.memfd_create(f"fake-held-{k}", os.MFD_CLOEXEC)
            os.pwrite(fd, self.memory[k * step:(k + 1) * step], 0)
            st = os.fstat(fd)
            self.exported.append(fd)
            self.exported_ids.append((st.st_dev, st.st_ino))
        return n

    def _drop_exported(self) -> None:
        for fd in self.exported:
            os.close(fd)
        self.exported = []

    def _do_detach(self, arg: str, fds: list[int]) -> dict[str, Any]:
        if arg == "release":   # a deferred save's own descriptors go (the copier has them)
            assert self.state == "detached" and self.deferred, "release of nothing deferred"
            self._drop_exported()
            return {"ok": True}
        assert self.state == "prepared", f"detach while {self.state}"
        assert arg in ("", "hold"), f"detach {arg}"
        for fd in self.kept:
            os.close(fd)
        self.kept, self.state = [], "detached"
        if arg == "hold" and self.exported and self.deferred:
            # duplicates: the agent keeps its own until `detach release` (never one holder)
            self._out_fds = [os.dup(fd) for fd in self.exported]
            return {"ok": True, "held": len(self._out_fds), "release": True}
        if arg == "hold" and self.exported:
            self._out_fds, self.exported = self.exported, []   # sent, then the agent's closed
            return {"ok": True, "held": len(self._out_fds)}
        self._drop_exported()
        return {"ok": True, **({"held": 0} if arg == "hold" else {})}

    def _do_hold(self, arg: str, fds: list[int]) -> dict[str, Any]:
        """A deferred save's descriptors given back (`hold N`): its own again."""
        assert self.state == "detached" and self.deferred and len(fds) == int(arg), "hold"
        self._drop_exported()
        self.exported = list(fds)
        return {"ok": True, "held": len(fds)}

    def _take_held(self, held: list[int]) -> bytes | None:
        """The memory from the held descriptors (agent/PROTOCOL.md `resume held=N`), or None
        (not the ones it sent: the resume copies from the files)."""
        ids = [(st.st_dev, st.st_ino) for st in map(os.fstat, held)]
        if not held or ids != self.exported_ids:
            self.log.add(f"agent held-refused {self.pid}")
            return None
        return b"".join(os.pread(fd, os.fstat(fd).st_size, 0) for fd in held)

    def _do_resume(self, arg: str, fds: list[int]) -> dict[str, Any]:
        t = time.monotonic()
        streamed: list[bytearray] | None = None
        back: bytes | None = None
        try:
            assert self.state in ("prepared", "detached"), f"resume while {self.state}"
            words = arg.split()
            drained = "drained" in words   # the copier filled the files: they may be read
            arg = " ".join(w for w in words if w != "drained")
            if arg.startswith("held="):
                n = int(arg[5:])
                assert 1 <= n <= len(fds), f"held={n} with {len(fds)} descriptors"
                held, fds = fds[-n:], fds[:-n]
                try:
                    back = self._take_held(held)
                finally:
                    for fd in held:
                        os.close(fd)
                arg = ""
            elif self.exported and (self.state == "prepared" or self.deferred):   # its own
                back = self._take_held(self.exported)
            self._drop_exported()
            self.resumed_held = back is not None
            if back is not None:   # mapped back: the files are not read
                self.log.add(f"agent resume-held {self.pid}")
                self.memory, self.held = back, None
                for fd in [*fds, *self.kept]:
                    os.close(fd)
                fds, self.kept = [], []
                self.state, self.gate, self.deferred = "running", "open", False
                return {"ok": True, "bytes": 0, "seconds": time.monotonic() - t, "held": True}
            assert drained or not self.deferred, \
                "a deferred save's files read before the copier filled them"
            if self.driver is not None:
                assert self.driver.unlocked(self.pid), "the driver holds the program (would block)"
            if arg == "stream":
                assert len(fds) == 2 and self.held is None, "resume stream: a ring and a socket"
                self.log.add(f"agent resume-stream {self.pid}")
                streamed = self._stream_in(*fds)
            elif self.held is not None:
                assert not fds, "files given to resume what is held in memory"
            elif not fds:
                assert self.kept, "resume without files after detach"
            for fd in fds if streamed is None else ():
                assert self._describe(fd)["access"] == os.O_RDONLY, "a file not read-only"
            files = fds or self.kept
            out = bytearray()
            for n, want in enumerate(self.sums):
                size = min(CHUNK, len(self.original) - n * CHUNK)
                if self.held is not None:
                    chunk = self.held[n]
                elif streamed is not None:
                    at = (n // len(streamed)) * CHUNK
                    chunk = bytes(streamed[n % len(streamed)][at:at + size])
                else:
                    chunk = os.pread(files[n % len(files)], size, (n // len(files)) * CHUNK)
                if hashlib.sha256(chunk).hexdigest() != want:
                    message = f"chunk {n}: checksum mismatch"
                    if self.held is None and streamed is None:
                        raise Damaged(message + ": the file is damaged or not this program's")
                    raise AssertionError(message)
                out += chunk
        finally:
            for fd in fds:
                os.close(fd)
        for fd in self.kept:
            os.close(fd)
        self.kept, self.memory, self.held = [], bytes(out), None
        self.state, self.gate, self.deferred = "running", "open", False
        return {"ok": True, "bytes": len(out), "seconds": time.monotonic() - t, "held": False,
                **({"streamed": True} if streamed is not None else {})}

    def _do_abort(self, arg: str, fds: list[int]) -> dict[str, Any]:
        assert self.state == "prepared", f"abort while {self.state}"
        return self._do_resume(arg, [])

    @property
    def intact(self) -> bool:
        """Its memory is back, every byte as before."""
        return self.memory == self.original and self.state == "running" and self.gate == "open"


class FakeDriver:
    """torpor.driver.Driver's six calls on a dict of pid -> ProcessState, logging to Events;
    fail[call] = pid (or 0: any) makes that call raise DriverError."""

    def __init__(self, log: Events, pids: list[int] = ()):
        from torpor.driver import ProcessState
        self.S = ProcessState
        self.log = log
        self.states = {p: ProcessState.RUNNING for p in pids}
        self.fail: dict[str, int] = {}
        self.cuda_version = 13000

    def unlocked(self, pid: int) -> bool:
        return self.states.get(pid) == self.S.RUNNING

    def _call(self, call: str, pid: int, want: Any, then: Any) -> None:
        from torpor.driver import DriverError
        self.log.add(f"driver {call} {pid}")
        if call in self.fail and self.fail[call] in (0, pid):
            raise DriverError(f"cuCheckpointProcess{call.title()}", pid, 999, "CUDA_ERROR_FAKE",
                              "injected")
        if self.states.get(pid) != want:
            raise DriverError(f"cuCheckpointProcess{call.title()}", pid, 1,
                              "CUDA_ERROR_INVALID_VALUE", f"{call} in state {self.states.get(pid)}")
        self.states[pid] = then

    def get_state(self, pid: int) -> Any:
        from torpor.driver import DriverError
        if pid not in self.states:
            raise DriverError("cuCheckpointProcessGetState", pid, 1, "CUDA_ERROR_INVALID_VALUE",
                              "not a CUDA process")
        return self.states[pid]

    def try_state(self, pid: int) -> Any:
        return self.states.get(pid)

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._call("lock", pid, self.S.RUNNING, self.S.LOCKED)

    def checkpoint(self, pid: int) -> None:
        self._call("checkpoint", pid, self.S.LOCKED, self.S.CHECKPOINTED)

    def restore(self, pid: int, gpu_map: Any = None) -> None:
        self._call("restore", pid, self.S.CHECKPOINTED, self.S.LOCKED)

    def unlock(self, pid: int) -> None:
        self._call("unlock", pid, self.S.LOCKED, self.S.RUNNING)


def main(argv: list[str]) -> int:
    """The program: serves agent-<its pid>.sock in DIR, events to LOG, until killed. With
    --lib (the fake libcuda), it is also a CUDA program as tests/fakes/fake_cuda_program.py is
    (a context, then cuCtxSynchronize in a loop, which waits while the driver holds it), so
    that torpor and CRIU can checkpoint and restore it."""
    import argparse
    import ctypes
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("log")
    ap.add_argument("--bytes", type=int, default=3 * CHUNK + 12345)
    ap.add_argument("--lib", default="")
    ap.add_argument("--ticks", default="",
                    help="append a timestamp a loop to this file, and wait while the gate is "
                         "closed (as a real program's CUDA calls do): its longest gap is how "
                         "long the program was paused")
    ap.add_argument("--export", type=int, default=0,
                    help="its memory as N allocations a prepare exports (TORPOR_AGENT_VMM_EXPORT"
                         "=1's held memory: `detach hold` sends them)")
    args = ap.parse_args(argv[1:])
    preload = os.environ.get("LD_PRELOAD", "")
    if "libtorpor-agent" in preload:   # a container preloads the real agent: be the only one
        os.environ["LD_PRELOAD"] = " ".join(x for x in preload.split()
                                            if "libtorpor-agent" not in x)
        os.execv(sys.executable, [sys.executable, "-I", *argv])
    agent = FakeAgent(Path(args.dir) / f"agent-{os.getpid()}.sock", args.bytes,
                      log=Events(Path(args.log)))
    agent.export = args.export
    if args.lib:
        lib = ctypes.CDLL(args.lib)
        dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
        assert lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
        assert lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
    agent.start()
    try:
        while True:
            while args.ticks and agent.gate == "closed":
                time.sleep(0.005)
            if args.lib:
                lib.cuCtxSynchronize()
            if args.ticks:
                with open(args.ticks, "a") as f:
                    f.write(f"{time.time():.4f}\n")
            time.sleep(0.05 if not args.ticks else 0.01)
    finally:
        agent.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
