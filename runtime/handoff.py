"""Results a task reads from an earlier task on the same worker, with no edge through the scheduler.

When a task's producer runs on the same device worker, Dask would hold the task at the scheduler until
the producer's completion reached it and then send it over: a round trip per task (docs/performance.md,
"Tasks on one device hand results over in the worker"). Instead the driver submits the task without that edge,
naming the producer's key (``LocalResult``); the worker queues it at once and runs its tasks one at a
time in submission order (Dask priority), so the producer has finished by the time the task starts, and
its result is in the worker's memory, held there by the driver's future until its last reader finishes.
Anything the producer itself waits for through the scheduler, the task waits for too (the driver passes
those edges on), so a task never becomes runnable on the worker before its local producers do.

A task can still come early (a message batch delivered it before its producer, or the producer itself went back
because its own producer had not come yet, or it waits here for data from another machine): it goes back to the
scheduler and comes again behind the producer. How long that takes depends on the other machines and the
scheduler's load, not on a count of returns, so a producer counts as lost only after PATIENCE seconds unseen.

A result must stay in its worker's memory until its local readers ran, so Dask's active memory manager, which
would drop a copy another worker also holds, does not run meanwhile (runtime.replicas); a result missing all
the same is a LostResult, never a wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from distributed import Reschedule, get_worker

PATIENCE = 120.0
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


def receive(value: Any, finished: FinishedKeys, early_starts: dict[str, float]) -> Any:
    """value, with a LocalResult replaced by the result it names.

    finished holds the keys of the tasks this worker has run to completion. A producer it has not (it came
    later, or went back to the scheduler itself) means the task came early: Reschedule. early_starts holds, per
    producer, when a reader first came before it, so that a producer that never comes is an error, not an
    endless loop.
    """
    if not isinstance(value, LocalResult):
        return value
    worker = get_worker()
    if value.key in worker.data:
        early_starts.pop(value.key, None)
        return worker.data[value.key]
    if value.key in finished:
        raise LostResult(f"{value.key}, which this task reads, ran here but its result is no longer in this "
                         "worker's memory")
    wait_for(value, finished, early_starts)
    return None


def wait_for(value: Any, finished: FinishedKeys, early_starts: dict[str, float]) -> None:
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
    now = time.monotonic()
    since = early_starts.setdefault(value.key, now)
    if now - since > PATIENCE:
        seen = "not known to this worker" if state is None else f"{state.state} here, waiting for " + ", ".join(
            str(dependency.key) for dependency in state.dependencies if dependency.state != "memory")
        raise LostResult(f"{value.key}, which this task waits for, never ran on this worker ({seen})")
    raise Reschedule()
