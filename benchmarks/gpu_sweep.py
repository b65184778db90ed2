"""Benchmark: a sweep of GPT-2-small-shaped models fused on one GPU, against plain loops with and without compile.

Sixteen Hugging Face GPT2LMHeadModels of GPT-2 small's shape (12 layers, 768 wide, 12 heads; random init from a
config, nothing downloaded), one learning rate each, train on the same token batches: Harmony with its defaults
(the models fused into arrays where the simulator predicts it faster) and with compile=True, a plain loop that
steps each model in turn,
and the same loop over ``torch.compile``d models. Each row: steady seconds per sweep step (every model one step;
the plain loops' median after the first few, min-max beside; Harmony's mean after the first few, since the steps
of one task finish together), tokens per second and the ratio to the plain loop. ``--quick`` runs
a tiny shape, also on a CPU (``--device cpu``), to check the script itself.

``--models`` and ``--layers`` make the sweep smaller, for a lease whose minutes do not hold sixteen full models
(Harmony's call includes starting its cluster, the pilot and shipping the models).

    python -m benchmarks.gpu_sweep [--quick] [--device cuda|cpu] [--models 4] [--layers 2]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

import harmony
from benchmarks.report import arguments, report

WARMUP = 3


def gpt2s(count: int, layers: int, width: int, heads: int, context: int, seed: int = 0) -> list[torch.nn.Module]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=context, vocab_size=50257,
                        use_cache=False)
    torch.manual_seed(seed)
    return [GPT2LMHeadModel(config) for _ in range(count)]


def batches(steps: int, batch: int, context: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50257, (steps, batch, context), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def plain_steps(models: list[torch.nn.Module], data: list, device: str, rates: list[float], compiled: bool
                ) -> list[float]:
    """Seconds of each sweep step of the plain loop: every model steps on the batch in turn."""
    models = [model.to(device) for model in models]
    callers = [torch.compile(model) if compiled else model for model in models]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=rate) for model, rate in zip(models, rates)]
    times = []
    for batch in data:
        on_device = {key: value.to(device) for key, value in batch.items()}
        started = time.perf_counter()
        for caller, optimizer in zip(callers, optimizers):
            optimizer.zero_grad()
            caller(**on_device).loss.backward()
            optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times[WARMUP:]


def harmony_steps(models: list[torch.nn.Module], data: list, device: str, rates: list[float], compile: bool
                  ) -> tuple[list[float], harmony.TrainResult]:
    factories = [lambda p, lr=rate: torch.optim.AdamW(p, lr=lr) for rate in rates]
    result = harmony.train(models, data, loss_fn=None, optimizer=factories, devices=[device], compile=compile,
                           progress=False)
    finished = [max(step_times) for step_times in zip(*result.stats.step_seconds)]
    # a task runs several steps of a homed model or array, and they finish together: the mean after the warm-up
    return [(finished[-1] - finished[WARMUP]) / (len(finished) - WARMUP - 1)], result


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--ways", default="", help="only the ways whose name contains this")
    parser.add_argument("--models", type=int, default=None, help="how many models (default 16, quick 4)")
    parser.add_argument("--layers", type=int, default=None, help="layers of each model (default 12, quick 2)")


def main() -> None:
    args = arguments(__doc__.splitlines()[0], options)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_sweep needs a CUDA GPU (or --device cpu --quick to check the script)")
    logging.getLogger("distributed").setLevel(logging.ERROR)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    count, layers, width, heads, context, batch, steps = (
        (4, 2, 64, 4, 32, 4, 8) if args.quick else (16, 12, 768, 12, 128, 8, 15))
    count, layers = args.models or count, args.layers or layers
    rates = [1e-4 * (1 + index) for index in range(count)]
    data = batches(steps, batch, context)
    tokens = count * batch * context
    rows = []
    for way in ("plain loop", "plain loop, torch.compile", "harmony", "harmony, compile=True"):
        if args.ways not in way:
            continue
        models = gpt2s(count, layers, width, heads, context)
        extra = {}
        if way.startswith("harmony"):
            times, result = harmony_steps(models, data, device, rates, compile=way.endswith("True"))
            extra = {"arrays": str(result.arrays), "homed": len(result.homes),
                     "call s": result.stats.wall_seconds, "training s": result.stats.run_seconds}
        else:
            times = plain_steps(models, data, device, rates, compiled=way.endswith("compile"))
        times.sort()
        median = statistics.median(times)
        rows.append({"way": way, "step s": median, "range": f"{times[0]:.3f}-{times[-1]:.3f}",
                     "tokens/s": tokens / median, **extra})
        print(f"{way}: {median * 1e3:.1f} ms a sweep step {extra}", flush=True)
    for row in rows:
        row["/ first way"] = rows[0]["step s"] / row["step s"]
        for column in ("arrays", "homed", "call s", "training s"):
            row.setdefault(column, "")
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"
    report("gpu_sweep", f"{count} GPT-2s ({layers} layers x {width}) on {name}, batch {batch} x {context} tokens",
           rows, args.out, notes="step s: median seconds per sweep step after the first few; / first way: speed-up "
           "over the first row (the plain loop unless --ways left it out); call s: harmony.train's whole call, "
           "training s: its training (the rest: cluster, calibration, planning, shipping the models)")


if __name__ == "__main__":
    main()
