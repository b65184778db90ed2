"""The process's time in Python's garbage collector, summed by a gc callback, for the counters around each task.

A collection stops every thread of the process (it holds the interpreter lock), the task thread's kernel launches
among them, and a full one over a worker's few hundred thousand objects takes a tenth of a second or more. The
callback only adds to module globals: a collection can start inside any allocation, a lock's holder included.
"""

from __future__ import annotations

import gc
import time
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
