"""Planning: what harmony.plan takes for a sweep of GPT-2s of one architecture, before any training.

A sweep's planning pilots each model on one micro-batch, exports and cuts models that do not fit (torch.export,
once an architecture), and with fuse="auto" builds and pilots trial arrays of 2, 4, 8 ... members, their members cut
again for their share of the budget. Each planning runs in a fresh process (nothing kept from an earlier call:
HARMONY_CACHE_DIR is empty), ROUNDS times, then again twice in that process with new models of the sweep (a
notebook's re-run: the timings kept, with the exports kept and with them forgotten). In the same run, as the
scale to read it against: plain PyTorch's first training step of every model (forward, backward and an Adam step
each), in that process too.

    python -m benchmarks.planning
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

import harmony
from benchmarks.report import arguments, report
from harmony import timings

ROUNDS = 3
SWEEPS = [(8, "auto", 16.0, "8"), (8, "false", 2.0, "8"), (16, "auto", 16.0, "8"),
          (4, "false", 2.0, "4,8,16,32")]  # models, fuse, budget in one model's weights, batch sizes (in turn)


def sweep(count: int, sizes: str = "8") -> tuple[list[torch.nn.Module], Any]:
    """count GPT-2s 128 wide, 6 layers, vocabulary 1000 (random init), and their loader: 64 sequences of 32 tokens
    in batches of sizes (one loader shared where one size, else one a model, their sizes in turn)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=128, n_layer=6, n_head=4, vocab_size=1000, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    models = []
    for seed in range(count):
        torch.manual_seed(seed)
        models.append(GPT2LMHeadModel(config))
    ids = torch.randint(0, 1000, (64, 32), generator=torch.Generator().manual_seed(0))
    loaders = {size: [{"input_ids": ids[i:i + size], "labels": ids[i:i + size]} for i in range(0, 64, size)]
               for size in map(int, sizes.split(","))}
    if len(loaders) == 1:
        return models, next(iter(loaders.values()))
    return models, [list(loaders.values())[index % len(loaders)] for index in range(count)]


def child(count: int, fuse: str, budget: float, sizes: str) -> dict[str, object]:
    """One planning, and the plain first step of every model."""
    from harmony.runtime import pilot

    exports = []
    export = pilot.exported_graph
    pilot.exported_graph = lambda module, sample: exports.append(1) or export(module, sample)  # counted
    models, loaders = sweep(count, sizes)
    weights = sum(p.numel() * p.element_size() for p in models[0].parameters())
    microbatches = 2 if sizes == "8" else 4  # one micro-batch of 32 sequences would not fit
    started = time.perf_counter()
    forecast = harmony.plan(models, loaders, devices=["cpu"], device_memory=int(budget * weights),
                            microbatches=microbatches, fuse={"auto": "auto", "false": False}[fuse])
    planned = time.perf_counter() - started
    exported = len(exports)
    batches = loaders if sizes == "8" else loaders[0]
    started = time.perf_counter()
    for model in models:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        model(**batches[0]).loss.backward()
        optimizer.step()
    plain = time.perf_counter() - started
    again = {}
    for way in ("re-run, exported again", "re-run"):  # a notebook's cell run again: new models, timings kept
        if way == "re-run, exported again":
            timings.EXPORTS.clear()  # as before exports were kept across calls
        models, loaders = sweep(count, sizes)
        started = time.perf_counter()
        harmony.plan(models, loaders, devices=["cpu"], device_memory=int(budget * weights),
                     microbatches=microbatches, fuse={"auto": "auto", "false": False}[fuse])
        again[way] = time.perf_counter() - started
    return {"plan": planned, "exports": exported, "plain step": plain, "arrays": forecast.arrays, **again}


def main() -> None:
    if "--child" in sys.argv:
        count, fuse, budget, sizes = sys.argv[-4:]
        print(json.dumps(child(int(count), fuse, float(budget), sizes)))
        return
    args = arguments(__doc__.splitlines()[0])
    rounds = 1 if args.quick else ROUNDS
    environment = {**os.environ, "HARMONY_CACHE_DIR": ""}
    raw: dict[str, list[dict[str, object]]] = {}
    for _ in range(rounds):
        for count, fuse, budget, sizes in SWEEPS:
            output = subprocess.run([sys.executable, "-m", "benchmarks.planning", "--child", str(count), fuse,
                                     str(budget), sizes], capture_output=True, text=True, check=True, timeout=900,
                                    env=environment).stdout
            raw.setdefault(f"{count} {fuse} {budget:g} {sizes}", []).append(
                json.loads(output.strip().splitlines()[-1]))
    rows = []
    for key, runs in raw.items():
        count, fuse, budget, sizes = key.split()
        plans = [float(run["plan"]) for run in runs]  # type: ignore[arg-type]
        steps = [float(run["plain step"]) for run in runs]  # type: ignore[arg-type]
        rows.append({
            "models": int(count),
            "fuse": fuse,
            "budget x weights": float(budget),
            "batch sizes": sizes,
            "exports": runs[-1]["exports"],
            "plan s": statistics.median(plans),
            "range s": f"{min(plans):.1f}-{max(plans):.1f}",
            **{f"{way} s": f"{statistics.median(float(run[way]) for run in runs):.2f} "  # type: ignore[arg-type]
                           f"({min(float(run[way]) for run in runs):.2f}-{max(float(run[way]) for run in runs):.2f})"  # type: ignore[arg-type]
               for way in ("re-run, exported again", "re-run")},
            "plain first step s": statistics.median(steps),
            "arrays": " ".join(str(len(array)) for array in runs[-1]["arrays"]),  # type: ignore[union-attr]
        })
    report("planning", "Planning: harmony.plan of GPT-2 sweeps on one CPU device, each in a fresh process", rows,
           args.out, raw=raw, notes="plan s = harmony.plan's wall time (median of rounds); re-run = the same "
                                    "plan again in that process with new models (timings and exports kept; "
                                    "'exported again': the exports forgotten first); plain first step = "
                                    "every model's first forward, backward and Adam step in plain PyTorch; "
                                    "arrays = the last round's sub-array sizes; batch sizes: the models' "
                                    "loaders' in turn (8 in 2 micro-batches, the others in 4); exports = "
                                    "torch.export calls in the last round's plan")


if __name__ == "__main__":
    main()
