"""The runtime's host costs per pack call and per task, fitted to a run's steps for the plans this process makes
after it.

The pilot times a model's layers, never the work the runtime does around them: inside a task, around each pack's
call on a micro-batch (binding the weights, claiming and copying values, bookkeeping; on a GPU, launching the
kernels), and between tasks (the driver binding and submitting the next, the worker taking its values in and its
results out), which Dask's latency timed on the idle cluster does not show on a machine whose cores the devices
compute with. A swapped model with many small packs or micro-batches can spend most of its step on them. A run
tells them apart: its tasks' durations (each kind's median over the steady steps) less the simulator's work for
each, against each kind's pack calls, give the cost per call as their slope (Hardware.call_seconds; the intercept,
work per task inside a task, is no call's), or where every kind makes as many calls, the busy time per step does;
and its steady step against the simulator's, at that call cost, gives the cost per task (Hardware.handling_seconds,
inside and between tasks alike; tasks.simulator.fit_least finds it). The process keeps the last few runs' figures
per device kind (on disk too, for later processes on this machine: harmony.fitfiles), and a later harmony.train or
harmony.plan on such devices predicts, and chooses sections and modes, with the medians of their fits. A fit
simulates the run's plan a few times or more (seconds for a plan of many small packs), so a run keeps its figures
(Pending) and they are fitted when a later plan or the run's result first asks: no run waits for a fit nothing may
read. They are fits, not timers: what the simulator mispredicts otherwise (a layer's time, which the pilot can find
tens of percent off on a busy machine; a copy) lands in them too, and the medians keep one such run from moving
every later plan. harmony.shutdown() forgets them in the process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import logging
import statistics
import time
import uuid
from collections.abc import Iterable
from typing import Any

from torch import nn

from harmony import fitfiles
from harmony.result import Stats, TrainResult, steady_window
from harmony.runtime.devices import DeviceSpec
from harmony.tasks.graph import parse_key
from harmony.tasks.hardware import Hardware
from harmony.tasks.runplan import RunPlan
from harmony.tasks.simulator import Simulation, fit_least, simulate_machines
from harmony.tasks.work import update_passes

logger = logging.getLogger("harmony")


@dataclasses.dataclass(frozen=True)
class Fit:
    """What one run's steps say the runtime costs on the host: seconds per pack call (Hardware.call_seconds), per
    task (Hardware.handling_seconds) and, where it updated swapped packs on the host store, per update besides the
    optimizer's passes (Hardware.update_call_seconds; measured, update_cost). call_measured says whether the run could
    tell a call's cost from a task's."""

    call_seconds: float
    handling_seconds: float
    update_call_seconds: float | None = None
    call_measured: bool = True  # False: its kinds of tasks made as many calls each on CPU devices, and its cost per
    # task took its calls' cost too (_fit)


KEPT = 5  # runs' figures kept per kind
PHASE = 6  # the fewest steps between a pruned run's pruning steps (or its ends) that its fit reads
PAUSES = 3  # the fewest steps between evaluations or checkpoints that a run's median step stands clear of
PROBE = 1e-3  # seconds per call at which the simulator's work for a task counts its calls
TaskKind = tuple[str, int, int, int]  # a device task's kind, job, pack and group: its steps' tasks alike
LARGEST = 0.05  # seconds a call or a task may be fitted at: well above any runtime's work for one (docs/performance.md)
STEPS = (4, 8)  # a simulated run's steps, and those of them its steady step leaves out (the first steps' ramp)


class Pending:
    """One run's steady figures with its plan, fitted (fit) when first asked: what the run's steady step, its
    devices' busy time per step and its kinds of tasks' durations say of the host costs, for devices of kind;
    samples are each job's per step; models the key of its fits (keyed). kept:
    its figures are on disk for later processes (harmony.fitfiles; its devices were all on this machine), and its fit
    is written there once found. plan may be its msgpack bytes (as read from disk), decoded when first needed."""

    def __init__(self, plan: RunPlan | bytes, samples: list[int], step: float, busy: float, kind: str,
                 kept: bool = False, durations: dict[TaskKind, float] | None = None, update: float | None = None,
                 models: str = "") -> None:
        self._plan, self.samples, self.step, self.busy, self.kind, self.kept = plan, samples, step, busy, kind, kept
        self.durations = durations or {}
        self.update = update
        self.models = models  # the architectures it trained, and whether as arrays (keyed)
        self.name = uuid.uuid4().hex
        self.at = time.time()
        self._fit: Fit | None = None
        self._fitted = False

    @property
    def plan(self) -> RunPlan:
        if isinstance(self._plan, bytes):
            self._plan = RunPlan.from_msgpack(self._plan)
        return self._plan

    def fit(self) -> Fit | None:
        """The costs per call and per task the run's figures say (_fit; once, the same answer after), or None where
        no costs up to LARGEST explain them (or, read from disk, its plan is not one this version of Harmony
        reads)."""
        if not self._fitted:
            try:
                plan = self.plan
            except (ValueError, TypeError, KeyError) as error:  # a plan written by another version
                logger.info("harmony: a kept run's figures are not fitted (%s: %s)", type(error).__name__, error)
            else:
                self._fit = _fit(self, plan)
            self._fitted = True
            if self.kept:
                _save(self.kind)
        return self._fit

    def costs(self) -> tuple[float, float, float | None] | None:
        """(call_seconds, handling_seconds, update_call_seconds) of the fit, as a run's result reports them."""
        fit = self.fit()
        return None if fit is None else (fit.call_seconds, fit.handling_seconds, fit.update_call_seconds)

    def entry(self) -> dict[str, Any]:
        """What the file keeps of it."""
        plan = self._plan if isinstance(self._plan, bytes) else self._plan.to_msgpack()
        fit = None if self._fit is None else list(dataclasses.astuple(self._fit))
        return {"name": self.name, "at": self.at, "plan": plan, "samples": list(self.samples), "step": self.step,
                "busy": self.busy, "update": self.update, "fitted": self._fitted, "fit": fit, "models": self.models,
                "durations": [[*kind, seconds] for kind, seconds in self.durations.items()]}

    @staticmethod
    def read(entry: dict[str, Any], kind: str) -> Pending:
        """One run as a file kept it (KeyError, TypeError or ValueError where it is not such an entry)."""
        durations = {(str(task), int(job), int(pack), int(group)): float(seconds)
                     for task, job, pack, group, seconds in entry["durations"]}
        update = None if entry["update"] is None else float(entry["update"])
        run = Pending(bytes(entry["plan"]), [int(count) for count in entry["samples"]], float(entry["step"]),
                      float(entry["busy"]), kind, kept=True, durations=durations, update=update,
                      models=str(entry["models"]))
        run.name, run.at, run._fitted = str(entry["name"]), float(entry["at"]), bool(entry["fitted"])
        if entry["fit"] is not None:
            call, handling, stepping, measured = entry["fit"]
            run._fit = Fit(float(call), float(handling), None if stepping is None else float(stepping), bool(measured))
        return run


