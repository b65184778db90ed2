"""Evaluation: a job's validation loss (and metrics) with its weights after a given step, run as Dask tasks.

The binder decides when (every eval_every steps and at the end, with no later step applied meanwhile) and where
(the job's home, else one device of its machine); this module does it. One ``evl`` task per pack runs a chunk of
validation batches (their micro-batches) through the pack forward with no gradients, in eval mode (dropout off,
running statistics read, not written), with the pack's weights at that step's version swapped in once for them
all, as a training task groups its micro-batches; the last pack computes the loss and the metrics. A chunk is as
many batches as keep the boundary activations it holds on the host under CHUNK_BYTES: one chunk (the usual case)
ends in its last pack's task, named ``val-…``; several end in a ``val`` task that sums them. The validation
batches are scattered to a device's worker once per validation set (jobs on one loader share them) and kept there
for the run.

Figures are means over the validation samples: each batch's loss (a mean over its samples, as a training loss
is) weighted by its share of the samples; a fused array's members each get their own. An array evaluates its
members not pruned alone, as a step computes its members still training (runtime.rows; the others' figures, past
their pruning step, are NaN and kept by nobody).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from distributed import Client, Future

from harmony.runtime.array import evaluating, member_slice, sized
from harmony.runtime.bodies import task_body
from harmony.runtime.data import batch_size, split_tree
from harmony.runtime.errors import ModelFailure
from harmony.runtime.hoststore import tensors_at
from harmony.runtime.rows import Rows
from harmony.runtime.skeleton import dump_code, load_code
from harmony.runtime.worker import RunContext
from harmony.tasks.events import Evaluate, Evaluated
from harmony.tasks.microbatch import split_sizes
from harmony.tasks.packing import Packing

CHUNK_BYTES = 256 * 2**20  # boundary activations an evaluation's chunk of batches holds on the host, at most
Metrics = Callable[[Any, Any], Any] | Mapping[str, Callable[[Any, Any], Any]] | None


def metric_values(metrics: Metrics, output: Any, target: Any) -> dict[str, float]:
    """The metrics of one output as named floats: a callable's own name for a single value, its keys for a dict
    it returns, or the names of a dict of callables."""
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        return {name: float(fn(output, target)) for name, fn in metrics.items()}
    value = metrics(output, target)
    if isinstance(value, Mapping):
        return {name: float(item) for name, item in value.items()}
    return {getattr(metrics, "__name__", "metric"): float(value)}


def _evaluated(ctx: RunContext, model: int, step: int) -> Rows | None:
    """The members of an array an evaluation with the weights after step computes where not every one: those not
    pruned before it, or more (runtime.rows). Their figures past their pruning step are not kept; a member whose
    loss diverged is still evaluated, on the weights it kept. A function of the step, so that every pack's task
    of the evaluation computes the same members."""
    return ctx.rows(model, ctx.members(model).evaluated(step))


@task_body("evl")
def evaluation(
    ctx: RunContext, model: int, pack: int, span: int, batches: list[list[Any]], targets: list[list[Any]] | None,
    metrics: bytes | None, finish: bool, group: int, first: int, steps: None,
) -> Any:
    """Validation batches' micro-batches through a pack with its weights after step first: per batch its outputs
    (host copies), or for the last pack each member's loss and metrics (runtime.skeleton.dump_code's) summed over
    the batches' samples (with finish, their means: the evaluation's figures)."""
    spec = ctx.spec.models[model]
    runtime = spec.packs[pack]
    module = ctx.module(model, pack)
    last = pack == len(spec.packs) - 1
    measures: Metrics = None if metrics is None or not last else load_code(metrics)
    outputs: list[Any] = []
    sums: dict[str, torch.Tensor] = {"loss": torch.zeros(spec.members, dtype=torch.float64)}
    samples = 0
    rows = _evaluated(ctx, model, first)
    members = list(range(spec.members)) if rows is None else list(rows.computing)
    evaluated = members if rows is None else list(rows.training)
    loss_fn = ctx.loss_fn(model) if rows is None else ctx.loss_fn(model).narrowed(members)
    with (ctx.cache.weights((model, pack), first, ctx.device_source(model, pack, first),
                            ctx.part(model, pack, rows)) as weights,
          ctx.borrowed(model, pack, first) as borrowed,
          nullcontext() if rows is None else sized(module, len(members))):
        tensors = {**tensors_at(weights, runtime.device_weights), **borrowed}
        if rows is not None:
            tensors = rows.views(tensors)
        with evaluating(module):
            for batch, inputs in enumerate(batches):
                outputs.append([])
                for index, microbatch in enumerate(inputs):
                    with ctx.cache.scratch(runtime.workspace, f"activations of pack {pack}"), torch.no_grad():
                        x = ctx.cache.copy_in(microbatch, "activations" if pack else "inputs")
                        with (nullcontext(tensors) if rows is None else rows.selected(tensors, ()) as chosen,
                              ctx.autocast()):
                            y = ctx.call(model, pack)(chosen, x)
                        if not last:
                            outputs[-1].append(ctx.cache.copy_out(y, "activations"))
                            continue
                        assert targets is not None
                        target = ctx.cache.copy_in(targets[batch][index], "inputs")
                        count = batch_size(microbatch)
                        with ctx.autocast():
                            losses = loss_fn(y, target).reshape(-1).to("cpu", torch.float64)
                        sums["loss"][members] += losses * count
                        for row, member in enumerate(members):
                            if member not in evaluated:  # computed beside them (runtime.rows), not kept
                                continue
                            output = member_slice(y, row) if spec.members > 1 else y
                            for name, value in metric_values(measures, output, target).items():
                                sums.setdefault(name, torch.zeros(spec.members, dtype=torch.float64))[member] += (
                                    value * count)
                        samples += count
    if last and rows is not None:
        for values in sums.values():  # figures past their pruning step, which nobody keeps
            values[[member for member in range(spec.members) if member not in evaluated]] = float("nan")
    if not last:
        return outputs
    return total([{"sums": sums, "samples": samples}]) if finish else {"sums": sums, "samples": samples}


def total(parts: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """Per figure (the loss, each metric), each member's mean over the samples of every validation batch."""
    samples = sum(part["samples"] for part in parts)
    names = dict.fromkeys(name for part in parts for name in part["sums"])
    return {name: (sum(part["sums"][name] for part in parts if name in part["sums"]) / samples).tolist()
            for name in names}


