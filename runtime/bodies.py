"""Task bodies that device workers run: fwd, bwd and upd of one pack of one job for one span of steps.

fwd runs every micro-batch of the step through the pack with its weights swapped in once and returns the
outputs (the next pack's boundary inputs) as host copies. A boundary value (an output, or an input's
gradient in bwd) also stays on the device, where it fits, for the task that reads it next: if that task
starts there next it takes it instead of copying the host copy in; any other task drops it. bwd recomputes the
pack from its boundary inputs and backpropagates each micro-batch, accumulating weight gradients on
the device, and sends them to the host store once; the last pack's bwd runs forward, loss and
backward together, and with one micro-batch group a bwd then steps the pack's optimizer on the host store;
with several (vDP), or with the job's updates overlapped, an upd task does, on a host thread beside the device
(reducing the groups' gradients first). A homed model's weights, gradients and optimizer state stay on its home
device for the whole run, and its bwd applies its updates there. A fused array is one job here whose loss is a
vector (one per member). A boundary value between packs (and its gradient) is a tensor or a tuple of them.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from distributed import Reschedule, get_worker, secede
from torch.utils._pytree import tree_leaves, tree_map

from harmony.runtime import shipping
from harmony.runtime.array import sized
from harmony.runtime.cache import Reservation, Spilled, Taken
from harmony.runtime.clipping import on_device
from harmony.runtime.collector import collected_ns
from harmony.runtime.divergence import Diverged, first_not_finite
from harmony.runtime.errors import ModelFailure
from harmony.runtime.files import SPAN_TIMING_BYTES, grad_norms_name, losses_name, record_rows, span_timing_name
from harmony.runtime.handoff import receive, wait_for
from harmony.runtime.homed import HomedModel
from harmony.runtime.hoststore import tensor_at, tensors_at
from harmony.runtime.peer import files_read, received_bytes
from harmony.runtime.reparametrize import bound
from harmony.runtime.rows import Rows, gaps
from harmony.runtime.scaler import finite
from harmony.runtime.seeding import begin, microbatch_number
from harmony.runtime.spec import PackRuntime
from harmony.runtime.stages import ShapeError
from harmony.runtime.stash import Stash, detached, stash_key, worth_stashing
from harmony.runtime.worker import RunContext, context
from harmony.tasks import graph
from harmony.tasks.graph import TaskId, key_attempt, updates_in_backward
from harmony.tasks.memory import BudgetExceeded

Result = TypeVar("Result")


def _begin(ctx: RunContext, model: int, pack: int, step: int, group: int, index: int) -> None:
    """Set the random streams (runtime.seeding) for the index-th micro-batch of a group through a pack at a step."""
    spec = ctx.spec.models[model]
    begin(ctx.device, spec.seed, step, microbatch_number(group, index, spec.groups), spec.packs[pack].first)


def task_body(kind: str, host: bool = False) -> Callable[[Callable[..., Result]], Callable[..., Result]]:
    """Look the run up, take the task's inputs (results of earlier tasks on this worker are read from its
    memory, see handoff), give torch the device's threads, time the task, and report user errors by model.

    A host task (upd) leaves the worker's task thread as soon as it starts (Dask's secede): it runs on a thread
    of its own while the worker goes on with the device's next task, and does not count as the device's busy
    time (its timeline has it, by its key).

    ``first`` is the training step the task starts at and ``steps``, for a multi-step task, how many it runs
    (its data then per step); ``after`` holds the results of tasks on other devices that must finish first
    without being read (Dask waits for them) and the names of such tasks on this worker (a task that finds one
    not yet run goes back); ``peers`` flags the arguments that another device produced, whose bytes count as
    device to device; ``successor`` is the task that follows in the model's chain, whose weights the body may
    prefetch; ``group`` is the micro-batch group (vDP) whose micro-batches the task runs.
    """

    def decorate(body: Callable[..., Result]) -> Callable[..., Result]:
        @functools.wraps(body)
        def run(
            run_id: str,
            model: int,
            pack: int,
            span: int,
            *args: Any,
            first: int,
            steps: int | None = None,
            after: list[Any] | None = None,
            peers: tuple[bool, ...] = (),
            successor: TaskId | None = None,
            group: int = 0,
        ) -> Result:
            ctx = context(run_id)
            where = f"{kind} of pack {pack} at step {first} on {ctx.device_spec.name}"
            with _failures(model, where, Reschedule):
                for earlier in after or ():
                    wait_for(earlier, ctx.finished, ctx.early_starts)
                values = [receive(arg, ctx.finished, ctx.early_starts) for arg in args]
                received = [ctx.read(value) for value in values]
            key = str(get_worker().get_current_task())  # with its attempt's suffix: what local readers name
            if host:
                secede()
                began = time.time()
                ctx.counters.updating(model, True)  # a death beside it may be its doing (tasks.binding)
                try:
                    with _failures(model, where, ModelFailure, Reschedule), ctx.profiler.task(key, model, first):
                        return body(ctx, model, pack, span, *received, group=group, first=first, steps=steps)
                finally:
                    ctx.counters.updating(model, False)
                    ctx.timeline.append((key, began, time.time(), 0.0))
            ctx.successor = successor
            ctx.attempt = key_attempt(key)
            ctx.files = files_read(values)
            key_of = (kind, model, pack) if kind in ("fwd", "bwd") and steps is None else None  # runtime.threads
            ctx.use_threads(key_of)
            waited = ctx.counters.values["wait_ns"]
            collecting = collected_ns()
            began = time.time()
            started = time.perf_counter_ns()
            p2p, remote = received_bytes(values, received, peers, ctx.device.type == "cpu")
            ctx.counters.add("p2p", p2p)
            ctx.counters.add("remote", remote)
            ctx.counters.mark("executing", model + 1)  # whose task a death here interrupts (tasks.binding)
            try:
                with (
                    _failures(model, where, BudgetExceeded, ModelFailure, Reschedule, Dropped),
                    ctx.profiler.task(key, model, first),
                ):
                    result = body(ctx, model, pack, span, *received, group=group, first=first, steps=steps)
                    ctx.cache.settle()
                ctx.finished.add(key)
                return ctx.export(key, result) if kind in ("fwd", "bwd") else result
            finally:
                ctx.counters.set("executing", 0)
                ctx.counters.add("busy_ns", time.perf_counter_ns() - started)
                ctx.counters.add("gc_ns", collected_ns() - collecting)
                ctx.timeline.append((key, began, time.time(), (ctx.counters.values["wait_ns"] - waited) / 1e9))
                ctx.counters.add("tasks", 1)
                ctx.counters.set("used", ctx.cache.memory.used)
                ctx.counters.raise_to("reserved", ctx.cache.reserved())
                ctx.counters.publish()

        return run

    return decorate


HARMONY = tuple(Path(module.__file__).resolve().parent for module in (sys.modules["harmony"], graph, shipping))


class Dropped(RuntimeError):
    """The running task is no longer wanted: the driver dropped it (its span runs again as a new attempt, see
    Attempt, or its job failed) while it ran, and Dask lets a running task go on. It stops at its next micro-batch;
    Dask throws away whatever a dropped task ends with."""


def _stop_if_dropped() -> None:
    """Raise Dropped where Dask has cancelled the task this thread runs (its key released while it runs)."""
    worker = get_worker()
    state = worker.state.tasks.get(worker.get_current_task())
    if state is not None and state.state == "cancelled":
        raise Dropped(f"{state.key} was dropped while it ran")


@contextmanager
def _failures(model: int, where: str, *passing: type[BaseException]) -> Iterator[None]:
    """Raise what the block raises as _failure maps it, but the exceptions passing (as they are)."""
    try:
        yield
    except passing:
        raise
    except Exception as error:
        raise _failure(model, where, error) from None


def _failure(model: int, where: str, error: Exception) -> Exception:
    """A task's exception as the driver should see it: the model's own failure (raised in its code, or in torch
    under it, or its inputs of shapes its exported graph does not hold for), which stops that model alone; or,
    raised in Harmony's own code, an error that ends the run."""
    frames = traceback.extract_tb(error.__traceback__)
    if frames and Path(frames[-1].filename).resolve().parent in HARMONY and not isinstance(error, ShapeError):
        return RuntimeError(f"harmony failed in {where} for job {model}: {type(error).__name__}: {error}\n"
                            f"{traceback.format_exc()}")
    return ModelFailure(model, where, f"{type(error).__name__}: {error}", traceback.format_exc())