FITS: dict[str, list[Pending]] = {}  # by device kind ("cpu", "cuda"): this process's last runs' figures
READ: set[str] = set()  # the kinds whose file this process has read
_forgotten = False  # forget() was called: files are no longer read (this process starts afresh)


def _kept(kind: str) -> list[Pending]:
    """FITS[kind], the runs of kind's file this process has not read before its own the first time (the last KEPT)."""
    if kind not in READ and not _forgotten:
        READ.add(kind)
        runs = []
        for entry in fitfiles.load(kind):
            with contextlib.suppress(KeyError, TypeError, ValueError):
                runs.append(Pending.read(entry, kind))
        known = {run.name for run in FITS.get(kind, [])}
        FITS[kind] = sorted([*(run for run in runs if run.name not in known), *FITS.get(kind, [])],
                            key=lambda run: run.at)[-KEPT:]
    return FITS.get(kind, [])


def _save(kind: str) -> None:
    """Write kind's kept runs: the file's, with this process's own (theirs as this process knows them), the last
    KEPT."""
    ours = {run.name: run.entry() for run in FITS.get(kind, []) if run.kept}
    theirs = {entry.get("name"): entry for entry in fitfiles.load(kind) if isinstance(entry.get("at"), float)}
    runs = sorted({**theirs, **ours}.values(), key=lambda entry: entry["at"])[-KEPT:]
    fitfiles.save(kind, runs)


