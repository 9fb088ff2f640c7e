"""The public socket: who is calling is checked here, because gRPC does not check it.

gRPC's Unix-socket server accepts anyone who can open the socket file. torpord therefore serves
gRPC on private sockets in a 0700 directory and listens itself on the public socket: only
connections whose SO_PEERCRED (pid, uid, gid at connect time, from the kernel) has an allowed
uid (root, config socket_owner_uid) are spliced, byte for byte, to a private gRPC socket (root
to its own, `routes`: no flood of another uid's calls queues in front of root's). Anyone else
is closed at once.

One thread does it all, whatever the number of connections: a selector loop accepts, refuses,
splices (non-blocking, a bounded buffer each way, reading paused while the other side is
full) and times out. Bounded, so that no caller can take torpord down (issue 18, item 3):
- at most room() spliced connections (max_conns, fewer when the descriptor limit leaves no
  room for three each after RESERVE_FDS) and per_uid for any uid but root; past them a
  non-root connection is refused, and root's takes the place of the longest-idle one;
- a connection that has sent nothing within `silent_s`, or nothing either way within `idle_s`,
  is closed (a gRPC client sends its preface at once);
- accept never dies and never waits: out of descriptors (EMFILE, ENFILE), the longest-idle
  connections go (down to room()) and the listener rests 50 ms; the gRPC side is connected
  without blocking (its backlog full: the caller is refused, not waited for);
- repeated log lines (refusals, shedding) are summed up, one line per key every LOG_EVERY_S.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import resource
import selectors
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Iterable, Mapping

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred: pid_t pid; uid_t uid; gid_t gid
_CHUNK = 64 * 1024            # a splice holds at most this much each way
_NO_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
BACKLOG = 4096                # a flood of refused connects must not fill it before root's
MAX_CONNS = 1024
PER_UID = 128
RESERVE_FDS = 128             # descriptors left to gRPC, the handlers, CRIU and the logs
SILENT_S = 10.0
IDLE_S = 3600.0
LOG_EVERY_S = 10.0


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected conn."""
    return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def bind_unix(path: Path, mode: int, owner_uid: int = -1, backlog: int = 128) -> socket.socket:
    """A listening Unix socket at path (a stale one is replaced) with this mode (and owner)."""
    with contextlib.suppress(FileNotFoundError):
        if path.is_socket():
            path.unlink()
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
        self.heard = self.closed = False                 # heard: the caller has sent something
        self.active = time.monotonic()

    def other(self, s: socket.socket) -> socket.socket:
        return self.up if s is self.down else self.down