@task_body("fwd")
def forward(
    ctx: RunContext, model: int, pack: int, span: int, inputs: list[Any], group: int, first: int, steps: None
) -> list[Any]:
    """One step's micro-batches through the packs of a section (pack is the section's index), each pack's weights
    at that step's version, swapped in once; the buffers they update (running statistics; with micro-batch groups,
    group 0's) go into the next version's slot; the packs the plan stashes keep their activations for their backward.
    Returns the last pack's outputs."""
    this = Attempt(TaskId("fwd", model, pack, span, group), ctx.attempt)
    ctx.cache.drop_boundaries(this)
    section = ctx.spec.models[model].section(pack)
    values = inputs
    for index in section:
        values = _forward_pack(ctx, model, index, first, values, group, claim=this if index == section[0] else
                               Within(this, index), keep=_next(ctx) if index == section[-1] else
                               Within(this, index + 1), following=index + 1 if index < section[-1] else None,
                               stash=True)
    return values


@dataclass(frozen=True)
class Attempt:
    """One attempt of a task: whom a boundary value kept on the device is for. When a worker is lost its jobs' open
    spans run again, every task of a span as one new attempt (tasks.binding); an earlier attempt may still be running
    elsewhere, its inputs released under it (runtime.peer), so a value or a stash one attempt leaves on a device is
    never read by another."""

    task: TaskId
    number: int


def _next(ctx: RunContext) -> Attempt | None:
    """The running task's successor, in the same attempt (it is of the same span)."""
    return None if ctx.successor is None else Attempt(ctx.successor, ctx.attempt)


@dataclass(frozen=True)
class Within:
    """The consumer of a boundary value that stays inside its task: the task's pack that reads it next (a value
    kept on the device between the packs of one section, see DeviceCache.keep)."""

    task: Attempt
    pack: int
    gradient: bool = False


