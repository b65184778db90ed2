"""Where a swapped pack's update runs (pure): on the host store, or on the device its backward ran on.

On the host store (ZeRO-Offload's way) the gradients leave the device and the host's cores step the optimizer over
the master weights and the state kept there. On the device (DeepSpeed's Twin-Flow does this for a share of the
parameters), the bwd task copies the pack's optimizer state in beside its weights and gradients, steps the
optimizer there and writes the new weights and state back: the link carries the state both ways, and the weights
out instead of the gradients (the same bytes), while the host's cores do nothing. Which is faster depends on the
link, the host's optimizer rate and the device's, which the simulator compares (tasks.simulator, harmony.planner).

A job's packs can update on its device only when nothing but their own bwd task needs the step's gradients: one
micro-batch group (vDP reduces the groups' gradients on the host first), updates in the bwd task, no loss scaler
(fp16 unscales and skips across all packs) and no clipping (by the norm of all packs' gradients). Then each pack
that has weights to step does where its device copy is the master (a halved copy is not) and its weights,
gradients, state and a neighbour's weights arriving fit the budget at once ("for packs whose optimizer state fits
the device"); the others update on the host store.
"""

from __future__ import annotations

from harmony.tasks.packing import Pack
from harmony.tasks.runplan import Job


def device_update_need(packs: tuple[Pack, ...], index: int, state_ratio: float) -> int:
    """What the device holds while pack index's update runs there: its weights, its gradients, its optimizer state
    (the activations are gone by then) and a neighbour's weights arriving beside them (the pack before it, which
    backward runs next, or after it, the next step's forward)."""
    cost = packs[index].cost
    beside = max((packs[other].cost.weights for other in (index - 1, index + 1) if 0 <= other < len(packs)), default=0)
    return cost.weights + cost.grads + beside + packs[index].state_bytes(state_ratio)


def why_not_on_device(job: Job) -> str | None:
    """Why none of the job's packs can update on its device (None when those whose state fits can)."""
    if job.home is not None:
        return "homed: its updates run on its device already"
    if job.groups > 1:
        return "its micro-batch groups' gradients are summed on the host first (vdp)"
    if job.overlap:
        return "its updates run beside the device (overlap_update)"
    if job.scaled:
        return "fp16's loss scaler decides a step's updates from every pack's gradients"
    if job.clip:
        return "gradient clipping scales a step's updates by the norm of every pack's gradients"
    return None


def packs_on_device(job: Job, budget: int) -> tuple[int, ...]:
    """The packs of a job that may update on its device (why_not_on_device says none) under budget: those with
    weights to step, whose device copy is the master (not halved), and whose state fits beside them."""
    if why_not_on_device(job) is not None:
        return ()
    packs = job.device_packing.packs
    return tuple(index for index, pack in enumerate(packs)
                 if pack.grad_bytes and not job.halved(index)
                 and device_update_need(packs, index, job.state_ratio) <= budget)