def fits(kind: str | None, models: str | None = None, within: str | None = None, exclude: str | None = None
         ) -> list[Fit]:
    """The fits of the runs kept for devices of kind, oldest first (fitting those not fitted yet), of those that
    trained models (keyed) where given, of the architectures within (either way), or of architectures other than
    exclude; runs no costs explain left out."""
    if kind is None:
        return []
    return [fit for pending in _kept(kind) if (models is None or pending.models == models)
            and (within is None or architecture_of(pending.models) == within)
            and (exclude is None or architecture_of(pending.models) != exclude) and (fit := pending.fit()) is not None]


def learned(kind: str | None, models: str | None = None) -> Fit | None:
    """The costs later plans on devices of kind take: the medians of the process's last fits, the call cost's of
    those that measured it (0 where none did; None: no run fitted them). For a plan of models (keyed: its
    architectures and whether they train as arrays): the fits of runs of them trained that way where there are
    some, else of runs of them trained the other way; else the runs' of other architectures, but no call cost,
    which depends on the models (what the pilot mispredicts of their layers lands in it; docs/performance.md, "Fits
    kept by architecture"), where a task's handling and an update's do not as much. A fit carries what the pilot
    mispredicts of its way too (an array's layers against a model's): once runs of both ways are kept, fusion
    weighs each with its own (harmony.fusing); until then both with the one way's."""
    if models is None:
        same, kept = [], fits(kind)
    else:
        architecture = architecture_of(models)
        same = fits(kind, models) or fits(kind, within=architecture)
        kept = same or fits(kind, exclude=architecture)
    if not kept:
        return None
    updates = [fit.update_call_seconds for fit in kept if fit.update_call_seconds is not None]
    measured = [fit.call_seconds for fit in kept if fit.call_measured] if same or models is None else []
    return Fit(statistics.median(measured) if measured else 0.0,
               statistics.median(fit.handling_seconds for fit in kept),
               statistics.median(updates) if updates else None, bool(measured))


def architectures(models: Iterable[nn.Module]) -> str:
    """What tells a run's models apart from other runs' for their fits (learned): a digest of the distinct
    architectures among them (each one's class and its state's names, shapes and dtypes), however many of each."""
    distinct = sorted({repr((type(model).__qualname__, [(name, tuple(tensor.shape), str(tensor.dtype))
                                                        for name, tensor in model.state_dict().items()]))
                       for model in models})
    return hashlib.sha256(repr(distinct).encode()).hexdigest()[:16]


def keyed(architectures: str, arrays: bool) -> str:
    """The key of a run's fits (learned): its architectures, and whether it trained any of them as fused arrays."""
    return f"{architectures}/{'arrays' if arrays else 'models'}"


def architecture_of(key: str) -> str:
    """The architectures of a key of fits (keyed), either way."""
    return key.split("/")[0]


def kind_of(specs: Iterable[DeviceSpec]) -> str | None:
    """The one kind of device a run's specs are ("cpu", "cuda"), whose fits it takes and adds to; None for several."""
    kinds = {spec.kind for spec in specs}
    return next(iter(kinds)) if len(kinds) == 1 else None


def fitted(hardware: Hardware, kind: str | None, models: str | None = None) -> Hardware:
    """hardware with the costs runs on devices of kind fitted (learned, for a plan of models, a key of fits, where
    given); where none did, a task's handling is the CPU the calibration measured a task to take beyond its latency
    (Hardware.task_cpu over task_overhead: on devices that compute on the host's cores, the driver's, scheduler's and
    worker's work for a task comes out of the devices' compute), and a pack call costs nothing."""
    fit = learned(kind, models)
    if fit is None:
        return dataclasses.replace(hardware, handling_seconds=max(0.0, hardware.task_cpu - hardware.task_overhead))
    update = hardware.update_call_seconds if fit.update_call_seconds is None else fit.update_call_seconds
    return dataclasses.replace(hardware, call_seconds=fit.call_seconds, handling_seconds=fit.handling_seconds,
                               update_call_seconds=update)


