"""Measures Dask's cost per task on the live cluster: steps per task and the simulator's task cost come from it."""

from __future__ import annotations

import dataclasses
import logging
import time

from distributed import Client, as_completed, get_worker

from harmony.runtime.handoff import FinishedKeys, LocalResult, receive
from harmony.runtime.measure import accelerator_speed, this_machine, with_accelerator
from harmony.runtime.worker import wait_for_warmup
from harmony.tasks.hardware import Hardware

logger = logging.getLogger("harmony")

CHAIN = 24
ISOLATED = 8
IN_FLIGHT = 2
PAUSE = 0.01
FINISHED = FinishedKeys()  # on a worker: the calibration tasks that have run there


def _nothing(index: int, previous: LocalResult | None = None) -> int:
    """An empty task that, like a training task, first checks that the task before it on its worker has run."""
    receive(previous, FINISHED, {})
    FINISHED.add(str(get_worker().get_current_task()))
    return index


def _pause(index: int, seconds: float) -> int:
    """A task that keeps its worker busy without computing, as a training task keeps it busy."""
    time.sleep(seconds)
    return index


def _chain_latency(client: Client, address: str, chain: int) -> float:
    """Seconds per task of a chain of empty tasks submitted at once to one worker."""
    started = time.perf_counter()
    future = client.submit(_nothing, 0, workers=[address], pure=False, priority=0)
    futures = [future]
    for index in range(1, chain):
        future = client.submit(_nothing, index, LocalResult(future.key), workers=[address], pure=False,
                               priority=-index)
        futures.append(future)
    future.result()
    return (time.perf_counter() - started) / chain


def _passed(index: int, previous: int | None = None) -> int:
    """An empty task that takes the result of the one before it through Dask."""
    return index


def _edge_latency(client: Client, addresses: list[str], chain: int) -> float:
    """Seconds per task of a chain of empty tasks submitted at once, alternating between two workers, each taking
    the one before's result through Dask: the scheduler's edge and the fetch from the other worker, as a task
    reading a result of another device's task waits for it."""
    started = time.perf_counter()
    future = client.submit(_passed, 0, workers=[addresses[0]], pure=False)
    for index in range(1, chain):
        future = client.submit(_passed, index, future, workers=[addresses[index % 2]], pure=False)
    future.result()
    return (time.perf_counter() - started) / chain


def _isolated_cpu(client: Client, address: str, tasks: int, in_flight: int = IN_FLIGHT) -> float:
    """CPU seconds per task of the driver's process and the worker's, for tasks sent as the driver sends a
    homed model's: the next as one finishes, a few in flight, each keeping the worker busy a while."""
    [worker_before] = client.run(time.process_time, workers=[address]).values()
    driver_before = time.process_time()
    pending = as_completed([client.submit(_pause, index, PAUSE, workers=[address], pure=False)
                            for index in range(in_flight)])
    sent = in_flight
    for _ in pending:
        if sent < tasks:
            pending.add(client.submit(_pause, sent, PAUSE, workers=[address], pure=False))
            sent += 1
    driver = time.process_time() - driver_before
    [worker_after] = client.run(time.process_time, workers=[address]).values()
    return (driver + worker_after - worker_before) / sent


def task_cost(client: Client, workers: dict[str, str], chain: int = CHAIN, isolated: int = ISOLATED
              ) -> tuple[float, float, float]:
    """Seconds one task adds to a device's time, CPU seconds it takes from the machine (the slowest worker's of
    each), and seconds a result takes from one device's worker to another's (0 with one worker).

    The time: a chain of empty tasks, each naming the one before, submitted at once to a device worker as
    the driver submits a step's tasks on one device (no scheduler edge between them, run in submission order,
    see handoff), divided by its length. It counts the scheduler's transitions, the worker's execution and the
    results' reports, task after task.

    The CPU: what the driver's process (client and, embedded, scheduler) and the worker's spend per task when
    tasks come one at a time, as a homed model's multi-step tasks do, each sent when one before it ends and
    keeping its worker busy meanwhile, so that every message is handled on its own (more than a chain's, whose
    messages go out and are handled together). Figures: docs/performance.md, "Dask's cost per task".

    The edge: a chain of empty tasks alternating between the first two device workers, each a Dask dependency of
    the next (_edge_latency), per task.
    """
    if not workers:
        raise RuntimeError("no device worker is connected to the scheduler: nothing to measure the task cost on")
    client.run(wait_for_warmup)
    latencies, cpu = [], []
    for address in workers.values():
        _chain_latency(client, address, chain)  # the first pass warms the code paths up
        latencies.append(_chain_latency(client, address, chain))
        cpu.append(_isolated_cpu(client, address, isolated))
    addresses = list(workers.values())[:2]
    edge = 0.0
    if len(addresses) == 2:
        _edge_latency(client, addresses, chain)
        edge = _edge_latency(client, addresses, chain)
    return max(latencies), max(cpu), edge


MEASURED: dict[tuple[object, ...], Hardware] = {}  # per cluster (its scheduler and workers), what it measured
KEPT = 16


def measured_hardware(client: Client, workers: dict[str, str], cpu_compute: bool = True, by_name: bool = False,
                      stored: Hardware | None = None) -> Hardware:
    """This machine as the simulator sees it, with the task cost measured on the cluster the run will use (once per
    cluster: a warm cluster's next run, or the next run on the same user's workers, takes what it measured); the
    CPU a task takes counts where the devices compute on this machine's cores (cpu_compute), and where they do not,
    a worker's GPU gives the compute scale and the link (runtime.measure.accelerator_speed). by_name: the workers
    are known by their names alone (the embedded cluster's, where a device's worker started again is started the same
    way on the same machine: a warm cluster that closed a device's worker and started it again measures nothing);
    else by their addresses too (a user's worker of a name may come back on another machine). stored: what an
    earlier process measured on such a cluster, taken where this process has measured nothing for it."""
    known = tuple(sorted(workers)) if by_name else tuple(sorted(workers.items()))
    key = (client.scheduler.address, known, cpu_compute)
    if key not in MEASURED:
        while len(MEASURED) >= KEPT:
            del MEASURED[next(iter(MEASURED))]
        MEASURED[key] = stored if stored is not None else _measured(client, workers, cpu_compute)
    return MEASURED[key]


def _measured(client: Client, workers: dict[str, str], cpu_compute: bool) -> Hardware:
    """measured_hardware's figures, measured now."""
    latency, cpu, edge = task_cost(client, workers)
    logger.info("task cost on this cluster: %.1f ms per task of a chain, %.1f ms of CPU, %.1f ms from worker to "
                "worker", latency * 1e3, cpu * 1e3, edge * 1e3)
    hardware = dataclasses.replace(this_machine(), task_overhead=latency, edge_seconds=edge or latency,
                                   task_cpu=cpu if cpu_compute else 0.0, shared_cores=cpu_compute)
    if not cpu_compute:  # the devices are GPUs: measured on one of their workers
        address = next(iter(workers.values()))
        hardware = with_accelerator(hardware, client.run(accelerator_speed, workers=[address])[address])
    return hardware
