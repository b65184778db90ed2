"""Results a task reads from an earlier task on the same worker, with no edge through the scheduler.

When a task's producer runs on the same device worker, Dask would hold the task at the scheduler until
the producer's completion reached it and then send it over: a round trip per task (docs/performance.md,
"Tasks on one device hand results over in the worker"). Instead the driver submits the task without that edge,
naming the producer's key (``LocalResult``); the worker queues it at once and runs its tasks one at a
time in submission order (Dask priority), so the producer has finished by the time the task starts, and
its result is in the worker's memory, held there by the driver's future until its last reader finishes.
Anything the producer itself waits for through the scheduler, the task waits for too (the driver passes
those edges on), so a task never becomes runnable on the worker before its local producers do.

Two things can still happen, and are handled: a task comes early (a message batch delivered it before its
producer): it goes back to the scheduler and comes again behind the producer; and a result that another
worker also holds (it read it) loses its copy here to Dask's active memory manager, which does not know of
the local reader: the task fetches it from the other copy.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from distributed import Future, Reschedule, get_client, get_worker

MAX_EARLY_STARTS = 1000
RECENT_KEYS = 65_536


class FinishedKeys:
    """The keys of the last RECENT_KEYS tasks a worker finished (bounded: a run may have millions of tasks).

    A task that waits for one of them starts a few tasks after it, and the result itself stays in the
    worker's memory while a task waits for it; these keys only tell a result dropped by Dask's memory
    manager from a task that has not run yet.
    """

    def __init__(self, capacity: int = RECENT_KEYS) -> None:
        self.capacity = capacity
        self._keys: dict[str, None] = {}

    def add(self, key: str) -> None:
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            del self._keys[next(iter(self._keys))]

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)


@dataclass(frozen=True)
class LocalResult:
    """The result of the task with this key, which ran (or runs first) on the worker that reads it."""

    key: str


class LostResult(RuntimeError):
    """A local producer failed, or never ran on this worker."""


def receive(value: Any, finished: FinishedKeys, early_starts: Counter[str]) -> Any:
    """value, with a LocalResult replaced by the result it names.

    finished holds the keys of the tasks this worker has run to completion. A producer it has not (it came
    later, or went back to the scheduler itself) means the task came early: Reschedule. early_starts counts
    those returns per producer, so that a producer that never comes is an error, not an endless loop.
    """
    if not isinstance(value, LocalResult):
        return value
    worker = get_worker()
    if value.key in worker.data:
        early_starts.pop(value.key, None)
        return worker.data[value.key]
    if value.key in finished:
        return _fetch(value.key)
    wait_for(value, finished, early_starts)
    return None


def wait_for(value: Any, finished: FinishedKeys, early_starts: Counter[str]) -> None:
    """Return if value is not a LocalResult or its task has finished on this worker; else send the calling task
    back to the scheduler (see receive), or fail if its producer failed or never came."""
    if not isinstance(value, LocalResult):
        return
    worker = get_worker()
    if value.key in finished or value.key in worker.data:
        early_starts.pop(value.key, None)
        return
    state = worker.state.tasks.get(value.key)
    if state is not None and state.state == "error":
        raise LostResult(f"{value.key}, which this task waits for, failed")
    early_starts[value.key] += 1
    if early_starts[value.key] > MAX_EARLY_STARTS:
        raise LostResult(f"{value.key}, which this task waits for, never ran on this worker")
    raise Reschedule()


def _fetch(key: str) -> Any:
    """A finished result whose copy here was dropped, from the worker that still holds it."""
    client = get_client()
    future = Future(key, client)
    try:
        return future.result()
    finally:
        future.release()