def simulated(plan: RunPlan, samples: list[int], call_seconds: float, handling_seconds: float) -> Simulation:
    """The plan's run of STEPS[1] steps (every job as many) on the simulator, at a cost per pack call and per task."""
    hardware = dataclasses.replace(plan.hardware, call_seconds=call_seconds, handling_seconds=handling_seconds)
    timed = dataclasses.replace(plan, hardware=hardware)
    machines = {device: dict(plan.machines).get(device, "") for device in plan.devices}
    return simulate_machines(timed, [STEPS[1]] * len(plan.jobs), samples, machines)


def per_call(plan: RunPlan, samples: list[int], durations: dict[TaskKind, float]) -> float | None:
    """The cost per pack call that a run's task durations (each kind of task's median, durations) say, beside a cost
    per task inside it: the least-squares slope of what each kind took over the simulator's work for it at no call
    cost, against its pack calls (the simulator's count); None where the kinds measured make one count of calls
    (a slope needs two), or none, and on devices that do not compute on the host's cores, where a call's host work
    runs beside the kernels (Hardware.with_calls) and a task's duration is not linear in its calls. At least 0."""
    if not plan.hardware.shared_cores:
        return None
    base, probed = (simulated(plan, samples, cost, 0.0) for cost in (0.0, PROBE))
    points = []
    for kind, seconds in durations.items():
        works = [(base.work[task], probed.work[task]) for task in base.work
                 if task.span >= STEPS[0] and (task.kind, task.model, task.pack, task.group) == kind]
        if works:
            work = statistics.mean(low for low, _ in works)
            calls = statistics.mean(high - low for low, high in works) / PROBE
            points.append((calls, seconds - work))
    if len({round(calls, 6) for calls, _ in points}) < 2:
        return None
    mean_calls = statistics.mean(calls for calls, _ in points)
    mean_over = statistics.mean(over for _, over in points)
    slope = (sum((calls - mean_calls) * (over - mean_over) for calls, over in points)
             / sum((calls - mean_calls) ** 2 for calls, _ in points))
    return max(0.0, slope)


def steady(plan: RunPlan, samples: list[int], call_seconds: float, handling_seconds: float) -> tuple[float, float]:
    """The plan's predicted seconds per step once running and its devices' busy seconds per step (all devices'
    together), at a cost per pack call and per task: in one simulated run of STEPS[1] steps (every job as many), from
    when every task of its first STEPS[0] steps has ended to when all have, and the work of the tasks of the steps
    in between, over those steps."""
    run = simulated(plan, samples, call_seconds, handling_seconds)
    ramp = max(end for task, (_, end) in run.times.items() if task.span < STEPS[0])
    busy = sum(seconds for task, seconds in run.work.items() if task.span >= STEPS[0])
    steps = STEPS[1] - STEPS[0]
    return (run.makespan - ramp) / steps, busy / steps


def _window(stats: Stats, within: range | None = None) -> tuple[float, float, float] | None:
    """The slowest model's steady seconds per step, and when its steady steps begin and end (None: no model ran
    steps enough for a steady rate), of the steps within where given (of the models that ran them all). A model's
    steady step is the median over its steady steps (steps that finished together, a multi-step task's, as one): an
    evaluation's or a checkpoint's pause every few steps leaves it."""
    windows = []
    for times in stats.step_seconds:
        if within is not None:
            times = times[within.start:within.stop] if len(times) >= within.stop else []
        with contextlib.suppress(ValueError):  # a model that stopped early
            first, last = steady_window(times)
            ends = [step for step in range(first, last + 1) if step == last or times[step + 1] != times[step]]
            steps = [(times[b] - times[a]) / (b - a) for a, b in itertools.pairwise(ends)]
            windows.append((statistics.median(steps), times[first], times[last]))
    return max(windows) if windows else None


