"""The binding state's vocabulary: the events the driver feeds it and the instructions it answers with.

An event says what happened (a batch was fetched, a task finished or failed, a span was timed, a worker left or
joined); an instruction says what to do (fetch a batch, submit a task, release a value, read a span's timing,
fail a model). The driver carries instructions out and turns what comes of them into events; it decides nothing.
Times are seconds from the start of the run, read by the driver, so that the state stays pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from harmony.tasks.graph import TaskId, Value

# Events


@dataclass(frozen=True)
class BatchReady:
    """The batch of a model's span was fetched and shipped: it holds steps training steps (fewer than asked, or
    none, when the loader ran dry)."""

    model: int
    span: int
    steps: int


@dataclass(frozen=True)
class TaskFinished:
    task: TaskId
    at: float


@dataclass(frozen=True)
class TaskFailed:
    """A task raised. isolated: the failure is the job's own (its model's code, or its divergence), which fails
    that job alone unless the run is fail_fast; any other error fails the run. step: the training step it
    happened at, where the task knows it better than its span's first step (a divergence inside a span)."""

    task: TaskId
    error: BaseException
    at: float
    isolated: bool = False
    step: int | None = None


@dataclass(frozen=True)
class StepTimed:
    """A model's finished spans ran steps training steps in seconds on their device, in all so far."""

    model: int
    seconds: float
    steps: int


@dataclass(frozen=True)
class WorkerLost:
    """The scheduler lost the worker of a device (its process died, or it left); executing holds the jobs it was busy
    with then, where the driver could read them (the worker marks them in its host store): its task thread's, and
    those whose updates ran on a host thread beside it."""

    device: str
    at: float
    executing: frozenset[int] | None = None


@dataclass(frozen=True)
class WorkerJoined:
    """A worker for a device of the run joined the scheduler (a restarted one, or a new one of that name)."""

    device: str
    at: float


@dataclass(frozen=True)
class MachineLost:
    """Every worker of a machine has been gone for seconds: the state of the jobs homed there is out of reach."""

    machine: str
    seconds: float
    at: float


@dataclass(frozen=True)
class Evaluated:
    """A model's evaluation at step (its validation loss with the weights of that many trained steps) finished;
    with error, it failed (isolated: the model's own code raised)."""

    model: int
    step: int
    attempt: int
    at: float
    error: BaseException | None = None
    isolated: bool = False


@dataclass(frozen=True)
class Ranked:
    """The models still training were ranked at a pruning step: pruned holds, per job, the positions of its members
    that stop there (their weights stay those of step); ended the jobs none of whose members trains any more."""

    step: int
    pruned: dict[int, tuple[int, ...]]
    ended: frozenset[int]
    at: float


Event = (BatchReady | TaskFinished | TaskFailed | StepTimed | WorkerLost | WorkerJoined | MachineLost | Evaluated
         | Ranked)

# Instructions


@dataclass(frozen=True)
class Fetch:
    """Take the batches of training steps [first, first + count) from the model's loader, split each into groups
    micro-batch groups and ship them for the span's tasks; answer with BatchReady. With stacked, the span's
    tasks read its batches step by step (a multi-step task); else the one step's batch as it is."""

    model: int
    span: int
    first: int
    count: int
    groups: int
    stacked: bool


@dataclass(frozen=True)
class Submit:
    """Run task on device (attempt counts its runs after lost workers: each has a Dask key of its own).

    reads are the values it reads, in its arguments' order; local those of them that a task on the same device
    produced (the worker hands them over, with no edge through the scheduler) and peers whether each read came
    from another device. after are tasks on other devices it waits for without reading them; checks are tasks
    on its own device it must find finished. first is the training step it starts at and steps, for a
    multi-step task, how many it runs (its data then per step). successor is the task whose weights it may
    prefetch; priority orders a device's tasks (higher first).
    """

    task: TaskId
    attempt: int
    device: str
    reads: tuple[Value, ...]
    local: frozenset[Value]
    peers: tuple[bool, ...]
    after: tuple[TaskId, ...]
    checks: tuple[TaskId, ...]
    first: int
    steps: int | None
    successor: TaskId | None
    priority: int


@dataclass(frozen=True)
class Release:
    """No task will read value again: drop it (its future, or its batch file for reuse)."""

    value: Value


@dataclass(frozen=True)
class Cancel:
    """task will not run as submitted (its worker, or one it depends on, was lost): drop its future; a new
    attempt may follow."""

    task: TaskId


@dataclass(frozen=True)
class Leave:
    """A failed job reads no more batches from its loader from step on (a shared loader keeps none for it)."""

    model: int
    step: int


@dataclass(frozen=True)
class Checkpoint:
    """Write the job's checkpoint of step now, before anything that follows this instruction is carried out: the
    host store then holds step's weights (in one slot of each pack, the span already running after it can have
    published the next version in the other)."""

    model: int
    step: int


@dataclass(frozen=True)
class ReadTiming:
    """Read what the model's finished spans timed on their device; answer with StepTimed."""

    model: int


@dataclass(frozen=True)
class Fail:
    """The run cannot go on: raise error (a model's own exception with fail_fast, or a reason)."""

    model: int
    error: BaseException


@dataclass(frozen=True)
class Evaluate:
    """Evaluate the model on its validation data on device, with its weights after step training steps (forward
    only, pack by pack); answer with Evaluated. A new attempt replaces an earlier one (its device was lost)."""

    model: int
    step: int
    device: str
    attempt: int


@dataclass(frozen=True)
class Rank:
    """Every job still training has been evaluated at step, a pruning step: rank their models that still train there
    and say which stop; answer with Ranked."""

    step: int
    models: tuple[int, ...]


@dataclass(frozen=True)
class Prune:
    """The members at positions of the job stop at step, for every process of the run: their weights stay those of
    step (see divergence, whose keeping of stopped members' weights this shares)."""

    model: int
    step: int
    positions: tuple[int, ...]


@dataclass(frozen=True)
class Idle:
    """These devices (all of them, each time it changes) have nothing left to compute in this run: every job still
    training is homed on another. Their cores may go to the devices of their machine that still compute."""

    devices: frozenset[str]


Instruction = (Fetch | Submit | Release | Cancel | Leave | Checkpoint | ReadTiming | Fail | Evaluate | Rank | Prune
               | Idle)
