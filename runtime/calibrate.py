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


def task_cost(client: Client, workers: dict[str, str], chain: int = CHAIN) -> tuple[float, float]:
    """Seconds one task adds to a device's time, and CPU seconds it takes from the machine: a chain of empty
    tasks, each naming the one before, is submitted at once to each device worker as the driver submits a
    step's tasks on one device (no scheduler edge between them, run in submission order, see handoff). The
    slowest worker's time to finish it, divided by its length, is the first; the CPU time the driver's process
    (client and, embedded, scheduler) and that worker's process spent meanwhile, per task, the second.

    What it counts is the scheduler's transitions, the worker's execution and the results' reports, task
    after task; on a 2-core machine about 1 ms with the run's streams unbatched (batching.py), against about
    2 ms when each task waits at the scheduler for the one before and 11 ms for one task's round trip from
    the driver; the CPU time about 2.5 ms (1.5 in the driver, 1 in the worker)."""
    client.run(wait_for_warmup)
    latencies, cpu = [], []
    for address in workers.values():
        for measured in (False, True):
            [worker_before] = client.run(time.process_time, workers=[address]).values()
            driver_before = time.process_time()
            started = time.perf_counter()
            future = client.submit(_nothing, 0, workers=[address], pure=False, priority=0)
            futures = [future]
            for index in range(1, chain):
                future = client.submit(_nothing, index, LocalResult(future.key), workers=[address], pure=False,
                                       priority=-index)
                futures.append(future)
            future.result()
            elapsed = time.perf_counter() - started
            driver = time.process_time() - driver_before
            [worker_after] = client.run(time.process_time, workers=[address]).values()
            if measured:
                latencies.append(elapsed / chain)
                cpu.append((driver + worker_after - worker_before) / chain)
            del futures
    return max(latencies), max(cpu)


def measured_hardware(client: Client, workers: dict[str, str], cpu_compute: bool = True) -> Hardware:
    """This machine as the simulator sees it, with the task cost measured on the cluster the run will use;
    the CPU a task takes counts where the devices compute on this machine's cores (cpu_compute)."""
    latency, cpu = task_cost(client, workers)
    logger.info("task cost on this cluster: %.1f ms per task of a chain, %.1f ms of CPU", latency * 1e3, cpu * 1e3)
    return dataclasses.replace(this_machine(), task_overhead=latency, task_cpu=cpu if cpu_compute else 0.0)
