"""Which machine each job is homed on: its packs run on that machine's devices, its state is in that machine's store.

Across machines the work is task-parallel (Hydra's SHARP): a job never spans machines, so nothing of it crosses
between them but its batches going in and its weights coming home. Jobs are placed longest predicted work first,
each on the machine that would then finish first, a machine's finish being its work divided by its devices
(Sharded-LRTF's longest-first, applied once to whole machines): all machines finish together, and one with more
devices takes more work.
"""

from __future__ import annotations

from collections import Counter


def assign_machines(work: list[float], machines: list[str]) -> list[str]:
    """Per job, the machine it is homed on. work[j] is job j's predicted seconds of compute for the run; machines
    has one entry per device (the machine it is on), so a machine's share of the work grows with its devices."""
    devices = Counter(machines)
    if not devices:
        raise ValueError("no device to place jobs on")
    order = list(dict.fromkeys(machines))
    load = dict.fromkeys(order, 0.0)
    homes = [""] * len(work)
    for job in sorted(range(len(work)), key=lambda j: (-work[j], j)):
        machine = min(order, key=lambda m: ((load[m] + work[job]) / devices[m], order.index(m)))
        load[machine] += work[job]
        homes[job] = machine
    return homes


def finish_seconds(work: list[float], homes: list[str], machines: list[str]) -> dict[str, float]:
    """Per machine, its jobs' work divided by its devices: when it finishes if its devices share the work evenly."""
    devices = Counter(machines)
    load = dict.fromkeys(devices, 0.0)
    for seconds, machine in zip(work, homes):
        load[machine] += seconds
    return {machine: load[machine] / devices[machine] for machine in load}
