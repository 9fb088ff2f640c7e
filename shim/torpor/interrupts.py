"""Holding off Ctrl-C and SIGTERM where an interruption would do harm.

`torpor` turns SIGINT, SIGTERM and SIGHUP into KeyboardInterrupt so that a phase can roll
back. Inside a CRIU dump or restore, or a rollback, an interruption would instead kill CRIU
half-way (after it ended the program, say) or stop a rollback: those blocks defer the signals,
which are delivered when the block ends. CRIU inherits the mask, so a terminal's Ctrl-C does
not reach it either.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are delivered to the main thread only: nothing to hold here
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
