"""Benchmark: a swapped pack's activations kept on its device for its backward (stash=True) against recomputing them.

One MLP trained swapped (never homed) on one CPU device under budgets from a quarter of its weights to twice them
(--shares), AdamW, two micro-batches a step. Rows per budget: Harmony recomputing every pack's forward in its backward
(stash=False) and Harmony stashing where the budget has room (the default), with how many micro-batch passes went
which way; beside them the plain loop with the model in memory. Same data, same run; seconds a step are the median
of the steady steps, over rounds.

    python -m benchmarks.stash [--quick] [--rounds N] [--shares 0.25,0.5,1,2] [--packs-per-task K]
"""

from __future__ import annotations

import argparse
import logging
import statistics

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, plain_step_seconds, regression
from benchmarks.report import arguments, report

LR = 1e-3


def plain(width: int, depth: int, data: list) -> float:
    """Seconds per step of the plain loop with the model in memory (median of the steps after the first)."""
    model = mlp(width, depth)
    return statistics.median(plain_step_seconds(model, torch.optim.AdamW(model.parameters(), lr=LR), data)[1:])


def run(width: int, depth: int, data: list, budget: int, stash: bool, packs_per_task: int | None
        ) -> harmony.TrainResult:
    return harmony.train(mlp(width, depth), data, loss_fn=nn.functional.mse_loss,
                         optimizer=lambda p: torch.optim.AdamW(p, lr=LR), microbatches=2, devices=["cpu"],
                         device_memory=budget, resident=False, stash=stash, packs_per_task=packs_per_task,
                         progress=False)


def main() -> None:
    def extend(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rounds", type=int, default=2, help="runs of each way (the table gives the median)")
        parser.add_argument("--shares", type=lambda text: [float(part) for part in text.split(",")],
                            default=[0.25, 0.5, 1.0, 2.0], help="budgets as shares of the weights' bytes")
        parser.add_argument("--packs-per-task", type=int, default=None,
                            help="packs a task runs (sections); default: the plan's choice")

    args = arguments(__doc__.splitlines()[0], extend)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    width, depth, batch, steps = (256, 24, 64, 5) if args.quick else (1024, 16, 512, 8)
    weights = parameter_bytes(mlp(width, depth))
    data = regression(steps, batch, width)
    rows, raw = [], {}
    plains = [plain(width, depth, data) for _ in range(args.rounds)]
    rows.append({"budget / weights": "-", "way": "plain loop, in memory", "packs": 1,
                 "step s": statistics.median(plains), "range": f"{min(plains):.3f}-{max(plains):.3f}",
                 "weights in/step": 0, "stashed": 0, "recomputed": 0, "inputs recomputed": 0})
    raw["plain"] = plains
    ways = (("recompute (stash=False)", False), ("stash (default)", True))
    for share in args.shares:
        budget = round(weights * share)
        seconds: dict[bool, list[float]] = {False: [], True: []}
        last: dict[bool, harmony.TrainResult] = {}
        for _ in range(args.rounds):  # the ways alternate, so that the machine's drift falls on both
            for _, stash in ways:
                last[stash] = run(width, depth, data, budget, stash, args.packs_per_task)
                seconds[stash].append(last[stash].stats.steady_seconds_per_step(0))
        for way, stash in ways:
            raw[f"{share} {way}"] = seconds[stash]
            stats = last[stash].stats
            rows.append({"budget / weights": share, "way": way, "packs": len(last[stash].packings[0].packs),
                         "step s": statistics.median(seconds[stash]),
                         "range": f"{min(seconds[stash]):.3f}-{max(seconds[stash]):.3f}",
                         "weights in/step": stats.bytes_in["weights"] // steps,
                         "stashed": stats.stashed, "recomputed": stats.recomputed,
                         "inputs recomputed": stats.inputs_recomputed})
    for row in rows:
        row["/ plain"] = row["step s"] / rows[0]["step s"]
    report("stash", f"stashed activations: one MLP {width}x{depth} of {weights:,} B swapped on one CPU device, batch "
           f"{batch} in 2 micro-batches, AdamW, {args.rounds} rounds", rows, args.out,
           notes="weights in/step: bytes of weights copied onto the device per step; stashed / recomputed: "
           "micro-batch passes through a pack's backward (all but the last pack) that "
           "read the forward's activations / recomputed them; inputs recomputed: forwards a task of several packs ran "
           "first for its later packs' inputs (last round)", raw=raw)


if __name__ == "__main__":
    main()
