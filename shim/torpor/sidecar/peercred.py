"""The public socket: who is calling is checked here, because gRPC does not check it.

gRPC's Unix-socket server accepts anyone who can open the socket file. torpord therefore serves
gRPC on a private socket in a 0700 directory and listens itself on the public socket: each
connection's SO_PEERCRED (the caller's pid, uid and gid at connect time, from the kernel) is
read, and only the allowed uids (root and config socket_owner_uid) are spliced, byte for byte,
to the private gRPC socket. Anyone else is closed at once and logged.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import threading
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred: pid_t pid; uid_t uid; gid_t gid
_CHUNK = 256 * 1024


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected conn."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def bind_unix(path: Path, mode: int, owner_uid: int = -1) -> socket.socket:
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
    sock.listen(128)
    return sock


class _Splice:
    """One allowed connection and its upstream: two pump threads, closed when both end."""

    def __init__(self, proxy: "PeerCredProxy", down: socket.socket, up: socket.socket, who: str):
        self.proxy, self.down, self.up, self.who = proxy, down, up, who
        self._left = 2
        self._lock = threading.Lock()

    def start(self) -> None:
        for src, dst, name in ((self.down, self.up, "in"), (self.up, self.down, "out")):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True,
                             name=f"splice-{name}-{self.who}").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        clean = True
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            clean = False
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)       # pass the EOF on
                if not clean:
                    src.shutdown(socket.SHUT_RDWR)  # and wake the other pump on a failure
                    dst.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            with self._lock:
                self._left -= 1
                last = self._left == 0
            if last:
                self.close()

    def abort(self) -> None:
        for s in (self.down, self.up):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.down.close()
        self.up.close()
        self.proxy._forget(self)


class PeerCredProxy:
    """Listens on public_path; splices allowed peers to the gRPC server at private_path."""

    def __init__(self, public_path: Path, private_path: Path, allowed_uids: Iterable[int], *,
                 mode: int = 0o660, owner_uid: int = -1):
        self.public_path, self.private_path = Path(public_path), Path(private_path)
        self.allowed = frozenset(int(u) for u in allowed_uids)
        self.mode, self.owner_uid = mode, owner_uid
        self.refused = 0
        self.served = 0
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._splices: set[_Splice] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._sock = bind_unix(self.public_path, self.mode, self.owner_uid)
        self._thread = threading.Thread(target=self._accept_loop, name="peercred-accept",
                                        daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        """Close the public socket (and remove its file); connections already spliced go on."""
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
            try:
                if self.public_path.is_socket():
                    self.public_path.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """stop_accepting() and cut every spliced connection."""
        self.stop_accepting()
        with self._lock:
            splices = list(self._splices)
        for s in splices:
            s.abort()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def active(self) -> int:
        with self._lock:
            return len(self._splices)

    def _forget(self, splice: _Splice) -> None:
        with self._lock:
            self._splices.discard(splice)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not self._stop.is_set():
                for key, _ in sel.select():
                    if key.data == "wake" or self._stop.is_set():
                        return
                    try:
                        conn, _addr = self._sock.accept()
                    except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                        continue
                    except OSError as e:
                        log.error("accept on %s failed: %s", self.public_path, e)
                        continue
                    self._handle(conn)
        finally:
            sel.close()

    def _handle(self, conn: socket.socket) -> None:
        try:
            pid, uid, gid = peer_credentials(conn)
        except OSError as e:
            log.warning("refused a connection whose credentials cannot be read: %s", e)
            conn.close()
            self.refused += 1
            return
        if uid not in self.allowed:
            log.warning("refused connection from pid %d uid %d gid %d (allowed uids: %s)",
                        pid, uid, gid, ", ".join(map(str, sorted(self.allowed))))
            conn.close()
            self.refused += 1
            return
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            up.connect(str(self.private_path))
        except OSError as e:
            log.error("cannot reach the gRPC server at %s: %s", self.private_path, e)
            up.close()
            conn.close()
            return
        log.debug("connection from pid %d uid %d", pid, uid)
        self.served += 1
        splice = _Splice(self, conn, up, f"{pid}")
        with self._lock:
            self._splices.add(splice)
        splice.start()
