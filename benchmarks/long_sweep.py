"""Benchmark: a long sweep of 256 small models on 2 CPU devices, against the plain-PyTorch way of training them.

The sweep is a learning-rate grid over one small MLP (256 rates, so 256 models). Harmony trains it on two device
workers (one core each) three ways: each model its own job stepping once per task (the scheduler's worst case: a
small model lives on its device and runs a whole step as one task), each model its own job with spans of several
steps per task (the default), and the models fused into arrays (fuse=True). The plain way trains the models one
after the other in this process, one thread (what a device worker has), and its time is the models' compute: with
two devices, half of it is the wall time a runtime without overhead would take; the share of Harmony's wall time
spent outside model compute is one minus that over Harmony's run time (cluster start excluded, reported beside).

While each run goes, a thread samples the driver's resident memory and the number of tasks the scheduler (in
the driver's process, as in every embedded run) holds. Each way runs at two lengths, STEPS and 4 x STEPS: work
held in the driver and the scheduler is bounded when the longer run holds no more tasks at its peak and its
driver memory grows by no more than the shorter one's (the JSON keeps every sample).

    python -m benchmarks.long_sweep [--quick]
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any

import psutil
import torch
from distributed import Scheduler
from torch import nn

import harmony
from benchmarks.models import mlp, regression, train_sequentially
from benchmarks.report import arguments, report

MODELS = 256
DEVICES = 2
STEPS = 25
BATCH = 32
WIDTH = 32
SAMPLE_SECONDS = 0.25

WAYS: dict[str, dict[str, Any]] = {
    "one step per task": {"fuse": False, "steps_per_task": 1},
    "spans (default)": {"fuse": False},
    "fused arrays": {"fuse": True},
}


class Sampler:
    """Samples the driver's RSS and the tasks every scheduler in this process holds, until stopped."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self.started = time.perf_counter()

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join()

    def _run(self) -> None:
        me = psutil.Process()
        while not self.stopping.wait(SAMPLE_SECONDS):
            tasks = sum(len(scheduler.tasks) for scheduler in list(Scheduler._instances))
            self.samples.append((time.perf_counter() - self.started, me.memory_info().rss, tasks))


def models_and_rates(count: int) -> tuple[list[nn.Module], list[float]]:
    base = mlp(WIDTH, 2, outputs=4)
    rates = [1e-4 * 1.03**index for index in range(count)]
    return [copy.deepcopy(base) for _ in rates], rates


def plain_seconds(models: list[nn.Module], rates: list[float], data: list) -> float:
    """The models' compute: each model trained in turn by the plain loop, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_sequentially(models, rates, data, nn.functional.mse_loss)
    finally:
        torch.set_num_threads(threads)


def sweep(way: str, models: list[nn.Module], rates: list[float], data: list, compute: float) -> dict[str, Any]:
    factories = [lambda p, lr=rate: torch.optim.SGD(p, lr=lr) for rate in rates]
    rss_before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    with Sampler() as sampler:
        result = harmony.train(models, data, loss_fn=nn.functional.mse_loss, optimizer=factories,
                               devices=["cpu"] * DEVICES, progress=False, **WAYS[way])
    wall = time.perf_counter() - started
    run = max(result.stats.busy_seconds[name] + result.stats.idle_seconds[name] for name in result.stats.busy_seconds)
    samples = sampler.samples or [(0.0, rss_before, 0)]
    busy = sum(result.stats.busy_seconds.values())
    return {
        "way": way,
        "steps": len(data),
        "jobs": len(result.arrays),
        "tasks": result.stats.tasks,
        "wall s": wall,
        "run s": run,
        "start s": wall - run,
        "tasks/s": result.stats.tasks / run,
        "model-steps/s": MODELS * len(data) / run,
        "outside compute": 1 - (compute / DEVICES) / run,
        "outside task bodies": 1 - busy / (DEVICES * run),
        "scheduler tasks peak": max(tasks for _, _, tasks in samples),
        "driver RSS MiB peak": max(rss for _, rss, _ in samples) / 2**20,
        "driver RSS growth MiB": (samples[-1][1] - samples[0][1]) / 2**20,
        "_samples": samples,
    }


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    count = 32 if args.quick else MODELS
    lengths = (STEPS // 5, STEPS * 4 // 5) if args.quick else (STEPS, 4 * STEPS)
    rows, raw = [], {}
    warm, rates = models_and_rates(2)
    plain_seconds(warm, rates, regression(4, BATCH, WIDTH, outputs=4))  # torch's first optimizer step imports a lot
    for steps in lengths:
        data = regression(steps, BATCH, WIDTH, outputs=4)
        models, rates = models_and_rates(count)
        compute = plain_seconds(copy.deepcopy(models), rates, data)
        rows.append({"way": "plain PyTorch, 1 thread", "steps": steps, "jobs": count, "tasks": 0, "wall s": compute,
                     "run s": compute, "start s": 0.0, "tasks/s": 0.0, "model-steps/s": count * steps / compute,
                     "outside compute": 0.0, "outside task bodies": 0.0, "scheduler tasks peak": 0,
                     "driver RSS MiB peak": psutil.Process().memory_info().rss / 2**20, "driver RSS growth MiB": 0.0})
        for way in WAYS:
            models, rates = models_and_rates(count)
            row = sweep(way, models, rates, data, compute)
            raw[f"{way}, {steps} steps"] = row.pop("_samples")
            rows.append(row)
            print(f"{way}, {steps} steps: {row['run s']:.1f}s", flush=True)
    report("long_sweep", f"A sweep of {count} MLPs on {DEVICES} CPU devices (1 core each) vs plain PyTorch", rows,
           args.out, raw={"samples (seconds, driver RSS bytes, scheduler tasks)": raw},
           notes="run s = the devices' time from the run's first task to its end (cluster start in start s); "
           "outside compute = 1 - (plain one-thread time / devices) / run s; outside task bodies = 1 - worker busy "
           "time / (devices x run s); scheduler tasks and driver RSS sampled every 0.25 s (the scheduler runs in "
           "the driver's process); bounded = the 4x longer run's peak tasks and RSS growth no higher")


if __name__ == "__main__":
    main()
