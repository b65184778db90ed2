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

With --tasks pass the model is four times the budget and each pass is one task of all its packs, in 16
micro-batches (gpu_swap's 16k row in small: a pack's outputs for the whole batch take the whole budget), so most
values are handed on from pack to pack inside the task, kept on the device where they fit and sent out behind the
compute where they do not.

    python -m benchmarks.overlap [--quick] [--tasks pack|pass]
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

SHAPES = {  # --tasks: (width, depth, batch, steps), quick shapes, budget / weights, micro-batches, packs a task
    "pack": ((512, 16, 2048, 5), (512, 12, 1024, 4), 1 / 2, 8, 1),
    "pass": ((256, 32, 2048, 6), (256, 16, 1024, 4), 1 / 4, 16, 64),
}


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", choices=SHAPES, default="pack",
                        help="a pack a task (default), or each pass one task of all its packs")


def main() -> None:
    args = arguments(__doc__.splitlines()[0], options)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    full, quick, share, microbatches, packs_per_task = SHAPES[args.tasks]
    width, depth, batch, steps = quick if args.quick else full
    weights = parameter_bytes(mlp(width, depth))
    budget = int(weights * share)
    data = regression(steps, batch, width)
    model = mlp(width, depth)
    plain = statistics.median(plain_step_seconds(model, torch.optim.SGD(model.parameters(), lr=1e-3), data,
                                                 microbatches=microbatches)[1:])

    def run(link: float | None, prefetch: bool | str) -> harmony.TrainResult:
        return harmony.train(mlp(width, depth), data, loss_fn=nn.functional.mse_loss,
                             optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), microbatches=microbatches,
                             devices=["cpu"], device_memory=budget, link_bandwidth=link, prefetch=prefetch,
                             packs_per_task=packs_per_task, progress=False)

    free = run(None, True)
    compute = free.stats.steady_seconds_per_step()
    moved_in = sum(free.stats.bytes_in.values()) / steps
    moved_out = sum(free.stats.bytes_out.values()) / steps
    rows = []
    for label, ratio in (("copy < compute", 0.4), ("copy ~ compute", 1.0), ("copy > compute", 2.5)):
        bandwidth = max(moved_in, moved_out) / (ratio * compute)
        gpu_like = harmony.Hardware("this CPU over the link", host_link=bandwidth)
        for prefetch in (True, "weights", False):
            result = run(bandwidth, prefetch)
            stats = result.stats
            inward = sum(stats.bytes_in.values()) / steps / bandwidth
            outward = sum(stats.bytes_out.values()) / steps / bandwidth
            simulated = harmony.plan(mlp(width, depth), data, microbatches=microbatches, devices=1,
                                     device_memory=budget, hardware=gpu_like, prefetch=prefetch,
                                     packs_per_task=packs_per_task)
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
                "values in+out MB": (values + stats.bytes_out["activations"]) / steps / 1e6,
                "room wait s": sum(stats.room_seconds.values()) / steps,
                "peak": max(stats.peak_device_bytes.values()),
                "budget": budget,
            })
    report("overlap", f"Swap/compute overlap: an MLP of {weights:,} B on a {budget:,} B CPU device, batch {batch} in "
           f"{microbatches} micro-batches, " + ("a pack a task" if packs_per_task == 1 else "a pass a task"),
           rows, args.out,
           notes="step s: measured, from the end of the first step to the last; compute s: the same with no link; "
                 "plain PyTorch s: the median step of a plain loop, the model resident; in s / out s: the bytes each "
                 "way over the link's speed; room wait s: a step's waits of the compute thread for room on the device "
                 "(a value sent out to land, weights to arrive)")


if __name__ == "__main__":
    main()
