"""Benchmark 2: Harmony's overhead when the model fits the device, against a plain PyTorch loop.

One MLP on one CPU device with all cores. The plain loop and Harmony train the same model on the same
data, alternating over ROUNDS (5) rounds in the same run (a small shared machine's speed drifts by 10-20%
between minutes, so a plain time taken once would make the ratio a coin toss); Harmony's runs share one
device worker that stays up between rounds, so that a round costs the training, not a cluster's start.
Harmony's time per step is its steady rate (result.stats.steady_seconds_per_step: the first fifth of the
steps, start-up included, left out); each round gives a ratio and the table shows their median. With M
micro-batches the plain loop accumulates gradients over the same M chunks, so the ratio is the runtime's
cost, not micro-batching's. End to end (one fresh run, cluster start-up included) is reported beside.
Goal: steady-state ratio <= 1.05 once steps take >= 50 ms.

    python -m benchmarks.overhead_fits
"""

from __future__ import annotations

import copy
import logging
import statistics
import time

import torch
from distributed import Client
from torch import nn

import harmony
from benchmarks.models import mlp, regression
from benchmarks.report import arguments, report
from harmony.runtime.cluster import start_embedded
from harmony.runtime.devices import DeviceSpec, cpu_count

ROUNDS = 5


def plain_seconds_per_step(model: nn.Module, data: list, microbatches: int = 1, warmup: int = 2) -> float:
    """The plain loop's mean time per step; with microbatches > 1 it accumulates gradients over that many chunks."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    timings = []
    for x, y in data:
        started = time.perf_counter()
        optimizer.zero_grad()
        for x_part, y_part in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (nn.functional.mse_loss(model(x_part), y_part) * (len(x_part) / len(x))).backward()
        optimizer.step()
        timings.append(time.perf_counter() - started)
    return sum(timings[warmup:]) / len(timings[warmup:])


def harmony_run(model: nn.Module, data: list, microbatches: int, cluster: Client | None = None) -> harmony.TrainResult:
    """Harmony on one CPU device: on cluster's worker, else on an embedded cluster of its own."""
    return harmony.train(model, data, loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
                         microbatches=microbatches, devices=None if cluster else ["cpu"], cluster=cluster,
                         prefetch=False, progress=False)


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    rounds = 2 if args.quick else ROUNDS
    shapes = ((1024, 256, 24),) if args.quick else ((512, 128, 200), (1024, 256, 80), (2048, 256, 60))
    rows = []
    handle = start_embedded([DeviceSpec("cpu-0", "cpu", 0, cpu_count())], dashboard_address=":0")
    try:
        for width, batch, steps in shapes:
            base = mlp(width, 3, outputs=8)
            data = regression(steps, batch, width)
            for microbatches in (1, 4):
                rows.append(compare(base, data, microbatches, rounds, handle.client))
    finally:
        handle.close()
    report("overhead_fits", "Overhead when the model fits: Harmony vs a plain PyTorch loop (1 CPU device)", rows,
           args.out, notes="plain = the loop on the same M micro-batches; ratio = median over rounds of "
           "(Harmony steady time per step / plain loop time per step in the same round), Harmony on one device "
           "worker that stays up between rounds; goal <= 1.05 when steps take >= 50 ms; worker busy = time inside "
           "task bodies; tasks/step = 1 / steps per task for a resident model (its bwd task runs the span); "
           "end-to-end = one fresh train() with its own cluster, start-up included")


def compare(base: nn.Module, data: list, microbatches: int, rounds: int, cluster: Client) -> dict[str, object]:
    """The plain loop and Harmony (on cluster's worker) one after the other, rounds times; one fresh run too."""
    steps, (x, _) = len(data), data[0]
    plain, steady, ratios, busy, tasks = [], [], [], [], []
    for _ in range(rounds):
        plain.append(plain_seconds_per_step(copy.deepcopy(base), data, microbatches))
        result = harmony_run(copy.deepcopy(base), data, microbatches, cluster)
        steady.append(result.stats.steady_seconds_per_step(0))
        ratios.append(steady[-1] / plain[-1])
        busy.append(sum(result.stats.busy_seconds.values()) / steps)
        tasks.append(result.stats.tasks / steps)
    harmony.shutdown()  # a fresh run: no warm cluster kept by an earlier one
    started = time.perf_counter()
    harmony_run(copy.deepcopy(base), data, microbatches)
    harmony.shutdown()
    end_to_end = time.perf_counter() - started
    return {
        "width": x.shape[1],
        "batch": x.shape[0],
        "M": microbatches,
        "steps": steps,
        "plain ms/step": statistics.median(plain) * 1e3,
        "harmony ms/step": statistics.median(steady) * 1e3,
        "ratio": statistics.median(ratios),
        "ratios by round": " ".join(f"{ratio:.3f}" for ratio in ratios),
        "worker busy ms/step": statistics.median(busy) * 1e3,
        "tasks/step": statistics.median(tasks),
        "end-to-end s": end_to_end,
        "plain total s": statistics.median(plain) * steps,
    }


if __name__ == "__main__":
    main()
