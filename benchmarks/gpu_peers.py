"""Harmony against DeepSpeed ZeRO-3 with CPU offload: one MLP four times a device's budget, in the same run.

Three ways train the same MLP (SGD) on the same data: a plain PyTorch loop with the model resident on the device,
Harmony swapping it under a budget of a quarter of its weights, and DeepSpeed ZeRO-3 with its parameters and its
optimizer offloaded to the CPU (``offload_param``, ``offload_optimizer``), told to keep at most a quarter of the
weights live on the device (``stage3_max_live_parameters``, ``stage3_prefetch_bucket_size``). Each round runs the
three in turn (DeepSpeed in a child process: it sets up torch.distributed for itself); the table gives the median
step time of the rounds and their range, each way's peak device bytes and its last loss. On a GPU, --depths also
grows the model under the same budget: the largest depth each way trains without going over it (issue 28: "compare
step time and the largest model per budget"). On a CPU device DeepSpeed runs on its CPU accelerator
(``DS_ACCELERATOR=cpu``), where device and host memory are one: step times only.

    pip install deepspeed  # not a dependency of Harmony: the peer, where it installs
    python -m benchmarks.gpu_peers [--device cpu] [--depths 32,64,128]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, regression
from benchmarks.report import arguments, report

LR = 1e-3
MARK = "DEEPSPEED RESULT "


def steady(timings: list[float], skip: int = 2) -> float:
    return statistics.median(timings[skip:]) if len(timings) > skip else statistics.median(timings)


def plain_resident(width: int, depth: int, data: list, device: torch.device) -> dict[str, Any]:
    """A plain loop with the whole model on device."""
    model = mlp(width, depth).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timings, loss = [], torch.zeros(())
    for x, y in data:
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"step s": steady(timings), "peak": peak, "loss": float(loss.detach())}


def harmony_swapped(width: int, depth: int, data: list, device: str, budget: int, microbatch: int) -> dict[str, Any]:
    """Harmony under budget, as planned."""
    result = harmony.train(mlp(width, depth), data, loss_fn=nn.functional.mse_loss,
                           optimizer=lambda p: torch.optim.SGD(p, lr=LR),
                           microbatches=max(1, len(data[0][0]) // microbatch), devices=[device], device_memory=budget,
                           fuse=False, progress=False)
    return {"step s": result.stats.steady_seconds_per_step(0), "peak": max(result.stats.peak_device_bytes.values()),
            "loss": result.history[0][-1]}


def deepspeed_config(batch: int, live: int) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer on the CPU, at most live parameters on the device at once."""
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "stage3_max_live_parameters": live,
            "stage3_prefetch_bucket_size": live // 2,
            "stage3_param_persistence_threshold": 0,
        },
    }


