"""Benchmark: the micro-batch count microbatches="auto" chooses, against the counts around it.

One swapped MLP (a quarter and a half of its weights as budget), each pass one task of all its packs, trained on one
CPU device (or --device cuda:0) at the count "auto" chooses (the fewest at which every layer fits the budget), at
twice and four times that count, and at 64; beside each, the plain loop over the same micro-batches with the model
in memory. Rounds alternate the counts (median and range). Fewer micro-batches mean fewer, larger pack calls over
the same compute; more leave room for larger packs, stashes and values copied ahead: which wins is what this
measures.

    python -m benchmarks.microbatch_count [--quick] [--device cuda:0]
"""

from __future__ import annotations

import logging
import statistics

import torch
from torch import nn

import harmony
from benchmarks.microbatch_cost import options, plain_seconds, sgd
from benchmarks.models import mlp, parameter_bytes, regression
from benchmarks.report import arguments, report

DEPTH = 16


def main() -> None:
    args = arguments(__doc__.splitlines()[0], options)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    device = torch.device(args.device)
    width, batch = (2048, 16384) if device.type == "cuda" else (256, 1024)
    shares, rounds, steps = ((0.25,), 2, 6) if args.quick else ((0.25, 0.5), 3, 10)
    data = regression(steps, batch, width)
    weights = parameter_bytes(mlp(width, DEPTH))
    rows, raw = [], {}
    for share in shares:
        budget = int(weights * share)
        settings = {"device_memory": budget, "packs_per_task": 2 * DEPTH, "optimizer": sgd}
        chosen = harmony.plan(mlp(width, DEPTH), data, devices=[args.device], microbatches="auto", **settings)
        fewest = chosen.plan.options.microbatches
        counts = sorted({fewest, 2 * fewest, 4 * fewest, 64} & set(range(fewest, batch + 1)))
        measured: dict[int, list[float]] = {count: [] for count in counts}
        plain: dict[int, list[float]] = {count: [] for count in counts}
        packs = {}
        for _ in range(rounds):
            for count in counts:
                plain[count].append(plain_seconds(width, data, count, device))
                result = harmony.train(mlp(width, DEPTH), data, loss_fn=nn.functional.mse_loss,
                                       devices=[args.device], microbatches=count, progress=False, **settings)
                measured[count].append(result.stats.steady_seconds_per_step())
                packs[count] = len(result.plan.jobs[0].packing.packs)
        for count in counts:
            step = statistics.median(measured[count])
            rows.append({"budget share": share, "micro-batches": count, "auto's": count == fewest,
                         "packs": packs[count], "Harmony s": step, "min": min(measured[count]),
                         "max": max(measured[count]), "plain s": statistics.median(plain[count]),
                         "over auto's": step / statistics.median(measured[fewest])})
            raw[f"{share} {count}"] = {"harmony": measured[count], "plain": plain[count]}
    report("microbatch_count", f"Micro-batch counts: MLP {width} x {DEPTH}, batch {batch}, a pass a task, on "
           f"{args.device}", rows, args.out,
           notes="auto's: the count microbatches='auto' chose for that budget; Harmony s / plain s: median steady "
                 "seconds a step over the rounds (min-max: Harmony's), the plain loop over the same micro-batches "
                 "with the model in memory; over auto's: the step over the step at auto's count", raw=raw)


if __name__ == "__main__":
    main()
