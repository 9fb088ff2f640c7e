"""The public socket: who is calling is checked here, because gRPC does not check it.

gRPC's Unix-socket server accepts anyone who can open the socket file. torpord therefore serves
gRPC on private sockets in a 0700 directory and listens itself on the public socket: each
connection's SO_PEERCRED (the caller's pid, uid and gid at connect time, from the kernel) is
read, and only the allowed uids (root and config socket_owner_uid) are spliced, byte for byte,
to a private gRPC socket (root to its own, `routes`, so that no flood of another uid's calls
can queue in front of root's). Anyone else is closed at once.

One thread does it all, whatever the number of connections: a selector loop accepts, refuses,
splices (non-blocking, a bounded buffer each way, reading paused while the other side is
full) and times out. Bounded, so that no caller can take torpord down (issue 18, item 3):
- at most `max_conns` spliced connections, and `per_uid` for any uid but root; past them a
  non-root connection is refused, and root's takes the place of the longest-idle one;
- a connection that has sent nothing within `silent_s`, or nothing either way within `idle_s`,
  is closed (a gRPC client sends its preface at once);
- accept never dies: out of descriptors (EMFILE, ENFILE), the longest-idle connection goes
  and the loop goes on;
- repeated log lines (refusals, shedding) are summed up, one line per key every LOG_EVERY_S.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import selectors
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Iterable, Mapping

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred: pid_t pid; uid_t uid; gid_t gid
_CHUNK = 256 * 1024
BACKLOG = 4096                # a flood of refused connects must not fill it before root's
MAX_CONNS = 1024
PER_UID = 128
SILENT_S = 10.0
IDLE_S = 3600.0
LOG_EVERY_S = 10.0


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected conn."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def bind_unix(path: Path, mode: int, owner_uid: int = -1, backlog: int = 128) -> socket.socket:
    """A listening Unix socket at path (a stale one is replaced) with this mode (and owner)."""
    try:
        if path.is_socket():
            path.unlink()
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o177)  # never visible with looser bits, even for a moment
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, mode)
    if owner_uid > 0:
        os.chown(path, owner_uid, -1)
    sock.listen(backlog)
    return sock


class _Quiet:
    """Log lines summed up per key: the first at once, then one every LOG_EVERY_S with how
    many were held back."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._held: collections.Counter[str] = collections.Counter()

    def say(self, level: int, key: str, text: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -LOG_EVERY_S) < LOG_EVERY_S:
            self._held[key] += 1
            return
        held = self._held.pop(key, 0)
        self._last[key] = now
        log.log(level, "%s%s", text, f" (and {held} more like it in the last "
                                     f"{LOG_EVERY_S:.0f} s)" if held else "")


class _Splice:
    """One allowed connection (down) and its gRPC server connection (up)."""

    __slots__ = ("down", "up", "uid", "who", "pending", "heard", "active", "closed")

    def __init__(self, down: socket.socket, up: socket.socket, uid: int, who: str):
        self.down, self.up, self.uid, self.who = down, up, uid, who
        self.pending: dict[socket.socket, bytes] = {}   # what waits to be written to a side
        self.heard = False                               # the caller has sent something
        self.active = time.monotonic()
        self.closed = False

    def other(self, s: socket.socket) -> socket.socket:
        return self.up if s is self.down else self.down


