"""The driver: a client-side late-binding loop that keeps a few tasks in flight on every device.

It carries out what the pure BindingState decides: fetch the batches it asks for, submit each bound
task to Dask restricted to its device's worker (``fwd-m3-p2-s17-<run>`` keys, pure=False), and on
every completion report back and drop the futures of values nobody will read again. vDP's upd tasks go
before other ready tasks on a worker (Dask priority), since the next step waits for them. A task may be
submitted while its dependencies still run; those it does not read (the task that updated a pack, before
the next step's forward of it) are passed as ``after=`` futures so that Dask orders them too. Activations flow
worker to worker as Dask results; nothing large passes through the driver. Each step's (or span's)
mini-batch is written once into a host-store file that its tasks name (see shipping), and the file is
removed when its last reader has finished.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from distributed import Client, Future, as_completed

from harmony.runtime import bodies
from harmony.runtime.data import SharedFeed, batch_size, split_tree
from harmony.runtime.errors import ModelFailure
from harmony.runtime.hoststore import HostStore
from harmony.runtime.shipping import discard, ship
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
        self.state = state
        self.feeds = feeds
        self.workers = workers
        self.microbatches = microbatches
        self.on_batch = on_batch
        self.on_progress = on_progress
        self.values: dict[Value, Any] = {}
        self.weights: dict[tuple[int, int], list[float]] = {}
        self.in_flight: dict[str, TaskId] = {}
        self.device_of: dict[TaskId, str] = {}
        self.tasks_run = 0
        self.started = time.perf_counter()
        self.finish_seconds: dict[int, float] = {}
        self.step_seconds: list[list[float]] = [[] for _ in feeds]
        self.spans: dict[tuple[int, int], tuple[int, int]] = {}
        self.steps_fetched = [0] * len(feeds)

    def _fetch_batches(self) -> None:
        """Open every step the binding state wants open now (a model may open two at once: at the start, and
        when a finished step lets the one after the next open)."""
        wanted = self.state.wanted_batches()
        while wanted:
            for model, step in wanted:
                depth = self.state.models[model].depth
                if depth > 1:
                    self._fetch_span(model, step, depth)
                elif self._fetch_step(model, step):
                    self._ship(model, step, self.state.models[model].groups)
                    self.state.add_batch(model, step)
                else:
                    self.state.end_of_data(model)
            wanted = self.state.wanted_batches()

    def _ship(self, model: int, step: int, groups: int) -> None:
        """Pack a step's (or a span's) batches for their tasks once, however many tasks read them."""
        for group in range(groups):
            for kind in (BatchInput, BatchTargets):
                value = kind(model, step, group)
                name = f"batch-m{model}-s{step}-g{group}-{kind.__name__}"
                self.values[value] = ship(self.values[value], self.store, name)

    def _fetch_step(self, model: int, step: int) -> bool:
        """Split one step's mini-batch into its micro-batch groups; False when the loader has run dry."""
        batch = self.feeds[model].get(step)
        if batch is None:
            return False
        inputs_, targets = batch
        sizes = split_sizes(batch_size(inputs_), self.microbatches)
        micro_inputs, micro_targets = split_tree(inputs_, sizes), split_tree(targets, sizes)
        weights = loss_weights(sizes)
        groups = self.state.models[model].groups
        first = 0
        for group, count in enumerate(group_sizes(len(sizes), groups)):
            chunk = slice(first, first + count)
            first += count
            self.values[BatchInput(model, step, group)] = micro_inputs[chunk]
            self.values[BatchTargets(model, step, group)] = micro_targets[chunk]
            self.weights[(model, step, group)] = weights[chunk]
        if self.on_batch is not None:
            self.on_batch(model, step)
        self.steps_fetched[model] += 1
        return True

    def _fetch_span(self, model: int, span: int, depth: int) -> None:
        """The mini-batches of depth consecutive steps, for one multi-step task of a resident model."""
        first = span * depth
        steps = []
        for step in range(first, first + depth):
            if not self._fetch_step(model, step):
                break
            steps.append(step)
        if not steps:
            self.state.end_of_data(model)
            return
        for kind in (BatchInput, BatchTargets):
            self.values[kind(model, span)] = [self.values.pop(kind(model, step)) for step in steps]
        self.weights[(model, span, 0)] = [self.weights.pop((model, step, 0)) for step in steps]
        self.spans[(model, span)] = (first, len(steps))
        self._ship(model, span, 1)
        self.state.add_batch(model, span)
        if len(steps) < depth:
            self.state.end_of_data(model)

    def _submit(self, task: TaskId, device: str) -> Future:
        packs = self.state.models[task.model].packs
        reads = inputs(task, packs)
        args: list[Any] = [self.values[value] for value in reads]
        peers = tuple(isinstance(value, TaskId) and self.device_of[value] != device for value in reads)
        if task.kind == "bwd":
            last = task.pack == packs - 1
            args.append(self.weights[(task.model, task.step, task.group)] if last else [])
        data = set(reads)
        bound = self.state.bound
        after = [
            self.values[dep]
            for dep in self.state.dependencies(task)
            if dep not in data and dep in bound and not self._worker_orders(task, dep, device)
        ]
        span = self.spans.get((task.model, task.step))
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
            priority=1 if task.kind == "upd" else 0,
            **extra,
        )
        self.values[task] = future
        self.device_of[task] = device
        self.in_flight[future.key] = task
        return future

    def _worker_orders(self, task: TaskId, dep: TaskId, device: str) -> bool:
        """Whether the device's worker alone runs dep before task, with no edge through the scheduler.

        A resident model's tasks all run on its home worker, one at a time, and read nothing from each other
        but the device state: the worker runs its queued tasks in submission order (Dask priority), so the
        next task waits in its queue and starts the moment the one before ends, instead of being sent only once
        the scheduler has heard that its dependency finished (a round trip per task). The body checks the order
        (a task that finds its model's previous step not yet applied is rescheduled).
        """
        return task.model in self.state.homes and self.device_of.get(dep) == device

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
            task = self.in_flight.pop(future.key)
            if future.status == "error":
                error = future.exception()
                if isinstance(error, ModelFailure):
                    raise error
                raise error.with_traceback(future.traceback())
            done_before = self.state.steps_done[task.model]
            for value in self.state.complete(task):
                discard(self.values.pop(value, None), self.store)
                if isinstance(value, TaskId):
                    self.device_of.pop(value, None)
                if isinstance(value, BatchTargets):
                    self.weights.pop((value.model, value.step, value.group), None)
            now = time.perf_counter() - self.started
            if self.state.steps_done[task.model] > done_before:
                _, count = self.spans.pop((task.model, task.step), (task.step, 1))
                self.step_seconds[task.model].extend([now] * count)
            self.tasks_run += 1
            total = self.state.total_steps[task.model]
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
            discard(value, self.store)
        self.values.clear()
        self.in_flight.clear()