def figures(stats: Stats, within: range | None = None) -> tuple[float, float, dict[TaskKind, float]] | None:
    """A run's steady seconds per step (its slowest model's, _window; of the steps within where given), its devices'
    busy seconds per step over the same steps (the fwd and bwd tasks of Stats.timeline, cut to those steps' span:
    upd tasks beside the devices and evaluations left out), and each kind of those tasks' median seconds (TaskKind)
    among those inside the span; None where no model ran steps enough for a steady rate."""
    window = _window(stats, within)
    if window is None:
        return None
    step, begin, end = window
    busy = 0.0
    taken: dict[TaskKind, list[float]] = {}
    for tasks in stats.timeline.values():
        for start, stop, _, key in tasks:
            parsed = parse_key(key)
            if parsed is None or parsed[0].kind == "upd":
                continue
            busy += max(0.0, min(stop, end) - max(start, begin))
            if begin <= start and stop <= end:
                task = parsed[0]
                taken.setdefault((task.kind, task.model, task.pack, task.group), []).append(stop - start)
    return step, busy * step / (end - begin), {kind: statistics.median(seconds) for kind, seconds in taken.items()}


def phase(plan: RunPlan, pruned: dict[int, int], steps: int) -> tuple[range, RunPlan, list[int]] | None:
    """The steps of a pruned run that its fit reads and the plan they ran: the first PHASE steps or more between its
    pruning steps (or its ends) in which a swapped job trains, and the plan of the jobs training in them (an array
    with members stopped narrowed to those training, Job.narrowed; compiled, it computes every member), with those
    jobs' indices in plan; None where no such steps. pruned: each stopped model's step (TrainResult.pruned); steps:
    the run's."""
    bounds = sorted({0, *pruned.values(), steps})
    for start, stop in itertools.pairwise(bounds):
        training = {index: sum(pruned.get(member, steps) >= stop for member in job.members)
                    for index, job in enumerate(plan.jobs)}
        kept = [index for index, count in training.items() if count]
        if stop - start < PHASE or all(plan.jobs[index].home is not None for index in kept):
            continue
        jobs = [plan.jobs[index] for index in kept]
        jobs = [job if training[index] == len(job.members) or plan.options.compile
                else job.narrowed(training[index] / len(job.members)) for index, job in zip(kept, jobs)]
        return range(start, stop), dataclasses.replace(plan, jobs=tuple(jobs)), kept
    return None


def learn(result: TrainResult, samples: list[int], kind: str | None, local: bool = False, models: str = ""
          ) -> Pending | None:
    """Keep a run's steady figures (samples: each job's per step; models: the key of its fits, keyed) for devices of
    kind, to be fitted when first asked (Pending), and with local (its devices all on this machine) on disk for later
    processes; None (nothing kept) where the run says nothing of the costs: devices of several kinds, no swapped job,
    a pruned run without PHASE steps between pruning steps in which a swapped job trains (its figures are the first
    such steps', with the plan of the jobs training in them: phase), evaluations or checkpoints fewer than PAUSES
    steps apart (the simulator predicts neither), too few steps for a steady rate."""
    plan, steps = result.plan, None
    if kind is None or all(job.home is not None for job in plan.jobs):
        return None
    pauses = [every for every, on in ((plan.options.eval_every, any(result.val_history)),
                                      (plan.options.checkpoint_every, True)) if on and every is not None]
    if min(pauses, default=PAUSES) < PAUSES:  # time the simulator does not predict, in too many steps for the median
        return None
    kept = list(range(len(plan.jobs)))
    if result.pruned:
        found = phase(plan, result.pruned, max(len(times) for times in result.stats.step_seconds))
        if found is None:
            return None
        steps, plan, kept = found
    found = figures(result.stats, steps)
    if found is None:
        return None
    step, busy, timed = found
    taken = {(task, kept.index(job), pack, group): seconds
             for (task, job, pack, group), seconds in timed.items() if job in kept}
    pending = Pending(plan, [samples[index] for index in kept], step, busy, kind, kept=local, durations=taken,
                      update=update_cost(result), models=models)
    FITS[kind] = [*_kept(kind)[1 - KEPT:], pending]
    if local:
        _save(kind)
    return pending


