"""Bounded thread pools: numpy, zstd, hashing and file I/O all release the GIL, so threads give real parallelism."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def num_threads(configured: int) -> int:
    """`codec.threads`: 0 means one per core."""
    return configured or os.cpu_count() or 1


def ordered_map(fn: Callable[[T], R], items: Iterable[T], workers: int) -> Iterator[R]:
    """`fn` over `items` on `workers` threads, results in input order, at most 2 x workers in flight
    (so memory stays bounded by a few pieces however many there are)."""
    pending: deque[Future] = deque()
    with ThreadPoolExecutor(workers) as pool:
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
