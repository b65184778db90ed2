"""Measures Dask's cost per task on the live cluster, so that steps per task come from measured task time."""

from __future__ import annotations

import dataclasses
import logging
import statistics
import sys
import time

from distributed import Client

from harmony.runtime.measure import this_machine
from harmony.tasks.simulator import Hardware

logger = logging.getLogger("harmony")

ROUND_TRIPS = 12


def _settle() -> None:
    """On a worker: wait until its background imports are done, so they do not disturb what is measured."""
    warmup = sys.modules.get("harmony.runtime.warmup")
    if warmup is not None:
        warmup.wait()


def _nothing(index: int) -> int:
    return index


def task_latency(client: Client, workers: dict[str, str], round_trips: int = ROUND_TRIPS) -> float:
    """Median seconds from submitting an empty task on a device worker to its result reaching the driver.

    That is what one task costs the run beyond its work: the driver's submit, the scheduler's
    transitions, the worker's execution and the report back, one after another as in the driver's loop.
    """
    client.run(_settle)
    samples = []
    for address in workers.values():
        client.submit(_nothing, -1, workers=[address], pure=False).result()
        for index in range(round_trips):
            started = time.perf_counter()
            client.submit(_nothing, index, workers=[address], pure=False).result()
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def measured_hardware(client: Client, workers: dict[str, str]) -> Hardware:
    """This machine as the simulator sees it, with the task cost measured on the cluster the run will use."""
    latency = task_latency(client, workers)
    logger.info("task cost on this cluster: %.1f ms from submit to result", latency * 1e3)
    return dataclasses.replace(this_machine(), task_overhead=latency)
