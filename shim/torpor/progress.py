"""Progress of long phases on stderr, and the per-phase timings that end up in torpor.json."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator, TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def human_rate(nbytes: float, seconds: float) -> str:
    """Bytes per second in decimal GB/s (how PCIe and disks are rated), or MB/s below 1 GB/s."""
    rate = nbytes / max(seconds, 1e-9)
    return f"{rate / 1e9:.1f} GB/s" if rate >= 1e9 else f"{rate / 1e6:.0f} MB/s"


class Progress:
    """Prints one line when a phase starts, a ticker while it runs long, one when it ends.

    `timings` collects seconds per phase name; a phase entered twice adds up.
    """

    def __init__(self, stream: TextIO | None = sys.stderr, tick_s: float = 2.0):
        self.stream = stream
        self.tick_s = tick_s
        self.timings: dict[str, float] = {}

    def say(self, text: str) -> None:
        """One line on the stream. A stream that takes no more lines (stderr a pipe whose
        reader left, a full disk) ends the progress, never the operation: a say() between
        a dump and its seal failed a checkpoint that had ended its program."""
        stream = self.stream
        if stream is not None:
            try:
                print(f"torpor: {text}", file=stream, flush=True)
            except (OSError, ValueError):   # ValueError: a closed file
                self.stream = None

    @contextlib.contextmanager
    def phase(self, name: str, detail: str = "",
              measure: Callable[[], int] | None = None) -> Iterator[None]:
        """Time a phase; measure() (bytes so far) turns the ticker into a rate."""
        self.say(f"{name}: {detail}" if detail else f"{name}...")
        start = time.monotonic()
        stop = threading.Event()

        def ticker() -> None:
            while not stop.wait(self.tick_s):
                elapsed = time.monotonic() - start
                if measure is not None:
                    done = measure()
                    self.say(f"  {name}: {human_bytes(done)} in {elapsed:.0f} s "
                             f"({human_bytes(done / max(elapsed, 1e-9))}/s)")
                else:
                    self.say(f"  {name}: still working, {elapsed:.0f} s")

        thread = None
        if self.stream is not None:
            thread = threading.Thread(target=ticker, name=f"progress-{name}", daemon=True)
            thread.start()
        try:
            yield
        finally:
            stop.set()
            if thread is not None:
                thread.join()
            elapsed = time.monotonic() - start
            self.timings[name] = self.timings.get(name, 0.0) + elapsed
        self.say(f"  {name} done in {elapsed:.2f} s")
