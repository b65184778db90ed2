"""Benchmark: compile=True (each pack through torch.compile) against eager packs, and a plain loop either way.

A chain of transformer-style MLP blocks (layer norm, linear, GELU, linear, dropout: elementwise work that a
compiler fuses around the matrix products), on one CPU device: whole on it (homed), and swapped under a third of
its weights. Rows: the plain loop eager and over torch.compile (the model whole in memory), then Harmony eager and
compiled in each placement. Step times are steady ones (the first steps, which compile, left out); "first s" is
the time to the end of the first step, compiling included. Same data, same run.

    python -m benchmarks.compiled [--quick]
"""

from __future__ import annotations

import logging
import statistics

import torch
from torch import nn

import harmony
from benchmarks.models import parameter_bytes, plain_step_seconds, regression
from benchmarks.report import arguments, report

LR = 1e-3


def blocks(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                         nn.Linear(4 * width, width), nn.Dropout(0.1)) for _ in range(depth)))


def plain(width: int, depth: int, data: list, compile: bool) -> tuple[float, float]:
    """(seconds to the end of the first step, steady seconds per step) of a plain Adam loop, 2 micro-batches."""
    model = blocks(width, depth)
    forward = torch.compile(model) if compile else model
    seconds = plain_step_seconds(forward, torch.optim.Adam(model.parameters(), lr=LR), data)
    return seconds[0], statistics.median(seconds[2:])


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    width, depth, batch, steps = (64, 8, 16, 8) if args.quick else (512, 8, 512, 16)
    weights = parameter_bytes(blocks(width, depth))
    data = [(x, x.clone()) for x, _ in regression(steps, batch, width)]
    rows = []
    for compile in (False, True):
        first, step = plain(width, depth, data, compile)
        rows.append({"way": f"plain loop{', torch.compile' if compile else ''}", "placement": "in memory",
                     "first s": first, "step s": step})
    for placement, budget in (("homed", 10 * weights), ("swapped", weights // 3)):
        for compile in (False, True):
            result = harmony.train(blocks(width, depth), data, nn.functional.mse_loss,
                                   lambda p: torch.optim.Adam(p, lr=LR), microbatches=2, devices=["cpu"],
                                   device_memory=budget, compile=compile, progress=False)
            rows.append({"way": f"harmony{', compile=True' if compile else ''}", "placement": placement,
                         "first s": result.stats.step_seconds[0][0], "step s": result.stats.steady_seconds_per_step(0),
                         "packs": len(result.packings[0].packs)})
    for row in rows:
        row.setdefault("packs", 1)
        row["/ plain eager"] = row["step s"] / rows[0]["step s"]
    report("compiled", f"torch.compile of packs: {depth} MLP blocks of width {width} ({weights:,} B), batch {batch}, "
           f"{steps} steps, one CPU device", rows, args.out,
           notes="first s: to the end of the first step (compiling included); step s: steady, per step")


if __name__ == "__main__":
    main()
