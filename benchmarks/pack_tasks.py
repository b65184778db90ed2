"""Benchmark: tasks of several packs against one pack per task, for small packs whose compute is near Dask's cost.

A sweep of swapped MLPs, each cut into many small packs under a budget of a quarter of its weights, trains on
CPU devices with one pack per task, with the packs per task that ``packs_per_task="auto"`` takes from the measured
task cost, and with a whole pass per task; beside them, in the same run, the plain loop (every model in memory,
one after the other). Each row: packs and tasks per step, Dask tasks in all, steady seconds per sweep step (the
median over the steps after the first few, min-max beside) and its ratio to the plain loop's.

    python -m benchmarks.pack_tasks [--quick]
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, regression
from benchmarks.report import arguments, report

WIDTH = 128
DEPTH = 32
MODELS = 4
BATCH = 64
WARMUP = 3


def plain_step_seconds(models: list[nn.Module], data: list) -> list[float]:
    """The plain loop's sweep steps: each model's step in turn, every model in memory."""
    optimizers = [torch.optim.Adam(model.parameters(), lr=1e-3) for model in models]
    times = []
    for x, y in data:
        started = time.perf_counter()
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        times.append(time.perf_counter() - started)
    return times[WARMUP:]


def harmony_run(data: list, devices: int, packs_per_task: int | str) -> dict[str, object]:
    models = [mlp(WIDTH, DEPTH, seed=seed) for seed in range(MODELS)]
    budget = parameter_bytes(models[0]) // 4
    result = harmony.train(models, data, loss_fn=nn.functional.mse_loss,
                           optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), devices=["cpu"] * devices,
                           device_memory=budget, fuse=False, packs_per_task=packs_per_task, progress=False)
    finished = [max(step_times) for step_times in zip(*result.stats.step_seconds)]  # every model's step done
    steps = [b - a for a, b in zip(finished[WARMUP:], finished[WARMUP + 1 :])]
    job = result.plan.jobs[0]
    return {"packs": len(job.packing.packs), "tasks per pass": job.section_count, "tasks": result.stats.tasks,
            "updates": "device" if job.device_updates else "beside" if job.overlap else "host",
            "threads": ",".join("one" if one else "all" for one in result.stats.one_thread.values()) or "one each",
            "steps": steps}


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    steps = 8 if args.quick else 20
    data = regression(steps, BATCH, WIDTH)
    plain = statistics.median(plain_step_seconds([mlp(WIDTH, DEPTH, seed=seed) for seed in range(MODELS)], data))
    rows, raw = [], {}
    for devices in (1, 2):
        for packs_per_task in (1, "auto", DEPTH * 2):
            run = harmony_run(data, devices, packs_per_task)
            times = sorted(run.pop("steps"))  # type: ignore[arg-type]
            median = statistics.median(times)
            label = "whole pass" if packs_per_task == DEPTH * 2 else str(packs_per_task)
            raw[f"{devices} devices, {label}"] = times
            rows.append({"devices": devices, "packs per task": label, **run, "step s": median,
                         "range": f"{times[0]:.3f}-{times[-1]:.3f}", "/ plain loop": median / plain})
            print(f"{devices} devices, packs per task {label}: {median * 1e3:.1f} ms a step", flush=True)
    report("pack_tasks", f"{MODELS} MLPs of {DEPTH} layers x {WIDTH} under a quarter of a model's weights, CPU devices "
           f"(plain loop {plain * 1e3:.1f} ms a step)", rows, args.out,
           notes="step s: median seconds per sweep step (every model one step) after the first few; range min-max",
           raw=raw)


if __name__ == "__main__":
    main()
