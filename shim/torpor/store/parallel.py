"""Ordered parallel maps with bounded work in flight: memory stays at `depth` chunks however
large a file is, and results come back in input order, so they can be streamed."""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(pool: concurrent.futures.Executor, fn: Callable[[T], R], items: Iterable[T],
                depth: int, inline: Callable[[T], bool] | None = None) -> Iterator[R]:
    """fn over items on pool, at most depth at a time, yielding results in order. Items are
    pulled lazily (a file is read as its chunks are handed out); a consumer that stops early
    or an error cancels what has not started. Items for which inline is true are done by the
    caller's thread as they come: work too small to be worth a trip through the pool (a
    second checkpoint's thousands of chunks known by fingerprint)."""
    pending: collections.deque[concurrent.futures.Future[R]] = collections.deque()
    try:
        for item in items:
            if inline is not None and inline(item):
                done: concurrent.futures.Future[R] = concurrent.futures.Future()
                try:
                    done.set_result(fn(item))
                except Exception as e:
                    done.set_exception(e)
                pending.append(done)
            else:
                pending.append(pool.submit(fn, item))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
        concurrent.futures.wait(pending)
