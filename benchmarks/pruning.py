"""Benchmark: what prune="halving" saves a sweep, against the same sweep trained to the end and the plain loop's
successive halving.

A grid of MLPs (one architecture, SGD with momentum at a spread of learning rates) learning a fixed random MLP,
evaluated every --every steps. Each way trains the grid and reports its seconds, the model-steps it trained and the
validation loss of the model it ends with as best. The plain loops step every model still training once per
batch in turn (as a hand-written sweep in one process does) and halve at each evaluation like Harmony's pruner;
Harmony runs on two CPU devices, unfused (a pruned model frees its device), fused (an array homed on its device
computes its members still training), fused and swapped (under a device budget of four times the largest layer's
weights of an array of all: its steps compute the members still training too, runtime.rows) and as fuse="auto"
chooses. Seconds are medians over rounds (the ways alternate, so that the machine's drift falls on all of them).

    python -m benchmarks.pruning [--quick] [--rounds N] [--models 8] [--every 8] [--width 512] [--ways swapped]
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import harmony
from benchmarks.models import mlp
from benchmarks.report import arguments, report
from harmony.tasks.pruning import Standing, halving


def rates(count: int) -> list[float]:
    """count learning rates spread evenly in log space over [1e-4, 0.1]."""
    return [10 ** (-4 + 3 * index / max(count - 1, 1)) for index in range(count)]


def factory(rate: float) -> Callable[..., torch.optim.Optimizer]:
    return lambda parameters: torch.optim.SGD(parameters, lr=rate, momentum=0.9)


def teacher_data(steps: int, batch: int, width: int, seed: int) -> list:
    """Batches of inputs and a fixed random MLP's outputs for them (with a little noise): a target the grid can learn,
    so that the learning rates part."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * batch, width, generator=generator)
    with torch.no_grad():
        y = mlp(width, 2, seed=99)(x)
        y = y / y.std() + 0.1 * torch.randn(steps * batch, 8, generator=generator)  # unit scale, a little noise
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, steps * batch, batch)]


def validation_loss(model: nn.Module, val: list) -> float:
    with torch.no_grad():
        return sum(nn.functional.mse_loss(model(x), y).item() * len(x) for x, y in val) / sum(len(x) for x, _ in val)


def plain(models: list[nn.Module], data: list, val: list, every: int, prune: bool) -> dict[str, Any]:
    """The plain sweep in one process: per batch every model still training steps; every `every` steps they are
    evaluated and, with prune, the worse half stops."""
    optimizers = [factory(rate)(model.parameters()) for model, rate in zip(models, rates(len(models)))]
    training = list(range(len(models)))
    losses = dict.fromkeys(training, math.inf)
    model_steps = 0
    started = time.perf_counter()
    for step, (x, y) in enumerate(data, start=1):
        for index in training:
            optimizers[index].zero_grad()
            nn.functional.mse_loss(models[index](x), y).backward()
            optimizers[index].step()
            model_steps += 1
        if step % every == 0 or step == len(data):
            for index in training:
                losses[index] = validation_loss(models[index], val)
        if prune and step % every == 0 and step < len(data):
            stopped = set(halving(step, [Standing(index, "", losses[index]) for index in training]))
            training = [index for index in training if index not in stopped]
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "model-steps": model_steps, "computed": model_steps,
            "best val loss": min(losses.values())}


def with_harmony(models: list[nn.Module], data: list, val: list, every: int, prune: bool, fuse: bool | str,
                 swapped: bool = False, link: str | None = None) -> dict[str, Any]:
    """swapped: arrays (fuse=True) under a budget of four times the largest layer's weights of an array of all;
    link: a simulated host link's bandwidth (harmony.train's link_bandwidth)."""
    layer = len(models) * max(sum(param.numel() * param.element_size() for param in module.parameters())
                              for module in models[0].modules() if isinstance(module, nn.Linear))
    result = harmony.train(models, data, nn.functional.mse_loss, [factory(rate) for rate in rates(len(models))],
                           devices=2, fuse=fuse, val_loaders=val, eval_every=every,
                           prune="halving" if prune else None, progress=False,
                           device_memory=4 * layer if swapped else None, link_bandwidth=link)
    assert not swapped or not result.homes, f"arrays {result.arrays} homed at {result.homes}"
    return {"seconds": result.stats.wall_seconds, "run": result.stats.run_seconds,
            "model-steps": sum(result.stats.steps),
            "computed": result.stats.computed, "best val loss": result.best().val_loss,
            "busy": statistics.mean(result.stats.utilization().values()),
            "weights in GB": result.stats.bytes_in["weights"] / 1e9,
            "grads out GB": result.stats.bytes_out["grads"] / 1e9,
            "arrays": " + ".join(str(len(members)) for members in result.arrays)}


