"""Benchmark: what Harmony adds per pack and micro-batch, beside the plain loop over the same micro-batches.

One swapped MLP (a budget of a quarter of its weights, or the room for a pass's values where that is more), each
pass one task of all its packs, trained on one CPU device with as many micro-batches as each row says; beside it,
in the same round, the plain loop over the same micro-batches with the model in memory, and harmony.plan's
prediction. Rounds alternate the two (median and range). The cost per pack and micro-batch is Harmony's step less
the plain loop's, over the pack micro-batches a step runs (packs x micro-batches x 2: a forward, and a backward
that recomputes it): the recomputed forward, the runtime's own work around each pack's call (binding its weights,
claiming, copying and handing on its values, counting), the packs' host updates and the tasks' cost, of which the
simulator models the recompute, the copies and the task's cost. The packs are cut for the budget, so fewer
micro-batches (larger values) give more, smaller packs.

On a GPU (--device cuda:0) the same rows measure the host's cost per call where the kernels are short (it hides
behind them only where they take longer), with a wider model beside.

    python -m benchmarks.microbatch_cost [--quick] [--device cuda:0]
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

DEPTH = 16


def plain_seconds(width: int, data: list, microbatches: int, device: torch.device) -> float:
    """The median step (after the first) of a plain loop over the same micro-batches, the model on device."""
    model = mlp(width, DEPTH).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    seconds = []
    for x, y in data:
        started = time.perf_counter()
        optimizer.zero_grad()
        for xs, ys in zip(x.to(device).chunk(microbatches), y.to(device).chunk(microbatches)):
            (nn.functional.mse_loss(model(xs), ys) / microbatches).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def sgd(parameters: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=1e-3)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="the device to train on (cpu, or cuda:0)")


def main() -> None:
    args = arguments(__doc__.splitlines()[0], options)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    device = torch.device(args.device)
    batch = 4096 if device.type == "cuda" else 1024
    widths = (256, 2048) if device.type == "cuda" else (64, 256)
    widths, counts, rounds, steps = (widths[:1], (4, 16), 2, 6) if args.quick else (widths, (4, 16, 64), 3, 10)
    rows, raw = [], {}
    for width in widths:
        data = regression(steps, batch, width)
        weights = parameter_bytes(mlp(width, DEPTH))
        budget = max(weights // 4, 16 * batch * width)  # at least room for a layer's values at 4 micro-batches
        for microbatches in counts:
            settings = {"microbatches": microbatches, "device_memory": budget, "packs_per_task": 2 * DEPTH,
                        "optimizer": sgd}  # harmony.plan homes a model by its optimizer's state as train does
            predicted = {"fitted before": harmony.plan(mlp(width, DEPTH), data, devices=[args.device], **settings)
                         .step_seconds if harmony.calls.learned(device.type) else None}  # the row before's fits
            harmony.calls.forget()
            predicted["cold"] = harmony.plan(mlp(width, DEPTH), data, devices=[args.device], **settings).step_seconds
            plain, measured = [], []
            packs = 0
            for _ in range(rounds):
                harmony.calls.forget()  # every round planned alike; the last one's fit is kept for the next row
                plain.append(plain_seconds(width, data, microbatches, device))
                result = harmony.train(mlp(width, DEPTH), data, loss_fn=nn.functional.mse_loss,
                                       devices=[args.device], progress=False, **settings)
                measured.append(result.stats.steady_seconds_per_step())
                packs = len(result.plan.jobs[0].packing.packs)
            calls = packs * microbatches * 2
            step, base = statistics.median(measured), statistics.median(plain)
            rows.append({"width": width, "micro-batches": microbatches, "packs": packs,
                         "plain s": base, "Harmony s": step, "min": min(measured), "max": max(measured),
                         "Harmony / plain": step / base, "predicted s": predicted["cold"],
                         "predicted, fitted s": predicted["fitted before"],
                         "fitted us per call": 1e6 * (result.call_seconds or 0.0),
                         "room wait ms/step": 1e3 * sum(result.stats.room_seconds.values()) / len(data),
                         "gc ms/step": 1e3 * sum(result.stats.gc_seconds.values()) / len(data),
                         "per pack micro-batch us": 1e6 * (step - base) / calls})
            raw[f"{width}x{microbatches}"] = {"plain": plain, "harmony": measured}
    report("microbatch_cost", f"The runtime's cost per pack and micro-batch: MLP <width> x {DEPTH}, batch {batch}, "
           f"a pass a task, on {args.device}", rows, args.out,
           notes="plain s / Harmony s: median steady seconds a step over the rounds (min-max: Harmony's); per pack "
                 "micro-batch: (Harmony - plain) over packs x micro-batches x 2; predicted s: harmony.plan "
                 "before any run; predicted, fitted s: harmony.plan with the host cost per pack call fitted to the "
                 "row before's last run (another micro-batch count or width: out of sample); fitted us per call: what "
                 "this row's last run fitted (harmony.calls); room wait / gc: the last run's waits for room on the "
                 "device and its worker's garbage collections, over its steps", raw=raw)


if __name__ == "__main__":
    main()
