"""Benchmark 5: the simulator's predictions against measurements, step time and peak device bytes.

Runs a model that fits, one four times the budget, and the same over a slow link, and sets what
harmony.plan predicts for each beside what harmony.train measured (steady state: the difference
between a long and a short run, so that start-up cancels out). Peaks are predicted for the
simulated schedule; the runtime's peaks for its own schedule are checked exactly in the test suite.
The prediction uses the task cost the run measured on its cluster (stats.task_seconds).

    python -m benchmarks.simulator_check
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, regression
from benchmarks.report import arguments, report
from harmony.runtime.measure import this_machine
from harmony.tasks.microbatch import split_sizes
from harmony.tasks.simulator import order_from_keys, replay_memory


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    width, depth, batch, steps = (256, 20, 64, 8) if args.quick else (512, 20, 128, 16)
    short = 2
    weights = parameter_bytes(mlp(width, depth))
    data = regression(steps, batch, width)
    cases = [("fits", None, None), ("4x budget", weights // 4, None), ("4x budget, slow link", weights // 4, 50e6)]
    rows = []

    def train(batches: list, budget: int | None, link: float | None) -> harmony.TrainResult:
        return harmony.train(mlp(width, depth), batches, loss_fn=nn.functional.mse_loss,
                             optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), microbatches=2, devices=["cpu"],
                             device_memory=budget, link_bandwidth=link, prefetch=False, progress=False)

    for label, budget, link in cases:
        result = train(data, budget, link)
        warmup = train(data[:short], budget, link)
        steady = (result.stats.finish_seconds[0] - warmup.stats.finish_seconds[0]) / (steps - short)
        here = this_machine()
        hardware = harmony.Hardware("this machine", host_link=link or here.host_link,
                                    task_overhead=result.stats.task_seconds)
        plan = harmony.plan(mlp(width, depth), data, loss_fn=nn.functional.mse_loss,
                            optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), microbatches=2, devices=1,
                            device_memory=budget or result.stats.budgets["cpu-0"], hardware=hardware, prefetch=False)
        jobs = result.plan.jobs
        replayed = replay_memory(order_from_keys(result.stats.schedule), [job.device_packing for job in jobs],
                                 result.stats.budgets, result.plan.homes, [job.state_ratio for job in jobs],
                                 [split_sizes(batch, 2)], [job.sections for job in jobs],
                                 {index: job.device_updates for index, job in enumerate(jobs)},
                                 {index: job.stashes for index, job in enumerate(jobs)})
        rows.append({
            "case": label,
            "measured step s": steady,
            "predicted step s": plan.step_seconds,
            "task cost ms": result.stats.task_seconds * 1e3,
            "measured peak": result.stats.peak_device_bytes["cpu-0"],
            "predicted peak": plan.peak_device_bytes["dev-0"],
            "replayed peak": replayed.peak["cpu-0"],
            "measured weights in": result.stats.bytes_in["weights"],
            "predicted weights in": plan.memory.weights_in,
        })
    report("simulator_check", "Simulator vs measurement (1 CPU device, prefetch off)", rows, args.out,
           notes="replayed peak: the simulator replaying the run's own recorded schedule (equal by test)")


if __name__ == "__main__":
    main()
