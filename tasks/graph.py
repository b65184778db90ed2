"""The task graph of training: fwd, bwd and upd tasks per (model, pack, span, group), their dependencies and data edges.

A span is the training steps one task runs: one step, except for a homed single-pack model, whose tasks may
run several consecutive steps each (see amortize); a model's spans are numbered 0, 1, ... in order. A span's
micro-batches form one group, or in vDP mode one group per device: each group runs every
pack forward and backward on its own micro-batches. With one group, a pack's bwd applies the pack's
update itself as soon as its gradients are out, so the span has no upd tasks (one task fewer per pack on
the chain through the scheduler), unless the job's updates are overlapped: then, as with several groups, a
pack's upd task steps its optimizer on the host store once its bwd (every group's, which it first reduces) is
done, on a host thread beside the device, which goes on with the backward of earlier packs (with a scaled fp16
loss or clipped gradients, once every bwd of its span is done: whether any gradient overflowed, or the norm of
them all, decides every pack's update).

Here a "pack" is what one task runs: a pack, or a section of consecutive packs when the job's tasks run several
(tasks.runplan.Job.sections); the graph is the same, and a pass has one task per section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["fwd", "bwd", "upd"]


@dataclass(frozen=True, order=True)
class TaskId:
    """One task: kind, model index, pack index, span, micro-batch group.

    fwd runs packs 0..P-2 forward, keeping nothing but their boundary inputs; bwd runs packs P-1..0,
    recomputing the pack from its boundary input (the last pack's bwd also runs its forward and the
    loss, so the last pack is swapped in once); upd applies the optimizer to a pack in the host store
    (its group is always 0).
    """

    kind: Kind
    model: int
    pack: int
    span: int
    group: int = 0

    def key(self, run: str, attempt: int = 0) -> str:
        """The Dask key: its prefix (the task kind) is what the dashboard groups by; a task run again after its
        worker was lost gets a key of its own (``-r<attempt>``)."""
        group = f"-g{self.group}" if self.group else ""
        again = f"-r{attempt}" if attempt else ""
        return f"{self.kind}-m{self.model}-p{self.pack}-s{self.span}{group}-{run}{again}"


@dataclass(frozen=True)
class BatchInput:
    """The inputs of a model's micro-batch group for a span (the boundary input of pack 0)."""

    model: int
    span: int
    group: int = 0


@dataclass(frozen=True)
class BatchTargets:
    """The targets of a model's micro-batch group for a span (what the last pack's loss needs)."""

    model: int
    span: int
    group: int = 0


Value = TaskId | BatchInput | BatchTargets


def parse_key(key: str) -> tuple[TaskId, str] | None:
    """The task and run of a key made by TaskId.key (any attempt), or None for any other key."""
    parts = key.split("-")
    if _attempt(parts) is not None:
        parts = parts[:-1]
    if len(parts) not in (5, 6) or parts[0] not in ("fwd", "bwd", "upd"):
        return None
    try:
        model, pack, span = int(parts[1][1:]), int(parts[2][1:]), int(parts[3][1:])
        group = int(parts[4][1:]) if len(parts) == 6 else 0
    except ValueError:
        return None
    return TaskId(parts[0], model, pack, span, group), parts[-1]  # type: ignore[arg-type]


def key_attempt(key: str) -> int:
    """Which attempt of its task a key made by TaskId.key names (0: the first)."""
    attempt = _attempt(key.split("-"))
    return 0 if attempt is None else attempt


def _attempt(parts: list[str]) -> int | None:
    """The attempt a key's parts end with (``-r<attempt>``, after at least the kind, model, pack, span and run), or
    None where they end with the run (the first attempt)."""
    last = parts[-1]
    return int(last[1:]) if len(parts) > 5 and last[:1] == "r" and last[1:].isdigit() else None


def updates_in_backward(groups: int, overlap: bool = False) -> bool:
    """Whether a model's bwd tasks apply its updates (one micro-batch group, nothing to reduce first, and updates
    not overlapped with the device's next tasks)."""
    return groups == 1 and not overlap


