"""Benchmark: what evaluating every few steps costs a swapped model, against the same run without validation and a
plain loop's no_grad evaluation.

Two MLPs swapped under a third of their weights on two CPU devices, evaluated on 8 validation batches every
--every steps. An evaluation runs one task per pack over all the batches (each pack's weights swapped in once per
evaluation, as a training task groups its micro-batches), so its cost is the validation forward plus one pass of
weights, whatever the number of batches. Seconds are medians over rounds (the ways alternate).

    python -m benchmarks.evaluation [--quick] [--rounds N] [--every 2]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, regression
from benchmarks.report import arguments, report

LR = 0.01


def plain(models: list[nn.Module], data: list, val: list | None, every: int) -> float:
    """Seconds of the plain loop: each model in memory, stepped per batch, evaluated every `every` steps."""
    optimizers = [torch.optim.SGD(model.parameters(), lr=LR) for model in models]
    started = time.perf_counter()
    for step, (x, y) in enumerate(data, start=1):
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if val is not None and (step % every == 0 or step == len(data)):
                model.eval()
                with torch.no_grad():
                    sum(nn.functional.mse_loss(model(vx), vy).item() for vx, vy in val)
                model.train()
    return time.perf_counter() - started


def with_harmony(models: list[nn.Module], data: list, val: list | None, every: int, budget: int) -> dict[str, Any]:
    result = harmony.train(models, data, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=LR), devices=2,
                           device_memory=budget, fuse=False, val_loaders=val, eval_every=every if val else None,
                           progress=False)
    keys = [key for tasks in result.stats.timeline.values() for *_, key in tasks]
    evaluations = sum(len(history) for history in result.val_history)
    return {"seconds": result.stats.run_seconds, "packs": len(result.packings[0].packs), "evaluations": evaluations,
            "evaluation tasks": sum(key.startswith(("evl-", "val-")) for key in keys),
            "weights in": result.stats.bytes_in["weights"]}


def main() -> None:
    def extend(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rounds", type=int, default=3, help="runs of each way (the table gives the median)")
        parser.add_argument("--every", type=int, default=2, help="steps between evaluations")

    args = arguments(__doc__.splitlines()[0], extend)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    width, depth, batch, steps = (256, 8, 32, 6) if args.quick else (512, 16, 64, 12)
    data = regression(steps, batch, width)
    val = regression(8, batch, width, seed=7)
    weights = parameter_bytes(mlp(width, depth))
    budget = weights // 3

    def models() -> list[nn.Module]:
        return [mlp(width, depth, seed=seed) for seed in range(2)]

    with_harmony(models(), data[:2], None, args.every, budget)  # the embedded cluster started before the rounds
    runs: dict[str, list[Any]] = {"plain loop": [], "plain loop, evaluated": [], "Harmony": [],
                                  "Harmony, evaluated": []}
    for _ in range(args.rounds):
        runs["plain loop"].append(plain(models(), data, None, args.every))
        runs["plain loop, evaluated"].append(plain(models(), data, val, args.every))
        runs["Harmony"].append(with_harmony(models(), data, None, args.every, budget))
        runs["Harmony, evaluated"].append(with_harmony(models(), data, val, args.every, budget))
    rows = []
    for name, measured in runs.items():
        seconds = [run if isinstance(run, float) else run["seconds"] for run in measured]
        first = measured[0] if isinstance(measured[0], dict) else {}
        rows.append({"way": name, "s": statistics.median(seconds), "range": f"{min(seconds):.2f}-{max(seconds):.2f}",
                     "packs": first.get("packs", 1), "evaluations": first.get("evaluations", 0),
                     "evaluation tasks": first.get("evaluation tasks", 0), "weights in": first.get("weights in", 0)})
    for index in (1, 3):
        rows[index]["+ evaluation s"] = rows[index]["s"] - rows[index - 1]["s"]
        rows[index - 1]["+ evaluation s"] = 0.0
    report("evaluation", f"evaluation: 2 MLPs {width}x{depth} of {weights:,} B swapped under a third of it on 2 "
           f"CPU devices, batch {batch}, {steps} steps, 8 validation batches every {args.every} steps, "
           f"{args.rounds} rounds",
           rows, args.out, raw={name: [run if isinstance(run, float) else run["seconds"] for run in measured]
                                for name, measured in runs.items()})


if __name__ == "__main__":
    main()
