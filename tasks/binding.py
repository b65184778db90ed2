"""Late binding as a state machine: which ready task a device with a free slot runs next. No I/O.

The driver feeds it events (a batch arrived, a loader ran dry, a task finished) and asks it for
bindings; it answers with task ids and with the values that nobody will read any more.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from harmony.tasks.amortize import SpanPlan
from harmony.tasks.graph import (
    BatchInput,
    BatchTargets,
    TaskId,
    Value,
    consumers,
    dependencies,
    inputs,
    step_tasks,
    successor,
    updater,
)

KIND_RANK = {"upd": 0, "bwd": 1, "fwd": 2}
POLICIES = ("lrtf", "round_robin")
MODES = ("free", "vpp", "vdp")


@dataclass(frozen=True)
class ModelWork:
    """What the binder needs to know of one model (or fused array): its packs and their weight bytes.

    steps (the run's length, when known) and step_seconds count training steps. depth is how many training
    steps each of its tasks runs (a resident model's multi-step tasks, a span each: one of its steps here); with
    task_seconds (a task's cost) and batch_bytes (one step's batch), the spans not yet opened are re-cut as
    the finished ones measure their step time (see SpanPlan), depth being the first spans' length.
    """

    pack_weight_bytes: tuple[int, ...]
    steps: int | None = None
    step_seconds: float = 0.0
    groups: int = 1
    depth: int = 1
    task_seconds: float = 0.0
    batch_bytes: int = 0

    @property
    def packs(self) -> int:
        return len(self.pack_weight_bytes)


@dataclass
class DeviceState:
    """The binder's view of one device: tasks bound to it and the packs it probably holds."""

    budget: int
    slots: int
    bound: set[TaskId] = field(default_factory=set)
    resident: OrderedDict[tuple[int, int], int] = field(default_factory=OrderedDict)

    def touch(self, pack: tuple[int, int], nbytes: int) -> None:
        self.resident.pop(pack, None)
        self.resident[pack] = nbytes
        while sum(self.resident.values()) > self.budget and len(self.resident) > 1:
            self.resident.popitem(last=False)


class BindingState:
    """Ready tasks, bound tasks and finished tasks of every model; picks what a free device runs next.

    A model's steps here are its spans (one training step each, unless its tasks run several): total_steps,
    opened and steps_done count them, trained counts the training steps done.
    """

    def __init__(
        self,
        models: list[ModelWork],
        budgets: dict[str, int],
        slots_per_device: int = 4,
        policy: str = "lrtf",
        mode: str = "free",
        homes: dict[int, str] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}; use one of {POLICIES}")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; use one of {MODES}")
        self.policy = policy
        self.mode = mode
        self.homes = homes or {}
        self.device_names = list(budgets)
        self.models = models
        self.devices = {name: DeviceState(budget, slots_per_device) for name, budget in budgets.items()}
        self.spans = [SpanPlan(work.steps, work.depth, work.task_seconds, work.batch_bytes) for work in models]
        self.opened: list[int] = [0] * len(models)
        self.trained: list[int] = [0] * len(models)
        self._open_spans: dict[tuple[int, int], tuple[int, int]] = {}
        self.pending: set[TaskId] = set()
        self.done: set[TaskId] = set()
        self.bound: dict[TaskId, str] = {}
        self.readers: dict[Value, int] = {}
        self.steps_done: list[int] = [0] * len(models)
        self._deps: dict[TaskId, list[TaskId]] = {}
        self._unmet: dict[TaskId, set[TaskId]] = {}
        self._dependents: dict[TaskId, list[TaskId]] = {}
        self._ready: set[TaskId] = set()

    def wanted_batches(self) -> list[tuple[int, int]]:
        """(model, step) pairs whose mini-batch the driver should fetch now, every one that may open, in order.

        A model's step opens once the step before the previous one has finished its backward, so that at
        most two steps are open: the next step's tasks can be queued on a device (waiting on the updates
        they depend on) before the current step ends, with no round trip through the driver. Two may open
        at once (at the start, or when the driver comes late), and both are asked for.
        """
        wanted = []
        for m, opened in enumerate(self.opened):
            total = self.total_steps(m)
            groups = self.models[m].groups
            step = opened
            while (total is None or step < total) and (
                step < 2 or all(TaskId("bwd", m, 0, step - 2, g) in self.done for g in range(groups))
            ):
                wanted.append((m, step))
                step += 1
        return wanted

    def next_span(self, model: int) -> tuple[int, int]:
        """The first training step and the length of the model's next span (see SpanPlan)."""
        return self.spans[model].next_span()

    def add_batch(self, model: int, step: int, count: int = 1) -> None:
        """The mini-batch for (model, step) is available (count training steps of it, a span's): its tasks
        become candidates."""
        assert step == self.opened[model], f"batches arrive in order: expected {self.opened[model]}, got {step}"
        self._open_spans[(model, step)] = (self.spans[model].opened, count)
        self.spans[model].open(count)
        packs = self.models[model].packs
        groups = self.models[model].groups
        for group in range(groups):
            for value in (BatchInput(model, step, group), BatchTargets(model, step, group)):
                self.readers[value] = len(consumers(value, packs))
        for task in step_tasks(model, packs, step, groups):
            self.pending.add(task)
            self.readers[task] = len(consumers(task, packs))
            deps = self._deps[task] = dependencies(task, packs, groups)
            unmet = {dep for dep in deps if dep not in self.done and dep not in self.bound}
            for dep in unmet:
                self._dependents.setdefault(dep, []).append(task)
            if unmet:
                self._unmet[task] = unmet
            else:
                self._ready.add(task)
        self.opened[model] = step + 1

    def span(self, model: int, step: int) -> tuple[int, int] | None:
        """The first training step and the length of the span that (model, step)'s tasks run, while it is open;
        None for a model whose tasks run one training step each."""
        return self._open_spans.get((model, step)) if self.spans[model].runs_spans else None

    def total_steps(self, model: int) -> int | None:
        """How many steps (spans) the model runs in all: those opened and those its plan has left to cut (None
        while its loader's length is unknown)."""
        left = self.spans[model].spans_left()
        return None if left is None else self.opened[model] + left

    def end_of_data(self, model: int) -> None:
        """The model's loader has no more batches: the steps opened so far are all it trains."""
        self.spans[model].end()

    def measured(self, model: int, seconds: float, steps: int) -> None:
        """The model's finished spans ran steps training steps in seconds: re-cut the spans not yet opened."""
        self.spans[model].measured(seconds, steps)

    @property
    def finished(self) -> bool:
        return all(
            (total := self.total_steps(m)) is not None and self.steps_done[m] >= total for m in range(len(self.models))
        )

    def has_free_slot(self, device: str) -> bool:
        state = self.devices[device]
        return len(state.bound) < state.slots

    def dependencies(self, task: TaskId) -> list[TaskId]:
        """Tasks that must finish before task may run (kept from when its step opened until it completes)."""
        cached = self._deps.get(task)
        if cached is not None:
            return cached
        work = self.models[task.model]
        return dependencies(task, work.packs, work.groups)

    def placement(self, task: TaskId) -> str | None:
        """The device a task must run on in this mode, or None where any device may take it.

        vpp spreads packs round-robin over devices (pack p of model m on device (m + p) mod D), so that
        activations flow device to device; vdp gives micro-batch group g to device g mod D, each device
        running every pack for its group. vdp's upd tasks run on the host store and may go anywhere. A resident
        model runs everything, its updates included, on its home device.
        """
        if task.model in self.homes:
            return self.homes[task.model]
        if self.mode == "free" or task.kind == "upd":
            return None
        count = len(self.device_names)
        index = (task.model + task.pack) % count if self.mode == "vpp" else task.group % count
        return self.device_names[index]

    def ready(self, device: str | None = None) -> list[TaskId]:
        """Candidates (for device, if given) whose dependencies have all finished or are bound already.

        A task whose inputs are still being computed can be handed to Dask, which starts it the moment
        they exist; queueing it on the device hides the round trip through the driver. Readiness is kept
        up to date as tasks are bound (see _satisfy), so that asking costs nothing per waiting task: the
        driver asks after every completion, in the process that also runs an embedded scheduler.
        """
        return [task for task in self._ready if device is None or self.placement(task) in (None, device)]

    def _satisfy(self, task: TaskId) -> None:
        """task was bound: the tasks that waited for it alone become ready."""
        for dependent in self._dependents.pop(task, ()):
            unmet = self._unmet[dependent]
            unmet.discard(task)
            if not unmet:
                del self._unmet[dependent]
                self._ready.add(dependent)

    def remaining_seconds(self, model: int) -> float:
        """Predicted time the model still needs: its remaining steps times its step time (one second per
        step when its step time is unknown, so that remaining steps decide)."""
        steps = self.spans[model].steps
        if steps is None:
            return float("inf")
        return (steps - self.trained[model]) * (self.models[model].step_seconds or 1.0)

    def model_rank(self, model: int) -> tuple[float, int]:
        """Which model a free device serves first: Sharded-LRTF gives it to the model with the longest
        remaining time; round-robin (and LRTF between models of unknown length) to the model that has
        made the least progress."""
        progress = self.trained[model]
        if self.policy == "lrtf":
            return -self.remaining_seconds(model), progress
        return 0.0, progress

    def score(self, task: TaskId, device: str) -> tuple[float, ...]:
        """Lower is better: tasks that can start now, updates first, then tasks whose pack is resident on
        device, backward before forward, then the model the policy ranks first."""
        resident = (task.model, task.pack) in self.devices[device].resident and task.kind != "upd"
        waiting = any(dep in self.bound for dep in self.dependencies(task))
        return (
            1 if waiting else 0,
            KIND_RANK[task.kind] if task.kind == "upd" else 1,
            0 if resident else 1,
            KIND_RANK[task.kind],
            *self.model_rank(task.model),
            task.model,
            task.pack,
            task.step,
            task.group,
        )

    def bind(self, device: str) -> TaskId | None:
        """Choose the ready task that device should run next, or None if there is none or no free slot."""
        if not self.has_free_slot(device):
            return None
        candidates = self.ready(device)
        if not candidates:
            return None
        task = min(candidates, key=lambda t: self.score(t, device))
        self.pending.discard(task)
        self._ready.discard(task)
        self.bound[task] = device
        self._satisfy(task)
        self.devices[device].bound.add(task)
        work = self.models[task.model]
        follower = successor(task, work.packs)
        if follower is not None:
            self.devices[device].touch((follower.model, follower.pack), work.pack_weight_bytes[follower.pack])
        return task

    def complete(self, task: TaskId) -> list[Value]:
        """Task finished: free its slot, update residency, and return the values nobody will read again."""
        device = self.bound.pop(task)
        self.devices[device].bound.discard(task)
        self.done.add(task)
        del self._deps[task]
        work = self.models[task.model]
        pack = (task.model, task.pack)
        applied = task == updater(task.model, task.pack, task.step, work.groups)
        if applied and task.model not in self.homes:
            for state in self.devices.values():  # the update made every device's copy of the pack stale
                state.resident.pop(pack, None)
        elif task.kind != "upd":
            self.devices[device].touch(pack, work.pack_weight_bytes[task.pack])
        if applied and all(
            updater(task.model, p, task.step, work.groups) in self.done for p in range(work.packs)
        ):
            self.steps_done[task.model] = task.step + 1
            self.trained[task.model] += self._open_spans.pop((task.model, task.step))[1]
        released = []
        for value in inputs(task, work.packs):
            self.readers[value] -= 1
            if self.readers[value] == 0:
                del self.readers[value]
                released.append(value)
        if self.readers.get(task) == 0:
            del self.readers[task]
            released.append(task)
        return released
