"""Benchmark 2: Harmony's overhead when the model fits the device, against a plain PyTorch loop.

One MLP whose step takes tens of milliseconds, on one CPU device with all cores. The plain loop and
Harmony train the same model on the same data; steady-state time per step is measured for Harmony as
the difference between a long and a short run's training time (cluster start-up and the first steps
cancel out), and end to end (everything train() does, cluster start-up included). Goal: steady-state
ratio <= 1.05 once steps take >= 50 ms.

    python -m benchmarks.overhead_fits
"""

from __future__ import annotations

import copy
import logging
import time

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, regression
from benchmarks.report import arguments, report


def plain_seconds_per_step(model: nn.Module, data: list, warmup: int = 2) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    timings = []
    for x, y in data:
        started = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        timings.append(time.perf_counter() - started)
    return sum(timings[warmup:]) / len(timings[warmup:])


def harmony_run(model: nn.Module, data: list, microbatches: int) -> harmony.TrainResult:
    return harmony.train(model, data, loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                         microbatches=microbatches, devices=["cpu"], prefetch=False, progress=False)


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    short, long = (4, 12) if args.quick else (10, 50)
    rows = []
    for width, batch in ((512, 128), (1024, 256), (2048, 256)) if not args.quick else ((1024, 256),):
        base = mlp(width, 3, outputs=8)
        data = regression(long, batch, width)
        plain = plain_seconds_per_step(copy.deepcopy(base), data)
        for microbatches in (1, 4):
            started = time.perf_counter()
            result_long = harmony_run(copy.deepcopy(base), data, microbatches)
            end_to_end = time.perf_counter() - started
            result_short = harmony_run(copy.deepcopy(base), data[:short], microbatches)
            steady = (result_long.stats.finish_seconds[0] - result_short.stats.finish_seconds[0]) / (long - short)
            busy = (result_long.stats.busy_seconds["cpu-0"] - result_short.stats.busy_seconds["cpu-0"]) / (long - short)
            rows.append({
                "width": width,
                "batch": batch,
                "M": microbatches,
                "plain ms/step": plain * 1e3,
                "harmony ms/step": steady * 1e3,
                "ratio": steady / plain,
                "worker busy ms/step": busy * 1e3,
                "resident": bool(result_long.homes),
                "end-to-end s": end_to_end,
                "plain total s": plain * long,
                "tasks/step": result_long.stats.tasks / long,
            })
    report("overhead_fits", "Overhead when the model fits: Harmony vs a plain PyTorch loop (1 CPU device)", rows,
           args.out, notes="ratio = steady-state Harmony time per step / plain loop time per step; goal <= 1.05 "
           "when steps take >= 50 ms; worker busy = time inside task bodies (the rest is scheduling latency)")


if __name__ == "__main__":
    main()
