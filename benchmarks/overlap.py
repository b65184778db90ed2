"""Benchmark 4: do swaps hide behind compute? Prefetch on and off over a simulated host-device link.

One model four times the device budget on one CPU device. A run without a link limit gives the compute
time per step; then, at link speeds where the copy time per step is below, near and above that compute
time, the model trains with prefetch (the copy engine brings the next pack in while the current one
computes) and without. Copy time is every byte that crosses the link in a step (weights, activations,
inputs, gradients) over its bandwidth. Each row shows the measured step time beside the ideal
max(compute, copy), the serial compute + copy, and the simulator's prediction.

    python -m benchmarks.overlap
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, regression
from benchmarks.report import arguments, report


def run(width: int, depth: int, data: list, budget: int, link: float | None, prefetch: bool) -> harmony.TrainResult:
    return harmony.train(mlp(width, depth), data, loss_fn=nn.functional.mse_loss,
                         optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), microbatches=2, devices=["cpu"],
                         device_memory=budget, link_bandwidth=link, prefetch=prefetch, progress=False)


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    width, depth, batch, steps = (512, 20, 128, 3) if args.quick else (1024, 20, 256, 3)
    weights = parameter_bytes(mlp(width, depth))
    budget = weights // 4
    data = regression(steps, batch, width)
    free = run(width, depth, data, budget, None, True)
    compute = free.stats.finish_seconds[0] / steps
    swapped = (sum(free.stats.bytes_in.values()) + sum(free.stats.bytes_out.values())) / steps
    rows = []
    for label, ratio in (("copy < compute", 0.4), ("copy ~ compute", 1.0), ("copy > compute", 2.5)):
        bandwidth = swapped / (ratio * compute)
        copy = swapped / bandwidth
        gpu_like = harmony.Hardware("this CPU over the link", host_link=bandwidth)
        for prefetch in (True, False):
            result = run(width, depth, data, budget, bandwidth, prefetch)
            predicted = harmony.plan(mlp(width, depth), data, microbatches=2, devices=["cpu"], device_memory=budget,
                                     prefetch=prefetch)
            simulated = harmony.plan(mlp(width, depth), data, microbatches=2, devices=1, device_memory=budget,
                                     hardware=gpu_like, prefetch=prefetch)
            rows.append({
                "link": label,
                "MB/s": bandwidth / 1e6,
                "prefetch": prefetch,
                "step s": result.stats.finish_seconds[0] / steps,
                "compute s": compute,
                "copy s": copy,
                "weights copy s": result.stats.bytes_in["weights"] / steps / bandwidth,
                "ideal max": max(compute, copy),
                "serial sum": compute + copy,
                "predicted s": simulated.step_seconds,
                "prefetched %": 100 * result.stats.bytes_prefetched / max(result.stats.bytes_in["weights"], 1),
                "activations in/step": result.stats.bytes_in["activations"] // steps,
                "kept/step": result.stats.bytes_kept // steps,
                "peak": max(result.stats.peak_device_bytes.values()),
                "predicted peak": max(predicted.peak_device_bytes.values()),
                "budget": budget,
            })
    report("overlap", f"Swap/compute overlap: one model of {weights:,} B on a {budget:,} B CPU device", rows,
           args.out, notes="step s: measured time per step; compute s: the same run with no link limit")


if __name__ == "__main__":
    main()
