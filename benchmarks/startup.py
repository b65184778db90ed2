"""Start-up: what a harmony.train call costs besides training, cold (a fresh process) and warm (a re-run cell).

The sweep a notebook user re-runs: 12 small MLPs (16 -> 64 -> 64 -> 1), 500 steps of 32 samples, SGD, one shared
loader, on the default devices. In the same run: the plain PyTorch loop over the 12 models (median of ROUNDS);
harmony.train cold, each in a fresh Python process (imports excluded: the clock starts at the call), ROUNDS times
measuring the cluster's calibration, then ROUNDS times taking the one a first such process kept on disk; warm,
ROUNDS calls in one process after a first call (the embedded cluster kept up between calls, its calibration
cached); and with other devices, ROUNDS calls each on one CPU device then on two (or two then one) after a
call on the other count (the warm cluster keeps the workers a call names, closes the rest and starts the missing
ones). A call's fixed cost is its wall time less its training (result.stats.run_seconds: the driver's first
instruction to every model's end). Goals (issue 27): cold fixed cost <= 1.5 s, warm <= 0.1 s, the sweep end
to end on a cold call >= 2x the plain loop.

    python -m benchmarks.startup
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import harmony
from benchmarks.models import train_sequentially
from benchmarks.report import arguments, report

ROUNDS = 3
MODELS = 12
STEPS = 500


def sweep(seed: int = 0) -> tuple[list[nn.Module], list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(seed)
    models = [nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
              for _ in range(MODELS)]
    return models, [(torch.randn(32, 16), torch.randn(32, 1)) for _ in range(STEPS)]


def plain_seconds() -> float:
    """The plain loop: each model trained on the loader in turn."""
    models, data = sweep()
    return train_sequentially(models, [0.01] * len(models), data, nn.functional.mse_loss)


def harmony_call(devices: list[str] | None = None) -> dict[str, float]:
    """One harmony.train call on the sweep (on devices, else the default ones): its wall time and its training
    time."""
    models, data = sweep()
    started = time.perf_counter()
    result = harmony.train(models, data, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.01),
                           devices=devices, progress=False)
    return {"call": time.perf_counter() - started, "training": result.stats.run_seconds}


def cold_call(cache: str = "") -> dict[str, float]:
    """harmony_call in a fresh process (its imports done before the clock starts), keeping what it measured in cache
    (HARMONY_CACHE_DIR; "": nothing). A run's fits are removed from cache after it: a later cold call differs from
    the first by the calibration kept alone (the fits would change its plan)."""
    output = subprocess.run([sys.executable, "-m", "benchmarks.startup", "--cold-child"], capture_output=True,
                            text=True, check=True, timeout=600, env={**os.environ, "HARMONY_CACHE_DIR": cache}).stdout
    for fits in Path(cache).glob("fits-*") if cache else []:
        fits.unlink()
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    if "--cold-child" in sys.argv:
        print(json.dumps(harmony_call()))
        harmony.shutdown()
        return
    args = arguments(__doc__.splitlines()[0])
    rounds = 1 if args.quick else ROUNDS
    plain, cold, kept, warm, fewer, more = [], [], [], [], [], []
    for _ in range(rounds):
        plain.append(plain_seconds())
        cold.append(cold_call())
    with tempfile.TemporaryDirectory() as cache:
        cold_call(cache)  # measures the calibration and keeps it
        for _ in range(rounds):
            kept.append(cold_call(cache))
    harmony_call()  # the first call in this process starts the cluster that the next ones find warm
    for _ in range(rounds):
        warm.append(harmony_call())
    harmony_call(["cpu", "cpu"])
    for _ in range(rounds):
        fewer.append(harmony_call(["cpu"]))
        more.append(harmony_call(["cpu", "cpu"]))
    harmony.shutdown()
    plain_median = statistics.median(plain)
    rows = []
    for way, calls in (("cold", cold), ("cold, calibration kept", kept), ("warm", warm),
                       ("two devices, then one", fewer), ("one device, then two", more)):
        totals = [call["call"] for call in calls]
        fixed = [call["call"] - call["training"] for call in calls]
        rows.append({
            "call": way,
            "plain loop s": plain_median,
            "harmony s": statistics.median(totals),
            "range s": f"{min(totals):.2f}-{max(totals):.2f}",
            "fixed cost s": statistics.median(fixed),
            "fixed range s": f"{min(fixed):.2f}-{max(fixed):.2f}",
            "x plain loop": plain_median / statistics.median(totals),
        })
    report("startup", f"Start-up: {MODELS} MLPs x {STEPS} steps, harmony.train cold and warm vs the plain loop",
           rows, args.out, raw={"plain": plain, "cold": cold, "kept": kept, "warm": warm, "fewer": fewer,
                                "more": more},
           notes="cold = a fresh process's first call (imports excluded), its calibration measured; calibration "
                 "kept: one an earlier process on these devices kept (harmony.calibration); warm = later calls in "
                 "one process "
                 "(cluster kept, calibration cached); two devices, then one (one, then two): a call on "
                 "devices=['cpu'] after one on two CPU devices (on two after one); fixed cost = call less training "
                 "(stats.run_seconds); x plain loop = plain loop time / harmony time (goal >= 2 cold); goals: fixed "
                 "<= 1.5 s cold, <= 0.1 s warm")


if __name__ == "__main__":
    main()