class PeerCredProxy:
    """Listens on public_path; splices allowed peers to the gRPC server at private_path (or at
    routes[uid] for a uid routed elsewhere)."""

    def __init__(self, public_path: Path, private_path: Path, allowed_uids: Iterable[int], *,
                 mode: int = 0o660, owner_uid: int = -1,
                 routes: Mapping[int, Path] | None = None, max_conns: int = MAX_CONNS,
                 per_uid: int = PER_UID, silent_s: float = SILENT_S, idle_s: float = IDLE_S):
        self.public_path, self.private_path = Path(public_path), Path(private_path)
        self.routes = {int(u): Path(p) for u, p in (routes or {}).items()}
        self.allowed = frozenset(int(u) for u in allowed_uids)
        self.mode, self.owner_uid = mode, owner_uid
        self.max_conns, self.per_uid = max_conns, per_uid
        self.silent_s, self.idle_s = silent_s, idle_s
        self.refused = 0
        self.served = 0
        self.shed = 0
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._splices: dict[_Splice, None] = {}       # insertion order: oldest first
        self._by_uid: collections.Counter[int] = collections.Counter()
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()                 # _splices, for active() and close()
        self._thread: threading.Thread | None = None
        self._quiet = _Quiet()
        self._cut_all = False
        self._calls: collections.deque = collections.deque()   # run in the loop's thread

    # -- life -------------------------------------------------------------------------------
    def start(self) -> None:
        self._sock = bind_unix(self.public_path, self.mode, self.owner_uid, BACKLOG)
        self._sock.setblocking(False)
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="peercred", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        """Close the public socket (and remove its file); connections already spliced go on."""
        if self._sock is None or self._sock.fileno() < 0:
            return
        self._call(lambda: self._close_listener())

    def close(self) -> None:
        """stop_accepting() and cut every spliced connection; the loop ends."""
        self.stop_accepting()
        self._cut_all = True
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def active(self) -> int:
        with self._lock:
            return len(self._splices)

    # -- the loop ---------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _call(self, fn) -> None:
        """Run fn in the loop's thread (the selector is the loop's alone) and wait for it."""
        if self._thread is None or not self._thread.is_alive() \
                or threading.current_thread() is self._thread:
            fn()
            return
        done = threading.Event()
        self._calls.append((fn, done))
        self._wake()
        done.wait(5)

    def _close_listener(self) -> None:
        assert self._sock is not None
        try:
            self._sel.unregister(self._sock)
        except (KeyError, ValueError):
            pass
        self._sock.close()
        try:
            if self.public_path.is_socket():
                self.public_path.unlink()
        except FileNotFoundError:
            pass

    def _loop(self) -> None:
        next_sweep = time.monotonic() + 1.0
        backoff_until = 0.0
        try:
            while not self._stop.is_set():
                timeout = max(0.0, min(next_sweep, backoff_until or next_sweep) - time.monotonic())
                for key, events in self._sel.select(timeout):
                    obj = key.fileobj
                    if obj == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except OSError:
                            pass
                        while self._calls:
                            fn, done = self._calls.popleft()
                            try:
                                fn()
                            finally:
                                done.set()
                    elif obj is self._sock:
                        if time.monotonic() >= backoff_until and not self._accept_some():
                            backoff_until = time.monotonic() + 0.05
                    elif isinstance(key.data, _Splice):
                        self._pump(key.data, obj, events)  # type: ignore[arg-type]
                if time.monotonic() >= next_sweep:
                    self._sweep()
                    next_sweep = time.monotonic() + 1.0
                if backoff_until and time.monotonic() >= backoff_until:
                    backoff_until = 0.0
        except Exception:   # never silently: and the daemon's health check sees it gone
            log.exception("the public socket's loop failed")
            raise
        finally:
            if self._cut_all:
                for s in list(self._splices):
                    self._drop(s)
            self._sel.close()

    def _accept_some(self, at_most: int = 512) -> bool:
        """Accept what waits (at most at_most, then the others get a turn). False when out of
        descriptors (the caller backs off briefly; the longest-idle connection went)."""
        assert self._sock is not None
        for _ in range(at_most):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._quiet.say(logging.ERROR, "emfile", f"accept on {self.public_path}: "
                                    f"{e.strerror}; closing the longest-idle connection")
                    self._shed(None)
                    return False
                if e.errno == errno.ECONNABORTED:
                    continue
                self._quiet.say(logging.ERROR, "accept", f"accept on {self.public_path}: {e}")
                return True
            self._handle(conn)
        return True

    def _handle(self, conn: socket.socket) -> None:
        try:
            pid, uid, gid = peer_credentials(conn)
        except OSError as e:
            self._quiet.say(logging.WARNING, "nocred",
                            f"refused a connection whose credentials cannot be read: {e}")
            conn.close()
            self.refused += 1
            return
        if uid not in self.allowed:
            self._quiet.say(logging.WARNING, f"refused-{uid}",
                            f"refused connection from pid {pid} uid {uid} gid {gid} (allowed "
                            f"uids: {', '.join(map(str, sorted(self.allowed)))})")
            conn.close()
            self.refused += 1
            return
        if uid != 0 and self._by_uid[uid] >= self.per_uid:
            self._quiet.say(logging.WARNING, f"cap-{uid}", f"refused connection from pid {pid} "
                            f"uid {uid}: it holds {self.per_uid} connections already")
            conn.close()
            self.refused += 1
            return
        if len(self._splices) >= self.max_conns and not (uid == 0 and self._shed(None)):
            self._quiet.say(logging.WARNING, "full", f"refused connection from pid {pid} uid "
                            f"{uid}: {self.max_conns} connections open")
            conn.close()
            self.refused += 1
            return
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        path = self.routes.get(uid, self.private_path)
        try:
            up.settimeout(1.0)
            up.connect(str(path))
        except OSError as e:
            self._quiet.say(logging.ERROR, "upstream",
                            f"cannot reach the gRPC server at {path}: {e}")
            up.close()
            conn.close()
            return
        conn.setblocking(False)
        up.setblocking(False)
        s = _Splice(conn, up, uid, str(pid))
        with self._lock:
            self._splices[s] = None
        self._by_uid[uid] += 1
        self.served += 1
        self._sel.register(conn, selectors.EVENT_READ, s)
        self._sel.register(up, selectors.EVENT_READ, s)
        log.debug("connection from pid %d uid %d", pid, uid)

    # -- splicing ---------------------------------------------------------------------------
    def _pump(self, s: _Splice, sock: socket.socket, events: int) -> None:
        if s.closed:
            return
        if events & selectors.EVENT_WRITE and not self._flush(s, sock):
            return
        if events & selectors.EVENT_READ:
            dst = s.other(sock)
            if dst in s.pending:        # the other side is full: wait for it
                return
            try:
                data = sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(s)
                return
            if not data:
                self._drop(s)           # either side's EOF ends the pair (gRPC has no half-close)
                return
            s.active = time.monotonic()
            if sock is s.down:
                s.heard = True
            self._send(s, dst, data)

    def _send(self, s: _Splice, dst: socket.socket, data: bytes) -> None:
        try:
            n = dst.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._drop(s)
            return
        if n < len(data):
            s.pending[dst] = data[n:]
            self._interest(s)

    def _flush(self, s: _Splice, dst: socket.socket) -> bool:
        data = s.pending.pop(dst, b"")
        if data:
            self._send(s, dst, data)
            if s.closed:
                return False
        self._interest(s)
        return True

    def _interest(self, s: _Splice) -> None:
        """Read a side unless what it sent still waits; write a side while something waits."""
        registered = self._sel.get_map()
        for sock in (s.down, s.up):
            ev = 0 if s.other(sock) in s.pending else selectors.EVENT_READ
            if sock in s.pending:
                ev |= selectors.EVENT_WRITE
            if ev and sock in registered:
                self._sel.modify(sock, ev, s)
            elif ev:
                self._sel.register(sock, ev, s)
            elif sock in registered:
                self._sel.unregister(sock)

    def _drop(self, s: _Splice) -> None:
        if s.closed:
            return
        s.closed = True
        for sock in (s.down, s.up):
            try:
                self._sel.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        with self._lock:
            self._splices.pop(s, None)
        self._by_uid[s.uid] -= 1
        if self._by_uid[s.uid] <= 0:
            del self._by_uid[s.uid]

    def _shed(self, uid: int | None) -> bool:
        """Close the longest-idle connection (of uid, if given; root's last). True if one
        went."""
        pick = [s for s in self._splices if uid is None or s.uid == uid]
        if not pick:
            return False
        victim = min(pick, key=lambda s: (s.uid == 0, s.active))
        self._quiet.say(logging.WARNING, "shed", f"closed an idle connection of pid {victim.who} "
                        f"uid {victim.uid} to make room")
        self.shed += 1
        self._drop(victim)
        return True

    def _sweep(self) -> None:
        now = time.monotonic()
        for s in list(self._splices):
            quiet = now - s.active
            if (not s.heard and quiet > self.silent_s) or quiet > self.idle_s:
                self._quiet.say(logging.INFO, "idle", f"closed a connection of pid {s.who} "
                                f"uid {s.uid}: silent for {quiet:.0f} s")
                self._drop(s)