def span_tasks(model: int, packs: int, span: int, groups: int = 1, overlap: bool = False) -> list[TaskId]:
    """Every task of one model's span, in a valid execution order."""
    forward = [TaskId("fwd", model, p, span, g) for g in range(groups) for p in range(packs - 1)]
    backward = [TaskId("bwd", model, p, span, g) for g in range(groups) for p in reversed(range(packs))]
    if updates_in_backward(groups, overlap):
        return forward + backward
    update = [TaskId("upd", model, p, span) for p in reversed(range(packs))]
    return forward + backward + update


def successor(task: TaskId, packs: int) -> TaskId | None:
    """The compute task that follows task in its group's chain: the one whose weights to prefetch, and the one
    that reads the boundary value task produces (a fwd's output, a bwd's input gradient)."""
    m, p, s, g = task.model, task.pack, task.span, task.group
    if task.kind == "fwd":
        return TaskId("fwd", m, p + 1, s, g) if p + 1 < packs - 1 else TaskId("bwd", m, packs - 1, s, g)
    if task.kind == "bwd" and p > 0:
        return TaskId("bwd", m, p - 1, s, g)
    return None


def updater(model: int, pack: int, span: int, groups: int = 1, overlap: bool = False) -> TaskId:
    """The task that applies a pack's updates for a span: its bwd, or its upd (several groups, or overlapped)."""
    if updates_in_backward(groups, overlap):
        return TaskId("bwd", model, pack, span)
    return TaskId("upd", model, pack, span)


def dependencies(task: TaskId, packs: int, groups: int = 1, overlap: bool = False, whole_step: bool = False
                 ) -> list[TaskId]:
    """Tasks that must finish before task may run: the pack's previous span's update, and its inputs' producers; an
    upd, its pack's bwd in every group, or where each update reads the whole step (Job.whole_step: a scaled loss,
    whose any gradient not finite skips every pack's update; clipping, by the norm of every pack's gradients) every
    bwd of its span."""
    m, p, s, g = task.model, task.pack, task.span, task.group
    if task.kind == "upd":
        return [TaskId("bwd", m, pack, s, group) for pack in (range(packs) if whole_step else (p,))
                for group in range(groups)]
    deps: list[TaskId] = []
    if p > 0:
        deps.append(TaskId("fwd", m, p - 1, s, g))
    if task.kind == "bwd" and p < packs - 1:
        deps.append(TaskId("bwd", m, p + 1, s, g))
    if s > 0:
        deps.append(updater(m, p, s - 1, groups, overlap))
    return deps


def inputs(task: TaskId, packs: int) -> tuple[Value, ...]:
    """The values a task reads: its boundary input, and for bwd the output gradient or the targets."""
    m, p, s, g = task.model, task.pack, task.span, task.group
    if task.kind == "upd":
        return ()
    boundary: Value = TaskId("fwd", m, p - 1, s, g) if p > 0 else BatchInput(m, s, g)
    if task.kind == "fwd":
        return (boundary,)
    gradient: Value = TaskId("bwd", m, p + 1, s, g) if p < packs - 1 else BatchTargets(m, s, g)
    return (boundary, gradient)


def consumers(value: Value, packs: int) -> list[TaskId]:
    """Tasks that read value; once they have all finished, value can be dropped."""
    if isinstance(value, BatchInput):
        readers = [TaskId("bwd", value.model, 0, value.span, value.group)]
        if packs > 1:
            readers.append(TaskId("fwd", value.model, 0, value.span, value.group))
        return readers
    if isinstance(value, BatchTargets):
        return [TaskId("bwd", value.model, packs - 1, value.span, value.group)]
    m, p, s, g = value.model, value.pack, value.span, value.group
    if value.kind == "fwd":
        readers = [TaskId("bwd", m, p + 1, s, g)]
        if p + 1 < packs - 1:
            readers.append(TaskId("fwd", m, p + 1, s, g))
        return readers
    if value.kind == "bwd" and p > 0:
        return [TaskId("bwd", m, p - 1, s, g)]
    return []
