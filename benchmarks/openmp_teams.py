"""OpenMP teams: what one extra team of torch's CPU pool threads, anywhere in a process, costs its compute thread.

A thread that runs a large torch operation gets GNU OpenMP pool threads of its own for as long as it lives.
With more pool threads than CPUs, libgomp stops letting idle pool threads spin between parallel regions, so
each operator of the compute thread waits for its helpers to wake. Harmony therefore runs every torch
operation of a device on its worker's task thread and copies with memmove elsewhere (runtime/serial_copy.py).

Measured here on the fusion benchmark's hand-fused loop (16 MLPs of width 128, batch 32, stacked weights and
baddbmm), the plain PyTorch way, in this process: alone, and with a second thread alive that once made a
large torch copy (what a device worker's copy engine or a ``client.run`` on its event loop used to do).
Rounds alternate in random order; each round compares the two ways a few hundred milliseconds apart.

    python -m benchmarks.openmp_teams [--quick]
"""

from __future__ import annotations

import copy
import random
import statistics
import threading
import time

import torch

from benchmarks.fusion import MODELS, classification, hand_fused_mlp, small_mlp
from benchmarks.report import arguments, report
from harmony.runtime.devices import cpu_count

STEPS = 200
ROUNDS = 30
ALONE = "one team (the compute thread's)"
SECOND = "a second team alive on another thread"


def timed_loop(models: list[torch.nn.Module], data: list) -> tuple[float, float]:
    """Seconds per step of the hand-fused loop, and the cores this process kept busy meanwhile."""
    cpu, started = time.process_time(), time.perf_counter()
    hand_fused_mlp(copy.deepcopy(models), data)
    wall = time.perf_counter() - started
    return wall / len(data), (time.process_time() - cpu) / wall


def with_second_team(models: list[torch.nn.Module], data: list) -> tuple[float, float]:
    """The loop while another thread that made one large torch copy is alive (its pool threads with it)."""
    release = threading.Event()

    def copy_then_wait() -> None:
        torch.empty(1 << 22).copy_(torch.ones(1 << 22))
        release.wait()

    other = threading.Thread(target=copy_then_wait, name="second-team")
    other.start()
    time.sleep(0.05)
    try:
        return timed_loop(models, data)
    finally:
        release.set()
        other.join()
        time.sleep(0.05)  # its pool threads leave with it


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    rounds = 6 if args.quick else ROUNDS
    torch.set_num_threads(cpu_count())
    data = classification(STEPS, (128,))
    models = [small_mlp(seed) for seed in range(MODELS)]
    ways = {ALONE: timed_loop, SECOND: with_second_team}
    measured: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    timed_loop(models, data)  # warm-up
    for _ in range(rounds):
        order = list(ways)
        random.shuffle(order)
        for way in order:
            measured[way].append(ways[way](models, data))
    alone = [seconds for seconds, _ in measured[ALONE]]
    rows = []
    for way, runs in measured.items():
        speeds = [100 * reference / seconds for reference, (seconds, _) in zip(alone, runs)]
        rows.append({
            "way": way,
            "ms/step (16 models)": statistics.median(seconds for seconds, _ in runs) * 1e3,
            "cores busy": statistics.median(busy for _, busy in runs),
            "% of one team's speed": statistics.median(speeds),
            "range over rounds": f"{min(speeds):.0f}-{max(speeds):.0f}",
        })
    report("openmp_teams", f"OpenMP teams: the hand-fused 16-MLP loop on {torch.get_num_threads()} threads", rows,
           args.out, notes=f"{rounds} rounds of {STEPS} steps each way, in random order within a round; medians. "
           "% of one team's speed: each round's one-team time over its time that way.",
           raw={way: [{"ms/step": seconds * 1e3, "cores busy": busy} for seconds, busy in runs]
                for way, runs in measured.items()})


if __name__ == "__main__":
    main()
