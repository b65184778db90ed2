"""Benchmark: results between devices of one machine: two CPU devices in vPP, where every pack's activations and
their gradients cross from one device to the other, at several batch sizes.

Each row: a batch size, the bytes that crossed per step and how (bytes_p2p: read from the producer's file;
bytes_remote: through Dask's comms), Harmony's seconds per step on two devices and on one (where nothing crosses),
and the plain loop's in the same run (the model in memory). Rounds alternate the ways; median and range.

    python -m benchmarks.device_links [--quick]
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

WIDTH = 1024
DEPTH = 8
MICROBATCHES = 4
WARMUP = 2


def plain_seconds(data: list) -> list[float]:
    model = mlp(WIDTH, DEPTH, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for x, y in data:
        started = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return times[WARMUP:]


def harmony_seconds(data: list, devices: int) -> tuple[list[float], int, int]:
    """Steady seconds per step, and the bytes per step that crossed from file and through comms."""
    model = mlp(WIDTH, DEPTH, seed=0)
    result = harmony.train(model, data, loss_fn=nn.functional.mse_loss,
                           optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), devices=["cpu"] * devices,
                           device_memory=parameter_bytes(model) // 2, microbatches=MICROBATCHES, mode="vpp",
                           fuse=False, progress=False)
    finished = result.stats.step_seconds[0]
    steps = len(data)
    return ([b - a for a, b in zip(finished[WARMUP:], finished[WARMUP + 1 :])],
            result.stats.bytes_p2p // steps, result.stats.bytes_remote // steps)


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    steps, rounds = (6, 1) if args.quick else (12, 3)
    batches = (256,) if args.quick else (64, 256, 1024)
    rows, raw = [], {}
    for batch in batches:
        data = regression(steps, batch, WIDTH)
        times: dict[str, list[float]] = {"plain": [], "1 device": [], "2 devices": []}
        crossed = (0, 0)
        for _ in range(rounds):
            times["plain"].append(statistics.median(plain_seconds(data)))
            times["1 device"].append(statistics.median(harmony_seconds(data, 1)[0]))
            two, *crossing = harmony_seconds(data, 2)
            times["2 devices"].append(statistics.median(two))
            crossed = (crossing[0], crossing[1])
        raw[str(batch)] = times
        median = {way: statistics.median(values) for way, values in times.items()}
        rows.append({"batch": batch, "MB a crossing": batch * WIDTH * 4 / 1e6, "p2p MB/step": crossed[0] / 1e6,
                     "remote MB/step": crossed[1] / 1e6, "plain s": median["plain"],
                     "1 device s": median["1 device"], "2 devices s": median["2 devices"],
                     "2 devices range": f"{min(times['2 devices']):.3f}-{max(times['2 devices']):.3f}",
                     "2 / 1 device": median["2 devices"] / median["1 device"]})
        print(rows[-1], flush=True)
    report("device_links", f"an MLP of {DEPTH} layers x {WIDTH} in vPP over two CPU devices, {MICROBATCHES} "
           "micro-batches, half its weights a device", rows, args.out,
           notes="seconds per step: median over rounds of each run's median steady step; 2 devices range: "
                 "min-max over rounds", raw=raw)


if __name__ == "__main__":
    main()