def _forward_pack(
    ctx: RunContext, model: int, pack: int, step: int, inputs: list[Any], group: int, claim: Any, keep: Any,
    following: int | None, recompute: bool = False, stash: bool = False, again: bool = False,
) -> list[Any]:
    """Every micro-batch through one pack, its weights swapped in once: the outputs as host copies (or handed on,
    below), each also kept on the device for keep where it fits; an input kept for claim is taken from the device.
    While it computes the weights of the pack following it in the task (else the next task's) are copied in. With
    stash (the step's forward, not a recompute) and the plan stashing the pack, each micro-batch runs with autograd
    and its activations stay on the device for the pack's backward where they fit (runtime.stash); else without
    gradients. A forward recomputed in bwd (recompute) leaves the buffers as it found them; else they go into the
    next slot.
    Outputs for a later pack of the task (keep a Within) are handed on (DeviceCache.hand_on), not copied out; with
    again (a bwd's forward, whose pack's backward reads its inputs once more), an input taken from the device is
    copied out first, as it is before the forward (which may change it in place: an in-place ReLU, a residual
    sum), for that backward."""
    runtime = ctx.spec.models[model].packs[pack]
    host = ctx.device_source(model, pack, step)
    buffers = runtime.device_buffers_offset
    rows = ctx.training_rows(model, step)
    stashing = (stash and runtime.stash and worth_stashing(ctx.cache.missed.get((model, pack)), step)
                and (rows is None or rows.viewed))  # copies of rows are made per call, not kept in a stash
    outputs = []
    with (ctx.cache.weights((model, pack), step, host, ctx.part(model, pack, rows)) as weights,
          ctx.borrowed(model, pack, step) as borrowed, _computing(ctx, model, pack, rows)):
        if _weights_after(ctx, len(inputs)) is None:
            _prefetch(ctx, model, following, step, runtime.workspace)
        tensors = _views(rows, {**tensors_at(weights, runtime.device_weights), **borrowed})
        start = weights[buffers:].clone() if runtime.has_buffers else None
        kind = "activations" if pack else "inputs"
        for index, microbatch in enumerate(inputs):
            _stop_if_dropped()
            if index and not ctx.spec.group:
                ctx.cache.reload((model, pack), host)
            kept = ctx.cache.claim(claim, index)
            fetched = ctx.cache.take(_ahead_key(model, pack, "input", index))
            more = index + 1 < len(inputs)
            with ctx.cache.scratch(runtime.workspace, f"activations of pack {pack}") as reserved, torch.no_grad():
                x = kept if kept is not None else fetched
                if x is None:
                    x = ctx.cache.copy_in(microbatch, kind)
                if again and kept is not None and isinstance(microbatch, Spilled):
                    microbatch.value = ctx.cache.copy_out(x, "activations")
                ahead = _ahead(ctx, model, pack, "input", index + 1, inputs, kind, claim, reserved) if more else 0
                if index == _weights_after(ctx, len(inputs)):
                    _prefetch(ctx, model, following, step, keep_free=0)  # the workspace is held
                later = max(runtime.workspace - ahead, 0) if more else 0  # the next micro-batch reserves
                _begin(ctx, model, pack, step, group, index)
                if stashing:
                    made = Stash(tensors, [slot.spec.name for slot in runtime.grads.slots])
                    y = made.forward(ctx.call(model, pack), x, ctx.autocast(), _track if pack else _untracked)
                    if not made.pinned:
                        ctx.cache.stash(stash_key(model, pack, step, group, index, ctx.attempt), (model, pack), step,
                                        made, made.nbytes, reserved, keep_free=later)
                    del made  # a stash the cache did not keep is freed here, inside the reservation
                    y = detached(y)
                else:
                    with _selected(rows, tensors, runtime) as chosen, ctx.autocast():
                        y = ctx.call(model, pack)(chosen, x)
                if not isinstance(keep, Within):  # a later pack of this task reads it from the device (hand_on)
                    outputs.append(ctx.cache.send(y, "activations", reserved))
            if recompute and start is not None:
                weights[buffers:].copy_(start)
            if isinstance(keep, Within):
                outputs.append(ctx.cache.hand_on(keep, index, y, keep_free=later))
            elif keep is not None:
                ctx.cache.keep(keep, index, y, keep_free=later, sent=outputs[-1])
        if start is not None and not recompute:
            with ctx.writing(model, pack, step) as current:
                _buffers_out(ctx, model, pack, step, group, weights, start, current)
    return ctx.cache.arrived(outputs)


def _weights_after(ctx: RunContext, microbatches: int) -> int | None:
    """The micro-batch during which the next weights are prefetched, where values are copied ahead: the link
    carries one copy at a time each way, so they go once the values the pack reads sooner are on their way (the
    last micro-batch's, copied in ahead during the one before it). None: as the pack starts, beside the room its
    micro-batches will reserve."""
    return max(microbatches - 2, 0) if ctx.cache.copies_ahead else None


def _ahead_key(model: int, pack: int, what: str, microbatch: int) -> tuple[Any, ...]:
    """Where the copy engine leaves a micro-batch's value (what: its "input", or its "upstream" gradient or
    target) copied in ahead of it (DeviceCache.ahead)."""
    return ("ahead", model, pack, what, microbatch)


def _ahead(ctx: RunContext, model: int, pack: int, what: str, microbatch: int, values: list[Any], kind: str,
           claim: Any, reservation: Reservation | None = None) -> int:
    """Copy values[microbatch] in while the micro-batch before it computes (in room its forward's reservation
    leaves, where given), unless it is kept on the device for claim; the bytes that copy holds from now (0: none
    started)."""
    if claim is not None and ctx.cache.kept(claim, microbatch):
        return 0
    return ctx.cache.ahead(_ahead_key(model, pack, what, microbatch), values[microbatch], kind, reservation)


def _buffers_out(
    ctx: RunContext, model: int, pack: int, step: int, group: int, weights: torch.Tensor, start: torch.Tensor,
    current: bool,
) -> None:
    """After a step's forward through a pack: its buffers (running statistics) into the next version's slot (with
    micro-batch groups, vDP, group 0's, as DDP keeps rank 0's) where the pack is still at step's version (current,
    under RunContext.writing), and the cached copy back to its own version's (start), which an evaluation of that
    step may read next. A fused array's members not training at step keep their rows as they were (start): the
    forward computed them, or not (runtime.rows), but a stopped member's statistics stay as they were when it
    stopped, as a plain loop's stay once it stops calling that model."""
    spec = ctx.spec.models[model]
    runtime = spec.packs[pack]
    device = weights[runtime.device_buffers_offset :]
    training = ctx.members(model).training(step) if spec.members > 1 else []
    idle = [member for member in range(spec.members) if member not in training] if training else []
    if idle:
        index = torch.tensor(idle, device=weights.device)
        for slot in runtime.device_buffers:
            before = tensor_at(start, replace(slot, offset=slot.offset - runtime.device_buffers_offset))
            tensor_at(weights, slot).index_copy_(0, index, before.index_select(0, index))
    if group == 0 and current:
        following_slot = ctx.next_weights(model, pack, step)
        ctx.cache.write_back(device, following_slot[runtime.buffers_offset :], "buffers")
    device.copy_(start)


