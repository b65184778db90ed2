"""Measures Dask's cost per task on the live cluster: steps per task and the simulator's task cost come from it."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

from distributed import Client, get_worker

from harmony.runtime.handoff import FinishedKeys, LocalResult, receive
from harmony.runtime.measure import this_machine
from harmony.runtime.worker import wait_for_warmup
from harmony.tasks.simulator import Hardware

logger = logging.getLogger("harmony")

CHAIN = 24
FINISHED = FinishedKeys()  # on a worker: the calibration tasks that have run there


def _nothing(index: int, previous: LocalResult | None = None) -> int:
    """An empty task that, like a training task, first checks that the task before it on its worker has run."""
    receive(previous, FINISHED, Counter())
    FINISHED.add(str(get_worker().get_current_task()))
    return index


def task_cost(client: Client, workers: dict[str, str], chain: int = CHAIN) -> float:
    """Seconds one task adds to a device's time: a chain of empty tasks, each naming the one before, is
    submitted at once to each device worker as the driver submits a step's tasks on one device (no scheduler
    edge between them, run in submission order, see handoff), and the slowest worker's time to finish it is
    divided by its length.

    What it counts is the scheduler's transitions, the worker's execution and the results' reports, task
    after task; on a 2-core machine about 1 ms with the run's streams unbatched (batching.py), against about
    2 ms when each task waits at the scheduler for the one before and 11 ms for one task's round trip from
    the driver."""
    client.run(wait_for_warmup)
    costs = []
    for address in workers.values():
        for measured in (False, True):
            started = time.perf_counter()
            future = client.submit(_nothing, 0, workers=[address], pure=False, priority=0)
            futures = [future]
            for index in range(1, chain):
                future = client.submit(_nothing, index, LocalResult(future.key), workers=[address], pure=False,
                                       priority=-index)
                futures.append(future)
            future.result()
            if measured:
                costs.append((time.perf_counter() - started) / chain)
            del futures
    return max(costs)


def measured_hardware(client: Client, workers: dict[str, str]) -> Hardware:
    """This machine as the simulator sees it, with the task cost measured on the cluster the run will use."""
    cost = task_cost(client, workers)
    logger.info("task cost on this cluster: %.1f ms per task of a chain", cost * 1e3)
    return dataclasses.replace(this_machine(), task_overhead=cost)