class PeerCredProxy:
    """Listens on public_path; splices allowed peers to the gRPC server at private_path (or at
    routes[uid] for a uid routed elsewhere). refused, served, shed: counts since start."""

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
        self.refused = self.served = self.shed = 0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop, self._cut_all = threading.Event(), False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._splices: dict[_Splice, None] = {}       # insertion order: oldest first
        self._by_uid: collections.Counter[int] = collections.Counter()
        self._sel, self._quiet = selectors.DefaultSelector(), _Quiet()
        self._lock = threading.Lock()                 # _splices, for active() and close()
        self._unlisten, self._unlistened = threading.Event(), threading.Event()

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
        if self._thread is None or not self._thread.is_alive():
            return self._close_listener()
        self._unlisten.set()
        self._wake()
        self._unlistened.wait(5)

    def close(self) -> None:
        """stop_accepting() and cut every spliced connection; the loop ends."""
        self.stop_accepting()
        self._cut_all = True
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def active(self) -> int:
        with self._lock:
            return len(self._splices)

    def room(self) -> int:
        """How many connections may be spliced now: max_conns, and what the descriptor limit
        leaves after RESERVE_FDS (read each time: the limit may be changed under torpord)."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fds = self.max_conns if soft == resource.RLIM_INFINITY else (soft - RESERVE_FDS) // 3
        return max(4, min(self.max_conns, fds))

    # -- the loop ---------------------------------------------------------------------------
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _close_listener(self) -> None:
        """In the loop's thread (the selector is the loop's alone), or when it is gone."""
        if self._sock is None or self._sock.fileno() < 0:
            return
        self._listen(False)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            if self.public_path.is_socket():
                self.public_path.unlink()

    def _listen(self, on: bool) -> None:
        """Watch the listener (again), or rest it: a readable listener that cannot be accepted
        from (out of descriptors) must not spin the loop."""
        if self._sock is None or self._sock.fileno() < 0:
            return
        if on and self._sock not in self._sel.get_map():
            self._sel.register(self._sock, selectors.EVENT_READ, None)
        elif not on and self._sock in self._sel.get_map():
            self._sel.unregister(self._sock)

    def _loop(self) -> None:
        next_sweep, rest_until = time.monotonic() + 1.0, 0.0
        try:
            while not self._stop.is_set():
                if rest_until and time.monotonic() >= rest_until:
                    rest_until = 0.0
                    self._listen(True)
                timeout = max(0.0, min(next_sweep, rest_until or next_sweep) - time.monotonic())
                for key, events in self._sel.select(timeout):
                    obj = key.fileobj
                    if obj == self._wake_r:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 4096)
                        if self._unlisten.is_set():
                            self._close_listener()
                            self._unlistened.set()
                    elif obj is self._sock and not self._accept_some():
                        rest_until = time.monotonic() + 0.05
                        self._listen(False)
                    elif isinstance(key.data, _Splice):
                        self._pump(key.data, obj, events)  # type: ignore[arg-type]
                if time.monotonic() >= next_sweep:
                    self._sweep()
                    next_sweep = time.monotonic() + 1.0
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
        descriptors (the caller rests the listener; the longest-idle connections went)."""
        assert self._sock is not None
        for _ in range(at_most):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                if e.errno in _NO_FDS:
                    self._out_of_fds(f"accept on {self.public_path}: {e.strerror}")
                    return False
                if e.errno != errno.ECONNABORTED:
                    self._quiet.say(logging.ERROR, "accept", f"accept on {self.public_path}: {e}")
                    return True
                continue
            self._handle(conn)
        return True

    def _refuse(self, conn: socket.socket, key: str, text: str) -> None:
        self._quiet.say(logging.WARNING, key, text)
        conn.close()
        self.refused += 1

    def _handle(self, conn: socket.socket) -> None:
        try:
            pid, uid, gid = peer_credentials(conn)
        except OSError as e:
            return self._refuse(conn, "nocred", "refused a connection whose credentials "
                                f"cannot be read: {e}")
        if uid not in self.allowed:
            return self._refuse(conn, f"refused-{uid}", f"refused connection from pid {pid} "
                                f"uid {uid} gid {gid} (allowed uids: "
                                f"{', '.join(map(str, sorted(self.allowed)))})")
        if uid != 0 and self._by_uid[uid] >= self.per_uid:
            return self._refuse(conn, f"cap-{uid}", f"refused connection from pid {pid} uid "
                                f"{uid}: it holds {self.per_uid} connections already")
        room = self.room()
        if len(self._splices) >= room and not (uid == 0 and self._shed(1)):
            return self._refuse(conn, "full", f"refused connection from pid {pid} uid {uid}: "
                                f"{room} connections open")
        up = self._upstream(uid)
        if isinstance(up, str):
            return self._refuse(conn, "up", f"refused connection from pid {pid} uid {uid}: {up}")
        conn.setblocking(False)
        s = _Splice(conn, up, uid, str(pid))
        with self._lock:
            self._splices[s] = None
        self._by_uid[uid] += 1
        self.served += 1
        self._sel.register(conn, selectors.EVENT_READ, s)
        self._sel.register(up, selectors.EVENT_READ, s)
        log.debug("connection from pid %d uid %d", pid, uid)

    def _upstream(self, uid: int, retry: bool = True) -> socket.socket | str:
        """A connection to uid's gRPC server, made without waiting, or why there is none. Out
        of descriptors, the longest-idle connections go, and it is tried once more."""
        path, up = self.routes.get(uid, self.private_path), None
        try:
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            up.setblocking(False)
            up.connect(str(path))          # a Unix socket: done at once, or EAGAIN (backlog full)
            return up
        except OSError as e:
            if up is not None:
                up.close()
            if retry and e.errno in _NO_FDS and self._out_of_fds(f"{path}: {e}"):
                return self._upstream(uid, retry=False)
            return f"cannot reach the gRPC server at {path}: {e}"

    def _out_of_fds(self, what: str) -> bool:
        """Shed the longest-idle connections, one at least, down to room(); True if one went."""
        n = max(1, len(self._splices) - self.room())
        self._quiet.say(logging.ERROR, "emfile", f"{what}; closing the {n} longest-idle "
                        "connection(s)")
        return self._shed(n) > 0

    # -- splicing ---------------------------------------------------------------------------
    def _pump(self, s: _Splice, sock: socket.socket, events: int) -> None:
        if s.closed or (events & selectors.EVENT_WRITE and not self._flush(s, sock)):
            return
        dst = s.other(sock)
        if not events & selectors.EVENT_READ or dst in s.pending:   # dst full: wait for it
            return
        try:
            data = sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(s)           # either side's EOF ends the pair (gRPC has no half-close)
            return
        s.active = time.monotonic()
        s.heard = s.heard or sock is s.down
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
        """Write what waits for dst; False when that ended the pair."""
        if dst in s.pending:
            self._send(s, dst, s.pending.pop(dst))
        if not s.closed:
            self._interest(s)
        return not s.closed

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
            if sock in self._sel.get_map():
                self._sel.unregister(sock)
            sock.close()
        with self._lock:
            self._splices.pop(s, None)
        self._by_uid -= collections.Counter((s.uid,))     # and a uid at 0 is gone

    def _shed(self, n: int) -> int:
        """Close the n longest-idle connections (root's last); how many went."""
        victims = sorted(self._splices, key=lambda s: (s.uid == 0, s.active))[:n]
        for v in victims:
            self._quiet.say(logging.WARNING, "shed", f"closed an idle connection of pid {v.who} "
                            f"uid {v.uid} to make room")
            self._drop(v)
        self.shed += len(victims)
        return len(victims)

    def _sweep(self) -> None:
        now = time.monotonic()
        for s in list(self._splices):
            quiet = now - s.active
            if (not s.heard and quiet > self.silent_s) or quiet > self.idle_s:
                self._quiet.say(logging.INFO, "idle", f"closed a connection of pid {s.who} "
                                f"uid {s.uid}: silent for {quiet:.0f} s")
                self._drop(s)