def _prefetch(ctx: RunContext, model: int, pack: int | None, version: int, keep_free: int) -> None:
    """Copy in the weights the running task reads next: those of pack (of the same task) if given, else the next
    task's."""
    if pack is None:
        ctx.prefetch_next(keep_free=keep_free)
    else:
        ctx.prefetch_pack(model, pack, version, keep_free)


@task_body("bwd")
def backward(
    ctx: RunContext,
    model: int,
    pack: int,
    span: int,
    inputs: list[Any],
    gradients_or_targets: list[Any],
    loss_weights: list[Any],
    group: int,
    first: int,
    steps: int | None,
) -> list[Any] | None:
    """Backward of the packs of a section (pack is its index) for step first, or, with steps, of a homed model's
    last (only) pack for that many consecutive steps from first, inputs, targets and loss weights given per step. A
    homed model's updates all run here, on its device, after each step's backward; a swapped model's with one group
    run here too, on the host store, once each pack's gradients are out, unless they are overlapped.

    Over several packs, the inputs of every pack but the last are recomputed first (forward, no gradients; in the
    last section, which has no fwd task, this is the step's forward, whose buffers go into the next slot), then
    each pack from the last backpropagates as a one-pack task would, its input's gradient the upstream gradient
    of the pack before it."""
    spec = ctx.spec.models[model]
    this = Attempt(TaskId("bwd", model, pack, span, group), ctx.attempt)
    ctx.cache.drop_boundaries(this)
    if spec.home is not None:
        return _homed_backward(ctx, model, first, steps, inputs, gradients_or_targets, loss_weights, group)
    section = spec.section(pack)
    last_section = section[-1] == len(spec.packs) - 1
    with _section_stashes(ctx, model, section, first, group, len(inputs), last_section) as taken:
        boundaries = {section[0]: inputs}
        section_input = this if last_section else None  # what fwd kept for this task; else an upstream gradient
        for index in section[:-1]:
            if taken is not None:  # every later pack's stash is here: no input to recompute
                boundaries[index + 1] = [None] * len(inputs)
                continue
            boundaries[index + 1] = _forward_pack(  # the last section has no fwd task: this is the step's forward
                ctx, model, index, first, boundaries[index], group, claim=section_input if index == section[0] else
                Within(this, index), keep=Within(this, index + 1), following=index + 1, recompute=not last_section,
                stash=last_section, again=True)
            if not last_section:
                ctx.counters.add("inputs_recomputed", len(inputs))
        upstream = gradients_or_targets
        for index in reversed(section):
            claim_input: Any = Within(this, index) if index != section[0] else (
                this if last_section and len(section) == 1 else None)
            claim_upstream: Any = Within(this, index, gradient=True) if index != section[-1] else (
                None if last_section else this)
            keep = _next(ctx) if index == section[0] else Within(this, index - 1, gradient=True)
            following = index - 1 if index > section[0] else None
            upstream = _backward_pack(ctx, model, index, span, first, boundaries[index], upstream, loss_weights,
                                      group, claim_input, claim_upstream, keep, following, taken)
    return upstream if section[0] > 0 else None


def _section_stashes(ctx: RunContext, model: int, section: range, step: int, group: int, microbatches: int,
                     last_section: bool) -> AbstractContextManager[Taken | None]:
    """The stashes of every pack but the first of a section that is not a pass's last, taken at once so that its
    bwd recomputes none of their inputs, where they are all here and the room its packs' backward needs beside
    them can still be had (nothing can then evict one before its use); else None, and the inputs are recomputed."""
    spec = ctx.spec.models[model]
    later = section[1:]
    if last_section or not later or not all(spec.packs[pack].stash for pack in later):
        return nullcontext(None)
    keys = [stash_key(model, pack, step, group, index, ctx.attempt) for pack in later for index in range(microbatches)]
    return ctx.cache.unstash_all(keys, max(_backward_bytes(ctx, model, pack) for pack in section))


def _backward_bytes(ctx: RunContext, model: int, pack: int) -> int:
    """What a pack's backward holds on its device: its weights (and those it borrows), gradients, workspace and,
    updated there, its optimizer state; over its buffers' real sizes, where the simulator counts the plan's
    (tasks.simulator._backward_bytes)."""
    spec = ctx.spec.models[model]
    runtime = spec.packs[pack]
    state = round(spec.state_ratio * runtime.grads.nbytes) if runtime.device_update else 0
    return spec.held_bytes(pack) + runtime.grads.nbytes + runtime.workspace + state


