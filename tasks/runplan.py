"""The run's plan: one frozen value that says everything a run has decided before its first task.

It is built once (harmony.planner), printed by ``harmony.plan``, executed by the runtime and serializable with
msgpack, so that a checkpoint can record what it resumes. It holds no module and no callable: what a job
computes with (its layers, loss and optimizer factory) travels beside it, in the same order as ``jobs``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack

from harmony.tasks.fusion import FusionChoice
from harmony.tasks.hardware import Hardware
from harmony.tasks.layout import TensorSpec
from harmony.tasks.packing import Pack, PackCost, Packing

PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}  # -> the dtype autocast computes in (None: none)


@dataclass(frozen=True)
class Options:
    """Every option of harmony.train and harmony.plan that shapes the run, validated (see their docstrings)."""

    epochs: int = 1
    steps: int | None = None
    microbatches: int | str = 1  # "auto" until harmony.planner.fewest_microbatches makes it a count
    prefetch: bool | str = True  # "weights": weights only, no micro-batch values copied ahead
    policy: str = "lrtf"
    group: bool = True
    mode: str = "auto"
    resident: bool = True
    fuse: bool | int | str = "auto"
    steps_per_task: int | str = "auto"
    fail_fast: bool = False
    checkpoint_every: int | None = None
    eval_every: int | None = None
    precision: str = "fp32"
    overlap_update: bool | None = None
    update_on: str = "auto"
    packs_per_task: int | str = "auto"
    grad_scaler: dict[str, float] | None = None
    compile: bool = False
    stash: bool = True
    threads: int | str = "auto"

    @property
    def fixed_threads(self) -> int | None:
        """The threads every device worker computes with where threads is a count; None where each CPU device
        adapts its own (runtime.threads, runtime.devices.shared_threads)."""
        return None if self.threads == "auto" else int(self.threads)

    @property
    def ahead(self) -> bool:
        """Whether micro-batch values are copied ahead (and sent behind) where a device has a link to copy over:
        prefetch=True, not "weights"."""
        return self.prefetch is True


@dataclass(frozen=True)
class Job:
    """A model, or a fused array of models, as the run trains it: one unit to the binder and the devices.

    members are the indices of the user's models it trains; feed is the loader it reads; seed its random
    stream. packing is how it is cut, home the device it stays on whole (None: it is swapped), groups its
    micro-batch groups per step (vDP), depth the training steps its first tasks each run (more than one only
    for a homed single-pack job; with task_seconds > 0 the later ones are re-cut from their measured step time).
    steps is the run's length when known; step_seconds the predicted compute of one step; batch_bytes the bytes
    of one step's batch; state_ratio the optimizer-state bytes per gradient byte. overlap: a swapped job's updates
    run in upd tasks on a host thread beside its device instead of in its bwd tasks (see tasks.graph). sections
    are the first packs of the consecutive packs each of its tasks runs (a task's "pack" in tasks.graph is then its
    section's index); empty, one pack per task. scaled: its loss is scaled for fp16 (runtime.scaler), so that every
    update of a step waits for every backward of it. clip: each member's largest total gradient norm (inf where that
    member is not clipped), empty when none is (runtime.clipping): as with scaled, every update of a step waits for
    every backward of it. device_updates: the packs whose bwd tasks step the pack's
    optimizer on the device, its state copied in beside the pack's weights and gradients and out with the new
    weights, instead of sending the gradients to the host store's optimizer (tasks.updates). stashes: the packs
    whose forward keeps its activations on the device for its backward (runtime.stash), those whose stash the
    simulator predicts still there when their backward runs.
    """

    members: tuple[int, ...]
    label: str
    feed: int
    seed: int
    packing: Packing
    steps: int | None
    step_seconds: float
    batch_bytes: int
    state_ratio: float = 2.0
    home: str | None = None
    groups: int = 1
    depth: int = 1
    task_seconds: float = 0.0
    machine: str = ""
    overlap: bool = False
    sections: tuple[int, ...] = ()
    scaled: bool = False
    clip: tuple[float, ...] = ()
    device_updates: tuple[int, ...] = ()
    stashes: tuple[int, ...] = ()

    @property
    def whole_step(self) -> bool:
        """Whether each update of a step reads what every pack's backward of it found (fp16's overflow, the gradient
        norm for clipping): its upd tasks wait for every bwd of the step (tasks.graph)."""
        return self.scaled or bool(self.clip)

    @property
    def device_update(self) -> bool:
        """Whether any of its packs updates on its device."""
        return bool(self.device_updates)

    @property
    def fused(self) -> bool:
        """Whether the job is a fused array of several models."""
        return len(self.members) > 1

    @property
    def halves(self) -> bool:
        """Whether its packs' device copies hold their halved weights (Pack.halved) in autocast's dtype: a swapped
        model's do (a homed model's weights never leave its device, a fused array's are stacked in float32)."""
        return self.home is None and not self.fused

    def halved(self, pack: int) -> frozenset[str]:
        """The pack's parameters whose device copy is in autocast's dtype (tasks.layout.halve)."""
        return frozenset(self.packing.packs[pack].halved) if self.halves else frozenset()

    def halved_bytes(self, pack: int) -> int:
        """The float32 bytes of the pack's weights whose device copy is in autocast's dtype (halved)."""
        return self.packing.packs[pack].halved_bytes if self.halves else 0

    @property
    def device_packing(self) -> Packing:
        """The packing as the devices hold it, what the simulator replays and times. Packs are cut for halved copies
        (tasks.packing); a job that does not halve holds its weights at their float32 bytes, and autocast copies
        them in each forward (Pack.float_workspace)."""
        if self.halves:
            return self.packing
        packs = []
        for pack in self.packing.packs:
            held = dataclasses.replace(pack.cost, weights=pack.float_bytes, workspace=pack.float_workspace)
            packs.append(dataclasses.replace(pack, cost=held) if pack.halved else pack)
        return dataclasses.replace(self.packing, packs=tuple(packs))

    def narrowed(self, fraction: float) -> Job:
        """The job as its steps run with fraction of its members training, of a swapped array that computes those
        alone (runtime.rows): its compute, the values it hands between packs, and the rows of its weights copied in
        and of its gradients written back (and so its host update), shrunk to them (a pack updated on its device
        still moves its whole stacks); the tasks, and their fixed costs, as many."""
        packs = tuple(dataclasses.replace(
            pack, forward_seconds_per_sample=pack.forward_seconds_per_sample * fraction,
            input_bytes_per_sample=pack.input_bytes_per_sample * fraction,
            cost=pack.cost if pack.index in self.device_updates else dataclasses.replace(
                pack.cost, weights=round(pack.cost.weights * fraction), grads=round(pack.cost.grads * fraction)))
            for pack in self.packing.packs)
        return dataclasses.replace(self, packing=dataclasses.replace(self.packing, packs=packs),
                                   step_seconds=self.step_seconds * fraction)

    @property
    def section_count(self) -> int:
        """How many tasks one pass (forward or backward) of a step has: one per section."""
        return len(self.sections) if self.sections else len(self.packing.packs)

    def section(self, index: int) -> range:
        """The packs the tasks of section index run, in order."""
        return section_packs(self.sections, len(self.packing.packs), index)

    def section_bytes(self, index: int) -> int:
        """The weight bytes of a section's packs (a task holds one or two of them on its device at a time)."""
        return sum(self.packing.packs[pack].weight_bytes for pack in self.section(index))


