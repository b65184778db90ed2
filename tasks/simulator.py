"""A simulator of schedules: memory replayed against device budgets, and time predicted for a hardware.

replay_memory follows a per-device task order with the device cache's own rules (tasks.memory: weights cached
until evicted least recently used, stale once their pack is updated, pinned while their task runs; gradients
and each micro-batch's workspace reserved while a task runs; a boundary value kept for the task that reads it
where it fits) and returns each device's peak bytes and the bytes swapped, or refuses the order with the task
and the byte count at which a budget would be exceeded. simulate runs the same BindingState the driver uses
against a clock, with task durations from the profile and a Hardware description, and returns the per-device
order it would produce with predicted times.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from harmony.tasks.amortize import homed_task_seconds, runs_spans, steps_per_task
from harmony.tasks.binding import BindingState
from harmony.tasks.events import BatchReady, Fetch, Instruction, Submit, TaskFinished
from harmony.tasks.graph import TaskId, parse_key, successor, updates_in_backward
from harmony.tasks.hardware import Hardware
from harmony.tasks.memory import BudgetExceeded, DeviceMemory
from harmony.tasks.microbatch import deal, split_sizes
from harmony.tasks.packing import Packing
from harmony.tasks.runplan import Job, RunPlan, section_packs
from harmony.tasks.work import optimizer_seconds, task_seconds, update_passes, update_seconds


class ScheduleExceedsBudget(ValueError):
    """Replaying a schedule would put more bytes on a device than its budget."""

    def __init__(self, device: str, task: TaskId, need: int, held: int, budget: int) -> None:
        self.device, self.task, self.need, self.held, self.budget = device, task, need, held, budget
        super().__init__(
            f"{task.key('…')} on {device} needs {need:,} more bytes while {held:,} of its {budget:,}-byte "
            "budget are held by the running task"
        )


@dataclass
class MemoryReport:
    """What replaying a schedule found: per device peaks, and bytes swapped in total."""

    peak: dict[str, int]
    weights_in: int = 0
    grads_out: int = 0
    weights_out: int = 0
    kept: int = 0


def replay_memory(
    order: dict[str, list[TaskId]],
    packings: list[Packing],
    budgets: dict[str, int],
    homes: dict[int, str] | None = None,
    optimizer_state_ratios: list[float] | None = None,
    microbatch_samples: list[list[int]] | None = None,
    sections: list[tuple[int, ...]] | None = None,
    device_updates: dict[int, tuple[int, ...]] | None = None,
    stashes: dict[int, tuple[int, ...]] | None = None,
) -> MemoryReport:
    """Replay each device's task order against its budget, as the runtime's device cache accounts it.

    Homed models (homes) load their weights once and hold them, with a gradient buffer, and after
    their first update (which their bwd applies) their optimizer state (optimizer_state_ratios bytes per
    gradient byte); their weights are written back after each task instead of gradients every step.
    microbatch_samples gives per model the samples of each micro-batch of a step (dealt out among its groups
    in turn); with it, the boundary values that producers keep on the device for their consumers are
    replayed too (kept: the bytes consumers then took there instead of copying them in). sections gives per model
    the first packs of its tasks' sections (tasks.runplan.Job.sections): a task of several packs is replayed pack
    by pack, as the tasks of one pack each that it stands for (pack_tasks). device_updates gives per model the packs
    whose bwd tasks step their optimizer on the device (tasks.updates): the state beside the pack's weights and
    gradients, and the weights out instead of the gradients. stashes gives per model the packs whose forward keeps
    each micro-batch's activations for its backward (tasks.runplan.Job.stashes; Pack.stash_bytes each), by the
    runtime's rules (runtime.stash): kept where the next micro-batch's workspace still fits, taken back by the pack's
    backward, and in a section's bwd whose later packs' stashes are all here, taken at once, no input recomputed.
    """
    homes = homes or {}
    device_updates = device_updates or {}
    stashes = stashes or {}
    sections = sections or [()] * len(packings)
    ratios = optimizer_state_ratios or [2.0] * len(packings)
    groups = [1] * len(packings)
    for task in (task for tasks in order.values() for task in tasks):
        groups[task.model] = max(groups[task.model], task.group + 1)
    report = MemoryReport(peak={})
    for device, tasks in order.items():
        memory = DeviceMemory(device, budgets[device])
        stateful: set[int] = set()
        for task in tasks:
            if task.kind == "upd":
                continue
            try:
                packing = packings[task.model]
                parts = pack_tasks(task, sections[task.model], len(packing.packs))
                memory.drop_boundaries(*parts)
                midway = _midway_input(task, parts, len(packing.packs))
                microbatches = None if microbatch_samples is None else _group_microbatches(
                    microbatch_samples[task.model], groups[task.model], task.group)
                stashing = () if task.model in homes else stashes.get(task.model, ())
                section = section_packs(sections[task.model], len(packing.packs), task.pack)
                keeps = task.kind == "fwd" or section[-1] == len(packing.packs) - 1  # forwards that stash
                taken = _taken_together(memory, task, packing, section, stashing, len(microbatches or [0]),
                                        device_updates.get(task.model, ()), ratios[task.model])
                for part in parts:
                    if taken is not None and part.kind == "fwd":
                        continue  # its later packs' stashes are all here: no input recomputed
                    _replay_task(memory, part, packing, task.model in homes, report, microbatches, midway,
                                 ratios[task.model] if part.pack in device_updates.get(task.model, ()) else None,
                                 stashing if part.kind == "bwd" or keeps else (), taken)
                if task.kind == "bwd" and task.model in homes and task.model not in stateful:
                    stateful.add(task.model)
                    memory.reserve(packings[task.model].packs[task.pack].state_bytes(ratios[task.model]),
                                   "optimizer state")
            except BudgetExceeded as error:
                raise ScheduleExceedsBudget(device, task, error.need, error.held, error.budget) from None
        report.peak[device] = memory.peak
    return report


@contextmanager
def _pinned(memory: DeviceMemory, keys: list[Any]) -> Iterator[None]:
    """Pin those of keys the memory holds for the block (a running task's weights)."""
    held = [key for key in keys if key in memory.entries]
    for key in held:
        memory.pin(key)
    try:
        yield
    finally:
        for key in held:
            memory.unpin(key)


def pack_tasks(task: TaskId, sections: tuple[int, ...], packs: int) -> list[TaskId]:
    """What a task of a section does, as tasks of one pack each: fwd runs its packs forward; bwd runs every pack but
    the last forward (their inputs, recomputed), then each backward from the last."""
    section = section_packs(sections, packs, task.pack)
    if task.kind == "fwd":
        return [dataclasses.replace(task, pack=pack) for pack in section]
    ahead = [dataclasses.replace(task, kind="fwd", pack=pack) for pack in section[:-1]]
    return ahead + [dataclasses.replace(task, pack=pack) for pack in reversed(section)]


def _midway_input(task: TaskId, parts: list[TaskId], packs: int) -> tuple[TaskId, TaskId] | None:
    """In the bwd of a section that is not a pass's last, the forward that recomputes the last pack's input keeps
    it for that pack's backward, which takes it beside its upstream gradient: (that forward, that backward)."""
    forwards = [part for part in parts if part.kind == "fwd"]
    if task.kind != "bwd" or not forwards or forwards[-1].pack + 1 == packs - 1:
        return None
    return forwards[-1], dataclasses.replace(forwards[-1], kind="bwd", pack=forwards[-1].pack + 1)


def _stash_key(task: TaskId, pack: int, microbatch: int) -> tuple[Any, ...]:
    return ("stash", task.model, pack, task.span, task.group, microbatch)


def _taken_together(memory: DeviceMemory, task: TaskId, packing: Packing, section: range, stashing: tuple[int, ...],
                    microbatches: int, updated: tuple[int, ...], state_ratio: float) -> dict[Any, int] | None:
    """The stashes a section's bwd (not a pass's last) takes at once, as runtime.bodies does: those of its later
    packs, where they are all here with its packs' backward room beside them (updated: the packs whose optimizer
    steps on the device, with state_ratio); else None."""
    later = section[1:]
    if task.kind != "bwd" or section[-1] == len(packing.packs) - 1 or not later or any(
            pack not in stashing for pack in later):
        return None
    keys = [_stash_key(task, pack, index) for pack in later for index in range(microbatches)]
    room = max(_backward_bytes(packing, pack, state_ratio if pack in updated else None) for pack in section)
    return memory.unstash_all(keys, room)


def _backward_bytes(packing: Packing, index: int, state_ratio: float | None) -> int:
    """What a pack's backward holds on its device, as the plan counts it: its weights and those it borrows, its
    gradients, workspace and, where its optimizer steps there (state_ratio), its optimizer state. The runtime counts
    the same over its buffers' real sizes (runtime.bodies._backward_bytes)."""
    pack = packing.packs[index]
    lenders = {owner for _, owner, _ in pack.borrowed}
    state = pack.state_bytes(state_ratio) if state_ratio is not None else 0
    return (pack.cost.weights + sum(packing.packs[lender].cost.weights for lender in lenders) + pack.cost.grads
            + pack.cost.workspace + state)


def _replay_task(
    memory: DeviceMemory, task: TaskId, packing: Packing, homed: bool, report: MemoryReport,
    microbatches: list[int] | None, midway: tuple[TaskId, TaskId] | None = None, device_update: float | None = None,
    stashing: tuple[int, ...] = (), taken: dict[Any, int] | None = None,
) -> None:
    """One task's bytes on its device: its weights (pinned while it runs), its gradient buffer (a homed model's
    held for the run), each micro-batch's workspace in turn, and the boundary values it leaves for its successor
    (midway: see _midway_input). The boundaries kept for others were dropped when its section's task started.
    device_update is the optimizer state ratio of a swapped pack updated on its device (None: on the host).
    stashing: the packs whose forward here keeps its activations, or whose backward takes them back (from taken,
    where its section took them at once)."""
    pack = packing.packs[task.pack]
    key = (task.model, task.pack)
    memory.spared = key if task.kind == "bwd" else None
    copied, _ = memory.load(key, task.span, pack.weight_bytes)
    if copied:
        report.weights_in += pack.weight_bytes
    memory.pin(key)
    if homed and not memory.entries[key].held:
        memory.hold(key)
        memory.reserve(pack.grad_bytes, "gradients")
    if homed and task.kind == "bwd":
        report.weights_out += pack.weight_bytes  # flushed to the host store after each task
    elif task.kind == "bwd" and not homed:
        memory.reserve(pack.grad_bytes, "gradients")
        if device_update is None:
            report.grads_out += pack.grad_bytes
        else:
            report.weights_out += pack.grad_bytes  # the trainable weights, updated
    for index, samples in enumerate(microbatches or [0]):
        if microbatches is not None:
            report.kept += memory.claim(("boundary", task, index)) or 0
            if midway is not None and task == midway[1]:
                report.kept += memory.claim(("boundary", ("input", task), index)) or 0
        stash = _stash_key(task, task.pack, index)
        found = 0
        if task.kind == "bwd" and task.pack in stashing:
            found = (taken.pop(stash) if taken is not None and stash in taken else memory.unstash(stash)) or 0
        workspace = max(pack.cost.workspace - found, 0)
        memory.reserve(workspace, "activations")
        later = pack.cost.workspace if microbatches is not None and index + 1 < len(microbatches) else 0
        kept = task.kind == "fwd" and task.pack in stashing and memory.stash(
            stash, key, pack.stash_bytes, reserved=workspace, keep_free=later)
        memory.release(workspace + found - (pack.stash_bytes if kept else 0))
        if microbatches is not None:
            consumer = ("input", midway[1]) if midway is not None and task == midway[0] else None
            _keep_boundary(memory, task, packing, index, samples, later, consumer)
    if task.kind == "bwd" and not homed and device_update is not None:
        memory.reserve(pack.state_bytes(device_update), "optimizer state")
        memory.release(pack.state_bytes(device_update))
    if task.kind == "bwd" and not homed:
        memory.release(pack.grad_bytes)
    if task.kind == "bwd" and homed:
        memory.set_version(key, task.span + 1)
    memory.unpin(key)
    memory.spared = None


def _group_microbatches(sizes: list[int], groups: int, group: int) -> list[int]:
    """The sample counts of one micro-batch group's micro-batches."""
    return deal(sizes, groups)[group]


def _keep_boundary(
    memory: DeviceMemory, task: TaskId, packing: Packing, microbatch: int, samples: int, keep_free: int,
    consumer: Any = None,
) -> None:
    """What a task leaves on the device for its successor (or consumer): fwd its output (the next pack's input), bwd
    its input's gradient (the previous pack's upstream gradient, shaped like this pack's input), beside the
    workspace the task still reserves (keep_free)."""
    consumer = consumer or successor(task, len(packing.packs))
    if consumer is not None:
        reads = task.pack + 1 if task.kind == "fwd" else task.pack
        nbytes = round(packing.packs[reads].input_bytes_per_sample * samples)
        memory.keep(("boundary", consumer, microbatch), consumer, nbytes, keep_free)


def order_from_keys(schedule: dict[str, list[str]]) -> dict[str, list[TaskId]]:
    """A per-device order of task ids from the keys a run recorded (result.stats.schedule)."""
    order = {}
    for device, keys in schedule.items():
        parsed = [parse_key(key) for key in keys]
        order[device] = [item[0] for item in parsed if item is not None]
    return order


def homed_update_seconds(packing: Packing, pack: int, hardware: Hardware) -> float:
    """Predicted time of a homed pack's update on its device: its optimizer's step as the planner measured it
    (Pack.update_seconds), else the host store's passes, at the device's compute scale."""
    measured = packing.packs[pack].update_seconds
    seconds = optimizer_seconds(packing, range(pack, pack + 1), hardware) if measured is None else measured
    return seconds / hardware.compute_scale


def fit_least(predict: Callable[[float], float], measured: float, largest: float = 1.0, probe: float = 1e-3
              ) -> float:
    """The least cost (a Hardware.call_seconds or handling_seconds) at which predict (a plan's predicted figure, given
    that cost) reaches the measured one, to a hundredth (over by less): 0 where the plan without it predicts as much
    already, largest at most. predict never falls as the cost grows, so bisection finds it; it starts from a
    bracket a hundredth wide around where the line through predict(0) and predict(probe) reaches measured (on CPU
    devices the figures grow about linearly with the cost, so that four predictions often settle it), widened
    fourfold a time until it holds the cost. A prediction simulates the plan: on a large plan, a tenth of a second
    or more."""
    base = predict(0.0)
    if base >= measured:
        return 0.0
    rise = predict(probe) - base
    guess = min(largest, max(1e-6, probe * (measured - base) / rise)) if rise > 0 else 1e-6
    low, high = guess * 0.995, min(guess * 1.005, largest)
    while low > 0 and predict(low) >= measured:
        high, low = low, (low / 4 if low > 1e-6 else 0.0)
    while predict(high) < measured:
        if high >= largest:
            return largest
        low, high = high, min(4 * high, largest)
    while high - low > high / 100:
        middle = (low + high) / 2
        low, high = (middle, high) if predict(middle) < measured else (low, middle)
    return high


def boundary_bytes(task: TaskId, packing: Packing, samples: int) -> int:
    """Bytes of the activation that flows into the task's pack (0 for the first pack)."""
    return 0 if task.pack == 0 else round(packing.packs[task.pack].input_bytes_per_sample * samples)


def model_step_seconds(packing: Packing, samples: int, hardware: Hardware) -> float:
    """Predicted compute seconds of one step of a model: every pack's fwd, bwd and upd."""
    return sum(
        task_seconds(TaskId(kind, 0, pack, 0), packing, samples, hardware)
        for pack in range(len(packing.packs))
        for kind in ("fwd", "bwd", "upd")
    )


@dataclass
class Simulation:
    """A predicted run: per device, its tasks in order with start and end times, and the totals. busy is per device
    the seconds its tasks worked (their time less the per-task costs, upd tasks beside it not counted): what a run's
    Stats.busy_seconds measures."""

    order: dict[str, list[TaskId]]
    times: dict[TaskId, tuple[float, float]]
    makespan: float
    steps: list[int]
    busy: dict[str, float] = field(default_factory=dict)
    stashed: dict[int, set[int]] = field(default_factory=dict)  # per job, the packs whose backward found its stash
    work: dict[TaskId, float] = field(default_factory=dict)  # per fwd and bwd task, what it adds to its device's busy

    def step_seconds(self) -> float:
        """Predicted time per step of the whole sweep: the makespan over the most steps any model ran."""
        return self.makespan / max(max(self.steps), 1)


def simulate(
    packings: list[Packing],
    steps: list[int],
    samples: list[int],
    budgets: dict[str, int],
    hardware: Hardware,
    prefetch: bool | str = True,
    policy: str = "lrtf",
    mode: str = "free",
    groups: list[int] | None = None,
    homes: dict[int, str] | None = None,
    overlap: list[bool] | None = None,
    sections: list[tuple[int, ...]] | None = None,
    scaled: list[bool] | None = None,
    device_updates: list[tuple[int, ...]] | None = None,
    stash: bool = True,
) -> Simulation:
    """Predict the schedule and its times: the driver's binding state on a simulated clock.

    Each device runs one task at a time; a task starts when its device is free and its inputs exist (one made on
    another device edge_seconds and the handling of a task after its task ended);
    it takes the task overhead, its compute, and its copies (weights in unless the device caches them,
    boundary activations in and out, less the one its producer left on the device when it ran just before),
    where with prefetch a weight copy overlaps the previous task's compute and (prefetch True, not "weights") the
    boundary copies of every micro-batch but the first in and the last out overlap the task's own, each way beside
    the other (runtime.link: one copy at a time each way, both ways at once). An upd task runs on a host thread
    beside its device: one at a time per device, from when its bwd ends, taking the device's time only where the
    device computes on the host's cores (hardware.shared_cores).
    samples are per job and step; with groups (vDP) each group computes its share of them; overlap says per job
    whether its updates are overlapped (upd tasks) rather than applied in its bwd tasks, sections where its tasks
    run several packs each (tasks.runplan.Job.sections): such a task's copies hide behind the compute of the pack
    before them in the task; scaled where its loss is scaled (fp16: every upd of a step waits for all of its bwd);
    device_updates the packs whose bwd tasks update on the device (tasks.updates): the optimizer at the device's
    compute scale, its state over the link both ways; with stash, a bwd whose pack's activations are predicted
    still on the device does not recompute its forward (_Clock._stashed_seconds). packings are as cut; each is held
    as its job would hold it (simulate_jobs).
    """
    groups = groups or [1] * len(packings)
    homes = homes or {}
    overlap = overlap or [False] * len(packings)
    sections = sections or [()] * len(packings)
    scaled = scaled or [False] * len(packings)
    device_updates = device_updates or [()] * len(packings)
    jobs = [
        Job(members=(index,), label=packing.model, feed=index, seed=index, packing=packing, steps=None,
            step_seconds=0.0, batch_bytes=0, groups=g, home=homes.get(index), overlap=beside, sections=starts,
            scaled=scale, device_updates=there)
        for index, (packing, g, beside, starts, scale, there) in enumerate(
            zip(packings, groups, overlap, sections, scaled, device_updates))
    ]
    return simulate_jobs(jobs, steps, samples, budgets, hardware, prefetch, policy, mode, stash)


def simulate_jobs(
    jobs: list[Job],
    steps: list[int],
    samples: list[int],
    budgets: dict[str, int],
    hardware: Hardware,
    prefetch: bool | str = True,
    policy: str = "lrtf",
    mode: str = "free",
    stash: bool = True,
) -> Simulation:
    """simulate for a plan's jobs, as they are cut, homed, grouped, sectioned, overlapped and scaled: each at its
    device packing (Job.device_packing), for steps[j] steps of samples[j] samples, a step per task, numbered by its
    position, on budgets' devices whatever its machine (simulate one machine's jobs on its devices)."""
    spans = [_span(job, model_step_seconds(job.device_packing, n, hardware), hardware)
             for job, n in zip(jobs, samples, strict=True)]
    jobs = [
        dataclasses.replace(job, members=(index,), feed=index, seed=index, packing=job.device_packing, steps=count,
                            step_seconds=model_step_seconds(job.device_packing, n, hardware), batch_bytes=0,
                            depth=1, task_seconds=0.0, machine="")
        for index, (job, count, n) in enumerate(zip(jobs, steps, samples, strict=True))
    ]
    homes = {index: job.home for index, job in enumerate(jobs) if job.home is not None}
    state = BindingState(jobs, budgets, slots_per_device=1, policy=policy, mode=mode, homes=homes, hardware=hardware)
    clock = _Clock(jobs, samples, budgets, hardware, prefetch, stash, spans)
    clock.carry_out(state, state.start())
    while not state.finished:
        if not clock.events:
            raise RuntimeError("simulation stalled: no task could be bound")
        end, _, task = heapq.heappop(clock.events)
        clock.carry_out(state, state.handle(TaskFinished(task, end)))
    busy = {device: sum(clock.work.get(task, 0.0) for task in tasks) for device, tasks in clock.order.items()}
    return Simulation(clock.order, clock.times, max(end for _, end in clock.times.values()), steps, busy,
                      clock.stashed, clock.work)


def simulate_machines(plan: RunPlan, counts: list[int], samples: list[int], machines: dict[str, str]) -> Simulation:
    """The plan's run simulated machine by machine (a job runs on its machine's devices alone), as one Simulation
    whose makespan is the longest machine's."""
    options, jobs = plan.options, list(plan.jobs)
    order: dict[str, list[TaskId]] = {}
    times: dict[TaskId, tuple[float, float]] = {}
    busy: dict[str, float] = {}
    work: dict[TaskId, float] = {}
    for machine in dict.fromkeys(machines.values()):
        own = [index for index, job in enumerate(jobs) if job.machine == machine]
        budgets = {device: budget for device, budget in plan.devices.items() if machines[device] == machine}
        if not own:
            order.update({device: [] for device in budgets})
            continue
        run = simulate_jobs([jobs[index] for index in own], [counts[index] for index in own],
                            [samples[index] for index in own], budgets, plan.hardware, options.prefetch,
                            options.policy, plan.mode, options.stash)
        renamed = {task: dataclasses.replace(task, model=own[task.model]) for task in run.times}
        order.update({device: [renamed[task] for task in tasks] for device, tasks in run.order.items()})
        times.update({renamed[task]: span for task, span in run.times.items()})
        busy.update(run.busy)
        work.update({renamed[task]: seconds for task, seconds in run.work.items()})
    return Simulation(order, times, max((end for _, end in times.values()), default=0.0), counts, busy, work=work)


def _span(job: Job, step_seconds: float, hardware: Hardware) -> int:
    """The steps one task of a job that runs spans runs (harmony.planner.with_depth: as given, or from its step
    time, the task's cost and the run's length where known), over which the simulator spreads the task's cost while
    binding it a step per task; 1 for any other job."""
    if not runs_spans(job):
        return 1
    if job.depth > 1:
        return job.depth
    return steps_per_task(step_seconds, homed_task_seconds(job, hardware), job.batch_bytes, job.steps)


class _Clock:
    """What the simulated devices do with the binding state's instructions, and when."""

    def __init__(
        self, jobs: list[Job], samples: list[int], budgets: dict[str, int], hardware: Hardware,
        prefetch: bool | str, stash: bool = True, spans: list[int] | None = None,
    ) -> None:
        self.jobs = jobs
        self.spans = spans or [1] * len(jobs)
        self.samples = samples
        self.hardware = hardware
        self.per_task = hardware.task_overhead + hardware.handling_seconds  # what a task costs besides its work
        self.edge = hardware.edge_cost
        self.prefetch = bool(prefetch)  # weights copied in while the task before computes
        self.ahead = prefetch is True  # and micro-batch values while the one before (after) computes
        self.stash = stash
        self.free_at = dict.fromkeys(budgets, 0.0)
        self.host_free_at = dict.fromkeys(budgets, 0.0)
        self.last_compute = dict.fromkeys(budgets, 0.0)
        self.last_ahead = dict.fromkeys(budgets, 0.0)  # of the inward link's time in last_compute, what values took
        self.memory = {name: DeviceMemory(name, budget) for name, budget in budgets.items()}
        self.previous: dict[str, TaskId] = {}
        self.times: dict[TaskId, tuple[float, float]] = {}
        self.device_of: dict[TaskId, str] = {}
        self.order: dict[str, list[TaskId]] = {name: [] for name in budgets}
        self.work: dict[TaskId, float] = {}
        self.events: list[tuple[float, int, TaskId]] = []
        self.stashed: dict[int, set[int]] = {}  # per job, the packs whose backward found its stash

    def carry_out(self, state: BindingState, instructions: list[Instruction]) -> None:
        queue = deque(instructions)
        while queue:
            instruction = queue.popleft()
            if isinstance(instruction, Fetch):
                left = max(0, (self.jobs[instruction.model].steps or 0) - instruction.first)
                ready = BatchReady(instruction.model, instruction.span, min(instruction.count, left))
                queue.extend(state.handle(ready))
            elif isinstance(instruction, Submit):
                ends = [self.times[dep][1] + (self.edge if self.device_of[dep] != instruction.device else 0.0)
                        for dep in state.dependencies(instruction.task) if dep in self.times]
                self.run(instruction, ends)

    def run(self, submit: Submit, ready: list[float]) -> None:
        """Start a task on its device once the device is free and its dependencies have ended."""
        task, device = submit.task, submit.device
        job = self.jobs[task.model]
        packing = job.packing
        if task.kind == "upd":
            self.run_beside(task, device, ready)
            return
        n = -(-self.samples[task.model] // job.groups)
        start = max([self.free_at[device], *ready])
        packs = job.section(task.pack)
        compute = task_seconds(task, packing, n, self.hardware, packs)
        homed = job.home is not None
        if task.kind == "bwd" and homed:
            compute += sum(homed_update_seconds(packing, pack, self.hardware) for pack in packs)
        elif task.kind == "bwd" and updates_in_backward(job.groups, job.overlap):
            compute += sum(update_passes(job, pack, self.hardware) + self.hardware.update_call_seconds
                           for pack in packs)
        copy = self._copy_seconds(task, device, submit.first, n, compute)
        recomputes = task.kind == "bwd" and not homed
        skipped = 0
        if self.stash and not homed:
            saved, recomputes, skipped = self._stashed_seconds(task, device, n)
            compute -= saved
        if recomputes:
            copy += self._again_seconds(task, n)
        if not homed:
            compute = self._with_calls(task, n, compute, skipped)
        end = start + self.per_task / self.spans[task.model] + compute + copy
        self.times[task] = (start, end)
        self.device_of[task] = device
        self.order[device].append(task)
        self.previous[device] = task
        self.work[task] = compute + copy
        self.free_at[device] = end
        self.last_compute[device] = compute
        heapq.heappush(self.events, (end, len(self.times), task))

    def _with_calls(self, task: TaskId, samples: int, compute: float, skipped: int) -> float:
        """A swapped fwd or bwd task's compute with the runtime's host work for its pack calls (Hardware.with_calls):
        a call per pack and micro-batch in a forward; in a backward two (the recompute and the backward), and one
        for each pack but the last to recompute the inputs of a section's later packs (task_seconds), less the
        skipped forwards a stash saved."""
        job = self.jobs[task.model]
        microbatches = -(-samples // job.packing.microbatch_samples)
        packs = len(job.section(task.pack))
        calls = packs * microbatches if task.kind == "fwd" else (3 * packs - 1) * microbatches - skipped
        return self.hardware.with_calls(compute, calls)

    def run_beside(self, task: TaskId, device: str, ready: list[float]) -> None:
        """An upd task on the device's host thread: its own Dask task (the task overhead and handling) and the
        optimizer's passes, from when its bwd ends; on shared cores the device loses that compute."""
        start = max([self.host_free_at[device], *ready])
        job = self.jobs[task.model]
        compute = update_seconds(job.packing, job.section(task.pack), self.hardware)
        end = start + self.per_task + compute
        if self.hardware.shared_cores:
            self.free_at[device] = max(self.free_at[device], start) + compute
        self.times[task] = (start, end)
        self.device_of[task] = device
        self.order[device].append(task)
        self.host_free_at[device] = end
        heapq.heappush(self.events, (end, len(self.times), task))

    def _stashed_seconds(self, task: TaskId, device: str, samples: int) -> tuple[float, bool, int]:
        """The forwards a task's backward does not recompute, whether it recomputes its packs' inputs (a bwd not taking
        its later packs' stashes at once), and how many pack calls those forwards were: those of its packs'
        micro-batches whose stash (runtime.stash) is still on the device. A fwd task (and the forward a pass's last
        section runs in its bwd) stashes each pack's micro-batches' activations (Pack.stash_bytes each), as many as
        reserving them beside what the task holds (its weights unless this clock holds them, and the workspace) evicts
        only weights and older stashes; a bwd first reserves each pack's weights, gradients and workspace (which may
        evict stashes, its own last), then takes its stashes. A section's bwd (not a pass's last) whose later packs'
        stashes are all here, with the room its backward needs beside them, takes them at once and recomputes none of
        their inputs (_taken_together, as the memory replay does). The task's weights stay while it runs."""
        job = self.jobs[task.model]
        packing = job.packing
        memory = self.memory[device]
        last = len(packing.packs) - 1
        section = job.section(task.pack)
        sizes = split_sizes(samples, -(-samples // packing.microbatch_samples))

        def working(pack: int, backward: bool) -> int:
            """What the task holds for pack beside stashes, less its weights where this clock holds them already (a
            prefetch does not take a stash's room: it waits, or the weights are copied when their task starts)."""
            cost = packing.packs[pack].cost
            held = 0 if (task.model, pack) in memory.entries else cost.weights
            return held + cost.workspace + (cost.grads if backward else 0)

        def hold(nbytes: int, pack: int) -> bool:
            """Reserve nbytes as the task would (its pack's stashes last); whether they fit."""
            try:
                memory.reserve(nbytes, "a task", spared=((task.model, pack),))
            except BudgetExceeded:
                return False
            return True

        def forward(pack: int, microbatch: int) -> float:
            return packing.packs[pack].forward_seconds_per_sample * sizes[microbatch] / self.hardware.compute_scale

        def stash(pack: int) -> None:
            """As many of the pack's micro-batches' stashes as fit, from its first (a failed reservation evicts
            nothing, and a stash of its own is never evicted for another)."""
            nbytes, held = packing.packs[pack].stash_bytes, working(pack, False)
            kept = next((count for count in range(len(sizes), 0, -1) if hold(held + count * nbytes, pack)), 0)
            if kept:
                memory.release(held)
            for index in range(kept):
                memory.stash(_stash_key(task, pack, index), (task.model, pack), nbytes, nbytes, 0)

        saved, skipped = 0.0, 0
        with _pinned(memory, [(task.model, pack) for pack in section]):
            if task.kind == "fwd":
                for pack in section:
                    stash(pack)
                return saved, False, skipped
            if section[-1] == last:  # this bwd runs the step's forward: its packs but the last stash there
                for pack in section[:-1]:
                    stash(pack)
            together = _taken_together(memory, task, packing, section, tuple(section), len(sizes), job.device_updates,
                                       job.state_ratio) or {}
            if together:  # its later packs' stashes all here: no input recomputed
                saved += sum(forward(pack, index) for pack in section[:-1] for index in range(len(sizes)))
                skipped += (len(section) - 1) * len(sizes)
            for pack in reversed(section):
                needed = working(pack, True)
                if hold(needed, pack):
                    memory.release(needed)
                for index in range(len(sizes)):
                    key = _stash_key(task, pack, index)
                    taken = together.pop(key) if key in together else memory.unstash(key)
                    if taken is not None:
                        memory.release(taken)
                        if pack != last:
                            self.stashed.setdefault(task.model, set()).add(pack)
                            saved += forward(pack, index)
                            skipped += 1
        return saved, not together, skipped

    def _again_seconds(self, task: TaskId, samples: int) -> float:
        """Seconds of the copies a bwd over a section makes of its inner packs' inputs when it recomputes them: each
        is copied out before the forward that may change it in place and in again for its pack's backward
        (runtime.bodies, again); with ahead the copies in of every micro-batch but the first hide behind compute."""
        link = self.hardware.host_link
        job = self.jobs[task.model]
        packs = job.section(task.pack)
        if not link or len(packs) < 3:
            return 0.0
        inner = sum(boundary_bytes(dataclasses.replace(task, pack=pack), job.packing, samples) for pack in packs[1:-1])
        microbatches = -(-samples // job.packing.microbatch_samples)
        return inner / link * (1 + (1 / microbatches if self.ahead else 1))

    def _copy_seconds(self, task: TaskId, device: str, first: int, samples: int, compute: float) -> float:
        """Seconds of the task's copies over the host link that its compute does not hide: boundary values (with
        ahead, all but the first micro-batch's in and the last one's out hidden behind the task's compute, each
        direction up to it), weights the device does not cache (with prefetch, hidden behind what the inward link
        has left of the previous task's compute, or of the previous pack's in the task, beside the values that came
        in ahead then) and a swapped pack's gradients."""
        link = self.hardware.host_link
        if not link:
            return 0.0
        job = self.jobs[task.model]
        packing = job.packing
        homed = job.home is not None
        packs = job.section(task.pack)
        copy = 0.0
        boundary = boundary_bytes(dataclasses.replace(task, pack=packs[0]), packing, samples) / link
        previous = self.previous.get(device)
        kept = previous is not None and successor(previous, job.section_count) == task
        inward, outward = ((1 if task.kind == "fwd" else 2) - kept) * boundary, boundary
        microbatches = -(-samples // packing.microbatch_samples)
        ahead = 0.0
        if self.ahead and microbatches > 1:
            hidden = (microbatches - 1) / microbatches  # the first micro-batch's values in, the last one's out wait
            ahead = min(inward * hidden, compute)
            copy += (inward + outward) * (1 - hidden)
            copy += max(0.0, inward * hidden - compute) + max(0.0, outward * hidden - compute)
        else:
            copy += inward + outward
        hiding = max(0.0, self.last_compute[device] - self.last_ahead[device])
        loads = [part.pack for part in pack_tasks(task, job.sections, len(packing.packs))]  # bwd: inputs first
        for pack in loads:
            nbytes = packing.packs[pack].weight_bytes
            try:
                copied, _ = self.memory[device].load((task.model, pack), 0 if homed else first, nbytes)
            except BudgetExceeded:
                copied = True
            if copied:
                copy += max(0.0, nbytes / link - hiding) if self.prefetch else nbytes / link
            hiding = max(0.0, compute - ahead) / len(loads)
        self.last_ahead[device] = ahead
        if task.kind == "bwd" and not homed:  # gradients out; updated on the device, the weights out instead and
            copy += sum(packing.packs[pack].grad_bytes  # the optimizer state in and out
                        + (2 * packing.packs[pack].state_bytes(job.state_ratio) if pack in job.device_updates else 0)
                        for pack in packs) / link
        return copy