def _homed_backward(
    ctx: RunContext, model: int, first: int, steps: int | None, inputs: list[Any], targets: list[Any],
    loss_weights: list[Any], group: int,
) -> None:
    """A homed model's steps from first (its whole state on the device, its updates applied there)."""
    spec = ctx.spec.models[model]
    runtime = spec.packs[0]
    count = 1 if steps is None else steps
    if homed_span_applied(ctx.homed_next_step(model), first, count, model):
        return None
    if steps is not None:  # per step, taken as the steps run (a stacked span makes each step's views then)
        assert len(inputs) == len(targets) == len(loss_weights) == count, f"{count} steps of data"
        per_step: Iterable[tuple[Any, Any, Any]] = zip(inputs, targets, loss_weights)
    else:
        per_step = [(inputs, targets, loss_weights)]
    host = ctx.host_weights(model, 0, first)
    with ctx.cache.weights((model, 0), first, host) as weights:
        ctx.prefetch_next(keep_free=runtime.workspace)
        seconds, timed, diverged = _homed_steps(ctx, model, first, count, per_step, group, ctx.homed(model, weights))
        ctx.flush_homed(model)
        if diverged is not None:
            raise diverged
        if steps is not None:
            _record_span_timing(ctx, model, seconds, timed)
    return None


def _backward_pack(
    ctx: RunContext, model: int, pack: int, span: int, step: int, inputs: list[Any], gradients_or_targets: list[Any],
    loss_weights: list[Any], group: int, claim_input: Any, claim_upstream: Any, keep: Any, following: int | None,
    taken: Taken | None = None,
) -> list[Any]:
    """One swapped pack's backward for step: its weights swapped in once, its gradients accumulated over the
    micro-batches on the device and sent to the host store once (with those of the tied weights later packs
    borrow from it), then, with one group and updates not overlapped, its update on the host store, or, updated
    on the device, the update there instead of the gradients' trip. Returns its input's gradients (host copies,
    each also kept on the device for keep where it fits)."""
    spec = ctx.spec.models[model]
    runtime = spec.packs[pack]
    host = ctx.device_source(model, pack, step)
    rows = ctx.training_rows(model, step)
    part = ctx.part(model, pack, rows)
    with (
        ctx.cache.sparing((model, pack)),
        ctx.cache.weights((model, pack), step, host, part) as weights,
        ctx.cache.scratch(runtime.grads.nbytes, f"gradients of pack {pack}"),
        ctx.borrowed(model, pack, step) as borrowed,
        _computing(ctx, model, pack, rows),
    ):
        if _weights_after(ctx, len(inputs)) is None:
            _prefetch(ctx, model, following, step, runtime.workspace)
        grad_bytes = ctx.cache.zeros(runtime.grads.nbytes)
        tensors = _views(rows, {**tensors_at(weights, runtime.device_weights), **borrowed})
        last = pack == len(spec.packs) - 1
        start = weights[runtime.device_buffers_offset :].clone() if last and runtime.has_buffers else None
        grads = tensors_at(grad_bytes, runtime.grads)
        ctx.add_lent_grads(model, pack, group, grads)
        losses = StepLosses(1)
        input_grads = _backward_step(ctx, model, pack, span, step, weights, tensors, _views(rows, grads), inputs,
                                     gradients_or_targets, loss_weights, group, claim_input, claim_upstream, keep,
                                     functools.partial(_prefetch, ctx, model, following, step, 0), losses, rows,
                                     taken)
        if rows is not None:
            rows.clear(grads)
        if last:  # once its micro-batches are through, before anything is written or updated: one sync a step
            ctx.members(model).check(first_not_finite([part for part, _ in losses.parts[0]]), step)
        if last and group == 0:
            ctx.counters.add("computed", spec.members if rows is None else len(rows.computing))
        with ctx.writing(model, pack, step) as current:  # what the step's attempt computed, written once
            if current:
                if last:
                    _record_losses(ctx, model, step, group, losses.totals())
                if spec.scaled:
                    ctx.scaler(model).flag(step, pack, group, not finite(grads))
                if spec.clip and on_device(spec.groups):  # the host reads no gradient for the norm
                    ctx.record_norms(model, pack, step, grad_bytes)
                if not runtime.device_update or runtime.borrowed:  # a borrowed weight's gradient goes to its lender
                    _grads_out(ctx, model, pack, group, grad_bytes, None if part is None else rows)
            if start is not None:  # the last pack's forward ran here
                _buffers_out(ctx, model, pack, step, group, weights, start, current)
        if runtime.device_update:
            ctx.update_on_device(model, pack, step, weights, grad_bytes)
    if runtime.device_update:
        ctx.cache.drop((model, pack))  # stepped in place: no longer the version they are cached as
    elif updates_in_backward(spec.groups, spec.overlap):
        ctx.update(model, pack, step, ctx.files)
    return input_grads


def _grads_out(ctx: RunContext, model: int, pack: int, group: int, grad_bytes: torch.Tensor, rows: Rows | None
               ) -> None:
    """A pack's step's gradients into the host store: with rows (its weights copied in part, RunContext.part), the
    computed members' rows alone, the host's other rows zeroed (what the whole write of their zero rows left;
    runtime.rows); else all of them."""
    host = ctx.host_grads(model, pack, group)
    if rows is None:
        ctx.cache.write_back(grad_bytes, host, "grads")
        return
    spans = rows.spans(ctx.spec.models[model].packs[pack].grads)
    ctx.cache.write_back(grad_bytes, host, "grads", spans)
    for start, stop in gaps(spans, host.numel()):
        host[start:stop].zero_()


