"""Benchmark: weights copied to the device in bf16 (precision="bf16") against float32 copies, over a slow link.

One MLP four times the budget of one CPU device, its host<->device copies held to a simulated link speed at which
they take longer than the compute. Rows: the plain-PyTorch bf16 autocast loop with the model resident (the
compute alone), Harmony in float32, Harmony in bf16 copying float32 weights that autocast then casts (the way
before this benchmark's feature, kept as a baseline by turning halving off), and Harmony in bf16 copying the
weights autocast only casts already in bf16 (the default). Same data, same budget, same run.

    python -m benchmarks.half_copies [--quick]
"""

from __future__ import annotations

import logging
import statistics
from contextlib import nullcontext
from unittest import mock

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, plain_step_seconds, regression
from benchmarks.report import arguments, report
from harmony.runtime.halving import unhalved

LR = 1e-3


def plain_resident(width: int, depth: int, data: list) -> float:
    """Seconds per step of a plain bf16 autocast loop with the model in memory (median of the steps after one)."""
    model = mlp(width, depth)
    seconds = plain_step_seconds(model, torch.optim.SGD(model.parameters(), lr=LR), data, torch.bfloat16)
    return statistics.median(seconds[1:])


def run(width: int, depth: int, data: list, budget: int, link: float, precision: str) -> harmony.TrainResult:
    return harmony.train(mlp(width, depth), data, loss_fn=nn.functional.mse_loss,
                         optimizer=lambda p: torch.optim.SGD(p, lr=LR), microbatches=2, devices=["cpu"],
                         device_memory=budget, link_bandwidth=link, precision=precision, packs_per_task=1,
                         progress=False)


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    width, depth, batch, steps = (256, 24, 64, 4) if args.quick else (1024, 16, 256, 6)
    weights = parameter_bytes(mlp(width, depth))
    budget = weights // 4
    link = 2 * weights / 0.5  # the float32 weights of a step (read about twice) take half a second over it
    data = regression(steps, batch, width)
    rows = [{"way": "plain bf16 autocast loop, resident", "step s": plain_resident(width, depth, data),
             "weights in/step": 0, "halved bytes": 0, "packs": 1}]
    ways = (("harmony fp32", "fp32", True), ("harmony bf16, float32 copies", "bf16", False),
            ("harmony bf16, bf16 copies (default)", "bf16", True))
    for way, precision, halving in ways:
        off = mock.patch("harmony.runtime.pilot.casts", unhalved)  # none halved, cut for float32
        with nullcontext() if halving else off:
            result = run(width, depth, data, budget, link, precision)
        job = result.plan.jobs[0]
        rows.append({
            "way": way, "packs": len(result.packings[0].packs), "step s": result.stats.steady_seconds_per_step(0),
            "weights in/step": result.stats.bytes_in["weights"] // steps,
            "halved bytes": sum(spec.nbytes for index, pack in enumerate(result.packings[0].packs)
                                for spec in pack.weights if spec.name in job.halved(index)),
        })
    for row in rows:
        row["/ resident"] = row["step s"] / rows[0]["step s"]
    report("half_copies", f"bf16 weight copies: one MLP of {weights:,} B on one CPU device, budget {budget:,} B, "
           f"link {link / 1e6:.0f} MB/s", rows, args.out,
           notes="packs: what the model is cut into; weights in/step: bytes copied onto the device per step; "
           "halved bytes: float32 bytes of the weights whose device copy is bf16")


if __name__ == "__main__":
    main()
