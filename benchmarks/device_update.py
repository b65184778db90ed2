"""Where a swapped model's update runs: on the host store (in backward, or beside the device) or on the device.

One MLP four times its device's budget, trained with SGD (no optimizer state) and with Adam (two moments per
weight), each of three ways: the host store's optimizer in each pack's backward task, in upd tasks beside the
device (overlap_update), and on the device (update_on="device": the state copied in beside the pack's weights and
gradients, the new weights and state copied out). Beside each measured step the plan's prediction for that way, and
the way "auto" picks; against a plain PyTorch loop with the model resident on the same device. On CPU devices the
device is the host, so an update there only adds the state's copies; on a GPU (--device cuda:0) the host's cores
and the link decide it (issue 28: "for packs whose optimizer state fits the device, the update runs on the device;
choose by prediction").

    python -m benchmarks.device_update [--device cuda:0] [--link 12GB/s]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, regression
from benchmarks.report import arguments, report

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=1e-3),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-4),
}
WAYS = {  # (update_on, overlap_update)
    "host, in backward": ("host", False),
    "host, beside the device": ("host", True),
    "on the device": ("device", False),
    "auto": ("auto", None),
}


def plain_resident(model: nn.Module, data: list, device: torch.device, factory: Callable) -> float:
    """Seconds per step of a plain loop with the whole model on device (the steps after the first two)."""
    model = model.to(device)
    optimizer = factory(list(model.parameters()))
    timings = []
    for x, y in data:
        started = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - started)
    return sum(timings[2:]) / len(timings[2:])


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="the device to train on (cpu, or cuda:0)")
    parser.add_argument("--link", default=None, help="a simulated host<->device link for a CPU device (e.g. 12GB/s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every way, alternating (median and range)")


def main() -> None:
    args = arguments(__doc__.splitlines()[0], options)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    device = torch.device(args.device)
    width, depth, batch, steps = (256, 24, 32, 6) if args.quick else (1024, 24, 256, 8)
    if device.type == "cuda":
        width, depth, batch, steps = (2048, 32, 4096, 8) if not args.quick else (1024, 32, 2048, 6)
    weights = parameter_bytes(mlp(width, depth))
    budget = weights // 4
    data = regression(steps, batch, width)
    settings = {"microbatches": 2, "devices": [args.device], "device_memory": budget, "fuse": False,
                "link_bandwidth": args.link, "progress": False}
    planned = {k: v for k, v in settings.items() if k not in ("progress", "link_bandwidth")}
    rows, raw = [], {}
    for name, factory in OPTIMIZERS.items():
        measured: dict[str, list[float]] = {way: [] for way in ("plain PyTorch, resident", *WAYS)}
        seen: dict[str, dict] = {}
        for round_index in range(args.rounds):
            measured["plain PyTorch, resident"].append(plain_resident(mlp(width, depth), data, device, factory))
            order = list(WAYS)[round_index % len(WAYS):] + list(WAYS)[:round_index % len(WAYS)]  # no way always first
            for way in order:
                update_on, overlap = WAYS[way]
                chosen = {"update_on": update_on, "overlap_update": overlap}
                result = harmony.train(mlp(width, depth), data, loss_fn=nn.functional.mse_loss, optimizer=factory,
                                       **settings, **chosen)
                measured[way].append(result.stats.steady_seconds_per_step(0))
                print(f"{name}, round {round_index + 1}: {way}: {measured[way][-1]:.4f} s a step", flush=True)
                if way not in seen:
                    forecast = harmony.plan(mlp(width, depth), data, loss_fn=nn.functional.mse_loss,
                                            optimizer=factory, **planned, **chosen)
                    job, stats = result.plan.jobs[0], result.stats
                    seen[way] = {
                        "chosen": "on the device" if job.device_update else "beside" if job.overlap else "in backward",
                        "predicted s": forecast.step_seconds,
                        "grads out/step": stats.bytes_out["grads"] // steps,
                        "state in+out/step": (stats.bytes_in["state"] + stats.bytes_out["state"]) // steps,
                        "weights out/step": stats.bytes_out["weights"] // steps,
                    }
        resident = statistics.median(measured["plain PyTorch, resident"])
        for way, timings in measured.items():
            rows.append({"optimizer": name, "way": way, "step s (median)": statistics.median(timings),
                         "min": min(timings), "max": max(timings),
                         "resident / this": resident / statistics.median(timings),
                         **seen.get(way, {"chosen": "", "predicted s": 0.0, "grads out/step": 0,
                                          "state in+out/step": 0, "weights out/step": 0})})
        raw[name] = measured
    report("device_update", f"Where the update runs: one MLP of {weights:,} B on {args.device} with a budget of "
           f"{budget:,} B" + (f", link {args.link}" if args.link else "") + f", {args.rounds} rounds", rows,
           args.out, notes="step s: measured steady seconds a step, median of the rounds (each round runs every way "
           "once, in turn, starting one further along the list each round) with their range; predicted s: "
           "harmony.plan's prediction for that way on this machine (measured copy speed and host optimizer rate; a "
           "GPU's measured speed and pinned link); chosen: where the run's updates ran", raw=raw)


if __name__ == "__main__":
    main()