def _homed_steps(
    ctx: RunContext,
    model: int,
    first: int,
    count: int,
    per_step: Iterable[tuple[Any, Any, Any]],
    group: int,
    state: HomedModel,
) -> tuple[float, int, Diverged | None]:
    """A homed model's count consecutive steps from first, as a plain loop runs them: per step, fresh gradients,
    every micro-batch's forward, loss and backward through its module (bound to the device weights), then the
    update on the device. Returns the seconds the steps took (until their losses were on the host), how many
    steps those are (all of them but the model's first step, its warm-up), and whether the model diverged: then
    the steps stop at the one whose loss was not finite, before its update (see divergence).

    What does not change between steps is set up once for the task (the loss function, grad mode) and the
    steps' losses go to the host store together at the end: on a small model the per-step bookkeeping of a
    swapped pack's backward costs as much as the step's arithmetic.
    """
    spec = ctx.spec.models[model]
    runtime = spec.packs[0]
    loss_fn = ctx.loss_fn(model)
    members = ctx.members(model)
    losses = StepLosses(count)
    started = time.perf_counter()
    done = 0
    state.grad_norms.clear()
    try:
        with torch.enable_grad():
            for index, (inputs, targets, loss_weights) in enumerate(per_step):
                step = first + index
                if step == 1 and index == 1:
                    started = time.perf_counter()
                state.clear_grads()
                seen = []
                with state.narrowing():
                    with ctx.cache.scratch(runtime.workspace, "activations of pack 0"):
                        for microbatch, (x, target, weight) in enumerate(zip(inputs, targets, loss_weights)):
                            x = ctx.cache.copy_in(x, "inputs")
                            target = ctx.cache.copy_in(target, "inputs")
                            _begin(ctx, model, 0, step, group, microbatch)
                            with ctx.autocast():
                                computed, step_losses = state.losses(loss_fn, x, target)
                            _backpropagate_loss(computed, weight, state.scaled)
                            seen.append(step_losses.detach().reshape(-1))
                            losses.add(index, seen[-1], weight)
                    state.stop(members.check(first_not_finite(seen), step))  # one sync a step (see divergence)
                    if group == 0:
                        ctx.counters.add("computed", state.computing)
                    state.step(step)  # after the activations are gone, as in a plain loop (its state charged then)
                done = index + 1
    except Diverged as diverged:
        _record_losses(ctx, model, first, group, losses.totals(done))
        _record_grad_norms(ctx, model, first, state)
        return time.perf_counter() - started, 0, diverged
    _record_losses(ctx, model, first, group, losses.totals())
    _record_grad_norms(ctx, model, first, state)
    return time.perf_counter() - started, count - 1 if first == 0 else count, None


def _record_span_timing(ctx: RunContext, model: int, seconds: float, steps: int) -> None:
    """Add a span's timed seconds and steps to the model's running totals in the host store, which the driver
    reads when the task has finished (the model's tasks run one after another on its device)."""
    if steps > 0:
        totals = ctx.store.attach(span_timing_name(model), SPAN_TIMING_BYTES).view(torch.float64)
        totals += torch.tensor([seconds, float(steps)], dtype=torch.float64)


class StepLosses:
    """The per-member losses of consecutive steps' micro-batches, kept as they come and summed per step
    (weighted by each micro-batch's share, in float64) once, when the steps' totals are asked for."""

    def __init__(self, steps: int) -> None:
        self.parts: list[list[tuple[torch.Tensor, float]]] = [[] for _ in range(steps)]

    def add(self, step_index: int, losses: torch.Tensor, weight: float) -> None:
        self.parts[step_index].append((losses, weight))

    def totals(self, steps: int | None = None) -> torch.Tensor:
        """steps x members float64 on the host: row i is step i's loss per member (the first steps ones only)."""
        parts_of = self.parts[:steps]
        if not parts_of:
            return torch.zeros(0, 1, dtype=torch.float64)
        if all(len(parts) == 1 and parts[0][1] == 1 for parts in parts_of):  # whole batches: the losses as is
            return torch.stack([parts[0][0] for parts in parts_of]).to("cpu", torch.float64)
        totals = torch.zeros(len(parts_of), parts_of[0][0][0].numel(), dtype=torch.float64)
        for row, parts in zip(totals, parts_of):
            for losses, weight in parts:
                row.add_(losses.cpu(), alpha=weight)
        return totals