def update_cost(result: TrainResult) -> float | None:
    """The runtime's work per update of a swapped pack (Hardware.update_call_seconds) that a run measured: its
    workers' seconds per update, on the host store and on the devices (Stats.update_seconds, device_update_seconds),
    less the optimizer's passes predicted for one (each kind's mean over the packs its plan updates that way; on a
    device at its compute scale), at least 0; None where it updated none."""
    stats, plan = result.stats, result.plan
    counts = (sum(stats.updates.values()), sum(stats.device_updates.values()))
    if not sum(counts):
        return None
    host, device = [], []
    for job in plan.jobs:
        if job.home is None:
            for pack in range(len(job.packing.packs)):
                (device if pack in job.device_updates else host).append(update_passes(job, pack, plan.hardware))
    predicted = [statistics.mean(passes) if passes else 0.0 for passes in (host, device)]
    spent = sum(stats.update_seconds.values()) + sum(stats.device_update_seconds.values())
    return max(0.0, (spent - sum(count * passes for count, passes in zip(counts, predicted))) / sum(counts))


def _fit(run: Pending, plan: RunPlan) -> Fit | None:
    """Pending.fit: the call cost from the run's task durations (per_call); where they cannot tell it from a cost per
    task (every kind of task makes as many calls), on devices that compute on the host's cores none (the cost per
    task takes it: fitted to the busy time, the work a task does around its calls, taking its values in and its
    results out, would be charged to every call, and a plan of many calls a task, a whole pass or an array, predicted
    far slower than it runs), and beside a GPU's kernels the call cost fitted to its busy time; then the cost per
    task to the steady step, each with the run's measured cost per update (update_cost) in its plan; None where no
    costs up to LARGEST explain them (the plan mispredicts something else)."""
    started = time.perf_counter()
    plan = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware,
                                                                  update_call_seconds=run.update or 0.0))

    @functools.cache  # the second fit starts where the first ended
    def predicted(call: float, handling: float) -> tuple[float, float]:
        return steady(plan, run.samples, call, handling)

    sloped = per_call(plan, run.samples, run.durations) if run.durations else None
    measured = sloped is not None or not plan.hardware.shared_cores
    if sloped is not None:
        calls = min(sloped, LARGEST)
    else:
        calls = fit_least(lambda cost: predicted(cost, 0.0)[1], run.busy, LARGEST) if measured else 0.0
    handling = fit_least(lambda cost: predicted(calls, cost)[0], run.step, LARGEST)
    if max(calls, handling) >= LARGEST:
        logger.info("harmony: a run's %.1f ms steps (%.1f ms of them busy) are more than any host cost per pack "
                    "call and per task explains (%.0f ms each): its plan mispredicts something else, and later plans "
                    "take nothing of it", run.step * 1e3, run.busy * 1e3, LARGEST * 1e3)
        return None
    logger.info("harmony: the runtime's host cost on %s devices, fitted to a run's %.1f ms steps (%.1f ms of them "
                "busy): %s a pack call, %.0f µs a task, %s an update (fitted in %.2f s)", run.kind,
                run.step * 1e3, run.busy * 1e3,
                f"{calls * 1e6:.0f} µs" if measured else "none told apart (its tasks made as many each)",
                handling * 1e6,
                "none" if run.update is None else f"{run.update * 1e6:.0f} µs", time.perf_counter() - started)
    return Fit(calls, handling, run.update, measured)


def forget(files: bool = False) -> None:
    """Drop the fitted costs: this process's next plans predict without them until a run fits them again (the
    files stay for later processes; with files, this machine's are deleted too)."""
    global _forgotten
    FITS.clear()
    _forgotten = True
    if files:
        fitfiles.remove()