class Evaluations:
    """The driver's side: each job's validation batches (split into micro-batches once), the evaluations in
    flight and what they found, per job as (step, {figure: per-member values})."""

    def __init__(self, client: Client, run: str, batches: list[list[tuple[Any, Any]] | None], microbatches: int,
                 metrics: Metrics, on_done: Callable[[Future], None]) -> None:
        self.client = client
        self.run = run
        split: dict[int, list[tuple[list[Any], list[Any]]]] = {}  # jobs that share validation data share its split
        self.sets = [None if job is None else id(job) for job in batches]
        self.batches = [None if job is None else split.setdefault(id(job), [_split(b, microbatches) for b in job])
                        for job in batches]
        self.metrics = None if metrics is None else dump_code(metrics)  # as the loss travels (runtime.skeleton)
        self.on_done = on_done
        self.scattered: dict[tuple[int | None, str], list[Any]] = {}  # per validation set and worker
        self.flight: dict[int, tuple[Evaluate, list[Future]]] = {}
        self.results: list[list[tuple[int, dict[str, list[float]]]]] = [[] for _ in batches]

    def submit(self, evaluate: Evaluate, worker: str, packing: Packing) -> None:
        """The evaluation's tasks, all restricted to worker; its last task's future (the figures) reports to
        on_done."""
        self.release(evaluate.model)
        model, step = evaluate.model, evaluate.step
        batches = self.batches[model]
        assert batches, f"job {model} has no validation data"
        data = self.scattered.get((self.sets[model], worker))
        if data is None:  # once per validation set and device: a scatter is a round trip that holds the driver
            data = self.scattered[(self.sets[model], worker)] = self.client.scatter(
                [part for batch in batches for part in batch], workers=[worker], hash=False)
        packs = len(packing.packs)
        held = max([pack.input_bytes_per_sample for pack in packing.packs[1:]], default=0.0)
        chunks = chunked([sum(batch_size(x) for x in inputs) * held for inputs, _ in batches], CHUNK_BYTES)
        futures: list[Future] = []
        suffix = f"-r{evaluate.attempt}" if evaluate.attempt else ""
        for index, chunk in enumerate(chunks):
            value: Any = [data[2 * batch] for batch in chunk]
            for pack in range(packs):
                last, finish = pack == packs - 1, len(chunks) == 1
                kind = "val" if last and finish else "evl"
                value = self.client.submit(
                    evaluation, self.run, model, pack, step, value,
                    [data[2 * batch + 1] for batch in chunk] if last else None, self.metrics, finish, first=step,
                    key=f"{kind}-m{model}-p{pack}-s{step}-b{index}-{self.run}{suffix}",
                    workers=[worker], allow_other_workers=False, pure=False, priority=2)
                futures.append(value)
        if len(chunks) > 1:
            lasts = futures[packs - 1::packs]
            futures.append(self.client.submit(total, lasts, key=f"val-m{model}-s{step}-{self.run}{suffix}",
                                              workers=[worker], allow_other_workers=False, pure=False, priority=2))
        self.flight[model] = (evaluate, futures)
        futures[-1].add_done_callback(self.on_done)

    def heard(self, future: Future, at: float) -> Evaluated | None:
        """The event a finished sum task means, or None for a future not (or no longer) in flight."""
        model = next((job for job, (_, futures) in self.flight.items() if futures[-1] is future), None)
        if model is None:
            return None
        evaluate, _ = self.flight[model]
        if future.status == "cancelled":
            return None  # its worker is gone: the binder hears that and runs the evaluation again
        if future.status == "error":
            error = future.exception()
            self.release(model)
            return Evaluated(model, evaluate.step, evaluate.attempt, at, error.with_traceback(future.traceback()),
                             isolated=isinstance(error, ModelFailure))
        figures = future.result()
        self.release(model)
        self.results[model].append((evaluate.step, figures))
        return Evaluated(model, evaluate.step, evaluate.attempt, at)

    def release(self, model: int) -> None:
        """Forget the futures of the model's evaluation in flight (Dask then drops its tasks)."""
        _, futures = self.flight.pop(model, (None, []))
        for future in futures:
            future.release()

    def forget_worker(self, worker: str) -> None:
        """A worker left: the batches scattered to it are gone with it."""
        for key in [key for key in self.scattered if key[1] == worker]:
            del self.scattered[key]

    def close(self) -> None:
        for model in list(self.flight):
            self.release(model)
        for data in self.scattered.values():
            for future in data:
                future.release()
        self.scattered.clear()


def chunked(sizes: list[float], limit: float) -> list[list[int]]:
    """Consecutive indices of sizes in chunks whose sizes add up to at most limit (a larger one alone)."""
    chunks: list[list[int]] = [[]]
    held = 0.0
    for index, size in enumerate(sizes):
        if chunks[-1] and held + size > limit:
            chunks.append([])
            held = 0.0
        chunks[-1].append(index)
        held += size
    return chunks


def _split(batch: tuple[Any, Any], microbatches: int) -> tuple[list[Any], list[Any]]:
    inputs, targets = batch
    sizes = split_sizes(batch_size(inputs), microbatches)
    if len(sizes) == 1:
        return [inputs], [targets]
    return split_tree(inputs, sizes), split_tree(targets, sizes)
