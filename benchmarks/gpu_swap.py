"""Benchmark 6: swapping on a real GPU: one model four times the device budget, prefetch on the copy stream.

On one CUDA device, an MLP whose weights are four times the budget Harmony is given trains with SGD, beside plain-
PyTorch ways of doing the same work in the same run: the model resident on the GPU (it fits the real card: the
compute floor; also in Harmony's micro-batches, and under bf16 autocast) and a hand-written loop that swaps each
layer in before its forward and again before its backward, takes its gradients out and steps SGD on the host
(synchronous copies from pinned memory: the same 2W in and 1W out per step as Harmony). Harmony runs without
prefetch, with the weights prefetched only (next pack copied on the copy stream while this one computes), with
prefetch (and each micro-batch's values in on the copy stream while the one before computes, out on the outward
stream while the one after computes) one pack per task with its update in the backward task on the host or on the
GPU, and as planned (packs per task from the measured task cost, updates where the simulator predicts them fastest).
--profile writes each run's torch.profiler trace of two steps per device.
Each row: steady seconds per step, its throughput over the resident loop's, weight bytes in per step, and the ideal
max(compute, copy) at the measured pinned copy speed, at several batch sizes (samples served per weight load).

    python -m benchmarks.gpu_swap [--profile traces/]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
from torch import nn

import harmony
from benchmarks.models import mlp, parameter_bytes, regression
from benchmarks.report import arguments, report

LR = 1e-3


def pinned_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> tuple[float, float]:
    """Measured host-to-device and device-to-host bytes per second between pinned host memory and device."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    card = torch.empty(nbytes, dtype=torch.uint8, device=device)
    speeds = []
    for target, source in ((card, host), (host, card)):
        target.copy_(source)
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(5):
            target.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)
        speeds.append(5 * nbytes / (time.perf_counter() - started))
    return speeds[0], speeds[1]


def steady(timings: list[float], skip: int = 2) -> float:
    return sum(timings[skip:]) / len(timings[skip:])


def plain_resident(model: nn.Module, data: list, device: torch.device, bf16: bool = False,
                   microbatch: int | None = None) -> float:
    """Seconds per step of a plain loop with the whole model on the GPU (under bf16 autocast if asked), the batch
    at once or, given microbatch, in micro-batches of that many samples whose gradients add up (as Harmony's)."""
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    timings = []
    for x, y in data:
        started = time.perf_counter()
        optimizer.zero_grad()
        size = microbatch or len(x)
        for part, target in zip(x.split(size), y.split(size)):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                loss = nn.functional.mse_loss(model(part.to(device)), target.to(device)) * (len(part) / len(x))
            loss.backward()
        optimizer.step()
        torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - started)
    return steady(timings)


def plain_swapping(model: nn.Module, data: list, device: torch.device) -> tuple[float, int]:
    """Seconds per step and weight bytes in per step of a hand-written layer-swapping loop."""
    layers = list(model)
    for parameter in model.parameters():
        parameter.data = parameter.data.pin_memory()
    timings, moved = [], 0
    for x, y in data:
        started = time.perf_counter()
        moved = 0
        boundaries = [x.to(device)]
        with torch.no_grad():
            for layer in layers:
                on_card = {name: p.to(device) for name, p in layer.named_parameters()}
                moved += sum(p.nbytes for p in on_card.values())
                boundaries.append(torch.func.functional_call(layer, on_card, (boundaries[-1],)))
        upstream = None
        for index in reversed(range(len(layers))):
            layer = layers[index]
            on_card = {name: p.detach().to(device).requires_grad_() for name, p in layer.named_parameters()}
            moved += sum(p.nbytes for p in on_card.values())
            inputs = boundaries[index].requires_grad_()
            output = torch.func.functional_call(layer, on_card, (inputs,))
            if upstream is None:
                nn.functional.mse_loss(output, y.to(device)).backward()
            else:
                output.backward(upstream)
            upstream = inputs.grad
            with torch.no_grad():
                for name, parameter in layer.named_parameters():
                    parameter.add_(on_card[name].grad.to("cpu"), alpha=-LR)
        torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - started)
    return steady(timings), moved


WAYS = {  # Harmony's ways: (prefetch, packs_per_task, overlap_update, precision, update_on, microbatches)
    "harmony, no prefetch, a pack a task": (False, 1, False, "fp32", "host", None),
    "harmony, weights prefetched only, a pack a task, update in bwd": ("weights", 1, False, "fp32", "host", None),
    "harmony, a pack a task, update in bwd": (True, 1, False, "fp32", "host", None),
    "harmony, a pack a task, update on the device": (True, 1, False, "fp32", "device", None),
    "harmony, as planned": (True, "auto", None, "fp32", "auto", None),
    "harmony, the fewest micro-batches that fit (microbatches='auto'), as planned": (
        True, "auto", None, "fp32", "auto", "auto"),
    "harmony, weights prefetched only, as planned": ("weights", "auto", None, "fp32", "auto", None),
    "harmony bf16 (weights copied in as bf16), as planned": (True, "auto", None, "bf16", "auto", None),
}