def deepspeed_child(settings: dict[str, Any]) -> None:
    """In a child process: DeepSpeed's steps, printed as one JSON line after MARK."""
    import deepspeed

    device = torch.device(settings["device"])
    data = regression(settings["steps"], settings["batch"], settings["width"])
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    model = mlp(settings["width"], settings["depth"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=deepspeed_config(settings["batch"], settings["live"]))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timings, loss = [], torch.zeros(())
    for x, y in data:
        started = time.perf_counter()
        loss = nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    print(MARK + json.dumps({"step s": steady(timings), "peak": peak, "loss": float(loss.detach())}), flush=True)


def deepspeed_run(settings: dict[str, Any], timeout: float) -> dict[str, Any] | str:
    """DeepSpeed's figures from a child process, or why there are none."""
    with socket.socket() as probe:  # a free port for torch.distributed's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                   "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    if settings["device"] == "cpu":
        environment["DS_ACCELERATOR"] = "cpu"
    try:
        child = subprocess.run([sys.executable, "-m", "benchmarks.gpu_peers", "--child", json.dumps(settings)],
                               capture_output=True, text=True, timeout=timeout, env=environment)
    except subprocess.TimeoutExpired:
        return f"did not finish in {timeout:.0f} s"
    for line in child.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = (child.stderr or child.stdout).strip().splitlines()[-1:] or ["no output"]
    return f"failed: {tail[0][:200]}"


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three ways, in turn")
    parser.add_argument("--depths", type=lambda text: [int(d) for d in text.split(",")], default=None,
                        help="on a GPU: depths to grow the model to under the same budget")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


def main() -> None:
    args = arguments(__doc__.splitlines()[0], options)
    if args.child is not None:
        deepspeed_child(json.loads(args.child))
        return
    logging.getLogger("distributed").setLevel(logging.ERROR)
    device = torch.device(args.device)
    if device.type == "cuda":
        width, depth, batch, steps, microbatch = (1024, 32, 2048, 6, 512) if args.quick else (2048, 32, 8192, 8, 1024)
    else:
        width, depth, batch, steps, microbatch = (256, 24, 64, 5, 32) if args.quick else (1024, 24, 256, 6, 128)
    weights = parameter_bytes(mlp(width, depth))
    budget = weights // 4
    data = regression(steps, batch, width)
    settings = {"device": args.device, "width": width, "depth": depth, "batch": batch, "steps": steps,
                "live": budget // 4 // 4}  # a quarter of the budget in float32 parameters
    ways = ("plain PyTorch, resident", "Harmony, as planned", "DeepSpeed ZeRO-3, CPU offload")
    measured: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
    missing: dict[str, str] = {}
    for round_index in range(1 if args.quick else args.rounds):
        measured[ways[0]].append(plain_resident(width, depth, data, device))
        measured[ways[1]].append(harmony_swapped(width, depth, data, args.device, budget, microbatch))
        outcome = deepspeed_run(settings, timeout=600)
        if isinstance(outcome, str):
            missing[ways[2]] = outcome
        else:
            measured[ways[2]].append(outcome)
        for way in ways:
            done = measured[way][-1] if measured[way] and len(measured[way]) == round_index + 1 else None
            print(f"round {round_index + 1}: {way}: " + (f"{done['step s']:.4f} s a step" if done else
                                                         missing.get(way, "no figure")), flush=True)
    rows = []
    resident = statistics.median(run["step s"] for run in measured[ways[0]])
    for way in ways:
        runs = measured[way]
        if not runs:
            rows.append({"way": f"{way}: {missing.get(way, 'no figure')}", "step s (median)": 0.0, "min": 0.0,
                         "max": 0.0, "resident / this": 0.0, "peak": 0, "budget": budget, "last loss": 0.0})
            continue
        median = statistics.median(run["step s"] for run in runs)
        rows.append({"way": way, "step s (median)": median, "min": min(run["step s"] for run in runs),
                     "max": max(run["step s"] for run in runs), "resident / this": resident / median,
                     "peak": max(run["peak"] for run in runs), "budget": budget, "last loss": runs[-1]["loss"]})
    raw: dict[str, Any] = {"rounds": measured, "deepspeed config": deepspeed_config(batch, settings["live"])}
    if args.depths and device.type == "cuda":
        raw["largest"] = largest_per_budget(args.depths, width, batch, steps, microbatch, args.device, budget,
                                            settings["live"])
    report("gpu_peers", f"Harmony vs DeepSpeed ZeRO-3 offload on {args.device}: one MLP of {weights:,} B, budget "
           f"{budget:,} B (a quarter of its weights)", rows, args.out,
           notes="step s: steady seconds a step, median of the rounds and their range; peak: device bytes (CUDA: "
           "torch.cuda.max_memory_allocated; Harmony: its accounted peak; on a CPU device not measured); DeepSpeed "
           "keeps at most a quarter of the budget's parameters live", raw=raw)


def largest_per_budget(depths: list[int], width: int, batch: int, steps: int, microbatch: int, device: str,
                       budget: int, live: int) -> list[dict[str, Any]]:
    """Per depth, whether each way trains the model within budget device bytes."""
    grown = []
    for depth in depths:
        data = regression(min(steps, 3), batch, width)
        try:
            ours: dict[str, Any] | str = harmony_swapped(width, depth, data, device, budget, microbatch)
        except (harmony.InputError, torch.OutOfMemoryError) as error:
            ours = f"{type(error).__name__}: {str(error)[:120]}"
        theirs = deepspeed_run({"device": device, "width": width, "depth": depth, "batch": batch,
                                "steps": min(steps, 3), "live": live}, timeout=600)
        grown.append({"depth": depth, "weights": parameter_bytes(mlp(width, depth)), "harmony": ours,
                      "deepspeed": theirs,
                      "harmony within budget": isinstance(ours, dict) and ours["peak"] <= budget,
                      "deepspeed within budget": isinstance(theirs, dict) and theirs["peak"] <= budget})
        print(f"depth {depth}: Harmony {grown[-1]['harmony within budget']}, DeepSpeed "
              f"{grown[-1]['deepspeed within budget']}", flush=True)
    return grown


if __name__ == "__main__":
    main()
