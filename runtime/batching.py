"""Dask's message batching between the driver, the scheduler and the device workers, turned off for a run.

Dask batches the small messages on its streams (a worker's task reports, the scheduler's instructions to a
worker and the client's submissions each wait a few milliseconds for company), which suits many independent
tasks. A Harmony step is a chain of dependent tasks on a device, each link waiting for one message each
way, so the batching adds several milliseconds to every task (docs/performance.md, "Message batching"). A
run sends its messages at once and puts back what it found when it ends, on a
user's cluster, which outlives it. Only a run's own streams change: those of its client and of the
workers it uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from distributed import Client

UNBATCHED = 0.0


def _swap(stream: Any, seconds: float) -> float | None:
    """Set a batched stream's send interval; returns the one it had (None where there is no such stream)."""
    if stream is None or not hasattr(stream, "interval"):
        return None
    previous, stream.interval = stream.interval, seconds
    return previous


def _swap_worker_interval(dask_worker: Any, seconds: float) -> float | None:
    """On a worker: its stream to the scheduler."""
    return _swap(getattr(dask_worker, "batched_stream", None), seconds)


def _swap_scheduler_intervals(dask_scheduler: Any, intervals: dict[str, float]) -> dict[str, float]:
    """On the scheduler: its streams to the named workers and clients; returns the intervals they had."""
    previous = {}
    for address, seconds in intervals.items():
        stream = dask_scheduler.stream_comms.get(address) or dask_scheduler.client_comms.get(address)
        had = _swap(stream, seconds)
        if had is not None:
            previous[address] = had
    return previous


@contextlib.contextmanager
def unbatched(client: Client, workers: list[str], restore: bool) -> Iterator[None]:
    """Send every message at once between client, scheduler and workers while the block runs; with restore,
    put the intervals back afterwards (a cluster that is stopped at the end needs nothing put back)."""
    on_workers = client.run(_swap_worker_interval, seconds=UNBATCHED, workers=workers)
    on_scheduler = client.run_on_scheduler(
        _swap_scheduler_intervals, intervals=dict.fromkeys([*workers, client.id], UNBATCHED)
    )
    on_client = _swap(getattr(client, "scheduler_comm", None), UNBATCHED)
    try:
        yield
    finally:
        if restore:
            with contextlib.suppress(Exception):
                alive = client.scheduler_info()["workers"]  # a worker that died meanwhile would be waited for
                for address, seconds in on_workers.items():
                    if seconds is not None and address in alive:
                        client.run(_swap_worker_interval, seconds=seconds, workers=[address])
                client.run_on_scheduler(_swap_scheduler_intervals, intervals=on_scheduler)
                if on_client is not None:
                    _swap(client.scheduler_comm, on_client)
