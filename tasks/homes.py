"""Where jobs are homed: on a machine (every job, when the devices are on several), and on a device (a single-pack
model whose whole state fits there).

Across machines the work is task-parallel (Hydra's SHARP): a job never spans machines, so nothing of it crosses
between them but its batches going in and its weights coming home. Jobs are placed on machines longest predicted
work first, each on the machine that would then finish first, a machine's finish being its work divided by its
devices (Sharded-LRTF's longest-first, applied once to whole machines): all machines finish together, and one with
more devices takes more work.

A homed model's weights, gradients and optimizer state live on its home device for the whole run:
its weights cross host->device once, its gradients never leave, its update runs on the device, and
the trained weights go back to the host store once at the end. Models are homed largest first on the
device with the most room left; one that fits nowhere is swapped as usual.
"""

from __future__ import annotations

from collections import Counter

from harmony.tasks.packing import Packing


def homed_bytes(packing: Packing, optimizer_state_ratio: float) -> int:
    """What a homed single-pack model holds on its device: weights, a gradient buffer, optimizer state
    (optimizer_state_ratio bytes per trainable parameter byte) and one micro-batch's workspace (its weights held in
    float32: Pack.float_workspace)."""
    pack = packing.packs[0]
    return pack.float_bytes + pack.grad_bytes + pack.state_bytes(optimizer_state_ratio) + pack.float_workspace


def choose_homes(
    packings: list[Packing], optimizer_state_ratios: list[float], budgets: dict[str, int], floors: list[int]
) -> tuple[dict[int, str], dict[str, int]]:
    """model index -> home device for the models that can be homed, and the room each device has
    left for everything else.

    floors[m] is the smallest budget model m can be cut for (what its largest layer needs); every
    device keeps room for the largest floor of the models that are not homed, which are then cut
    into packs for the room left.
    """
    room = dict(budgets)
    homes: dict[int, str] = {}
    single = sorted(
        (m for m, packing in enumerate(packings) if len(packing.packs) == 1),
        key=lambda m: -homed_bytes(packings[m], optimizer_state_ratios[m]),
    )
    for model in single:
        others = [floors[m] for m in range(len(packings)) if m != model and m not in homes]
        need = homed_bytes(packings[model], optimizer_state_ratios[model])
        device = max(room, key=lambda name: room[name])
        if need + max(others, default=0) <= room[device]:
            homes[model] = device
            room[device] -= need - packings[model].packs[0].float_workspace
    return homes, room


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
