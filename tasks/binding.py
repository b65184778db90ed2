"""Late binding as a state machine: events in, instructions out, no I/O.

``BindingState.handle(event)`` takes what happened (a batch was fetched, a task finished, a span was timed) and
returns what to do (fetch a batch, submit a task to a device, release a value, read a span's timing), the way
distributed's ``WorkerState.handle_stimulus`` does. It keeps every fact of a run's progress: which spans are
open, which tasks are bound where, which have finished, who still reads each value, what each device probably
caches (tasks.memory), each model's span cutting (tasks.amortize) and when its steps finished. A driver, a
simulator or a test feeds it events; ``validate_state`` checks its invariants and ``story`` keeps its last
decisions for replaying a failing run.

Binding: each device keeps a few tasks in flight; when a slot frees, the device gets the ready task that best
reuses what it caches (see score), and a model's next span opens before the current one ends. Fetches come
first: after an event, the state asks for every batch that may open, one at a time, and binds once they are in.
"""

from __future__ import annotations

from collections import Counter, deque

from harmony.tasks.amortize import Spans
from harmony.tasks.events import (
    BatchReady,
    Cancel,
    Checkpoint,
    Evaluate,
    Evaluated,
    Event,
    Fail,
    Fetch,
    Idle,
    Instruction,
    Leave,
    MachineLost,
    Prune,
    Rank,
    Ranked,
    ReadTiming,
    Release,
    StepTimed,
    Submit,
    TaskFailed,
    TaskFinished,
    WorkerJoined,
    WorkerLost,
)
from harmony.tasks.graph import (
    BatchInput,
    BatchTargets,
    TaskId,
    Value,
    consumers,
    dependencies,
    inputs,
    span_tasks,
    successor,
    updater,
)
from harmony.tasks.hardware import Hardware
from harmony.tasks.memory import BudgetExceeded, DeviceMemory
from harmony.tasks.runplan import Job
from harmony.tasks.work import task_seconds

KIND_RANK = {"upd": 0, "bwd": 1, "fwd": 2}
POLICIES = ("lrtf", "round_robin")
MODES = ("free", "vpp", "vdp")
STORY = 10_000
TIE = 1e-9  # seconds: predicted starts this close are the same start


def packs(job: Job) -> int:
    """The tasks of one pass of a job's step: one per section of packs (tasks.graph counts these as packs)."""
    return job.section_count


def work_shares(job: Job) -> dict[tuple[str, int], float]:
    """Each fwd and bwd task's share of one group's step compute, by section (tasks.work.task_seconds, whose samples
    and compute scale cancel out here)."""
    last = job.section_count - 1
    work = {(kind, section): task_seconds(TaskId(kind, 0, section, 0), job.packing, 1, Hardware(), job.section(section))
            for section in range(job.section_count) for kind in ("fwd", "bwd") if kind == "bwd" or section < last}
    total = sum(work.values())
    return {key: value / total if total > 0 else 1 / len(work) for key, value in work.items()}


