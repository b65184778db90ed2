"""Benchmark 4: do swaps hide behind compute? Three prefetch settings over a simulated host-device link.

One MLP twice the device budget on one CPU device, one pack a task, its batch in 8 micro-batches: activations
and their gradients cross the link more than weights do, as in `gpu_swap`'s swapped rows. A run without a link
gives the compute time per step, beside a plain PyTorch loop over the same micro-batches with the whole model on
the device (no budget, no link: the floor); then, at link speeds where the busier direction's copies take less
than, about and more than that compute time, the model trains with prefetch=True (weights while the task before
computes, each micro-batch's values in while the one before computes and out while the one after computes),
"weights" (the weights only) and False (nothing). The link carries one copy at a time each way and both ways at
once (runtime.link). Each row shows the measured step time beside the ideal max(compute, in, out), the serial
compute + in + out, and the simulator's prediction.

    python -m benchmarks.overlap [--quick]
"""

from __future__ import annotations

import logging
import statistics

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, plain_step_seconds, regression
from benchmarks.report import arguments, report

MICROBATCHES = 8


def run(width: int, depth: int, data: list, budget: int, link: float | None,
        prefetch: bool | str) -> harmony.TrainResult:
    return harmony.train(mlp(width, depth), data, loss_fn=nn.functional.mse_loss,
                         optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), microbatches=MICROBATCHES, devices=["cpu"],
                         device_memory=budget, link_bandwidth=link, prefetch=prefetch, packs_per_task=1,
                         progress=False)


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    width, depth, batch, steps = (512, 12, 1024, 4) if args.quick else (512, 16, 2048, 5)
    weights = parameter_bytes(mlp(width, depth))
    budget = weights // 2
    data = regression(steps, batch, width)
    model = mlp(width, depth)
    plain = statistics.median(plain_step_seconds(model, torch.optim.SGD(model.parameters(), lr=1e-3), data,
                                                 microbatches=MICROBATCHES)[1:])
    free = run(width, depth, data, budget, None, True)
    compute = free.stats.steady_seconds_per_step()
    moved_in = sum(free.stats.bytes_in.values()) / steps
    moved_out = sum(free.stats.bytes_out.values()) / steps
    rows = []
    for label, ratio in (("copy < compute", 0.4), ("copy ~ compute", 1.0), ("copy > compute", 2.5)):
        bandwidth = max(moved_in, moved_out) / (ratio * compute)
        gpu_like = harmony.Hardware("this CPU over the link", host_link=bandwidth)
        for prefetch in (True, "weights", False):
            result = run(width, depth, data, budget, bandwidth, prefetch)
            stats = result.stats
            inward = sum(stats.bytes_in.values()) / steps / bandwidth
            outward = sum(stats.bytes_out.values()) / steps / bandwidth
            simulated = harmony.plan(mlp(width, depth), data, microbatches=MICROBATCHES, devices=1,
                                     device_memory=budget, hardware=gpu_like, prefetch=prefetch, packs_per_task=1)
            values = stats.bytes_in["activations"] + stats.bytes_in["inputs"]
            rows.append({
                "link": label,
                "MB/s": bandwidth / 1e6,
                "prefetch": str(prefetch),
                "step s": result.stats.steady_seconds_per_step(),
                "compute s": compute,
                "plain PyTorch s": plain,
                "in s": inward,
                "out s": outward,
                "ideal max": max(compute, inward, outward),
                "serial sum": compute + inward + outward,
                "predicted s": simulated.step_seconds,
                "weights prefetched %": 100 * stats.bytes_prefetched / max(stats.bytes_in["weights"], 1),
                "values ahead %": 100 * stats.bytes_ahead / max(values, 1),
                "outputs behind %": 100 * stats.bytes_behind / max(stats.bytes_out["activations"], 1),
                "peak": max(stats.peak_device_bytes.values()),
                "budget": budget,
            })
    report("overlap", f"Swap/compute overlap: an MLP of {weights:,} B on a {budget:,} B CPU device, batch {batch} in "
           f"{MICROBATCHES} micro-batches, a pack a task", rows, args.out,
           notes="step s: measured, from the end of the first step to the last; compute s: the same with no link; "
                 "plain PyTorch s: the median step of a plain loop, the model resident; in s / out s: the bytes each "
                 "way over the link's speed")


if __name__ == "__main__":
    main()
