"""The driver: carries out what the binding state decides, on a connected Dask cluster, and reports what happens.

It keeps no scheduling state of its own: every event (a batch fetched, a task finished or failed, a span timed)
goes to the pure ``BindingState``, and every instruction that comes back is done here: fetch a span's batches
from the loader and write them into a host-store file that its tasks name (see shipping), submit a task to its
device's worker (``fwd-m3-p2-s17-<run>`` keys, ``pure=False``, restricted to that worker), release a value, read
a span's timing. What it holds is the I/O's handles: the futures and shipped batches of values still read.

A worker runs its tasks one at a time in the order they were bound (each task's Dask priority), except vDP's upd
tasks, which go first since the next span waits for them. A dependency on the same device has no edge through
the scheduler: the task names it and reads its result from the worker's memory (see handoff); one on another
device is a Dask edge, an argument when the task reads its result and an ``after=`` future when it only must
finish first. Activations flow worker to worker as Dask results; nothing large passes through the driver.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from distributed import Client, Future, as_completed

from harmony.runtime import bodies
from harmony.runtime.data import SharedFeed, batch_size, split_tree
from harmony.runtime.files import SPAN_TIMING_BYTES, span_timing_name
from harmony.runtime.handoff import LocalResult
from harmony.runtime.hoststore import HostStore
from harmony.runtime.interrupt import raise_if_interrupted
from harmony.runtime.shipping import BatchFiles
from harmony.tasks.binding import BindingState
from harmony.tasks.events import (
    BatchReady,
    Event,
    Fail,
    Fetch,
    Instruction,
    ReadTiming,
    Release,
    StepTimed,
    Submit,
    TaskFailed,
    TaskFinished,
)
from harmony.tasks.graph import BatchInput, BatchTargets, Value, parse_key
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
        on_step: Callable[[int, int], None] | None = None,
        on_progress: Callable[[BindingState], None] | None = None,
    ) -> None:
        self.client = client
        self.run = run
        self.store = store
        self.batch_files = BatchFiles(store)
        self.state = state
        self.feeds = feeds
        self.workers = workers
        self.microbatches = microbatches
        self.on_step = on_step
        self.on_progress = on_progress
        self.values: dict[Value, Any] = {}
        self.loss_weights: dict[BatchTargets, list[Any]] = {}
        self.pending: as_completed | None = None
        self.started = time.perf_counter()

    def run_to_completion(self) -> None:
        """Carry out the state's instructions and report every finished task until every model has trained."""
        self.pending = as_completed()
        self._carry_out(self.state.start())
        while not self.state.finished:
            if not self.state.bound:
                raise RuntimeError("harmony driver: no task in flight and none ready before training finished")
            future = next(self.pending)
            raise_if_interrupted()  # a Ctrl-C that Python swallowed (see interrupt)
            self._carry_out(self.state.handle(self._outcome(future)))
            if self.on_progress is not None:
                self.on_progress(self.state)

    def _outcome(self, future: Future) -> Event:
        parsed = parse_key(future.key)
        assert parsed is not None, f"not a task of this run: {future.key}"
        task, _ = parsed
        at = time.perf_counter() - self.started
        if future.status == "error":
            return TaskFailed(task, future.exception().with_traceback(future.traceback()), at)
        return TaskFinished(task, at)

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
            self.batch_files.release(self.values.pop(instruction.value, None))
            if isinstance(instruction.value, BatchTargets):
                self.loss_weights.pop(instruction.value, None)
        elif isinstance(instruction, Fetch):
            return self._fetch(instruction)
        elif isinstance(instruction, ReadTiming):
            timing = self.store.attach(span_timing_name(instruction.model), SPAN_TIMING_BYTES)
            seconds, steps = timing.view(torch.float64).tolist()
            return StepTimed(instruction.model, seconds, int(steps))
        elif isinstance(instruction, Fail):
            raise instruction.error
        else:
            raise TypeError(f"not an instruction: {instruction!r}")
        return None

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
        for group in range(fetch.groups):
            inputs_ = BatchInput(fetch.model, fetch.span, group)
            targets = BatchTargets(fetch.model, fetch.span, group)
            if fetch.stacked:
                self.values[inputs_] = self.batch_files.ship_steps([parts[group][0] for parts in steps])
                self.values[targets] = self.batch_files.ship_steps([parts[group][1] for parts in steps])
                self.loss_weights[targets] = [parts[group][2] for parts in steps]
            else:
                [parts] = steps
                self.values[inputs_] = self.batch_files.ship(parts[group][0])
                self.values[targets] = self.batch_files.ship(parts[group][1])
                self.loss_weights[targets] = parts[group][2]
        return BatchReady(fetch.model, fetch.span, len(steps))

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

    def _submit(self, submit: Submit) -> None:
        task = submit.task
        args: list[Any] = [
            LocalResult(value.key(self.run)) if value in submit.local else self.values[value]  # type: ignore[union-attr]
            for value in submit.reads
        ]
        if task.kind == "bwd":
            targets = BatchTargets(task.model, task.span, task.group)
            args.append(self.loss_weights[targets] if targets in submit.reads else [])
        after = [self.values[dep] for dep in submit.after] + [LocalResult(dep.key(self.run)) for dep in submit.checks]
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
            key=task.key(self.run),
            workers=[self.workers[submit.device]],
            allow_other_workers=False,
            pure=False,
            priority=submit.priority,
        )
        self.values[task] = future
        if self.pending is not None:
            self.pending.add(future)

    def cancel(self) -> None:
        """Cancel whatever is still in flight and drop every value."""
        futures = [value for value in self.values.values() if isinstance(value, Future)]
        if futures:
            self.client.cancel(futures)
        for value in self.values.values():
            self.batch_files.release(value)
        self.values.clear()
        self.loss_weights.clear()