def harmony_run(model: nn.Module, data: list, budget: int, microbatch: int, prefetch: bool | str,
                packs_per_task: int | str, overlap_update: bool | None, precision: str, update_on: str,
                microbatches: str | None = None, profile: Path | None = None) -> harmony.TrainResult:
    """Harmony on the GPU under budget, in micro-batches of microbatch samples (or as microbatches="auto" chooses;
    its workers' tasks of two steps traced into profile where given)."""
    return harmony.train(model, data, loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=LR),
                         microbatches=microbatches or max(1, len(data[0][0]) // microbatch), devices=["cuda:0"],
                         device_memory=budget,
                         prefetch=prefetch, fuse=False, progress=False, packs_per_task=packs_per_task,
                         overlap_update=overlap_update, precision=precision, update_on=update_on,
                         log_dir=profile, profile_steps=2 if profile is not None else 0)


def budget_bytes(text: str, weights: int, depth: int, batch: int, width: int) -> int:
    """The device budget that text names: a share of the weights, plus, where it ends in '+activations', a
    Linear's input and a ReLU's output (float32) of the whole batch for every layer."""
    share, plus, extra = text.partition("+")
    if plus and extra != "activations":
        raise SystemExit(f"--budgets: {text!r} is not a share of the weights or a share '+activations'")
    return int(float(share) * weights) + (2 * depth * batch * width * 4 if plus else 0)


def progress(rows: list[dict]) -> None:
    """Print rows as they are measured, so that a run cut short still tells what it measured."""
    for row in rows:
        print(f"batch {row['batch']}: {row['way']}: {row['step s']:.4f} s a step", flush=True)


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=lambda text: [int(b) for b in text.split(",")], default=None,
                        help="samples per weight load, comma-separated (default 1024,4096,16384,65536)")
    parser.add_argument("--microbatch", type=int, default=512,
                        help="samples per micro-batch of Harmony's runs (their activations must fit beside a pack)")
    parser.add_argument("--ways", default="", help="only Harmony's ways whose name contains this")
    parser.add_argument("--budgets", type=lambda text: text.split(","), default=["0.25"],
                        help="Harmony's device budgets, comma-separated: a share of the weights, optionally "
                             "'+activations' (room besides for every layer's saved activations of the whole batch, "
                             "where stashes can last until their backward), e.g. 0.25,0.25+activations")
    parser.add_argument("--profile", type=Path, default=None,
                        help="trace the workers' tasks of two steps of every Harmony run into this directory "
                             "(torch.profiler; one subdirectory per run)")


