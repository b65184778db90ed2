"""The driver: carries out what the binding state decides, on a connected Dask cluster, and reports what happens.

It keeps no scheduling state of its own: every event (a batch fetched, a task finished or failed, a span timed)
goes to the pure ``BindingState``, and every instruction that comes back is done here: fetch a span's batches
from the loader and write them into a host-store file that its tasks name (see shipping), submit a task to its
device's worker (``fwd-m3-p2-s17-<run>`` keys, ``pure=False``, restricted to that worker), release a value, read
a span's timing. What it holds is the I/O's handles: the futures and shipped batches of values still read.

It waits on one queue for everything that can happen: a task's future finishing (or failing), and the
scheduler's word that a worker left or joined (a device lost mid-run is an event, not a hang); the wait wakes
every second to see a Ctrl-C that Python swallowed, and a run whose devices are all gone for DEVICE_TIMEOUT
fails. A task run again gets a key of its own; the futures of runs that were cancelled are not heard.

A worker runs its tasks one at a time in the order they were bound (each task's Dask priority), except vDP's upd
tasks, which go first since the next span waits for them. A dependency on the same device has no edge through
the scheduler: the task names it and reads its result from the worker's memory (see handoff); one on another
device is a Dask edge, an argument when the task reads its result and an ``after=`` future when it only must
finish first. Activations flow worker to worker as Dask results; nothing large passes through the driver.

With pruning, a Rank is answered here at once: the user's pruner (``ranking``, called in this process) gets the
models still training with their figures at the step, and what it stops becomes the Ranked event; a Prune writes
the members' step into their job's host-store file, which every process of the run reads.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

import torch
from distributed import Client, Future

from harmony.runtime import bodies
from harmony.runtime.data import SharedFeed, batch_size, split_tree
from harmony.runtime.divergence import Members
from harmony.runtime.errors import ModelFailure
from harmony.runtime.evaluation import Evaluations, Metrics
from harmony.runtime.files import SPAN_TIMING_BYTES, diverged_name, pruned_name, span_timing_name
from harmony.runtime.handoff import LocalResult
from harmony.runtime.hoststore import HostStore
from harmony.runtime.interrupt import raise_if_interrupted
from harmony.runtime.machines import RemoteBatches
from harmony.runtime.shipping import BatchFiles
from harmony.tasks.binding import BindingState
from harmony.tasks.events import (
    BatchReady,
    Cancel,
    Checkpoint,
    Evaluate,
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
from harmony.tasks.graph import BatchInput, BatchTargets, Value, parse_key
from harmony.tasks.microbatch import deal, loss_weights, split_sizes

BODIES: dict[str, Callable[..., Any]] = {"fwd": bodies.forward, "bwd": bodies.backward, "upd": bodies.update}
Ranking = Callable[[int, list[tuple[int, float, dict[str, float]]]], Collection[int]]  # see Driver
WAKE_SECONDS = 1.0
DEVICE_TIMEOUT = 120.0  # seconds a run waits for a worker to come back once every device is lost


class Driver:
    """Runs one training job to completion on a connected cluster."""

    def __init__(
        self,
        client: Client,
        run: str,
        stores: list[HostStore],
        batches: list[BatchFiles | RemoteBatches],
        state: BindingState,
        feeds: list[SharedFeed],
        workers: dict[str, str],
        microbatches: int,
        on_step: Callable[[int, int], None] | None = None,
        on_progress: Callable[[BindingState], None] | None = None,
        on_checkpoint: Callable[[int, int], None] | None = None,
        on_idle: Callable[[frozenset[str]], None] | None = None,
        validation: list[list[tuple[Any, Any]] | None] | None = None,
        metrics: Metrics = None,
        executing: Callable[[str], frozenset[int] | None] | None = None,
        ranking: Ranking | None = None,
    ) -> None:
        self.client = client
        self.run = run
        self.stores = stores
        self.batches = batches
        self.state = state
        self.feeds = feeds
        self.workers = workers
        self.microbatches = microbatches
        self.on_step = on_step
        self.executing = executing
        self.on_progress = on_progress
        self.on_checkpoint = on_checkpoint
        self.on_idle = on_idle
        self.ranking = ranking
        self.values: dict[Value, Any] = {}
        self.loss_weights: dict[BatchTargets, list[Any]] = {}
        self.heard: queue.SimpleQueue[Future | tuple[str, str]] = queue.SimpleQueue()
        self.devices = {address: name for name, address in workers.items()}
        self.stranded_since: dict[str, float] = {}
        self.started = time.perf_counter()
        self.evaluations = Evaluations(client, run, validation or [None] * len(feeds), microbatches, metrics,
                                       self.heard.put)

    def run_to_completion(self) -> None:
        """Carry out the state's instructions and report what happens until every model has trained (or failed)."""
        self.started = time.perf_counter()
        previous = getattr(self.client, "_event_handlers", {}).get("all")  # a handler of the user's, put back after
        self.client.subscribe_topic("all", self._scheduler_event)
        try:
            self._carry_out(self.state.start())
            alone_since: float | None = None
            while not self.state.finished:
                try:
                    heard = self.heard.get(timeout=WAKE_SECONDS)
                except queue.Empty:
                    heard = None
                raise_if_interrupted()  # a Ctrl-C that Python swallowed (see interrupt)
                event = None if heard is None else self._event(heard)
                if event is not None:
                    self._carry_out(self.state.handle(event))
                    if self.on_progress is not None:
                        self.on_progress(self.state)
                alone_since = self._check_progress(alone_since)
        finally:
            if previous is None:
                self.client.unsubscribe_topic("all")
            else:
                self.client.subscribe_topic("all", previous)

    def _check_progress(self, since: float | None) -> float | None:
        """Fail a run that cannot go on: every device lost for DEVICE_TIMEOUT, or nothing in flight while it is not
        finished and no machine's jobs wait for its devices; fail the jobs of a machine whose devices have all been
        lost that long. Returns since when the devices have been gone."""
        now = time.perf_counter()
        for machine in set(self.state.machines.values()):
            if not self.state.device_names or not self.state.stranded(machine):
                self.stranded_since.pop(machine, None)
            elif now - self.stranded_since.setdefault(machine, now) > DEVICE_TIMEOUT:
                del self.stranded_since[machine]
                self._carry_out(self.state.handle(MachineLost(machine, DEVICE_TIMEOUT, now - self.started)))
        if not self.state.device_names:
            if since is not None and now - since > DEVICE_TIMEOUT:
                raise RuntimeError(f"harmony: every device's worker has been lost for {DEVICE_TIMEOUT:.0f} s; "
                                   "the run cannot go on")
            return since if since is not None else now
        if (not self.state.bound and not self.state.finished and self.state.fetching is None
                and not self.state.evaluating and not self.stranded_since):  # a stranded machine's jobs wait, above
            raise RuntimeError("harmony driver: no task in flight and none ready before training finished")
        return None

    def _executing(self, device: str) -> frozenset[int] | None:
        """The jobs a lost device's worker was busy with, as it marked them (None where unknown)."""
        if self.executing is None:
            return None
        try:
            return self.executing(device)
        except (OSError, ValueError):  # a store already gone, or a device this run does not have
            return None

    def _scheduler_event(self, event: tuple[float, dict[str, Any]]) -> None:
        """On the client's event loop: a worker left or joined the scheduler."""
        _, message = event
        action = message.get("action")
        if action in ("remove-worker", "add-worker") and "worker" in message:
            self.heard.put((action, message["worker"]))

    def _event(self, heard: Future | tuple[str, str]) -> Event | None:
        """What a finished future or a scheduler's message means for the state, if anything."""
        at = time.perf_counter() - self.started
        if isinstance(heard, tuple):
            action, address = heard
            if action == "remove-worker":
                self.evaluations.forget_worker(address)
                name = self.devices.pop(address, None)
                return None if name is None else WorkerLost(name, at, self._executing(name))
            name = self._worker_name(address)
            if name is None:
                return None
            self.workers[name] = address
            self.devices[address] = name
            return WorkerJoined(name, at)
        if str(heard.key).startswith("val-"):
            return self.evaluations.heard(heard, at)
        parsed = parse_key(heard.key)
        if parsed is None:
            return None
        task, _ = parsed
        if self.values.get(task) is not heard:
            return None  # a run of a task that was cancelled since (its worker was lost, its job failed)
        if heard.status == "error":
            error = heard.exception()
            return TaskFailed(task, error.with_traceback(heard.traceback()), at, isinstance(error, ModelFailure),
                              getattr(error, "step", None))
        if heard.status == "cancelled":
            return None  # Dask dropped it (its worker gone): the scheduler's word on the worker says what to redo
        return TaskFinished(task, at)

    def _worker_name(self, address: str) -> str | None:
        """The device name of a worker that joined (its Dask name), if it is one of this run's devices."""
        info = self.client.scheduler_info()["workers"].get(address)
        name = None if info is None else str(info.get("name"))
        return name if name in self.workers else None

    def _carry_out(self, instructions: list[Instruction]) -> None:
        """Do each instruction in order; what comes of one (a batch fetched, a timing read) is an event whose
        instructions follow."""
        queue = deque(instructions)
        while queue:
            event = self._do(queue.popleft())
            if event is not None:
                queue.extend(self.state.handle(event))

    def _do(self, instruction: Instruction) -> Event | None:
        if isinstance(instruction, Submit):
            self._submit(instruction)
        elif isinstance(instruction, Release):
            self.batches[instruction.value.model].release(self.values.pop(instruction.value, None))
            if isinstance(instruction.value, BatchTargets):
                self.loss_weights.pop(instruction.value, None)
        elif isinstance(instruction, Cancel):
            future = self.values.pop(instruction.task, None)
            if isinstance(future, Future):
                future.release()  # not cancel: Dask's cancel walks dependents, some already released
        elif isinstance(instruction, Leave):
            self.feeds[instruction.model].leave(instruction.step)
        elif isinstance(instruction, Checkpoint):
            if self.on_checkpoint is not None:
                self.on_checkpoint(instruction.model, instruction.step)
        elif isinstance(instruction, Fetch):
            return self._fetch(instruction)
        elif isinstance(instruction, ReadTiming):
            store = self.stores[instruction.model]
            store.pull((span_timing_name(instruction.model),))
            timing = store.attach(span_timing_name(instruction.model), SPAN_TIMING_BYTES)
            seconds, steps = timing.view(torch.float64).tolist()
            return StepTimed(instruction.model, seconds, int(steps))
        elif isinstance(instruction, Evaluate):
            self.evaluations.submit(instruction, self.workers[instruction.device],
                                    self.state.jobs[instruction.model].packing)
        elif isinstance(instruction, Rank):
            return self._rank(instruction)
        elif isinstance(instruction, Prune):
            store = self.stores[instruction.model]
            Members(store, instruction.model, len(self.state.jobs[instruction.model].members)).prune(
                instruction.positions, instruction.step)
            store.overwrite((pruned_name(instruction.model),))  # its workers map the file already
        elif isinstance(instruction, Idle):
            if self.on_idle is not None:
                self.on_idle(instruction.devices)
        elif isinstance(instruction, Fail):
            raise instruction.error
        else:
            raise TypeError(f"not an instruction: {instruction!r}")
        return None

    def _rank(self, rank: Rank) -> Ranked:
        """The models still training at a pruning step (a fused array's members whose loss is finite and that were
        not pruned), each with its validation loss and metrics there, go to ranking (the user's pruner, called as
        ranking(step, [(model, val_loss, metrics), ...]) -> the models to stop): which members stop, which jobs end."""
        assert self.ranking is not None, "a run without a pruner was asked to rank"
        entries: list[tuple[int, float, dict[str, float]]] = []
        where: dict[int, tuple[int, int]] = {}
        stopped: dict[int, set[int]] = {}
        for job in rank.models:
            step, figures = self.evaluations.results[job][-1]
            assert step == rank.step, f"job {job} was last evaluated at step {step}, not {rank.step}"
            store = self.stores[job]
            store.pull((diverged_name(job), pruned_name(job)))
            members = self.state.jobs[job].members
            stopped[job] = set(Members(store, job, len(members)).stopped())
            for position, model in enumerate(members):
                if position not in stopped[job]:
                    metrics = {name: values[position] for name, values in figures.items() if name != "loss"}
                    entries.append((model, figures["loss"][position], metrics))
                    where[model] = (job, position)
        pruned: dict[int, list[int]] = {}
        for model in sorted(self.ranking(rank.step, entries)):
            job, position = where[model]
            pruned.setdefault(job, []).append(position)
        ended = frozenset(job for job in rank.models
                          if len(stopped[job]) + len(pruned.get(job, ())) == len(self.state.jobs[job].members))
        return Ranked(rank.step, {job: tuple(positions) for job, positions in pruned.items()}, ended,
                      time.perf_counter() - self.started)

    def _fetch(self, fetch: Fetch) -> BatchReady:
        """The span's batches from the model's loader, split into micro-batch groups and shipped to a file each
        (a multi-step span's steps stacked where they share a layout, see shipping)."""
        feed = self.feeds[fetch.model]
        steps = []
        for step in range(fetch.first, fetch.first + fetch.count):
            batch = feed.get(step)
            if batch is None:
                break
            steps.append(self._split(batch, fetch.groups))
            if self.on_step is not None:
                self.on_step(fetch.model, step)
        if not steps:
            return BatchReady(fetch.model, fetch.span, 0)
        batches = self.batches[fetch.model]
        for group in range(fetch.groups):
            inputs_ = BatchInput(fetch.model, fetch.span, group)
            targets = BatchTargets(fetch.model, fetch.span, group)
            if fetch.stacked:
                self.values[inputs_] = batches.ship_steps([parts[group][0] for parts in steps])
                self.values[targets] = batches.ship_steps([parts[group][1] for parts in steps])
                self.loss_weights[targets] = [parts[group][2] for parts in steps]
            else:
                [parts] = steps
                self.values[inputs_] = batches.ship(parts[group][0])
                self.values[targets] = batches.ship(parts[group][1])
                self.loss_weights[targets] = parts[group][2]
        return BatchReady(fetch.model, fetch.span, len(steps))

    def _split(self, batch: tuple[Any, Any], groups: int) -> list[tuple[list[Any], list[Any], list[float]]]:
        """Per micro-batch group: its micro-batches' inputs, targets and loss weights (dealt out in turn, see deal)."""
        inputs_, targets = batch
        sizes = split_sizes(batch_size(inputs_), self.microbatches)
        if len(sizes) == 1 and groups == 1:  # the common case, on the driver's critical path for small steps
            return [([inputs_], [targets], [1.0])]
        micro_inputs, micro_targets = split_tree(inputs_, sizes), split_tree(targets, sizes)
        return list(zip(deal(micro_inputs, groups), deal(micro_targets, groups), deal(loss_weights(sizes), groups)))

    def _submit(self, submit: Submit) -> None:
        task = submit.task
        args: list[Any] = [
            LocalResult(self.values[value].key) if value in submit.local else self.values[value]
            for value in submit.reads
        ]
        if task.kind == "bwd":
            targets = BatchTargets(task.model, task.span, task.group)
            args.append(self.loss_weights[targets] if targets in submit.reads else [])
        after = [self.values[dep] for dep in submit.after]
        after += [LocalResult(self.values[dep].key) for dep in submit.checks]
        future = self.client.submit(
            BODIES[task.kind],
            self.run,
            task.model,
            task.pack,
            task.span,
            *args,
            first=submit.first,
            steps=submit.steps,
            after=after,
            peers=submit.peers,
            successor=submit.successor,
            group=task.group,
            key=task.key(self.run, submit.attempt),
            workers=[self.workers[submit.device]],
            allow_other_workers=False,
            pure=False,
            priority=submit.priority,
        )
        self.values[task] = future
        future.add_done_callback(self.heard.put)

    def cancel(self) -> None:
        """Drop every value: the futures of whatever is still in flight (Dask then forgets those tasks) and the batch
        files."""
        for key, value in self.values.items():
            self.batches[key.model].release(value)
            if isinstance(value, Future):
                value.release()
        self.values.clear()
        self.loss_weights.clear()
        self.evaluations.close()
