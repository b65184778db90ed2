"""Benchmark 3: a heterogeneous sweep, Sharded-LRTF against round-robin binding.

Six models of three sizes (two each) train on two CPU devices. With Sharded-LRTF a freed device takes
work from the model with the longest remaining time; with round-robin, from the model that has made
the least progress. The table shows completion time and the spread between the first and the last
model to finish, measured, and as the simulator predicts it.

    python -m benchmarks.heterogeneous
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, regression
from benchmarks.report import arguments, report


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    steps, width, batch = (4, 256, 64) if args.quick else (8, 512, 128)
    depths = [2, 2, 4, 4, 8, 8]
    data = regression(steps, batch, width)
    rows = []
    for policy in ("lrtf", "round_robin"):
        models = [mlp(width, depth, seed=i) for i, depth in enumerate(depths)]
        result = harmony.train(models, data, loss_fn=nn.functional.mse_loss,
                               optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), microbatches=2,
                               devices=["cpu", "cpu"], policy=policy, progress=False)
        predicted = harmony.plan([mlp(width, depth, seed=i) for i, depth in enumerate(depths)], data,
                                 microbatches=2, devices=["cpu", "cpu"], policy=policy)
        finish = result.stats.finish_seconds
        simulated = [
            max(end for task, (_, end) in predicted.simulation.times.items() if task.model == m)
            for m in range(len(depths))
        ]
        rows.append({
            "policy": policy,
            "completion s": max(finish),
            "spread s": max(finish) - min(finish),
            "first done s": min(finish),
            "predicted completion s": max(simulated),
            "predicted spread s": max(simulated) - min(simulated),
            "utilization": ", ".join(f"{u:.0%}" for u in result.stats.utilization().values()),
        })
    report("heterogeneous", f"6 models of depth {depths} on 2 CPU devices, {steps} steps each", rows, args.out)


if __name__ == "__main__":
    main()