def _backpropagate_loss(
    losses: torch.Tensor, weight: float, scaled: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """Backpropagate a micro-batch's per-member losses weighted by its share of the mini-batch (their weighted
    sum's gradient, given to backward directly rather than through a sum node); returns them detached. With a loss
    scale (fp16), scaled multiplies that gradient by it (a float32 product, as a plain loop's (loss * share) *
    scale backpropagates)."""
    losses = losses.reshape(-1)
    gradient = torch.full_like(losses, weight)
    losses.backward(gradient if scaled is None else scaled(gradient))
    return losses.detach()


def _record_losses(ctx: RunContext, model: int, first: int, group: int, totals: torch.Tensor) -> None:
    """Write steps first, first + 1, ...'s per-member losses (rows of totals) into the host store's loss blocks."""
    record_rows(ctx.store, lambda block: losses_name(model, block, group), ctx.spec.models[model].members, first,
                totals)


def _record_grad_norms(ctx: RunContext, model: int, first: int, state: HomedModel) -> None:
    """Write a clipped homed model's gradient norms of the steps it ran from first into the host store's blocks."""
    if state.grad_norms:
        record_rows(ctx.store, lambda block: grad_norms_name(model, block), ctx.spec.models[model].members, first,
                    torch.stack(state.grad_norms).double().cpu())


def homed_span_applied(next_step: int, first: int, count: int, model: int) -> bool:
    """Whether a homed model's span of count steps from first is applied already (its worker ran it to the end
    and flushed it, then died before Dask heard: the span is run again, and must do nothing); else the span must
    start at the step the model's device state is at (it waited for the task before it, see handoff), since
    anything else would skip steps or apply them twice."""
    if next_step >= first + count:
        return True
    if first != next_step:
        raise RuntimeError(f"model {model}'s state on its device is at step {next_step} but a task for step {first} "
                           "started (a step would be skipped or applied twice)")
    return False


def _backward_step(
    ctx: RunContext,
    model: int,
    pack: int,
    span: int,
    step: int,
    weights: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    inputs: list[Any],
    gradients_or_targets: list[Any],
    loss_weights: list[float],
    group: int,
    claim_input: Any,
    claim_upstream: Any,
    keep: Any,
    prefetch: Callable[[], None],
    losses: StepLosses,
    rows: Rows | None,
    taken: Taken | None = None,
) -> list[Any]:
    """One step's micro-batches through a swapped pack's backward, accumulating into grads (views of the
    gradient buffer; tensors are views of weights; both of the computed members' rows alone where rows says so and
    they are views, see runtime.rows); the last pack adds its micro-batches' losses to losses (the
    caller writes them with the pack's gradients). An input or upstream
    gradient kept on the device for claim_input or claim_upstream is taken there; each input's gradient is kept
    on the device for keep where it fits. A stash among taken (its section's, taken at once) is used from there."""
    spec = ctx.spec.models[model]
    runtime = spec.packs[pack]
    last = pack == len(spec.packs) - 1
    input_grads = []
    buffers = runtime.device_buffers_offset
    saved_buffers = weights[buffers:].clone() if runtime.has_buffers and not last else None
    halved = runtime.halved.names & grads.keys() if runtime.halved is not None else set()
    for index, microbatch in enumerate(inputs):
        _stop_if_dropped()
        if index and not ctx.spec.group:
            ctx.cache.reload((model, pack), ctx.device_source(model, pack, step))
        kept_input = ctx.cache.claim(claim_input, index) if claim_input is not None else None
        kept_grad = ctx.cache.claim(claim_upstream, index) if claim_upstream is not None else None
        fetched_input = ctx.cache.take(_ahead_key(model, pack, "input", index))
        fetched_upstream = ctx.cache.take(_ahead_key(model, pack, "upstream", index))
        kept_input = kept_input if kept_input is not None else fetched_input
        kept_grad = kept_grad if kept_grad is not None else fetched_upstream
        key = stash_key(model, pack, step, group, index, ctx.attempt)
        ahead = 0

        def start_ahead(following: int = index + 1) -> None:
            """Once this micro-batch's workspace is reserved: the next one's values come in while it computes, and
            after the values the pack reads sooner, the next pack's weights (_weights_after)."""
            nonlocal ahead
            if following < len(inputs):
                stashed = stash_key(model, pack, step, group, following, ctx.attempt)
                if not ((taken is not None and stashed in taken) or ctx.cache.holds(stashed)):  # else not recomputed
                    ahead += _ahead(ctx, model, pack, "input", following, inputs,
                                    "activations" if pack else "inputs", claim_input)
                ahead += _ahead(ctx, model, pack, "upstream", following, gradients_or_targets,
                                "inputs" if last else "activations", claim_upstream)
            if following - 1 == _weights_after(ctx, len(inputs)):
                prefetch()

        with (taken.use(key) if taken is not None and key in taken else ctx.cache.unstash(key) if runtime.stash
              else nullcontext()) as found:
            from_stash = found is not None
            if found is not None:  # its forward's activations are here: backpropagate them, no recompute
                stash, nbytes = found
                with ctx.cache.scratch(max(runtime.workspace - nbytes, 0), f"activations of pack {pack}") as reserved:
                    upstream = kept_grad if kept_grad is not None else ctx.cache.copy_in(
                        gradients_or_targets[index], "activations")
                    start_ahead()
                    with _held(ctx, model, pack, {**tensors, **stash.leaves}):
                        x = stash.backward(tensors, grads, halved, upstream, _backward_from)
                    del stash, found
                    if pack > 0:
                        grad = _input_grad(x)
                        if not isinstance(keep, Within):
                            input_grads.append(ctx.cache.send(grad, "activations", reserved))
                    del x
                ctx.counters.add("stashed", 1)
            else:
                grad = _recomputed_backward(
                    ctx, model, pack, step, tensors, grads, halved, microbatch, gradients_or_targets[index],
                    loss_weights[index] if last else None, group, index, kept_input, kept_grad, losses,
                    None if isinstance(keep, Within) else input_grads, start_ahead, rows)
                if not last:
                    ctx.counters.add("recomputed", 1)
            if saved_buffers is not None and not from_stash:
                weights[buffers:].copy_(saved_buffers)
        keep_free = max(runtime.workspace - ahead, 0) if index + 1 < len(inputs) else 0
        if pack > 0 and isinstance(keep, Within):
            incoming = 1 if from_stash else 2  # the next micro-batch's upstream gradient, and its input to recompute
            input_grads.append(ctx.cache.hand_on(keep, index, grad, keep_free=keep_free, incoming=incoming))
        elif pack > 0 and keep is not None:
            ctx.cache.keep(keep, index, grad, keep_free=keep_free, sent=input_grads[-1])
    return ctx.cache.arrived(input_grads)


def _recomputed_backward(
    ctx: RunContext, model: int, pack: int, step: int, tensors: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
    halved: set[str], microbatch: Any, gradient_or_target: Any, loss_weight: float | None, group: int, index: int,
    kept_input: Any, kept_grad: Any, losses: StepLosses, input_grads: list[Any] | None,
    start_ahead: Callable[[], None], rows: Rows | None,
) -> Any:
    """One micro-batch's backward through a pack whose forward runs here (recomputed from its input, kept on the
    device or copied in; or the last pack's, whose loss, weighted by loss_weight, is added to losses): the input's
    gradient (on the device) returned and its host copy appended to input_grads (none for the first pack; none
    either without input_grads, where the caller hands the gradient on inside the task). kept_input and kept_grad
    (the upstream gradient, or the last pack's target) are already on the device where not None: kept there, or
    copied in ahead. start_ahead runs once the micro-batch's workspace is reserved. With rows, the members it says
    are computed alone (their losses recorded one per member, see runtime.rows)."""
    spec = ctx.spec.models[model]
    runtime = spec.packs[pack]
    grad = None
    with ctx.cache.scratch(runtime.workspace, f"activations of pack {pack}") as reserved:
        x = kept_input if kept_input is not None else ctx.cache.copy_in(
            microbatch, "inputs" if pack == 0 else "activations")
        target_or_gradient = kept_grad if kept_grad is not None else ctx.cache.copy_in(
            gradient_or_target, "inputs" if loss_weight is not None else "activations")
        start_ahead()  # after this micro-batch's own values: the link carries one copy at a time each way
        if pack > 0:
            _track(x)
        _begin(ctx, model, pack, step, group, index)
        with torch.enable_grad():
            leaves = _leaves(tensors, grads, halved)
            with _selected(rows, {**tensors, **leaves}, runtime) as weights, _held(ctx, model, pack, weights):
                with ctx.autocast():
                    y = ctx.call(model, pack)(weights, x)
                if loss_weight is not None:  # the last pack: loss and backward
                    loss_fn = ctx.loss_fn(model) if rows is None else ctx.loss_fn(model).narrowed(list(rows.computing))
                    with ctx.autocast():
                        step_losses = loss_fn(y, target_or_gradient)
                    scale = ctx.scaler(model).state(step)[0] if spec.scaled else None
                    scaled = None if scale is None else lambda gradient: gradient * scale
                    computed = _backpropagate_loss(step_losses, loss_weight, scaled)
                    losses.add(0, computed if rows is None else rows.spread(computed), loss_weight)
                else:
                    _backward_from(y, target_or_gradient)
        for name in halved:  # as autocast casts a weight's gradient back after its op, added in float32
            if leaves[name].grad is not None:
                grads[name].add_(leaves[name].grad)
        if pack > 0:
            grad = _input_grad(x)
            if input_grads is not None:
                input_grads.append(ctx.cache.send(grad, "activations", reserved))
    return grad


def _computing(ctx: RunContext, model: int, pack: int, rows: Rows | None) -> AbstractContextManager[None]:
    """The pack's module computing as many members as rows says (runtime.array.sized), else all of them."""
    return nullcontext() if rows is None else sized(ctx.module(model, pack), len(rows.computing))


def _views(rows: Rows | None, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A pack's stacks, or their computed members' rows where rows says so and they are views (runtime.rows)."""
    return tensors if rows is None else rows.views(tensors)


def _selected(rows: Rows | None, tensors: dict[str, torch.Tensor], runtime: PackRuntime
              ) -> AbstractContextManager[dict[str, torch.Tensor]]:
    """What one call of a pack computes with: tensors, or copies of the computed members' rows (runtime.rows)."""
    return nullcontext(tensors) if rows is None else rows.selected(tensors, runtime.buffer_names)


def _held(ctx: RunContext, model: int, pack: int, weights: dict[str, torch.Tensor]) -> AbstractContextManager[None]:
    """The pack's module holding weights (its tensors and its trainable leaves) through a forward and its backward:
    a backward that runs part of the forward again (torch.utils.checkpoint inside the model) reads them there, where
    the forward's call alone would have put the skeleton's meta tensors back. Compiled packs pass their tensors to
    the compiled code alone."""
    return nullcontext() if ctx.spec.compile else bound(ctx.module(model, pack), weights)


def _track(x: Any) -> None:
    """Make the floating-point tensors of a pack's input (one, or the several a stage boundary carries) autograd
    leaves, so that backward leaves their gradients in them."""
    if isinstance(x, torch.Tensor):
        x.requires_grad_(x.is_floating_point())
        return
    for leaf in tree_leaves(x):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            leaf.requires_grad_()


def _backward_from(y: Any, upstream: Any) -> None:
    """Backpropagate the upstream gradients of a pack's output, a tensor or a tuple of them, leaf by leaf."""
    if isinstance(y, torch.Tensor):
        if y.requires_grad:
            y.backward(upstream)
        return
    pairs = [(out, grad) for out, grad in zip(tree_leaves(y), tree_leaves(upstream), strict=True)
             if isinstance(out, torch.Tensor) and out.requires_grad]
    if pairs:
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


def _input_grad(x: Any) -> Any:
    """The gradient of a pack's input, shaped like the input: zeros for a floating-point tensor nothing reached, an
    empty tensor in place of one that takes no gradient (an integer mask or position ids)."""
    if isinstance(x, torch.Tensor):
        return x.grad if x.grad is not None else torch.zeros_like(x)

    def grad_of(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            return torch.empty(0, device=leaf.device if isinstance(leaf, torch.Tensor) else None)
        return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)

    return tree_map(grad_of, x)


def _untracked(x: Any) -> None:
    """A first pack's input (the batch) takes no gradient."""


def _leaves(
    tensors: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], halved: set[str]
) -> dict[str, torch.Tensor]:
    """Trainable weights as autograd leaves whose gradients accumulate into grads; a halved weight's gradient (in
    autocast's dtype) is left in its leaf, for the caller to add."""
    leaves = {}
    for name, grad in grads.items():
        leaf = tensors[name].detach().requires_grad_()
        if name not in halved:
            leaf.grad = grad
        leaves[name] = leaf
    return leaves


@task_body("upd", host=True)
def update(ctx: RunContext, model: int, pack: int, span: int, group: int, first: int, steps: None) -> None:
    """The updates of a section's packs beside the device, from its last: sum the groups' gradients (vDP), then
    step each pack's optimizer on the host store, once."""
    for index in reversed(ctx.spec.models[model].section(pack)):
        ctx.update(model, index, first)
