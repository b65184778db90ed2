"""Predicted compute of a task: a forward, a backward with its recompute, an optimizer's update, from the pilot's
per-sample times (tasks.packing) on a hardware. The simulator times tasks with it, and the binder weighs a device's
queue by it."""

from __future__ import annotations

from harmony.tasks.graph import TaskId
from harmony.tasks.hardware import Hardware
from harmony.tasks.packing import Packing
from harmony.tasks.runplan import Job


def task_seconds(task: TaskId, packing: Packing, samples: int, hardware: Hardware, packs: range | None = None
                 ) -> float:
    """Predicted compute time of a task over its packs (task.pack alone unless given): forward once for fwd; for
    bwd the recompute and a backward (the forward times the pack's backward_ratio) and, over several packs, a
    forward more for every pack but the last (the inputs of each, recomputed first); the optimizer's passes for
    upd."""
    packs = packs or range(task.pack, task.pack + 1)
    forwards = [packing.packs[pack].forward_seconds_per_sample * samples / hardware.compute_scale for pack in packs]
    if task.kind == "fwd":
        return sum(forwards)
    if task.kind == "bwd":
        backwards = [packing.packs[pack].backward_ratio * forward for pack, forward in zip(packs, forwards)]
        return sum(forwards) + sum(backwards) + sum(forwards[:-1])
    return update_seconds(packing, packs, hardware)


def update_seconds(packing: Packing, packs: range, hardware: Hardware) -> float:
    """Predicted time of the updates of packs on the host store: the optimizer's passes over their weights
    (optimizer_seconds) and the runtime's host work for each pack's update (Hardware.update_call_seconds)."""
    return optimizer_seconds(packing, packs, hardware) + len(packs) * hardware.update_call_seconds


def optimizer_seconds(packing: Packing, packs: range, hardware: Hardware) -> float:
    """Predicted time of the optimizer's steps of packs alone, wherever they run: a few passes over their weights at
    the host store's optimizer rate."""
    return 4 * sum(packing.packs[pack].float_bytes for pack in packs) / hardware.optimizer_bytes_per_second


def update_passes(job: Job, pack: int, hardware: Hardware) -> float:
    """Predicted time of the optimizer's passes of a swapped pack's update: on its device at the device's speed where
    it updates there (Job.device_updates), else on the host store."""
    passes = optimizer_seconds(job.packing, range(pack, pack + 1), hardware)
    return passes / hardware.compute_scale if pack in job.device_updates else passes
