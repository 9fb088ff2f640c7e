"""A bag of descriptors: more than one message can carry (the kernel's SCM_MAX_FD is 253) as one
descriptor, the way agent/src/fdbag.h makes and reads it. The bag is one end of a SOCK_SEQPACKET
pair whose queue holds them, at most BATCH a message (one byte each); the other end is closed
once they are in, so the bag reads to its end. Held GPU memory past HOLD_DIRECT allocations
travels this way (agent/PROTOCOL.md, "Held memory"): `detach hold`'s reply, `resume held=N`,
`hold N` and the copier's go.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
from collections.abc import Iterator, Sequence

BATCH = 240
SO_PASSPIDFD = 76     # Linux 6.5 (<asm-generic/socket.h>): a pidfd with every message read
SCM_PIDFD = 0x04
HOLD_DIRECT = 200     # held descriptors that go in the message itself (agent.h's HOLD_DIRECT)


class BagError(OSError):
    """A bag that cannot be made, or holds not what it should (an OSError: a transport's
    failure to whoever sends or receives through it)."""


def pack(fds: Sequence[int]) -> int:
    """A bag holding duplicates of fds (the caller keeps and closes its own): its descriptor,
    close-on-exec, the caller's to send and close. Never blocks."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)   # (socket.send_fds drops its flags before Python 3.12)
    try:
        for at in range(0, len(fds), BATCH):
            try:
                sent = a.sendmsg([b"h"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                          array.array("i", fds[at:at + BATCH]))])
            except BlockingIOError as e:
                raise BagError(f"a bag of {len(fds)} descriptors: its queue is full") from e
            except OSError as e:   # ETOOMANYREFS: this user's descriptors in flight
                raise BagError(f"a bag of {len(fds)} descriptors: {e.strerror or e}") from e
            if sent != 1:
                raise BagError(f"a bag of {len(fds)} descriptors: nothing went in")
    except BaseException:
        b.close()
        raise
    finally:
        a.close()
    return b.detach()


def _fds(anc: list[tuple[int, int, bytes]]) -> list[int]:
    """The SCM_RIGHTS descriptors of one message; any other descriptor the kernel put in it
    (SCM_PIDFD: its maker asked for one with every message) closed."""
    out = array.array("i")
    for level, kind, data in anc:
        if level != socket.SOL_SOCKET or kind not in (socket.SCM_RIGHTS, SCM_PIDFD):
            continue
        got = array.array("i")
        got.frombytes(data[:len(data) - len(data) % got.itemsize])
        if kind == SCM_PIDFD:
            for fd in got:
                os.close(fd)
        else:
            out.extend(got)
    return list(out)


def unpack(bag: int, want: int) -> list[int]:
    """Exactly want descriptors out of bag (someone else's: nothing in it is trusted), in the
    order they went in, not inheritable. BagError when it holds another number, or is no bag
    (whatever came out is closed). The bag stays the caller's to close. Never blocks."""
    fds: list[int] = []
    try:
        mine = os.dup(bag)
        try:
            s = socket.socket(fileno=mine)
        except OSError as e:   # (it does not close what it was given)
            os.close(mine)
            raise BagError(f"the bag of held descriptors is not a socket: {e}") from e
        with s:
            if s.family != socket.AF_UNIX or s.type != socket.SOCK_SEQPACKET:
                raise BagError("the bag of held descriptors is not a SOCK_SEQPACKET socket")
            try:   # its maker may have asked for a pidfd with every message read
                s.setsockopt(socket.SOL_SOCKET, SO_PASSPIDFD, 0)
            except OSError:
                pass   # a kernel before 6.5: there is no such thing
            for _ in range(want + 1):   # one descriptor a message at least: not for ever
                try:   # (socket.recv_fds drops its flags before Python 3.12)
                    data, anc, flags, _ = s.recvmsg(1, socket.CMSG_SPACE(253 * 4),
                                                    socket.MSG_DONTWAIT |
                                                    socket.MSG_CMSG_CLOEXEC)
                except BlockingIOError:
                    break               # its other end still open: what is queued
                got = _fds(anc)
                for fd in got:
                    os.set_inheritable(fd, False)
                fds.extend(got)
                if len(fds) > want:
                    raise BagError(f"the bag holds more than {want} descriptors")
                if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                    raise BagError("the bag of held descriptors was cut short (past this "
                                   "process's limit on open files?)")
                if not data and not got:
                    break               # its end
            else:
                raise BagError(f"the bag holds more than {want} messages")
        if len(fds) != want:
            raise BagError(f"the bag holds {len(fds)} descriptors, not {want}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


@contextlib.contextmanager
def carried(held: Sequence[int]) -> Iterator[list[int]]:
    """The descriptors that carry held memory in a message: held itself, or past HOLD_DIRECT
    one bag of them (closed after the block). BagError when none can be made."""
    if len(held) <= HOLD_DIRECT:
        yield list(held)
        return
    bag = pack(held)
    try:
        yield [bag]
    finally:
        os.close(bag)
