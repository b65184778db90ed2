"""A simulator of schedules: memory replayed against device budgets, and time predicted for a hardware.

replay_memory follows a per-device task order with the device cache's own rules (pack weights are
resident until evicted least-recently-used, a copy is stale once its pack was updated, a running
task's weights are pinned, gradients and each micro-batch's workspace are reserved while a task runs,
a boundary value is kept for the task that reads it when it fits, until another task starts) and
returns each device's peak bytes and the bytes swapped, or refuses the order with the task and the
byte count at which a budget would be exceeded. simulate runs the same BindingState the driver uses
against a clock, with task durations from the profile and a Hardware description, and returns the
per-device order it would produce with predicted times.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from harmony.tasks.binding import BindingState, ModelWork
from harmony.tasks.graph import TaskId, parse_key, successor, updates_in_backward
from harmony.tasks.microbatch import group_sizes
from harmony.tasks.packing import PackPlan


class ScheduleExceedsBudget(ValueError):
    """Replaying a schedule would put more bytes on a device than its budget."""

    def __init__(self, device: str, task: TaskId, need: int, held: int, budget: int) -> None:
        self.device, self.task, self.need, self.held, self.budget = device, task, need, held, budget
        super().__init__(
            f"{task.key('…')} on {device} needs {need:,} more bytes while {held:,} of its {budget:,}-byte "
            "budget are held by the running task"
        )


@dataclass(frozen=True)
class Hardware:
    """What a device can do: compute relative to the pilot machine, and link speeds in bytes per second.

    compute_scale 1.0 means as fast as the machine that ran the pilot pass; host_link is host<->device
    (None: copies cost nothing), peer_link device<->device; task_overhead is the runtime's fixed cost
    per task (Dask's scheduling, about a millisecond on a server, a few on a small machine); task_cpu is the
    CPU time a task takes from the cores the devices compute with (the driver's, the scheduler's and the
    worker's work for it; 0 where the devices compute elsewhere).
    """

    name: str = "this machine"
    compute_scale: float = 1.0
    host_link: float | None = None
    peer_link: float | None = None
    task_overhead: float = 0.003
    task_cpu: float = 0.0
    optimizer_bytes_per_second: float = 5e9


@dataclass
class MemoryReport:
    """What replaying a schedule found: per device peaks, and bytes swapped in total."""

    peak: dict[str, int]
    weights_in: int = 0
    grads_out: int = 0
    weights_out: int = 0
    kept: int = 0


@dataclass
class _Entry:
    nbytes: int
    version: int


class _DeviceMemory:
    """The device cache's accounting rules, without bytes."""

    def __init__(self, name: str, budget: int) -> None:
        self.name = name
        self.budget = budget
        self.used = 0
        self.peak = 0
        self.residents: OrderedDict[tuple, _Entry] = OrderedDict()
        self.held: set[tuple[int, int]] = set()

    def charge(self, nbytes: int, task: TaskId, pinned: tuple[int, int] | None) -> None:
        while self.used + nbytes > self.budget:
            victim = next((key for key in self.residents if key != pinned and key not in self.held), None)
            if victim is None:
                raise ScheduleExceedsBudget(self.name, task, nbytes, self.used, self.budget)
            self.used -= self.residents.pop(victim).nbytes
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def keep(self, consumer: TaskId, microbatch: int, nbytes: int, keep_free: int) -> None:
        """A boundary value kept for consumer if it fits beside keep_free bytes without evicting anything."""
        if self.used + nbytes + keep_free <= self.budget:
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            self.residents[("boundary", consumer, microbatch)] = _Entry(nbytes, -1)

    def claim(self, consumer: TaskId, microbatch: int) -> int:
        """Bytes of the boundary value kept for consumer's micro-batch (released), or 0 if none is left."""
        entry = self.residents.pop(("boundary", consumer, microbatch), None)
        if entry is None:
            return 0
        self.used -= entry.nbytes
        return entry.nbytes

    def drop_boundaries(self, running: TaskId) -> None:
        for key in [k for k in self.residents if k[0] == "boundary" and k[1] != running]:
            self.used -= self.residents.pop(key).nbytes

    def weights(self, key: tuple[int, int], version: int, nbytes: int, task: TaskId) -> bool:
        """Make key's weights resident at version; returns whether they had to be copied in."""
        entry = self.residents.get(key)
        if entry is not None and entry.version != version:
            self.used -= self.residents.pop(key).nbytes
            entry = None
        loaded = entry is None
        if loaded:
            self.charge(nbytes, task, None)
            self.residents[key] = _Entry(nbytes, version)
        self.residents.move_to_end(key)
        return loaded


def replay_memory(
    order: dict[str, list[TaskId]],
    plans: list[PackPlan],
    budgets: dict[str, int],
    homes: dict[int, str] | None = None,
    optimizer_state_ratios: list[float] | None = None,
    microbatch_samples: list[list[int]] | None = None,
) -> MemoryReport:
    """Replay each device's task order against its budget, as the runtime's device cache accounts it.

    Resident models (homes) load their weights once and hold them, with a gradient buffer, and after
    their first update (which their bwd applies) their optimizer state (optimizer_state_ratios bytes per
    gradient byte); their weights are written back once at the end instead of gradients every step.
    microbatch_samples gives per model the samples of each micro-batch of a step (split among its groups
    in order); with it, the boundary values that producers keep on the device for their consumers are
    replayed too (kept: the bytes consumers then took there instead of copying them in).
    """
    homes = homes or {}
    ratios = optimizer_state_ratios or [2.0] * len(plans)
    groups = [1] * len(plans)
    for task in (task for tasks in order.values() for task in tasks):
        groups[task.model] = max(groups[task.model], task.group + 1)
    report = MemoryReport(peak={})
    for device, tasks in order.items():
        memory = _DeviceMemory(device, budgets[device])
        stateful: set[int] = set()
        for task in tasks:
            pack = plans[task.model].packs[task.pack]
            key = (task.model, task.pack)
            resident = task.model in homes
            if task.kind == "upd":
                continue
            memory.drop_boundaries(task)
            if memory.weights(key, task.step, pack.weight_bytes, task):
                report.weights_in += pack.weight_bytes
            if resident and key not in memory.held:
                memory.held.add(key)
                memory.charge(pack.grad_bytes, task, key)
                report.weights_out += pack.weight_bytes
            elif task.kind == "bwd" and not resident:
                memory.charge(pack.grad_bytes, task, key)
                report.grads_out += pack.grad_bytes
            if microbatch_samples is None:
                memory.charge(pack.cost.workspace, task, key)
                memory.used -= pack.cost.workspace
            else:
                sizes = _group_microbatches(microbatch_samples[task.model], groups[task.model], task.group)
                for index, samples in enumerate(sizes):
                    report.kept += memory.claim(task, index)
                    memory.charge(pack.cost.workspace, task, key)
                    memory.used -= pack.cost.workspace
                    later = pack.cost.workspace if index + 1 < len(sizes) else 0
                    _keep_boundary(memory, task, plans[task.model], index, samples, later)
            if task.kind == "bwd" and not resident:
                memory.used -= pack.grad_bytes
            if task.kind == "bwd" and resident:
                memory.residents[key].version = task.step + 1
                if task.model not in stateful:
                    stateful.add(task.model)
                    memory.charge(round(ratios[task.model] * pack.grad_bytes), task, key)
        report.peak[device] = memory.peak
    return report


def _group_microbatches(sizes: list[int], groups: int, group: int) -> list[int]:
    """The sample counts of one micro-batch group's micro-batches."""
    counts = group_sizes(len(sizes), groups)
    start = sum(counts[:group])
    return sizes[start : start + counts[group]]


def _keep_boundary(
    memory: _DeviceMemory, task: TaskId, plan: PackPlan, microbatch: int, samples: int, keep_free: int
) -> None:
    """What a task leaves on the device for its successor: fwd its output (the next pack's input), bwd its
    input's gradient (the previous pack's upstream gradient, shaped like this pack's input), beside the
    workspace the task still reserves (keep_free)."""
    consumer = successor(task, len(plan.packs))
    if consumer is not None:
        reads = task.pack + 1 if task.kind == "fwd" else task.pack
        memory.keep(consumer, microbatch, round(plan.packs[reads].input_bytes_per_sample * samples), keep_free)


def order_from_keys(schedule: dict[str, list[str]]) -> dict[str, list[TaskId]]:
    """A per-device order of task ids from the keys a run recorded (result.stats.schedule)."""
    order = {}
    for device, keys in schedule.items():
        parsed = [parse_key(key) for key in keys]
        order[device] = [item[0] for item in parsed if item is not None]
    return order


def task_seconds(task: TaskId, plan: PackPlan, samples: int, hardware: Hardware) -> float:
    """Predicted compute time of a task: forward once for fwd, forward three times' worth for bwd (the
    recompute plus a backward that costs about two forwards), the optimizer's passes for upd."""
    pack = plan.packs[task.pack]
    forward = pack.forward_seconds_per_sample * samples / hardware.compute_scale
    if task.kind == "fwd":
        return forward
    if task.kind == "bwd":
        return 3 * forward
    return update_seconds(plan, task.pack, hardware)


def update_seconds(plan: PackPlan, pack: int, hardware: Hardware) -> float:
    """Predicted time of a pack's optimizer step on the host store: a few passes over its weights."""
    return 4 * plan.packs[pack].weight_bytes / hardware.optimizer_bytes_per_second


def boundary_bytes(task: TaskId, plan: PackPlan, samples: int) -> int:
    """Bytes of the activation that flows into the task's pack (0 for the first pack)."""
    return 0 if task.pack == 0 else round(plan.packs[task.pack].input_bytes_per_sample * samples)


def model_step_seconds(plan: PackPlan, samples: int, hardware: Hardware) -> float:
    """Predicted compute seconds of one step of a model: every pack's fwd, bwd and upd."""
    return sum(
        task_seconds(TaskId(kind, 0, pack, 0), plan, samples, hardware)
        for pack in range(len(plan.packs))
        for kind in ("fwd", "bwd", "upd")
    )


def _feed(state: BindingState, steps: list[int]) -> None:
    """Open every step the binder asks for, and end each model after its last step."""
    for model, step in state.wanted_batches():
        if step < steps[model]:
            state.add_batch(model, step)
        else:
            state.end_of_data(model)


@dataclass
class Simulation:
    """A predicted run: per device, its tasks in order with start and end times, and the totals."""

    order: dict[str, list[TaskId]]
    times: dict[TaskId, tuple[float, float]]
    makespan: float
    steps: list[int]
    busy: dict[str, float] = field(default_factory=dict)

    def step_seconds(self) -> float:
        """Predicted time per step of the whole sweep: the makespan over the most steps any model ran."""
        return self.makespan / max(max(self.steps), 1)


def simulate(
    plans: list[PackPlan],
    steps: list[int],
    samples: list[int],
    budgets: dict[str, int],
    hardware: Hardware,
    prefetch: bool = True,
    policy: str = "lrtf",
    mode: str = "free",
    groups: list[int] | None = None,
    homes: dict[int, str] | None = None,
) -> Simulation:
    """Predict the schedule and its times: the driver's binder on a simulated clock.

    Each device runs one task at a time; a task starts when its device is free and its inputs exist;
    it takes the task overhead, its compute, and its copies (weights in when not resident, boundary
    activations in and out, less the one its producer left on the device when it ran just before),
    where with prefetch a weight copy overlaps the previous task's compute.
    samples are per model and step; with groups (vDP) each group computes its share of them.
    """
    groups = groups or [1] * len(plans)
    works = [
        ModelWork(
            tuple(p.weight_bytes for p in plan.packs),
            steps=count,
            step_seconds=model_step_seconds(plan, n, hardware),
            groups=g,
        )
        for plan, count, n, g in zip(plans, steps, samples, groups)
    ]
    state = BindingState(works, budgets, slots_per_device=1, policy=policy, mode=mode, homes=homes)
    _feed(state, steps)
    free_at = dict.fromkeys(budgets, 0.0)
    last_compute = dict.fromkeys(budgets, 0.0)
    times: dict[TaskId, tuple[float, float]] = {}
    order: dict[str, list[TaskId]] = {name: [] for name in budgets}
    resident: dict[str, set[tuple[int, int, int]]] = {name: set() for name in budgets}
    busy = dict.fromkeys(budgets, 0.0)
    previous: dict[str, TaskId] = {}
    events: list[tuple[float, int, TaskId]] = []
    counter = 0
    while not state.finished:
        for device in budgets:
            if state.has_free_slot(device):
                task = state.bind(device)
                if task is None:
                    continue
                plan = plans[task.model]
                n = -(-samples[task.model] // groups[task.model])
                deps = [times[d][1] for d in state.dependencies(task) if d in times]
                start = max([free_at[device], *deps])
                compute = task_seconds(task, plan, n, hardware)
                homed = task.model in (homes or {})
                if task.kind == "bwd" and not homed and updates_in_backward(groups[task.model]):
                    compute += update_seconds(plan, task.pack, hardware)
                copy = 0.0
                link = hardware.host_link
                if task.kind != "upd" and link:
                    version = (task.model, task.pack, 0 if homed else task.step)
                    if version not in resident[device]:
                        resident[device].add(version)
                        weights = plan.packs[task.pack].weight_bytes / link
                        copy += max(0.0, weights - last_compute[device]) if prefetch else weights
                    boundary = boundary_bytes(task, plan, n)
                    kept = previous.get(device) is not None and successor(previous[device], len(plan.packs)) == task
                    crossings = (2 if task.kind == "fwd" else 3) - kept
                    copy += crossings * boundary / link
                    if task.kind == "bwd" and not homed:
                        copy += plan.packs[task.pack].grad_bytes / link
                end = start + hardware.task_overhead + compute + copy
                times[task] = (start, end)
                order[device].append(task)
                if task.kind != "upd":
                    previous[device] = task
                busy[device] += end - start
                free_at[device] = end
                last_compute[device] = compute
                counter += 1
                heapq.heappush(events, (end, counter, task))
        if not events:
            raise RuntimeError("simulation stalled: no task could be bound")
        _, _, task = heapq.heappop(events)
        state.complete(task)
        _feed(state, steps)
    return Simulation(order, times, max(end for _, end in times.values()), steps, busy)