class BindingState:
    """Every job's open spans, bound and finished tasks; decides what each device runs next.

    Jobs are numbered as the run's plan orders them (the ``m<job>`` of task keys); "model" below is a job. Per
    job: spans_opened and spans_done count its spans, steps_trained the training steps done, step_times when each
    training step finished (a span's steps finish together).
    """

    def __init__(
        self,
        jobs: list[Job],
        budgets: dict[str, int],
        slots_per_device: int = 4,
        policy: str = "lrtf",
        mode: str = "free",
        homes: dict[int, str] | None = None,
        validate: bool = False,
        fail_fast: bool = False,
        checkpoint_every: int | None = None,
        start: list[int] | None = None,
        allowed_failures: int = 3,
        machines: dict[str, str] | None = None,
        evaluate: bool = False,
        eval_every: int | None = None,
        prune: bool = False,
        pruned: dict[int, int] | None = None,
        hardware: Hardware | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}; use one of {POLICIES}")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; use one of {MODES}")
        self.policy = policy
        self.mode = mode
        self.edge = hardware.edge_cost if hardware else 0.0
        self.task_cost = hardware.task_cost if hardware else 0.0
        self.step_work = [{key: (job.step_seconds or 1.0) * share / job.groups  # a second a step where none predicted
                           for key, share in work_shares(job).items()} for job in jobs]
        self.homes = dict(homes or {})
        self.jobs = jobs
        self.slots = slots_per_device
        self.validate = validate
        self.fail_fast = fail_fast
        self.checkpoint_every = checkpoint_every
        self.allowed_failures = allowed_failures
        self.budgets = dict(budgets)
        self.device_names = list(budgets)
        self.machines = {name: (machines or {}).get(name, "") for name in budgets}
        self.memory = {name: DeviceMemory(name, budget) for name, budget in budgets.items()}
        self.running: dict[str, dict[TaskId, int]] = {name: {} for name in budgets}  # task: when it was bound
        self.spans = [Spans(job.steps, job.depth, job.task_seconds, job.batch_bytes) for job in jobs]
        self.spans_opened = [0] * len(jobs)
        self.spans_done = [0] * len(jobs)
        self.steps_trained = [0] * len(jobs)
        self.step_times: list[list[float]] = [[] for _ in jobs]
        self.finish_times: dict[int, float] = {}
        self.tasks_finished = 0
        self.open_spans: dict[tuple[int, int], tuple[int, int]] = {}
        self.bound: dict[TaskId, str] = {}
        self.placed: dict[TaskId, str] = {}
        self.done: set[TaskId] = set()
        self.readers: dict[Value, int] = {}
        self.edges: dict[TaskId, dict[TaskId, str]] = {}
        self.submitted = 0
        self.fetching: Fetch | None = None
        self.timing: set[int] = set()
        self.attempts: dict[TaskId, int] = {}
        self.failed: dict[int, dict[str, object]] = {}
        self.losses: Counter[int] = Counter()
        self.events: list[dict[str, object]] = []
        self.story: deque[tuple[Event | None, tuple[Instruction, ...]]] = deque(maxlen=STORY)
        self._deps: dict[TaskId, list[TaskId]] = {}
        self._unmet: dict[TaskId, set[TaskId]] = {}
        self._dependents: dict[TaskId, list[TaskId]] = {}
        self._ready: set[TaskId] = set()
        self.evaluate = evaluate
        self.eval_every = eval_every if evaluate else None
        self.evaluated = [0] * len(jobs)
        self.evaluating: dict[int, Evaluate] = {}
        self.evaluations_owed: dict[int, int] = {}
        self.attempts_evaluated: dict[int, int] = {}
        self.prune = prune and self.eval_every is not None
        self.pruned: dict[int, int] = dict(pruned or {})  # jobs none of whose members trains any more: their step
        self.pruned_members: dict[int, dict[int, int]] = {}  # per job, its members this run pruned: their step
        self.standing: set[int] = set()  # the jobs evaluated at the next pruning step
        self.ranking: Rank | None = None
        self.idle: frozenset[str] = frozenset()  # the devices with nothing left to compute (Idle)
        every = self.eval_every or 1
        self.decided = max([*self.pruned.values(), *((steps - 1) // every * every for model, steps in
                                                      enumerate(start or []) if steps and model not in self.pruned)],
                           default=0) if self.prune else 0  # the last pruning step ranked
        for model, steps in enumerate(start or []):
            self._resume(model, steps)
        for model in self.pruned:
            self.finish_times[model] = 0.0
            self.evaluations_owed.pop(model, None)

    def _resume(self, model: int, steps: int) -> None:
        """A job resumed from a checkpoint has trained steps already: its spans start there (a job stepping once
        per task keeps its span numbers equal to its steps).

        With pruning, every pruning step before a job's checkpoint was ranked (no job passes one before it is) and
        what it stopped was checkpointed then (the pruned jobs); a job resumed at a pruning step not known to be
        ranked is evaluated there again, for the ranking."""
        self.spans[model].open(steps)
        self.steps_trained[model] = steps
        self.step_times[model] = [0.0] * steps
        if not self.spans[model].multistep:
            self.spans_opened[model] = self.spans_done[model] = steps
        self.evaluated[model] = steps
        if (self.prune and model not in self.pruned and steps == self.decided + (self.eval_every or 0)
                and (self.spans[model].steps or steps + 1) > steps):
            self.evaluated[model] = steps - 1
            self.evaluations_owed[model] = steps

    # Events

    def start(self) -> list[Instruction]:
        """The run begins: the first batches to fetch."""
        return self._record(None, self._advance() + self._evaluations() + self._rank())

    def handle(self, event: Event) -> list[Instruction]:
        """Take one event; return what the driver must do now, in order."""
        if isinstance(event, BatchReady):
            instructions = self._batch_ready(event)
        elif isinstance(event, TaskFinished):
            instructions = self._task_finished(event)
        elif isinstance(event, TaskFailed):
            instructions = self._task_failed(event)
        elif isinstance(event, StepTimed):
            self.timing.discard(event.model)
            self.spans[event.model].measured(event.seconds, event.steps)
            instructions = self._advance()
        elif isinstance(event, WorkerLost):
            instructions = self._worker_lost(event)
        elif isinstance(event, WorkerJoined):
            instructions = self._worker_joined(event)
        elif isinstance(event, MachineLost):
            instructions = self._machine_lost(event)
        elif isinstance(event, Evaluated):
            instructions = self._evaluated(event)
        elif isinstance(event, Ranked):
            instructions = self._ranked(event)
        else:
            raise TypeError(f"not an event: {event!r}")
        return self._record(event, instructions + self._evaluations() + self._rank())

    def _record(self, event: Event | None, instructions: list[Instruction]) -> list[Instruction]:
        idle = self.idle_devices()
        if idle != self.idle:
            self.idle = idle
            instructions = [*instructions, Idle(idle)]
        self.story.append((event, tuple(instructions)))
        if self.validate:
            self.validate_state()
        return instructions

    def _batch_ready(self, event: BatchReady) -> list[Instruction]:
        fetch = self.fetching
        assert fetch is not None and (fetch.model, fetch.span) == (event.model, event.span), (
            f"{event} was not asked for (fetching {fetch})")
        self.fetching = None
        if event.steps:
            self._open(event.model, event.span, fetch.first, event.steps)
        if event.steps < fetch.count:
            self.spans[event.model].end()
        return self._advance()

    def _task_finished(self, event: TaskFinished) -> list[Instruction]:
        task = event.task
        if task not in self.bound:
            return []  # a run of a task that was cancelled meanwhile (its job rolled back or failed)
        device = self.bound.pop(task)
        self.running[device].pop(task, None)
        self.done.add(task)
        self.tasks_finished += 1
        del self._deps[task]
        self.edges.pop(task, None)
        job = self.jobs[task.model]
        first, count = self.open_spans[(task.model, task.span)]
        key = (task.model, task.pack)
        applied = task == updater(task.model, task.pack, task.span, job.groups, job.overlap)
        if task.kind != "upd":
            self._remember(device, key, first, job.section_bytes(task.pack))
        if applied and task.model in self.homes:
            self.memory[device].set_version(key, first + count)
        elif applied:
            for memory in self.memory.values():  # the update made every device's copy of the pack stale
                memory.drop(key)
        instructions: list[Instruction] = [Release(value) for value in self._released(task, packs(job))]
        if applied and all(self._is_done(updater(task.model, p, task.span, job.groups, job.overlap))
                           for p in range(packs(job))):
            instructions += self._span_done(task.model, task.span, event.at)
        return instructions + self._advance()

    def _task_failed(self, event: TaskFailed) -> list[Instruction]:
        """A task raised: with fail_fast, or when the failure is not the job's own (its code, its divergence), the
        run fails; else the job fails alone, with the weights of its last complete step, and the others go on."""
        task = event.task
        if task not in self.bound:
            return []  # a run of a task that was cancelled meanwhile
        if self.fail_fast or not event.isolated:
            return [Fail(task.model, event.error)]
        first, _ = self.open_spans[(task.model, task.span)]
        step = first if event.step is None else event.step
        instructions = self._fail_job(task.model, step, str(event.error), event.at)
        self.failed[task.model]["error"] = event.error
        return instructions + self._advance()

    def _fail_job(self, model: int, step: int, reason: str, at: float) -> list[Instruction]:
        """A job fails: it stops for good, with the weights of its last complete step."""
        self.failed[model] = {"step": step, "reason": reason, "steps": self.steps_trained[model]}
        self.events.append({"at": at, "event": "job failed", "job": model, "step": step, "reason": reason})
        return self._stop_job(model, at)

    def _stop_job(self, model: int, at: float) -> list[Instruction]:
        """Stop a job for good: its tasks cancelled, its values and batches dropped, its loader left."""
        instructions: list[Instruction] = []
        for span in range(self.spans_done[model], self.spans_opened[model]):
            instructions += self._clear_span(model, span)
            self.open_spans.pop((model, span), None)
            for group in range(self.jobs[model].groups):
                for value in (BatchInput(model, span, group), BatchTargets(model, span, group)):
                    self.readers.pop(value, None)
                    instructions.append(Release(value))
        self.evaluating.pop(model, None)
        self.evaluations_owed.pop(model, None)
        self.standing.discard(model)
        self.finish_times.setdefault(model, at)
        self.timing.discard(model)
        return [*instructions, Leave(model, self.spans[model].opened)]

    def _clear_span(self, model: int, span: int) -> list[Instruction]:
        """Forget every task of an open span (bound or finished), cancelling its run; returns the cancellations."""
        job = self.jobs[model]
        cancelled: list[Instruction] = []
        for task in span_tasks(model, packs(job), span, job.groups, job.overlap):
            device = self.bound.pop(task, None)
            if device is not None:
                self.running.get(device, {}).pop(task, None)
            if device is not None or task in self.done or task in self.placed:
                cancelled.append(Cancel(task))
            self.done.discard(task)
            self.placed.pop(task, None)
            self.edges.pop(task, None)
            self.readers.pop(task, None)
            self._deps.pop(task, None)
            self._unmet.pop(task, None)
            self._dependents.pop(task, None)
            self._ready.discard(task)
        return cancelled

    def _roll_back(self, model: int) -> list[Instruction]:
        """Run a job's open spans again from their start: their tasks anew (each a new attempt), their batches kept.

        Updates its tasks applied already stay applied (the workers apply each one once, by version) and the steps
        run again read the weights those spans started from (the host store keeps the version before the current).
        """
        instructions: list[Instruction] = []
        job = self.jobs[model]
        for span in range(self.spans_done[model], self.spans_opened[model]):
            instructions += self._clear_span(model, span)
            for group in range(job.groups):
                for value in (BatchInput(model, span, group), BatchTargets(model, span, group)):
                    self.readers[value] = len(consumers(value, packs(job)))
            for task in span_tasks(model, packs(job), span, job.groups, job.overlap):
                self.attempts[task] = self.attempts.get(task, 0) + 1
                self._add_task(task)
        return instructions

    def _worker_lost(self, event: WorkerLost) -> list[Instruction]:
        """A device's worker is gone: what it ran or held is run again, on the devices left (or on it when a worker
        of its name comes back); a job homed there moves to the live device with the fewest homed jobs."""
        device = event.device
        if device not in self.memory:
            return []
        self.device_names.remove(device)
        del self.memory[device]
        running = self.running.pop(device)
        # what it was busy with when it died, and so may have killed it: as its worker marked it (its task thread's
        # job and those updating beside it), or else its first task, as the worker runs them in order
        if event.executing:
            suspects = set(event.executing)
        else:
            suspects = {min(running, key=running.__getitem__).model} if running else set()
        # and what waits there for a result the device held: Dask runs a lost result's task again, on the device it
        # was bound to, which never comes back under that address, so a task bound elsewhere would wait for it for
        # good (its producer may have finished and been forgotten here already)
        affected = (suspects
                    | {task.model for task, at in self.placed.items() if at == device}
                    | {task.model for task in self.bound if device in self.edges.get(task, {}).values()}
                    | {model for model, home in self.homes.items() if home == device})
        instructions: list[Instruction] = []
        redone: dict[int, str] = {}
        for model in sorted(model for model in affected if not self.stopped(model)):
            if model in suspects:
                self.losses[model] += 1
            if self.losses[model] > self.allowed_failures:
                reason = (f"the worker running its tasks died {self.losses[model]} times with no step of it done in "
                          f"between (distributed.scheduler.allowed-failures is {self.allowed_failures})")
                instructions += self._fail_job(model, self.steps_trained[model], reason, event.at)
                continue
            instructions += self._roll_back(model)
            if self.homes.get(model) == device and self.live_devices(model):
                self.homes[model] = self._home_for(model)
            redone[model] = self.homes.get(model, "any device")
        for model, evaluation in list(self.evaluating.items()):
            if evaluation.device == device and not self.stopped(model):
                del self.evaluating[model]
                self.evaluations_owed[model] = evaluation.step
                redone.setdefault(model, f"its evaluation at step {evaluation.step}")
        self.events.append({"at": event.at, "event": "worker lost", "device": device, "suspects": sorted(suspects),
                            "jobs redone": redone})
        return instructions + self._advance()

    def _worker_joined(self, event: WorkerJoined) -> list[Instruction]:
        """A worker for one of the run's devices joined: the device takes tasks again (homed jobs left without a
        live home go to it)."""
        device = event.device
        if device in self.memory or device not in self.budgets:
            return []
        self.device_names = [name for name in self.budgets if name in self.memory or name == device]
        self.memory[device] = DeviceMemory(device, self.budgets[device])
        self.running[device] = {}
        for model, home in self.homes.items():
            if home not in self.memory and self.machines[device] == self.jobs[model].machine:
                self.homes[model] = device
        self.events.append({"at": event.at, "event": "worker joined", "device": device})
        return self._advance()

    def _machine_lost(self, event: MachineLost) -> list[Instruction]:
        """A machine's workers have all been gone too long: each job homed there fails alone (its state was in that
        machine's host store), and the others go on."""
        instructions: list[Instruction] = []
        reason = (f"every worker of its machine has been lost for {event.seconds:.0f} s, and its state with that "
                  "machine's host store (a checkpoint_dir run resumes it from its last checkpoint)")
        for model in self.stranded(event.machine):
            instructions += self._fail_job(model, self.steps_trained[model], reason, event.at)
        return instructions + self._advance()

    def stranded(self, machine: str) -> list[int]:
        """The jobs homed on machine that are still training while it has no live device."""
        if any(self.machines[name] == machine for name in self.device_names):
            return []
        return [model for model, job in enumerate(self.jobs)
                if job.machine == machine and not self.stopped(model) and not self._job_finished(model)]

    def _home_for(self, model: int) -> str:
        """The live device of its machine a homed job moves to: the one with the fewest jobs homed there."""
        homed = Counter(home for other, home in self.homes.items() if other != model)
        live = self.live_devices(model)
        return min(live, key=lambda name: (homed[name], live.index(name)))

    def live_devices(self, model: int) -> list[str]:
        """The live devices a job's tasks may run on: those of its machine."""
        machine = self.jobs[model].machine
        return [name for name in self.device_names if self.machines[name] == machine]

    def _span_done(self, model: int, span: int, at: float) -> list[Instruction]:
        """Every update of a model's span is applied: count its steps, forget its finished tasks."""
        _, count = self.open_spans.pop((model, span))
        self.spans_done[model] = span + 1
        self.losses.pop(model, None)  # losses count in a row: a job that steps between them is not what kills
        before = self.steps_trained[model]
        self.steps_trained[model] += count
        self.step_times[model].extend([at] * count)
        self.done = {task for task in self.done if task.model != model or task.span > span}
        for task in [task for task in self.attempts if task.model == model and task.span <= span]:
            del self.attempts[task]
        released: list[Instruction] = []
        for group in range(self.jobs[model].groups):
            for value in (BatchInput(model, span, group), BatchTargets(model, span, group)):
                self.readers.pop(value, None)
                released.append(Release(value))
        ended = self._all_spans_done(model)
        if not self._owe_evaluation(model, ended) and ended:
            self.finish_times.setdefault(model, at)
        every = self.checkpoint_every
        if every and (ended or before // every < self.steps_trained[model] // every):
            released.insert(0, Checkpoint(model, self.steps_trained[model]))
        if self.spans[model].adaptive:
            self.timing.add(model)
            return [*released, ReadTiming(model)]
        return released

    def _released(self, task: TaskId, packs: int) -> list[Value]:
        """The values task read for the last time, and task's own if nobody reads it. A span's batches stay until
        the span is done (what its tasks are run again from, should a worker be lost)."""
        released = []
        for value in inputs(task, packs):
            self.readers[value] -= 1
            if self.readers[value] == 0 and isinstance(value, TaskId):
                del self.readers[value]
                released.append(value)
        if self.readers.get(task) == 0:
            del self.readers[task]
            released.append(task)
        for value in released:
            if isinstance(value, TaskId):
                self.placed.pop(value, None)
        return released

    # Opening spans

    def wanted_batches(self) -> list[tuple[int, int]]:
        """(model, span) pairs whose batch may be fetched now, in order.

        A model's span opens once the span before the previous one is done (its updates applied: with upd tasks,
        after its backward), so that at most two spans are open: the next span's tasks can be queued on a device
        (waiting on the updates they depend on) before the current span ends, with no round trip through the
        driver, and a checkpoint written when a span is done has at most one span running past it (the host store
        keeps two versions).
        """
        wanted = []
        for model, opened in enumerate(self.spans_opened):
            if self.stopped(model):
                continue
            total = self.total_spans(model)
            point = self.next_evaluation(model)
            if point is not None and self.spans[model].opened >= point + self.ahead(model):
                continue  # its weights at point are evaluated before a later step may overwrite them
            if self.prune and self.spans[model].opened >= self.decided + (self.eval_every or 0):
                continue  # held at the next pruning step until every job still training is ranked there
            span = opened
            while (total is None or span < total) and (span < 2 or self.spans_done[model] >= span - 1):
                wanted.append((model, span))
                span += 1
        return wanted

    def _advance(self) -> list[Instruction]:
        """What comes next once an event is taken: the next batch to fetch, else every binding that is possible
        (nothing while a fetch or a span's timing is awaited: they change what opens and what binds)."""
        if self.fetching is not None or self.timing:
            return []
        wanted = self.wanted_batches()
        if wanted:
            model, span = wanted[0]
            first, count = self.spans[model].next_span(until=self.next_evaluation(model))
            self.fetching = Fetch(model, span, first, count, self.jobs[model].groups, self.spans[model].multistep)
            return [self.fetching]
        return self._bind_all()

    def _open(self, model: int, span: int, first: int, count: int) -> None:
        """A span's batch is in: its tasks become candidates."""
        assert span == self.spans_opened[model], f"spans open in order: expected {self.spans_opened[model]}, got {span}"
        self.open_spans[(model, span)] = (first, count)
        self.spans[model].open(count)
        job = self.jobs[model]
        packs = job.section_count
        for group in range(job.groups):
            for value in (BatchInput(model, span, group), BatchTargets(model, span, group)):
                self.readers[value] = len(consumers(value, packs))
        for task in span_tasks(model, packs, span, job.groups, job.overlap):
            self._add_task(task)
        self.spans_opened[model] = span + 1

    def _add_task(self, task: TaskId) -> None:
        """A task of an open span becomes a candidate: who reads it, what it waits for."""
        job = self.jobs[task.model]
        self.readers[task] = len(consumers(task, job.section_count))
        deps = self._deps[task] = dependencies(task, job.section_count, job.groups, job.overlap, job.whole_step)
        unmet = {dep for dep in deps if not self._is_done(dep) and dep not in self.bound}
        for dep in unmet:
            self._dependents.setdefault(dep, []).append(task)
        if unmet:
            self._unmet[task] = unmet
        else:
            self._ready.add(task)

    # Binding

    def _bind_all(self) -> list[Instruction]:
        """Bind ready tasks to every device with a free slot, round after round, until none can be bound; first to
        each idle device a task that can start now, which a busy device's free slot would otherwise queue behind its
        running task while this one idles (a task waiting for another's result stays for that task's device)."""
        instructions: list[Instruction] = []
        for device in self.device_names:
            if self.occupied(device) == 0:
                task = self.bind(device, now=True)
                if task is not None:
                    instructions.append(self._submission(task, device))
        progress = True
        while progress:
            progress = False
            for device in self.device_names:
                task = self.bind(device)
                if task is not None:
                    instructions.append(self._submission(task, device))
                    progress = True
        return instructions

    def bind(self, device: str, now: bool = False) -> TaskId | None:
        """Choose the ready task that device should run next (with now, one that can start now: none of its
        dependencies still running), or None if there is none or no free slot (an upd task, which runs beside the
        device, needs none: it is bound as soon as its bwd is, beside that bwd's device)."""
        candidates = self.ready(device)
        if now:
            candidates = [task for task in candidates if not self.waiting(task)]
        if self.occupied(device) >= self.slots:
            candidates = [task for task in candidates if task.kind == "upd"]
        candidates.sort(key=lambda t: self.score(t, device))
        task = next((task for task in candidates if not self.sooner_elsewhere(task, device)), None)
        if task is None:
            return None
        self._ready.discard(task)
        self.bound[task] = device
        self.placed[task] = device
        self._satisfy(task)
        self.running[device][task] = self.submitted
        job = self.jobs[task.model]
        follower = successor(task, packs(job))
        if follower is not None:
            first, _ = self.open_spans[(task.model, task.span)]
            nbytes = job.section_bytes(follower.pack)
            self._remember(device, (follower.model, follower.pack), first, nbytes)
        return task

    def occupied(self, device: str) -> int:
        """The device's slots taken: its bound fwd and bwd tasks (an upd runs on a host thread beside the device)."""
        return sum(1 for task in self.running[device] if task.kind != "upd")

    def _submission(self, task: TaskId, device: str) -> Submit:
        """How task goes to device: which of its inputs its own worker hands over, what it waits for elsewhere.

        A producer on the same device is queued on its worker before task is, and the worker runs its tasks one
        at a time in submission order (runtime.handoff): task reads that result from the worker's memory and has
        no edge through the scheduler. It inherits what such a producer waits for on other devices, so that it
        never becomes runnable before its local producers do. upd tasks keep their edges both ways: they run beside
        the device's tasks (a host thread), not in their order.
        """
        job = self.jobs[task.model]
        reads = inputs(task, packs(job))
        deps = self.dependencies(task)
        local = frozenset(
            value for value in (*reads, *deps)
            if isinstance(value, TaskId) and "upd" not in (task.kind, value.kind) and self.placed.get(value) == device
        )
        edges = {value: self.placed[value] for value in reads if isinstance(value, TaskId) and value not in local}
        after: list[TaskId] = []
        checks: list[TaskId] = []
        for dep in deps:
            if dep not in self.bound:
                continue  # finished: nothing to wait for
            if dep in local:
                inherited = {edge: at for edge, at in self.edges.get(dep, {}).items() if at != device}
                after += [edge for edge in inherited if edge not in edges and edge in self.bound]
                edges.update(inherited)
                if dep not in reads:
                    checks.append(dep)
            elif dep not in reads:
                edges[dep] = self.placed[dep]
                after.append(dep)
        self.edges[task] = edges
        first, count = self.open_spans[(task.model, task.span)]
        self.submitted += 1
        return Submit(
            task=task,
            attempt=self.attempts.get(task, 0),
            device=device,
            reads=reads,
            local=frozenset(value for value in reads if value in local),
            peers=tuple(isinstance(value, TaskId) and self.placed[value] != device for value in reads),
            after=tuple(dict.fromkeys(after)),
            checks=tuple(checks),
            first=first,
            steps=count if self.spans[task.model].multistep else None,
            successor=successor(task, packs(job)),
            priority=1 if task.kind == "upd" else 1 - self.submitted,
        )

    def _remember(self, device: str, key: tuple[int, int], version: int, nbytes: int) -> None:
        """The device will probably cache key's weights at version (what its cache keeps if they fit)."""
        try:
            self.memory[device].load(key, version, nbytes)
        except BudgetExceeded:
            self.memory[device].drop(key)

    def placement(self, task: TaskId) -> str | None:
        """The device a task must run on in this mode, or None where any device may take it.

        vpp spreads packs round-robin over devices (pack p of model m on device (m + p) mod D), so that
        activations flow device to device; vdp gives micro-batch group g to device g mod D, each device
        running every pack for its group. An upd task runs on a host thread beside the device that ran its pack's
        (first group's) bwd, which holds that result: waiting for it elsewhere would copy it there. A homed
        model runs everything, its updates included, on its home device.
        """
        if task.model in self.homes:
            return self.homes[task.model]
        if task.kind == "upd":
            device = self.placed.get(TaskId("bwd", task.model, task.pack, task.span))
            return device if device in self.memory else None
        if self.mode == "free":
            return None
        live = self.live_devices(task.model)
        if not live:
            return None  # its machine has no device now: nothing can take it until one comes back (see ready)
        index = (task.model + task.pack) % len(live) if self.mode == "vpp" else task.group % len(live)
        return live[index]

    def ready(self, device: str | None = None) -> list[TaskId]:
        """Candidates (for device, if given) whose dependencies have all finished or are bound already.

        A task whose inputs are still being computed can be handed to Dask, which starts it the moment they
        exist; queueing it on the device hides the round trip through the driver. Readiness is kept up to date
        as tasks are bound (see _satisfy), so that asking costs nothing per waiting task.
        """
        return [task for task in self._ready if device is None
                or (self.placement(task) in (None, device) and self.machines[device] == self.jobs[task.model].machine)]

    def _satisfy(self, task: TaskId) -> None:
        """task was bound: the tasks that waited for it alone become ready."""
        for dependent in self._dependents.pop(task, ()):
            unmet = self._unmet.get(dependent)
            if unmet is None or task not in unmet:
                continue  # an entry from before dependent's span was rolled back
            unmet.discard(task)
            if not unmet:
                del self._unmet[dependent]
                self._ready.add(dependent)

    def dependencies(self, task: TaskId) -> list[TaskId]:
        """Tasks that must finish before task may run (kept from when its span opened until it completes)."""
        cached = self._deps.get(task)
        if cached is not None:
            return cached
        job = self.jobs[task.model]
        return dependencies(task, packs(job), job.groups, job.overlap, job.whole_step)

    def _is_done(self, task: TaskId) -> bool:
        """Whether task has finished (every task of a span before the model's last finished one has)."""
        return task.span < self.spans_done[task.model] or task in self.done

    def remaining_seconds(self, model: int) -> float:
        """Predicted time the model still needs: its remaining steps times its step time (one second per
        step when its step time is unknown, so that remaining steps decide)."""
        steps = self.spans[model].steps
        if steps is None:
            return float("inf")
        return (steps - self.steps_trained[model]) * (self.jobs[model].step_seconds or 1.0)

    def model_rank(self, model: int) -> tuple[float, int]:
        """Which model a free device serves first: Sharded-LRTF gives it to the model with the longest
        remaining time; round-robin (and LRTF between models of unknown length) to the model that has
        made the least progress."""
        progress = self.steps_trained[model]
        if self.policy == "lrtf":
            return -self.remaining_seconds(model), progress
        return 0.0, progress

    def waiting(self, task: TaskId) -> bool:
        """Whether a ready task still waits for a dependency bound and running (it starts when that one ends)."""
        return any(dep in self.bound for dep in self.dependencies(task))

    def seconds(self, task: TaskId) -> float:
        """A task's predicted time on its device: its share of its job's step compute (a second a step where the plan
        predicted none, so that tasks still weigh by their shares) for each step its span runs, and a task's cost;
        an upd, beside it, none."""
        if task.kind == "upd":
            return 0.0
        steps = self.open_spans[(task.model, task.span)][1] if self.spans[task.model].multistep else 1
        return self.step_work[task.model][(task.kind, task.pack)] * steps + self.task_cost

    def queued(self, device: str, through: TaskId | None = None) -> float:
        """The predicted seconds of device's bound tasks, or of those submitted up to through (it run in submission
        order): when it would be done with them, counted from now as if each had just started."""
        running = self.running[device]
        last = running[through] if through is not None else self.submitted
        return sum(self.seconds(task) for task, at in running.items() if at <= last)

    def starts(self, task: TaskId, device: str) -> tuple[float, int]:
        """When task would start if device took it now, and how many of its producers are elsewhere: after the
        device's bound tasks, and after each dependency still bound ends (its device's tasks up to it, a result
        from another device edge seconds later); a finished one's result read from another device, edge seconds
        from now."""
        start, away = self.queued(device), 0
        for dep in self.dependencies(task):
            at = self.bound.get(dep)
            if at is not None:
                ends = self.queued(at, dep)
            elif dep in self.placed and dep in inputs(task, packs(self.jobs[task.model])):
                at, ends = self.placed[dep], 0.0
            else:
                continue
            if at != device:
                away += 1
                ends += self.edge
            start = max(start, ends)
        return start, away

    def sooner_elsewhere(self, task: TaskId, device: str) -> bool:
        """Whether a task any device may run would start sooner on another device of its machine (starts), or as
        soon with fewer of its producers elsewhere: only the device where it starts first takes it, so that a
        device with work queued does not take what another would start first, and one job's chain of tasks moves
        between devices as their queues even out."""
        if self.placement(task) is not None:
            return False
        start, away = self.starts(task, device)
        for other in self.live_devices(task.model):
            if other != device:
                sooner, fewer = self.starts(task, other)
                if sooner < start - TIE or (sooner <= start + TIE and fewer < away):
                    return True
        return False

    def score(self, task: TaskId, device: str) -> tuple[float, ...]:
        """Lower is better: tasks that can start now, updates first, then tasks whose pack the device caches at
        the version they read, backward before forward, then the model the policy ranks first."""
        first, _ = self.open_spans[(task.model, task.span)]
        cached = task.kind != "upd" and self.memory[device].holds((task.model, task.pack), first)
        return (
            1 if self.waiting(task) else 0,
            KIND_RANK[task.kind] if task.kind == "upd" else 1,
            0 if cached else 1,
            KIND_RANK[task.kind],
            *self.model_rank(task.model),
            task.model,
            task.pack,
            task.span,
            task.group,
        )

    # Evaluation

    def next_evaluation(self, model: int) -> int | None:
        """The step after which the model is evaluated next within the run (every eval_every steps), or None:
        only at its end, or no evaluation at all."""
        if self.eval_every is None:
            return None
        return (self.evaluated[model] // self.eval_every + 1) * self.eval_every

    def ahead(self, model: int) -> int:
        """How many steps past an evaluation's a job may take while it is evaluated: one for a swapped job (its
        update writes the host store's other slot, leaving the evaluated version whole; the one after would
        overwrite it), none for a homed job (its update changes the device weights the evaluation reads)."""
        return 0 if model in self.homes else 1

    def _evaluations(self) -> list[Instruction]:
        """Evaluations owed that a live device of their job's machine can run now (one at a time per job): the
        job's home, else its device with the fewest tasks."""
        instructions: list[Instruction] = []
        for model, step in sorted(self.evaluations_owed.items()):
            live = self.live_devices(model)
            if not live or model in self.evaluating:
                continue
            home = self.homes.get(model)
            device = home if home in live else min(live, key=lambda name: (len(self.running[name]), live.index(name)))
            del self.evaluations_owed[model]
            self.evaluating[model] = Evaluate(model, step, device, self.attempts_evaluated.get(model, 0))
            self.attempts_evaluated[model] = self.evaluating[model].attempt + 1
            instructions.append(self.evaluating[model])
        return instructions

    def _evaluated(self, event: Evaluated) -> list[Instruction]:
        """An evaluation finished: the job goes on past its step (or ends); one that failed fails the job alone
        when its own code raised (else the run)."""
        evaluation = self.evaluating.get(event.model)
        if evaluation is None or (evaluation.step, evaluation.attempt) != (event.step, event.attempt):
            return []  # an attempt replaced since (its device was lost) or of a job that failed
        del self.evaluating[event.model]
        if event.error is not None:
            if self.fail_fast or not event.isolated:
                return [Fail(event.model, event.error)]
            instructions = self._fail_job(event.model, event.step, str(event.error), event.at)
            self.failed[event.model]["error"] = event.error
            return instructions + self._advance()
        self.evaluated[event.model] = event.step
        if self.prune and event.step == self.decided + (self.eval_every or 0):
            self.standing.add(event.model)
        self._owe_evaluation(event.model, self._all_spans_done(event.model))
        if self._job_finished(event.model):
            self.finish_times.setdefault(event.model, event.at)
        return self._advance()

    def _owe_evaluation(self, model: int, ended: bool) -> bool:
        """Owe an evaluation of the job's weights as they are now, when its steps trained reach its next evaluation
        point or its end (ended) and they are not evaluated yet; returns whether one is owed. Called when a span is
        done and when an evaluation is (a swapped job may have reached its next point meanwhile)."""
        trained = self.steps_trained[model]
        if not self.evaluate or trained <= self.evaluated[model]:
            return False
        if ended or trained == self.next_evaluation(model):
            self.evaluations_owed[model] = trained
        return model in self.evaluations_owed

    # Pruning

    def contends(self, model: int, step: int) -> bool:
        """Whether a job is ranked at pruning step: it still trains, and its data goes past step."""
        total = self.spans[model].steps
        return not self.stopped(model) and (total is None or total > step) and not self._all_spans_done(model)

    def _rank(self) -> list[Instruction]:
        """With pruning: once every job still training past the next pruning step has been evaluated there, rank
        them (one ranking at a time; they all wait at that step meanwhile)."""
        if not self.prune or self.ranking is not None:
            return []
        step = self.decided + (self.eval_every or 0)
        contenders = [model for model in range(len(self.jobs)) if self.contends(model, step)]
        if not contenders or any(model not in self.standing for model in contenders):
            return []
        self.ranking = Rank(step, tuple(contenders))
        return [self.ranking]

    def _ranked(self, event: Ranked) -> list[Instruction]:
        """A ranking is done: its pruned members stop at its step, a job with none left training stops whole (and is
        checkpointed there, what a resumed run knows it by), and every other job goes on past the step."""
        assert self.ranking is not None and event.step == self.ranking.step, f"{event} was not asked for"
        assert set(event.pruned) <= set(self.ranking.models) >= event.ended, f"{event} ranks jobs not ranked"
        self.ranking = None
        self.decided = event.step
        self.standing.clear()
        instructions: list[Instruction] = []
        for model, positions in sorted(event.pruned.items()):
            instructions.append(Prune(model, event.step, positions))
            self.pruned_members.setdefault(model, {}).update(dict.fromkeys(positions, event.step))
        models = sorted(self.jobs[model].members[position] for model, positions in event.pruned.items()
                        for position in positions)
        if models:
            self.events.append({"at": event.at, "event": "models pruned", "models": models, "step": event.step})
        for model in sorted(event.ended):
            self.pruned[model] = event.step
            if self.checkpoint_every:
                instructions.append(Checkpoint(model, event.step))
            instructions += self._stop_job(model, event.at)
        return instructions + self._advance()

    # What the run has done

    def total_spans(self, model: int) -> int | None:
        """How many spans the model runs in all: those opened and those its cutting has left (None while its
        loader's length is unknown)."""
        left = self.spans[model].spans_left()
        return None if left is None else self.spans_opened[model] + left

    def model_steps(self) -> tuple[int, int | None]:
        """The steps every model has trained, a fused array's step counting once per member, and how many they
        train in all (None while a loader's length is unknown; a failed job's count ends where it stopped)."""
        members = [len(job.members) for job in self.jobs]
        done = sum(steps * count for steps, count in zip(self.steps_trained, members))
        totals = [(self.steps_trained[job] if self.stopped(job) else spans.steps) * count
                  for job, (spans, count) in enumerate(zip(self.spans, members)) if spans.steps is not None]
        return done, sum(totals) if len(totals) == len(self.spans) else None

    def idle_devices(self) -> frozenset[str]:
        """The live devices with nothing left to compute in this run: while every job still training is homed (a
        job that is not can run on any device), those that are no such job's home; none once nothing trains."""
        homes = set()
        for model in range(len(self.jobs)):
            if self.stopped(model) or self._job_finished(model):
                continue
            if model not in self.homes:
                return frozenset()
            homes.add(self.homes[model])
        return frozenset(self.memory) - homes if homes else frozenset()

    @property
    def finished(self) -> bool:
        return all(self.stopped(m) or self._job_finished(m) for m in range(len(self.jobs)))

    def stopped(self, model: int) -> bool:
        """Whether a job stopped before its end: it failed, or it was pruned."""
        return model in self.failed or model in self.pruned

    def _all_spans_done(self, model: int) -> bool:
        """Whether a job has run every span of its data."""
        total = self.total_spans(model)
        return total is not None and self.spans_done[model] >= total

    def _job_finished(self, model: int) -> bool:
        """Whether a job has run every span of its data (and, with evaluation, been evaluated at its end)."""
        if not self._all_spans_done(model):
            return False
        return not self.evaluate or (self.evaluated[model] >= self.steps_trained[model]
                                     and model not in self.evaluating and model not in self.evaluations_owed)

    def validate_state(self) -> None:
        """Check every invariant of the state; raises AssertionError naming the first one broken."""
        for device, tasks in self.running.items():
            busy = self.occupied(device)
            assert busy <= self.slots, f"{device} runs {busy} tasks with {self.slots} slots"
            assert all(self.bound.get(task) == device for task in tasks), f"{device}'s tasks are bound elsewhere"
            self.memory[device].validate()
        assert sum(len(tasks) for tasks in self.running.values()) == len(self.bound), "a bound task runs nowhere"
        for task in self.bound:
            assert not self._is_done(task), f"{task} is both bound and finished"
            assert self.placed.get(task) == self.bound[task], f"{task} is bound where it is not placed"
        for task in self._ready:
            assert task not in self.bound and not self._is_done(task), f"{task} is ready but bound or finished"
            assert all(self._is_done(dep) or dep in self.bound for dep in self.dependencies(task)), (
                f"{task} is ready before its dependencies are bound")
        for task, unmet in self._unmet.items():
            assert unmet and not any(self._is_done(dep) for dep in unmet), f"{task} waits for finished tasks"
        for value, count in self.readers.items():
            assert count >= 0, f"{value} has {count} readers"
            assert count > 0 or not isinstance(value, TaskId) or not self._is_done(value), f"{value} is kept unread"
        for task, device in self.bound.items():
            assert device in self.memory, f"{task} is bound to {device}, which is lost"
        assert self.idle == self.idle_devices(), "the driver was not told which devices are idle"
        for model, home in self.homes.items():
            assert home in self.budgets, f"job {model} is homed on {home}, not a device of the run"
            assert self.machines[home] == self.jobs[model].machine, f"job {model} is homed off its machine"
        for task, device in self.bound.items():
            assert self.machines[device] == self.jobs[task.model].machine, f"{task} is bound off its job's machine"
        assert not any(self.stopped(task.model) for task in self.bound), "a stopped job has tasks bound"
        for model, spans in enumerate(self.spans):
            assert self.spans_done[model] <= self.spans_opened[model], f"model {model} finished unopened spans"
            assert len(self.step_times[model]) == self.steps_trained[model], f"model {model}'s steps are miscounted"
            assert spans.opened >= self.steps_trained[model], f"model {model} trained steps it never opened"
        for model, evaluation in self.evaluating.items():
            assert not self.stopped(model), f"stopped model {model} is evaluated"
            assert self.evaluations_owed.get(model, evaluation.step + 1) > evaluation.step, f"{model} evaluates twice"
            ahead = self.ahead(model)
            assert 0 <= self.steps_trained[model] - evaluation.step <= ahead, f"model {model} evaluates stale weights"
            assert self.spans[model].opened <= evaluation.step + ahead, f"{model} opened steps past its evaluation"
        if self.prune:
            step = self.decided + (self.eval_every or 0)
            for model in range(len(self.jobs)):
                assert self.stopped(model) or self.spans[model].opened <= step, f"model {model} passed step {step}"
                assert model not in self.standing or self.evaluated[model] == step, f"model {model} stands unevaluated"
            assert self.ranking is None or self.ranking.step == step, "a ranking of another step is awaited"
            assert not set(self.pruned) & {task.model for task in self.bound}, "a pruned job has tasks bound"
        for model, step in self.evaluations_owed.items():
            assert step <= self.steps_trained[model] <= step + self.ahead(model), f"model {model}'s evaluation is stale"
            assert self.spans[model].opened <= step + self.ahead(model), f"{model} opened steps past its evaluation"
        for (model, span), (first, count) in self.open_spans.items():
            assert self.spans_done[model] <= span < self.spans_opened[model], f"span {span} of model {model} is stale"
            assert count >= 1 and first >= self.steps_trained[model], f"span {span} of model {model} is miscut"
