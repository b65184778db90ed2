"""Python's garbage collector during a run: its time, summed by a gc callback for the counters around each task,
and the objects a run starts with kept out of its full collections.

A collection stops every thread of the process (it holds the interpreter lock), the task thread's kernel launches
among them, and a full one scans every object of the process (torch's, Dask's, the user's; its cost is in
docs/performance.md, "Where a swapped step waits"). Frozen (gc.freeze) from a run's start to its end, those objects
are not scanned, and a full collection scans only what the run made since. The callback only adds to module
globals: a collection can start inside any allocation, a lock's holder included.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_started = 0
_total = 0


def _timed(phase: str, info: dict[str, Any]) -> None:
    global _started, _total
    if phase == "start":
        _started = time.perf_counter_ns()
    else:
        _total += time.perf_counter_ns() - _started


def install() -> None:
    """Start summing this process's collections (once; later calls do nothing)."""
    if _timed not in gc.callbacks:
        gc.callbacks.append(_timed)


def collected_ns() -> int:
    """Nanoseconds this process has spent collecting since install()."""
    return _total


def freeze() -> bool:
    """Keep every object alive now out of later collections; False, and nothing done, where something else (the
    user, another run of this process) froze objects already: unfreeze would let theirs go too."""
    if gc.get_freeze_count():
        return False
    gc.freeze()
    return True


def unfreeze(froze: bool) -> None:
    """Undo freeze where it froze (its objects are collected as any others again)."""
    if froze:
        gc.unfreeze()


@contextmanager
def frozen() -> Iterator[None]:
    """freeze for the block."""
    froze = freeze()
    try:
        yield
    finally:
        unfreeze(froze)
