"""The task graph of training: fwd, bwd and upd tasks per (model, pack, step), their dependencies and data edges."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["fwd", "bwd", "upd"]


@dataclass(frozen=True, order=True)
class TaskId:
    """One task: kind, model index, pack index, step.

    fwd runs packs 0..P-2 forward, keeping nothing but their boundary inputs; bwd runs packs P-1..0,
    recomputing the pack from its boundary input (the last pack's bwd also runs its forward and the
    loss, so the last pack is swapped in once); upd applies the optimizer to a pack in the host store.
    """

    kind: Kind
    model: int
    pack: int
    step: int

    def key(self, run: str) -> str:
        """The Dask key: its prefix (the task kind) is what the dashboard groups by."""
        return f"{self.kind}-m{self.model}-p{self.pack}-s{self.step}-{run}"


@dataclass(frozen=True)
class BatchInput:
    """The inputs of a model's mini-batch for a step (the boundary input of pack 0)."""

    model: int
    step: int


@dataclass(frozen=True)
class BatchTargets:
    """The targets of a model's mini-batch for a step (what the last pack's loss needs)."""

    model: int
    step: int


Value = TaskId | BatchInput | BatchTargets


def parse_key(key: str) -> tuple[TaskId, str] | None:
    """The task and run of a key made by TaskId.key, or None for any other key."""
    parts = key.split("-")
    if len(parts) != 5 or parts[0] not in ("fwd", "bwd", "upd"):
        return None
    try:
        model, pack, step = int(parts[1][1:]), int(parts[2][1:]), int(parts[3][1:])
    except ValueError:
        return None
    return TaskId(parts[0], model, pack, step), parts[4]  # type: ignore[arg-type]


def step_tasks(model: int, packs: int, step: int) -> list[TaskId]:
    """Every task of one model's step, in a valid execution order."""
    forward = [TaskId("fwd", model, p, step) for p in range(packs - 1)]
    backward = [TaskId("bwd", model, p, step) for p in reversed(range(packs))]
    update = [TaskId("upd", model, p, step) for p in reversed(range(packs))]
    return forward + backward + update


def successor(task: TaskId, packs: int) -> TaskId | None:
    """The compute task that follows task in its model's step: the one whose weights to prefetch."""
    m, p, s = task.model, task.pack, task.step
    if task.kind == "fwd":
        return TaskId("fwd", m, p + 1, s) if p + 1 < packs - 1 else TaskId("bwd", m, packs - 1, s)
    if task.kind == "bwd" and p > 0:
        return TaskId("bwd", m, p - 1, s)
    return None


def dependencies(task: TaskId, packs: int) -> list[TaskId]:
    """Tasks that must finish before task may run."""
    m, p, s = task.model, task.pack, task.step
    deps: list[TaskId] = []
    if task.kind == "upd":
        return [TaskId("bwd", m, p, s)]
    if p > 0:
        deps.append(TaskId("fwd", m, p - 1, s))
    if task.kind == "bwd" and p < packs - 1:
        deps.append(TaskId("bwd", m, p + 1, s))
    if s > 0:
        deps.append(TaskId("upd", m, p, s - 1))
    return deps


def inputs(task: TaskId, packs: int) -> tuple[Value, ...]:
    """The values a task reads: its boundary input, and for bwd the output gradient or the targets."""
    m, p, s = task.model, task.pack, task.step
    if task.kind == "upd":
        return ()
    boundary: Value = TaskId("fwd", m, p - 1, s) if p > 0 else BatchInput(m, s)
    if task.kind == "fwd":
        return (boundary,)
    gradient: Value = TaskId("bwd", m, p + 1, s) if p < packs - 1 else BatchTargets(m, s)
    return (boundary, gradient)


def consumers(value: Value, packs: int) -> list[TaskId]:
    """Tasks that read value; once they have all finished, value can be dropped."""
    if isinstance(value, BatchInput):
        readers = [TaskId("bwd", value.model, 0, value.step)]
        if packs > 1:
            readers.append(TaskId("fwd", value.model, 0, value.step))
        return readers
    if isinstance(value, BatchTargets):
        return [TaskId("bwd", value.model, packs - 1, value.step)]
    m, p, s = value.model, value.pack, value.step
    if value.kind == "fwd":
        readers = [TaskId("bwd", m, p + 1, s)]
        if p + 1 < packs - 1:
            readers.append(TaskId("fwd", m, p + 1, s))
        return readers
    if value.kind == "bwd" and p > 0:
        return [TaskId("bwd", m, p - 1, s)]
    return []