def section_packs(sections: tuple[int, ...], packs: int, index: int) -> range:
    """The packs of section index of a job cut into packs packs whose sections start at sections (empty: one pack
    per section)."""
    if not sections:
        return range(index, index + 1)
    stop = sections[index + 1] if index + 1 < len(sections) else packs
    return range(sections[index], stop)


@dataclass(frozen=True)
class RunPlan:
    """What a run will do: its jobs, the devices and their budgets, the execution mode, and why.

    budgets are (device, bytes) pairs in device order; fusion says per group of fusable models which sub-array
    size was chosen and what each size was predicted to give; predicted_modes the seconds per step predicted
    for each mode compared; hardware what those predictions assumed; machines each device's machine where the
    devices are on several (or on one the driver is not on).
    """

    jobs: tuple[Job, ...]
    budgets: tuple[tuple[str, int], ...]
    mode: str
    options: Options
    hardware: Hardware
    fusion: tuple[FusionChoice, ...] = ()
    predicted_modes: tuple[tuple[str, float], ...] = ()
    machines: tuple[tuple[str, str], ...] = ()

    @property
    def devices(self) -> dict[str, int]:
        """Device name -> byte budget, in device order."""
        return dict(self.budgets)

    @property
    def homes(self) -> dict[int, str]:
        """Job index -> home device, for the jobs that stay whole on a device."""
        return {index: job.home for index, job in enumerate(self.jobs) if job.home is not None}

    def job_of(self, model: int) -> int:
        """The index of the job that trains the user's model."""
        return next(index for index, job in enumerate(self.jobs) if model in job.members)

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self, default=_encode, use_bin_type=True)

    @staticmethod
    def from_msgpack(data: bytes) -> RunPlan:
        plan = msgpack.unpackb(data, object_hook=_decode, use_list=False, strict_map_key=False, raw=False)
        if not isinstance(plan, RunPlan):
            raise ValueError("the bytes do not hold a run's plan")
        return plan


SERIALIZED: dict[str, type] = {
    cls.__name__: cls for cls in (RunPlan, Job, Options, Hardware, FusionChoice, Packing, Pack, PackCost, TensorSpec)
}
TAG = "__harmony__"


def _encode(value: Any) -> Any:
    """A plan's dataclasses as tagged maps (their fields by name), for msgpack."""
    if dataclasses.is_dataclass(value) and type(value).__name__ in SERIALIZED:
        return {TAG: type(value).__name__, **{f.name: getattr(value, f.name) for f in dataclasses.fields(value)}}
    raise TypeError(f"a run's plan holds no {type(value).__name__}")


def _decode(fields: dict[Any, Any]) -> Any:
    """A tagged map back into its dataclass (arrays come back as tuples, as the plan holds them)."""
    name = fields.get(TAG)
    if name is None:
        return fields
    values = {key: value for key, value in fields.items() if key != TAG}
    return SERIALIZED[name](**values)
