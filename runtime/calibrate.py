"""Measures Dask's cost per task on the live cluster: steps per task and the simulator's task cost come from it."""

from __future__ import annotations

import dataclasses
import logging
import time

from distributed import Client

from harmony.runtime.measure import this_machine
from harmony.runtime.worker import wait_for_warmup
from harmony.tasks.simulator import Hardware

logger = logging.getLogger("harmony")

CHAIN = 24


def _nothing(index: int, previous: int | None = None) -> int:
    return index


def task_cost(client: Client, workers: dict[str, str], chain: int = CHAIN) -> float:
    """Seconds one task adds to a device's time: a chain of empty tasks, each reading the one before, is
    submitted at once to each device worker, as the driver submits a step's dependent tasks ahead of time,
    and the slowest worker's time to finish it is divided by its length.

    What it counts is the scheduler's transitions, the worker's execution and the results' reports, task
    after task; on a 2-core machine about 2 ms with the run's streams unbatched (batching.py), 6 ms with
    Dask's batching, against about 11 ms for one task's round trip from the driver and 1.6 ms per task when
    the tasks are independent (they are not, in a training step)."""
    client.run(wait_for_warmup)
    costs = []
    for address in workers.values():
        for measured in (False, True):
            started = time.perf_counter()
            future = client.submit(_nothing, 0, workers=[address], pure=False)
            for index in range(1, chain):
                future = client.submit(_nothing, index, future, workers=[address], pure=False)
            future.result()
            if measured:
                costs.append((time.perf_counter() - started) / chain)
    return max(costs)


def measured_hardware(client: Client, workers: dict[str, str]) -> Hardware:
    """This machine as the simulator sees it, with the task cost measured on the cluster the run will use."""
    cost = task_cost(client, workers)
    logger.info("task cost on this cluster: %.1f ms per task of a chain", cost * 1e3)
    return dataclasses.replace(this_machine(), task_overhead=cost)
