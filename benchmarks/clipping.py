"""Benchmark: what clip_grad_norm costs a swapped model, against the same run unclipped and the plain loop's cost of
clip_grad_norm_.

Clipping needs the norm of all of a step's gradients before any pack updates, so a clipped swapped model's packs
update in upd tasks that wait for the whole backward, and the first of them reads every pack's gradients in the
host store once more for the norm (runtime/clipping.py). One MLP, AdamW, two micro-batches a step, on one CPU
device: swapped under a share of its weights (--share), and homed (the budget holds it: clipping on its device, as
a plain loop clips), each unclipped and clipped at a norm every step exceeds; beside them the plain loop with the
model in memory, unclipped and with clip_grad_norm_. Seconds a step are the median of the steady steps, over rounds
(the ways alternate, so that the machine's drift falls on all of them).

    python -m benchmarks.clipping [--quick] [--rounds N] [--share 0.5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, regression
from benchmarks.report import arguments, report

LR = 1e-3
CLIP = 1e-3  # below every step's gradient norm here: every step is clipped


def plain(width: int, depth: int, data: list, clip: float | None) -> float:
    """Seconds per step of the plain loop with the model in memory (median of the steps after the first)."""
    model = mlp(width, depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    seconds = []
    for x, y in data:
        started = time.perf_counter()
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            (nn.functional.mse_loss(model(xs), ys) / 2).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def run(width: int, depth: int, data: list, budget: int | None, clip: float | None) -> harmony.TrainResult:
    return harmony.train(mlp(width, depth), data, loss_fn=nn.functional.mse_loss,
                         optimizer=lambda p: torch.optim.AdamW(p, lr=LR), microbatches=2, devices=["cpu"],
                         device_memory=budget, resident=budget is None, clip_grad_norm=clip, progress=False)


def main() -> None:
    def extend(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rounds", type=int, default=3, help="runs of each way (the table gives the median)")
        parser.add_argument("--share", type=float, default=0.5, help="the swapped budget as a share of the weights")

    args = arguments(__doc__.splitlines()[0], extend)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    width, depth, batch, steps = (256, 24, 64, 6) if args.quick else (1024, 16, 256, 10)
    weights = parameter_bytes(mlp(width, depth))
    data = regression(steps, batch, width)
    ways = [(f"Harmony swapped ({args.share:g} of the weights)", round(weights * args.share), None),
            ("Harmony swapped, clipped", round(weights * args.share), CLIP),
            ("Harmony homed", None, None), ("Harmony homed, clipped", None, CLIP)]
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in ways}
    seconds.update({"plain loop, in memory": [], "plain loop, clip_grad_norm_": []})
    last: dict[str, harmony.TrainResult] = {}
    for _ in range(args.rounds):
        seconds["plain loop, in memory"].append(plain(width, depth, data, None))
        seconds["plain loop, clip_grad_norm_"].append(plain(width, depth, data, CLIP))
        for name, budget, clip in ways:
            last[name] = run(width, depth, data, budget, clip)
            seconds[name].append(last[name].stats.steady_seconds_per_step(0))
    rows = []
    for name, values in seconds.items():
        result = last.get(name)
        job = result.plan.jobs[0] if result is not None else None
        rows.append({"way": name, "packs": len(job.packing.packs) if job else 1,
                     "updates": "-" if job is None else "homed" if job.home else "upd tasks" if job.overlap
                     else "in backward", "step s": statistics.median(values),
                     "range": f"{min(values):.3f}-{max(values):.3f}"})
    for row in rows:  # each clipped way against the unclipped way before it
        base = rows[rows.index(row) - 1] if "clip" in row["way"] else row
        row["/ unclipped"] = row["step s"] / base["step s"]
    report("clipping", f"clip_grad_norm: one MLP {width}x{depth} of {weights:,} B on one CPU device, batch {batch} in "
           f"2 micro-batches, AdamW, {steps} steps, {args.rounds} rounds", rows, args.out,
           notes=f"clipped at {CLIP}, below every step's norm; / unclipped: against the row before it", raw=seconds)


if __name__ == "__main__":
    main()
