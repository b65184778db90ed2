"""How many consecutive training steps one task of a homed model runs, and how many consecutive packs one task of
a swapped model runs, so Dask's cost per task amortizes.

A homed single-pack model (or fused array) needs one task per step (its backward, which also runs
the forward, the loss and the update). When a step takes about as long as scheduling a task, most of
the time is scheduling; one task that runs several steps, reading the batches of all of them from one
file, divides that cost. The depth comes from the step time the pilot pass measured and the task
cost measured on the live cluster the run uses (runtime.calibrate): the time a task adds to its device or,
where the devices compute on the machine's cores, the CPU time it takes from them, whichever is more.
The pilot's step time is a prediction (for a fused array, from one model's profile at the array's batch), so a
Spans re-decides the depth of the spans not yet opened from the step time its finished spans measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harmony.tasks.hardware import Hardware
from harmony.tasks.runplan import Job

OVERHEAD_SHARE = 0.01
MAX_DEPTH = 256
MAX_SHIPPED_BYTES = 64 * 2**20
SHORT_TAIL = 4  # a last span shorter than a SHORT_TAIL-th of the depth joins the span before it


def steps_per_task(
    step_seconds: float,
    task_overhead: float,
    batch_bytes: int,
    steps: int | None,
    share: float = OVERHEAD_SHARE,
) -> int:
    """The fewest steps per task that keep scheduling under share of the work, within the limits.

    At most MAX_DEPTH steps, at most MAX_SHIPPED_BYTES of batches read by one task (host memory), and at most a
    quarter of the run's steps (when known), so that progress and finishing times stay fine-grained. MAX_DEPTH
    leaves room for the share to hold on millisecond steps. A task boundary costs more than the calibrated
    figure (the steps after it run slower for a while), which the share of 1% leaves room for. Figures:
    docs/performance.md, "Dask's cost per task".
    """
    if step_seconds <= 0 or task_overhead <= 0:
        return 1
    depth = math.ceil(task_overhead / (share * step_seconds))
    depth = min(depth, MAX_DEPTH, max(1, MAX_SHIPPED_BYTES // max(batch_bytes, 1)))
    if steps is not None:
        depth = min(depth, max(1, steps // 4))
    return max(1, depth)


def runs_spans(job: Job) -> bool:
    """Whether a job's tasks each run a span of steps: a homed single-pack job with one micro-batch group."""
    return job.home is not None and len(job.packing.packs) == 1 and job.groups == 1


def homed_task_seconds(job: Job, hardware: Hardware) -> float:
    """What one task of a job that runs spans costs besides its steps: its task cost (Hardware.task_cost) and the
    flush of the job's weights and optimizer state to the host store that ends it."""
    pack = job.packing.packs[0]
    flushed = pack.float_bytes + job.state_ratio * pack.grad_bytes
    return hardware.task_cost + flushed / (hardware.host_link or float("inf"))


PACK_OVERHEAD_SHARE = 0.1


def pack_sections(pack_seconds: list[float], task_overhead: float, fewest: int = 1,
                  share: float = PACK_OVERHEAD_SHARE) -> tuple[int, ...]:
    """The first packs of sections of consecutive packs, each section one task: packs join the section before them
    until its forward takes task_overhead / share (scheduling stays under share of a section's work), with at least
    `fewest` sections (as many packs in each, at most, as that leaves). Returns () for one pack per task.

    A section's packs swap in one after the other inside its task, each one's weights copied while the one before
    computes, so that a section may hold more weights than the device: only the task cost is amortized, not the
    budget. The share is coarser than a homed span's: the packs of a section no longer pipeline across devices.
    """
    if task_overhead <= 0 or len(pack_seconds) < 2:
        return ()
    most = max(1, len(pack_seconds) // max(1, fewest))
    target = task_overhead / share
    starts, total = [0], 0.0
    for pack, seconds in enumerate(pack_seconds):
        if pack > starts[-1] and (total >= target or pack - starts[-1] >= most):
            starts.append(pack)
            total = 0.0
        total += seconds
    return () if len(starts) == len(pack_seconds) else tuple(starts)


def even_sections(packs: int, per_task: int) -> tuple[int, ...]:
    """Sections of per_task packs each (the last may hold fewer); () for one pack per task."""
    return () if per_task <= 1 or packs < 2 else tuple(range(0, packs, per_task))


@dataclass
class Spans:
    """How one model's training steps are cut, in order, into spans of consecutive steps (one task each).

    steps is how many training steps the run takes (None while unknown); depth is the length of the spans
    not yet opened. The last one may be shorter; where it would be shorter than a quarter of the depth it joins
    the span before it instead (a whole task boundary for a few steps otherwise). With a task cost (task_seconds,
    and the bytes of one step's batch), every measurement of the steps run so far re-decides the depth from their
    measured step time; without one the depth stays as given.
    """

    steps: int | None
    depth: int = 1
    task_seconds: float = 0.0
    batch_bytes: int = 0
    opened: int = 0

    @property
    def adaptive(self) -> bool:
        return self.task_seconds > 0

    @property
    def multistep(self) -> bool:
        """Whether the model's tasks may each run several steps (their data then shipped step by step)."""
        return self.depth > 1 or self.adaptive

    def next_span(self, until: int | None = None) -> tuple[int, int]:
        """The first step and the length of the next span (0 steps once all are opened); a span ends at step until
        (an evaluation's) rather than cross it."""
        if self.steps is None:
            count = self.depth
        else:
            left = max(0, self.steps - self.opened)
            count = left if left * SHORT_TAIL < self.depth * (SHORT_TAIL + 1) else self.depth
        if until is not None and self.opened < until < self.opened + count:
            count = until - self.opened
        return self.opened, count

    def open(self, count: int) -> None:
        """A span of count steps was opened (fewer than asked when the loader ran dry)."""
        self.opened += count

    def end(self) -> None:
        """The loader has no more batches: the steps opened so far are all the run takes."""
        self.steps = self.opened

    def spans_left(self) -> int | None:
        """How many spans are still to open (None while the run's length is unknown)."""
        if self.steps is None:
            return None
        left = self.steps - self.opened
        spans = -(-left // self.depth)
        tail = left - (spans - 1) * self.depth
        return spans - 1 if spans > 1 and tail * SHORT_TAIL < self.depth else spans

    def measured(self, seconds: float, steps: int) -> None:
        """The model's finished spans took seconds over steps of their steps: re-decide the depth (adaptive only)."""
        if self.adaptive and steps > 0 and seconds > 0:
            self.depth = steps_per_task(seconds / steps, self.task_seconds, self.batch_bytes, self.steps)
