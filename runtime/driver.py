"""The driver: a client-side late-binding loop that keeps a few tasks in flight on every device.

It carries out what the pure BindingState decides: fetch the batches it asks for, submit each bound
task to Dask restricted to its device's worker (``fwd-m3-p2-s17-<run>`` keys, pure=False), and on
every completion report back and drop the futures of values nobody will read again. A worker runs its
ready tasks in the order they were bound (each task's Dask priority is its submission number: Dask's own
would run the later of two tasks sent within 100 ms first), except vDP's upd tasks, which go first since
the next step waits for them. A task may be submitted while its dependencies still run. A dependency on
the same device has no edge through the scheduler: the worker runs its tasks in submission order and the
task reads the result from the worker's memory (see handoff); one on another device is a Dask edge, an
argument when the task reads its result and an ``after=`` future when it only must finish first (the task
that updated a pack, before the next step's forward of it). Activations flow worker to worker as Dask
results; nothing large passes through the driver. Each step's (or span's) mini-batch is written once into a
host-store file that its tasks name (see shipping), and the file is reused once its last reader has finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from distributed import Client, Future, as_completed

from harmony.runtime import bodies
from harmony.runtime.data import SharedFeed, batch_size, split_tree
from harmony.runtime.errors import ModelFailure
from harmony.runtime.handoff import LocalResult
from harmony.runtime.hoststore import HostStore
from harmony.runtime.interrupt import raise_if_interrupted
from harmony.runtime.shipping import BatchFiles
from harmony.runtime.spec import SPAN_TIMING_BYTES, span_timing_name
from harmony.tasks.binding import BindingState
from harmony.tasks.graph import BatchInput, BatchTargets, TaskId, Value, inputs, successor
from harmony.tasks.microbatch import group_sizes, loss_weights, split_sizes

BODIES: dict[str, Callable[..., Any]] = {"fwd": bodies.forward, "bwd": bodies.backward, "upd": bodies.update}


class Driver:
    """Runs one training job to completion on a connected cluster."""

    def __init__(
        self,
        client: Client,
        run: str,
        store: HostStore,
        state: BindingState,
        feeds: list[SharedFeed],
        workers: dict[str, str],
        microbatches: int,
        on_batch: Callable[[int, int], None] | None = None,
        on_progress: Callable[[BindingState, int], None] | None = None,
    ) -> None:
        self.client = client
        self.run = run
        self.store = store
        self.batch_files = BatchFiles(store)
        self.state = state
        self.feeds = feeds
        self.workers = workers
        self.microbatches = microbatches
        self.on_batch = on_batch
        self.on_progress = on_progress
        self.values: dict[Value, Any] = {}
        self.weights: dict[tuple[int, int], list[float]] = {}
        self.in_flight: dict[str, TaskId] = {}
        self.edges: dict[TaskId, dict[TaskId, tuple[Future, str]]] = {}
        self.holds: dict[TaskId, list[Future]] = {}
        self.submitted = 0
        self.device_of: dict[TaskId, str] = {}
        self.tasks_run = 0
        self.started = time.perf_counter()
        self.finish_seconds: dict[int, float] = {}
        self.step_seconds: list[list[float]] = [[] for _ in feeds]
        self.steps_fetched = [0] * len(feeds)

    def _fetch_batches(self) -> None:
        """Open every step the binding state wants open now."""
        for model, step in self.state.wanted_batches():
            if self.state.spans[model].runs_spans:
                self._fetch_span(model, step)
            elif self._fetch_step(model, step):
                self._ship(model, step, self.state.models[model].groups)
                self.state.add_batch(model, step)
            else:
                self.state.end_of_data(model)

    def _ship(self, model: int, step: int, groups: int) -> None:
        """Pack a step's batches for their tasks once, however many tasks read them."""
        for group in range(groups):
            for kind in (BatchInput, BatchTargets):
                value = kind(model, step, group)
                self.values[value] = self.batch_files.ship(self.values[value])

    def _fetch_step(self, model: int, step: int) -> bool:
        """Split one step's mini-batch into its micro-batch groups; False when the loader has run dry."""
        batch = self.feeds[model].get(step)
        if batch is None:
            return False
        groups = self.state.models[model].groups
        for group, (micro_inputs, micro_targets, weights) in enumerate(self._split(batch, groups)):
            self.values[BatchInput(model, step, group)] = micro_inputs
            self.values[BatchTargets(model, step, group)] = micro_targets
            self.weights[(model, step, group)] = weights
        self._opened(model, step)
        return True

    def _split(self, batch: tuple[Any, Any], groups: int) -> list[tuple[list[Any], list[Any], list[float]]]:
        """Per micro-batch group: its micro-batches' inputs, targets and loss weights."""
        inputs_, targets = batch
        sizes = split_sizes(batch_size(inputs_), self.microbatches)
        if len(sizes) == 1 and groups == 1:  # the common case, on the driver's critical path for small steps
            return [([inputs_], [targets], [1.0])]
        micro_inputs, micro_targets = split_tree(inputs_, sizes), split_tree(targets, sizes)
        weights = loss_weights(sizes)
        parts, first = [], 0
        for count in group_sizes(len(sizes), groups):
            chunk = slice(first, first + count)
            first += count
            parts.append((micro_inputs[chunk], micro_targets[chunk], weights[chunk]))
        return parts

    def _opened(self, model: int, step: int) -> None:
        if self.on_batch is not None:
            self.on_batch(model, step)
        self.steps_fetched[model] += 1

    def _fetch_span(self, model: int, span: int) -> None:
        """The mini-batches of the consecutive steps of the model's next span, for one multi-step task of a
        resident model (one group), shipped stacked where the steps' batches have one layout (see shipping)."""
        first, depth = self.state.next_span(model)
        feed = self.feeds[model]
        span_inputs, span_targets, span_weights = [], [], []
        for step in range(first, first + depth):
            batch = feed.get(step)
            if batch is None:
                break
            [(micro_inputs, micro_targets, weights)] = self._split(batch, 1)
            span_inputs.append(micro_inputs)
            span_targets.append(micro_targets)
            span_weights.append(weights)
            self._opened(model, step)
        if not span_inputs:
            self.state.end_of_data(model)
            return
        self.values[BatchInput(model, span)] = self.batch_files.ship_steps(span_inputs)
        self.values[BatchTargets(model, span)] = self.batch_files.ship_steps(span_targets)
        self.weights[(model, span, 0)] = span_weights
        self.state.add_batch(model, span, len(span_inputs))
        if len(span_inputs) < depth:
            self.state.end_of_data(model)

    def _measured(self, model: int) -> None:
        """Tell the binding state the step time the model's finished spans measured on their device (the
        seconds and steps its tasks added up in the host store, see bodies), so that it re-cuts the later ones."""
        timing = self.store.attach(span_timing_name(model), SPAN_TIMING_BYTES)  # the store keeps the mapping
        seconds, steps = timing.view(torch.float64).tolist()
        self.state.measured(model, seconds, int(steps))

    def _submit(self, task: TaskId, device: str) -> Future:
        packs = self.state.models[task.model].packs
        reads = inputs(task, packs)
        local = {dep for dep in {*reads, *self.state.dependencies(task)} if self._worker_orders(task, dep, device)}
        args: list[Any] = [
            LocalResult(value.key(self.run)) if value in local else self.values[value]  # type: ignore[union-attr]
            for value in reads
        ]
        peers = tuple(isinstance(value, TaskId) and self.device_of[value] != device for value in reads)
        if task.kind == "bwd":
            last = task.pack == packs - 1
            args.append(self.weights[(task.model, task.step, task.group)] if last else [])
        after = self._order(task, device, reads, local)
        span = self.state.span(task.model, task.step)
        extra = {"span": span} if span is not None else {}
        future = self.client.submit(
            BODIES[task.kind],
            self.run,
            task.model,
            task.pack,
            task.step,
            *args,
            after=after,
            peers=peers,
            successor=successor(task, packs),
            group=task.group,
            key=task.key(self.run),
            workers=[self.workers[device]],
            allow_other_workers=False,
            pure=False,
            priority=1 if task.kind == "upd" else -self.submitted,
            **extra,
        )
        self.values[task] = future
        self.device_of[task] = device
        self.in_flight[future.key] = task
        self.submitted += 1
        return future

    def _order(self, task: TaskId, device: str, reads: tuple[Value, ...], local: set[Value]) -> list[Any]:
        """What task waits for besides its arguments: futures of tasks on other devices it does not read (the
        scheduler holds it until they finish; it inherits those its local dependencies wait for), and the names
        of unfinished tasks before it on this device (the worker checks they ran, see handoff), whose results
        stay held until task finishes."""
        read_edges = {
            value: (self.values[value], self.device_of[value])
            for value in reads
            if isinstance(value, TaskId) and value not in local
        }
        edges: dict[TaskId, tuple[Future, str]] = {}
        checks: list[LocalResult] = []
        holds: list[Future] = []
        for dep in self.state.dependencies(task):
            if dep not in self.state.bound:
                continue  # finished: nothing to wait for
            if dep in local:
                edges.update((edge, held) for edge, held in self.edges.get(dep, {}).items() if held[1] != device)
                holds.append(self.values[dep])
                if dep not in reads:
                    checks.append(LocalResult(dep.key(self.run)))
            elif dep not in reads:
                edges[dep] = (self.values[dep], self.device_of[dep])
        self.edges[task] = {**read_edges, **edges}
        self.holds[task] = holds
        return [*(future for edge, (future, _) in edges.items() if edge not in read_edges), *checks]

    def _worker_orders(self, task: TaskId, dep: Value, device: str) -> bool:
        """Whether the device's worker alone runs dep before task, with no edge through the scheduler.

        A producer bound to the same device is queued on its worker before task is, and the worker runs its
        tasks one at a time in submission order (see handoff): task then reads dep's result from the worker's
        memory and starts the moment the tasks before it end, instead of being sent once the scheduler has
        heard that dep finished. vDP's upd tasks, which run before other tasks on a worker (Dask priority),
        keep their edges.
        """
        return isinstance(dep, TaskId) and task.kind != "upd" and self.device_of.get(dep) == device

    def _bind_all(self, pending: as_completed) -> None:
        progress = True
        while progress:
            progress = False
            for device in self.state.devices:
                task = self.state.bind(device)
                if task is not None:
                    pending.add(self._submit(task, device))
                    progress = True

    def run_to_completion(self) -> None:
        """Bind, submit and complete tasks until every model has trained all its steps."""
        pending = as_completed()
        self._fetch_batches()
        self._bind_all(pending)
        while not self.state.finished:
            if not self.in_flight:
                raise RuntimeError("harmony driver: no task in flight and none ready before training finished")
            future = next(pending)
            raise_if_interrupted()  # a Ctrl-C that Python swallowed (see interrupt)
            task = self.in_flight.pop(future.key)
            self.edges.pop(task, None)
            self.holds.pop(task, None)
            if future.status == "error":
                error = future.exception()
                if isinstance(error, ModelFailure):
                    raise error
                raise error.with_traceback(future.traceback())
            done_before, trained_before = self.state.steps_done[task.model], self.state.trained[task.model]
            for value in self.state.complete(task):
                self.batch_files.release(self.values.pop(value, None))
                if isinstance(value, TaskId):
                    self.device_of.pop(value, None)
                if isinstance(value, BatchTargets):
                    self.weights.pop((value.model, value.step, value.group), None)
            now = time.perf_counter() - self.started
            if self.state.steps_done[task.model] > done_before:
                self.step_seconds[task.model].extend([now] * (self.state.trained[task.model] - trained_before))
                if self.state.spans[task.model].adaptive:
                    self._measured(task.model)
            self.tasks_run += 1
            total = self.state.total_steps(task.model)
            if total is not None and self.state.steps_done[task.model] >= total:
                self.finish_seconds.setdefault(task.model, now)
            if self.on_progress is not None:
                self.on_progress(self.state, self.tasks_run)
            self._fetch_batches()
            self._bind_all(pending)

    def cancel(self) -> None:
        """Cancel whatever is still in flight and drop every value."""
        futures = [value for value in self.values.values() if isinstance(value, Future)]
        if futures:
            self.client.cancel(futures)
        for value in self.values.values():
            self.batch_files.release(value)
        self.values.clear()
        self.in_flight.clear()
        self.edges.clear()
        self.holds.clear()