def main() -> None:
    args = arguments(__doc__.splitlines()[0], options)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_swap needs a CUDA GPU")
    logging.getLogger("distributed").setLevel(logging.ERROR)
    device = torch.device("cuda:0")
    width, depth, steps = (1024, 32, 6) if args.quick else (2048, 32, 10)
    host_to_device, device_to_host = pinned_bandwidth(device)
    weights = parameter_bytes(mlp(width, depth))
    rows, raw = [], {}
    for batch in args.batches or ((512, 2048) if args.quick else (1024, 4096, 16384, 65536)):
        data = regression(steps, batch, width)
        resident = plain_resident(mlp(width, depth), data, device)
        resident_bf16 = plain_resident(mlp(width, depth), data, device, bf16=True)
        swapping, moved = plain_swapping(mlp(width, depth), data, device)
        copy = 2 * weights / host_to_device + weights / device_to_host
        common = {"batch": batch, "compute s": resident, "copy s": copy, "ideal max": max(resident, copy)}
        rows.append({"way": "plain, resident on the GPU", **common, "step s": resident, "weights in/step": 0})
        rows.append({"way": "plain, swapping layers", **common, "step s": swapping, "weights in/step": moved})
        rows.append({"way": "plain bf16 autocast, resident on the GPU", **common, "compute s": resident_bf16,
                     "step s": resident_bf16, "weights in/step": 0})
        for bf16 in (False, True):  # Harmony's micro-batches without Harmony: what micro-batching alone costs
            name = "plain bf16 autocast" if bf16 else "plain"
            seconds = plain_resident(mlp(width, depth), data, device, bf16=bf16, microbatch=args.microbatch)
            rows.append({"way": f"{name}, resident on the GPU, micro-batches of {args.microbatch}", **common,
                         **({"compute s": resident_bf16} if bf16 else {}), "step s": seconds, "weights in/step": 0})
        progress(rows[-5:])
        for share, (way, (prefetch, packs_per_task, overlap_update, precision, update_on, microbatches)) in (
                (share, item) for share in args.budgets for item in WAYS.items()):
            if args.ways not in way:
                continue
            budget = budget_bytes(share, weights, depth, batch, width)
            traced = None if args.profile is None else args.profile / f"{batch}-{len(raw)}"
            try:
                result = harmony_run(mlp(width, depth), data, budget, args.microbatch, prefetch, packs_per_task,
                                     overlap_update, precision, update_on, microbatches, traced)
            except harmony.InputError as error:  # micro-batches whose activations do not fit beside a pack
                print(f"batch {batch}, budget {share}: {way}: {error}", flush=True)
                continue
            job = result.plan.jobs[0]
            where = "on the device" if job.device_update else "beside" if job.overlap else "in bwd"
            rows.append({
                "way": f"{way} ({job.section_count} tasks a pass, updates {where}, "
                       f"{len(job.stashes)} packs stashed)",
                "budget share": share,
                **common, **({"compute s": resident_bf16} if precision == "bf16" else {}),
                "step s": result.stats.steady_seconds_per_step(0),
                "predicted s": harmony.calls.steady_step(result.plan, [batch], result.plan.hardware.call_seconds),
                "host us/call fitted": 1e6 * (result.call_seconds or 0.0),
                "weights in/step": result.stats.bytes_in["weights"] // steps,
                "prefetched %": 100 * result.stats.bytes_prefetched / max(result.stats.bytes_in["weights"], 1),
                "values ahead+behind/step": (result.stats.bytes_ahead + result.stats.bytes_behind) // steps,
                "stashed passes/step": result.stats.stashed / steps,
                "peak": max(result.stats.peak_device_bytes.values()), "budget": budget,
                "reserved": max(result.stats.reserved_device_bytes.values(), default=0),
                "packs": len(result.packings[0].packs), "tasks/step": result.stats.tasks / steps,
                "micro-batches": result.plan.options.microbatches,
                "busy s/step": sum(result.stats.busy_seconds.values()) / steps,
                "room wait s/step": sum(result.stats.room_seconds.values()) / steps,
                "gc s/step": sum(result.stats.gc_seconds.values()) / steps,
                "activations in+out/step": (result.stats.bytes_in["activations"]
                                            + result.stats.bytes_out["activations"]) // steps,
            })
            progress(rows[-1:])
            raw[f"{batch} {share} {way}"] = {key: getattr(result.stats, key) for key in (
                "timeline", "step_seconds", "task_seconds", "busy_seconds", "idle_seconds", "room_seconds",
                "gc_seconds")}
    for row in rows:
        row["throughput / resident"] = row["compute s"] / row["step s"]
        row.setdefault("prefetched %", 0.0)
        row.setdefault("peak", 0)
        row.setdefault("reserved", 0)
        row.setdefault("budget", 0)
        row.setdefault("budget share", "")
        for column in ("packs", "micro-batches", "tasks/step", "stashed passes/step", "busy s/step",
                       "activations in+out/step",
                       "values ahead+behind/step", "predicted s", "host us/call fitted", "room wait s/step",
                       "gc s/step"):
            row.setdefault(column, 0)
    report("gpu_swap", f"Swapping on {torch.cuda.get_device_name(device)}: one MLP of {weights:,} B, budgets "
           f"{', '.join(args.budgets)} of it; pinned copies {host_to_device / 1e9:.1f} GB/s in, "
           f"{device_to_host / 1e9:.1f} GB/s out",
           rows, args.out, notes="batch: samples per weight load (issue 28's goal: 90% of the resident throughput from "
           "16k); compute s: the resident plain loop (for bf16 rows the resident bf16 autocast loop); "
           "copy s: 2W in + 1W out at the measured speed; "
           "peak: the bytes the budget accounted at most; reserved: the most the worker's CUDA caching allocator held; "
           "busy: time inside Harmony's task bodies; room wait: the part of it the host waited for room on the GPU "
           "(weights to arrive; values sent out no longer wait on a GPU); gc: the worker's garbage collections; "
           "activations: boundary bytes between host and GPU; predicted s: "
           "the run's plan's steady step, with the host cost per pack call fitted to the Harmony rows before it (the "
           "median of the last five; none for the first); host us/call fitted: what this run fitted (harmony.calls)",
           raw=raw)


if __name__ == "__main__":
    main()