def main() -> None:
    def extend(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rounds", type=int, default=3, help="runs of each way (the table gives the median)")
        parser.add_argument("--models", type=int, default=8, help="the grid's size")
        parser.add_argument("--every", type=int, default=8, help="steps between evaluations (pruning steps)")
        parser.add_argument("--width", type=int, default=None, help="the MLPs' width (default 512; 128 quick)")
        parser.add_argument("--link", default=None, help="a simulated host link for Harmony's devices (e.g. 2GB/s)")
        parser.add_argument("--ways", default="", help="only the ways whose names contain this (the two plain loops "
                            "always run: the table's ratios are to the plain halving)")

    args = arguments(__doc__.splitlines()[0], extend)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    width, depth, batch, steps = (128, 4, 32, 24) if args.quick else (512, 6, 128, 48)
    width = args.width or width
    every = min(args.every, steps // 4)
    data = teacher_data(steps, batch, width, seed=1)
    val = teacher_data(4, batch, width, seed=7)

    def harmony_way(prune: bool, fuse: bool | str, swapped: bool = False
                    ) -> Callable[[list[nn.Module]], dict[str, Any]]:
        return lambda models: with_harmony(models, data, val, every, prune, fuse, swapped, args.link)

    ways: dict[str, Callable[[list[nn.Module]], dict[str, Any]]] = {
        "plain loop, every model to the end": lambda models: plain(models, data, val, every, False),
        "plain loop, successive halving": lambda models: plain(models, data, val, every, True),
        "Harmony, every model to the end": harmony_way(False, False),
        "Harmony, prune='halving'": harmony_way(True, False),
        "Harmony fused, every model to the end": harmony_way(False, True),
        "Harmony fused, prune='halving'": harmony_way(True, True),
        "Harmony fused and swapped, every model to the end": harmony_way(False, True, swapped=True),
        "Harmony fused and swapped, prune='halving'": harmony_way(True, True, swapped=True),
        "Harmony fuse='auto', prune='halving'": harmony_way(True, "auto"),
    }
    ways = {name: way for index, (name, way) in enumerate(ways.items()) if index < 2 or args.ways in name}
    with_harmony([mlp(width, depth, seed=seed) for seed in range(2)], data[:2], val, 1, False, False)  # warm
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            runs[name].append(way([mlp(width, depth, seed=seed) for seed in range(args.models)]))
    rows = []
    for name, measured in runs.items():
        seconds = [run["seconds"] for run in measured]
        rows.append({"way": name, "model-steps": measured[0]["model-steps"], "computed": measured[0]["computed"],
                     "seconds": statistics.median(seconds),
                     "range": f"{min(seconds):.2f}-{max(seconds):.2f}",
                     "run s": statistics.median(run.get("run", run["seconds"]) for run in measured),
                     "best val loss": measured[0]["best val loss"],
                     "busy": measured[0].get("busy", 1.0), "arrays": measured[0].get("arrays", ""),
                     "weights in GB": measured[0].get("weights in GB", 0.0),
                     "grads out GB": measured[0].get("grads out GB", 0.0)})
    base = rows[1]["seconds"]
    for row in rows:
        row["/ plain halving"] = row["seconds"] / base
    report("pruning", f"prune='halving': {args.models} MLPs {width}x{depth}, batch {batch}, {steps} steps, evaluated "
           f"every {every}, SGD+momentum at {args.models} learning rates, 2 CPU devices"
           + (f" over a simulated {args.link} link" if args.link else "") + f", {args.rounds} rounds", rows,
           args.out, raw=runs, notes="seconds: the whole call; run s: the training alone (Harmony: stats.run_seconds, "
           "without starting, planning and taking down); model-steps: the steps the models trained; computed: those "
           "computed (stats.computed: an array's stopped members too where a step computes them); busy: the devices' "
           "mean busy share; "
           "arrays: the jobs' sizes (Harmony); weights in GB, grads out GB: bytes_in['weights'] and "
           "bytes_out['grads'] of the first round (Harmony)")


if __name__ == "__main__":
    main()
