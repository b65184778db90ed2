"""Benchmark 1: swap volume per step against the number of micro-batches, grouped vs per micro-batch.

One model four times larger than the device budget, M = 1, 2, 4, 8, 16. For each M, Harmony's grouped
tasks (weights swapped in once per pack per step) and the per-micro-batch policy (group=False, weights
swapped in again for every micro-batch) run on the same data; the table shows measured weight bytes in
and gradient bytes out per step beside the analytical 2W / 1W bound, the per-micro-batch cost 2*M*W,
and what the simulator predicts for the grouped run.

    python -m benchmarks.swap_volume
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, regression
from benchmarks.report import arguments, report


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    steps, batch, width, depth = (2, 32, 96, 24) if args.quick else (3, 32, 96, 24)
    counts = (1, 4) if args.quick else (1, 2, 4, 8, 16)
    weights = parameter_bytes(mlp(width, depth))
    budget = weights // 4
    data = regression(steps, batch, width)
    rows = []
    for microbatches in counts:
        measured = {}
        for group in (True, False):
            result = harmony.train(mlp(width, depth), data, loss_fn=nn.functional.mse_loss,
                                   optimizer=lambda p: torch.optim.SGD(p, lr=0.01), microbatches=microbatches,
                                   device_memory=budget, group=group, progress=False)
            measured[group] = result.stats
        predicted = harmony.plan(mlp(width, depth), data, microbatches=microbatches, device_memory=budget)
        rows.append({
            "M": microbatches,
            "W": weights,
            "weights_in/step": measured[True].bytes_in["weights"] / steps,
            "2W bound": 2 * weights,
            "grads_out/step": measured[True].bytes_out["grads"] / steps,
            "1W": weights,
            "per-microbatch in/step": measured[False].bytes_in["weights"] / steps,
            "2MW": 2 * microbatches * weights,
            "simulated in/step": predicted.weights_in_per_step,
            "peak": max(measured[True].peak_device_bytes.values()),
            "budget": budget,
        })
    report("swap_volume", f"Swap volume per step, one model of {weights:,} B on a {budget:,} B device", rows,
           args.out, notes="grouped weights_in stays under 2W for every M; per-micro-batch swapping grows as 2MW")


if __name__ == "__main__":
    main()
