"""Build the run's plan, for harmony.train and harmony.plan alike: pilot, fuse, then arrange.

0. ``fewest_microbatches``: with microbatches="auto", the fewest micro-batches at which every model's layers fit.
1. ``pilot``: run one micro-batch through every model on the CPU, profile its layers and cut it into packs for
   the smallest device budget (bad models and budgets are InputErrors here, before any worker starts).
2. ``build``: fuse same-architecture models on one loader into arrays of the best predicted size
   (harmony.fusing), choose the execution mode the simulator predicts fastest, home the jobs that fit a device
   whole (re-cutting the others for the room left), and give homed single-pack jobs their span depth.

Each decision returns new values; the result is one frozen RunPlan and, beside it, what each job computes with.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from harmony import timings
from harmony.candidate import RANKING_STEPS, Candidate, pilot_batch, step_samples
from harmony.errors import BudgetTooSmall, InputError, ModelError
from harmony.fusing import build_array, fuse
from harmony.runtime.array import configuration
from harmony.runtime.cache import tree_nbytes
from harmony.runtime.code import JobCode
from harmony.runtime.data import batch_size
from harmony.runtime.measure import update_rate
from harmony.runtime.pilot import Decomposition, KeywordCall, architecture, decompose, rebound
from harmony.runtime.stages import REMEDY, Entry, ShapeError, sized_by_shapes
from harmony.tasks.amortize import even_sections, homed_task_seconds, pack_sections, runs_spans, steps_per_task
from harmony.tasks.binding import MODES
from harmony.tasks.hardware import Hardware
from harmony.tasks.homes import assign_machines, choose_homes
from harmony.tasks.microbatch import split_sizes
from harmony.tasks.packing import LayerTooLarge, cut_packs, minimal_budget, with_update_rate
from harmony.tasks.profile import LayerProfile, ModelProfile
from harmony.tasks.runplan import PRECISIONS, Job, RunPlan
from harmony.tasks.simulator import Simulation, model_step_seconds, simulate_jobs
from harmony.tasks.updates import packs_on_device, why_not_on_device
from harmony.validate import Arguments, Cut, model_label

logger = logging.getLogger("harmony")

def _check_loss(args: Arguments, index: int, label: str, output: Any, target: Any) -> None:
    """Call the model's loss once on the pilot output: it must work and return a scalar tensor."""
    try:
        loss = args.loss_fns[index](output, target)  # type: ignore[misc]
    except Exception as error:
        raise InputError(f"loss_fn for {label} raised {type(error).__name__}: {error} when called "
                         "as loss_fn(output, target) on the first micro-batch") from error
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = "" if not isinstance(loss, torch.Tensor) else f" of shape {tuple(loss.shape)}"
        raise InputError(f"loss_fn for {label} returned {type(loss).__name__}{shape}; "
                         "it must return a scalar tensor (the mean loss over the micro-batch)")


def cut(profile: ModelProfile, budget: int, samples: int, label: str, ahead: bool) -> Any:
    """The packing of a profile for budget; a budget too small for its largest layer is an InputError."""
    try:
        return cut_packs(profile, budget, samples, ahead)
    except LayerTooLarge as error:
        raise cut_error(error, label) from None


def cut_error(error: LayerTooLarge, label: str) -> BudgetTooSmall:
    largest = error.largest_microbatch()
    smaller = (f"or split each batch into micro-batches of at most {largest} samples (microbatches='auto' finds the "
               "fewest)" if largest is not None else
               f"more micro-batches would not do: in micro-batches of one sample it still needs {error.one_sample:,}")
    return BudgetTooSmall(
        f"device_memory is too small for {label}: {error}. Raise device_memory to at least "
        f"{error.alone:,} bytes ({error.need.total:,} to prefetch), {smaller}", error.alone, error.need.total, largest,
        error.one_sample)


def fewest_microbatches(args: Arguments, budget: int) -> tuple[Arguments, dict[int, tuple[Decomposition, Any]]]:
    """args with microbatches="auto" made the fewest micro-batches of each step at which every model's layers fit
    budget (the smallest device's): piloted first on the whole batch, then, where a layer does not fit, on the
    count at which its activations, which shrink with the micro-batch while its weights and gradients do not,
    would (checked by piloting on it). A count chosen from sizes alone, never from timings: the same models,
    batches and budget give the same count, and so the same dropout masks (runtime.seeding). Beside it, by model,
    the decompositions and packings made at that count, for pilot to take rather than make again (an export is
    slow). Other values are returned as they are."""
    if args.options.microbatches != "auto":
        return args, {}
    count, found = 1, {}
    for index in range(len(args.models)):
        count, found[index] = _fewest_for(args, index, budget, count)
    for index, model in enumerate(args.models):
        samples = batch_size(args.first_batch(index)[0])
        if count > samples:
            raise InputError(f"microbatches='auto' needs {count} micro-batches for every model to fit the device "
                             f"budget, more than the {samples} samples of {model_label(index, model)}'s first batch; "
                             "train it in a call of its own, or give it larger batches")
        if count > 1 and any(isinstance(module, torch.nn.modules.batchnorm._BatchNorm) for module in model.modules()):
            logger.warning("harmony: microbatches='auto' chose %d micro-batches: the batch statistics of %s's "
                           "BatchNorm layers are each micro-batch's, not the whole batch's", count,
                           model_label(index, model))
    logger.info("harmony: microbatches='auto' chose %d micro-batch%s a step", count, "es" if count > 1 else "")
    return (dataclasses.replace(args, options=dataclasses.replace(args.options, microbatches=count)),
            {index: made for index, (at, made) in found.items() if at == count})


def _fewest_for(args: Arguments, index: int, budget: int, count: int
                ) -> tuple[int, tuple[int, tuple[Decomposition, Any]] | tuple[None, None]]:
    """The fewest micro-batches, from count on, at which model index's layers fit budget, and what was made there:
    (that count, (the decomposition, the packing)); a count beyond its samples is returned as it is, with (None,
    None)."""
    batch = batch_size(args.first_batch(index)[0])
    while count <= batch:  # else more than its samples: fewest_microbatches refuses it
        trial = dataclasses.replace(args, options=dataclasses.replace(args.options, microbatches=count))
        sample, target, sizes = pilot_batch(trial, index)
        kept = _kept(trial, index, sample)
        try:
            decomposition, packing = _cut(trial, index, sample, target, sizes[0], budget, timings.KEPT.get(kept))
        except BudgetTooSmall as error:
            if error.largest_microbatch is None or count == batch:
                raise BudgetTooSmall(f"device_memory is too small for {model_label(index, args.models[index])} in "
                                     f"any number of micro-batches (microbatches='auto'): {error}", error.one_sample,
                                     error.one_sample + error.prefetching - error.minimum, None,
                                     error.one_sample) from error
            count = max(count + 1, math.ceil(batch / error.largest_microbatch))
            continue
        return count, (count, (decomposition, packing))
    return count, (None, None)


def pilot(args: Arguments, budget: int, made: Mapping[int, tuple[Decomposition, Any]] | None = None
          ) -> list[Candidate]:
    """Profile every model on its first micro-batch and cut it into packs that fit budget (or take its
    decomposition and packing from made, fewest_microbatches's at this count)."""
    candidates = []
    for index in range(len(args.models)):
        candidate, notes = _piloted(args, index, budget, (made or {}).get(index))
        logger.info("%s%s", candidate.job.packing.explain(), "".join(f"; {note}" for note in notes[:3]))
        candidates.append(candidate)
    return candidates


def member_cutter(args: Arguments) -> Callable[[int, int], Candidate]:
    """How fusion cuts a model finer for an array (harmony.fusing.build_array): piloted and cut for a budget, its
    share of the array's. Each cut pilots the model again (the first of an architecture exported again at that
    budget, the others its chain rebound: _cut), so a model is cut once for a budget, the members of an
    architecture take the first one's timings at that budget, and a budget at or under one a model could not be cut
    for raises at once (larger arrays are tried at smaller shares)."""
    cut: dict[tuple[int, int], Candidate] = {}
    failed: dict[int, tuple[int, BudgetTooSmall]] = {}

    def cutter(index: int, budget: int) -> Candidate:
        if index in failed and budget <= failed[index][0]:
            raise failed[index][1]
        if (index, budget) not in cut:
            try:
                cut[index, budget] = _piloted(args, index, budget, finer=True)[0]
            except BudgetTooSmall as error:
                failed[index] = (max(budget, failed.get(index, (0, error))[0]), error)
                raise
        return cut[index, budget]

    return cutter


def _piloted(args: Arguments, index: int, budget: int, made: tuple[Decomposition, Any] | None = None,
             finer: bool = False) -> tuple[Candidate, list[str]]:
    """Model index piloted on its first micro-batch and cut into packs that fit budget (or as made), and the notes
    on how it was decomposed. finer: cut for an array (member_cutter), its timings kept apart from the model's own
    cut's, by budget."""
    sample, target, sizes = pilot_batch(args, index)
    kept = _kept(args, index, sample)
    timed = (kept, budget) if finer else kept
    decomposition, packing = made or _cut(args, index, sample, target, sizes[0], budget, timings.KEPT.get(timed))
    _check_exported_sizes(args, index, sample, decomposition.layers[0])
    timings.KEPT.setdefault(timed, decomposition.profile)
    optimizer = (kept, args.optimizer_classes[index], args.optimizer_state_ratios[index])
    if optimizer not in timings.RATES and args.optimizers[index] is not None:
        timings.RATES[optimizer] = update_rate(args.optimizers[index], decomposition.layers)
    profile, packing = with_update_rate(decomposition.profile, packing, timings.RATES.get(optimizer))
    job = Job(
        members=(index,),
        label=model_label(index, args.models[index]),
        feed=args.loader_of[index],
        seed=index,
        packing=packing,
        steps=args.expected_steps(index),
        step_seconds=model_step_seconds(packing, sum(sizes), Hardware()),
        batch_bytes=tree_nbytes(args.first_batch(index)),
        state_ratio=args.optimizer_state_ratios[index],
    )
    code = JobCode(tuple(decomposition.layers), args.loss_fns[index], args.optimizers[index])
    return Candidate(job, code, profile), decomposition.notes


def _check_exported_sizes(args: Arguments, index: int, sample: Any, first: torch.nn.Module) -> None:
    """Refuse, before work starts, a model exported whole (its first layer an Entry) whose graph does not hold for
    a micro-batch it will be given (a short last batch, a batch that microbatches does not divide evenly, a
    validation batch of another size), where its loader says its batch sizes (Arguments.batch_sizes) and in its
    validation batches; the run checks every micro-batch besides."""
    if not isinstance(first, Entry) or not isinstance(args.options.microbatches, int):  # else still choosing it
        return
    given = dict.fromkeys(args.batch_sizes(index) or (), "its loader gives")
    for inputs, _ in args.validation[args.validation_of[index]] if args.validation else ():
        given.setdefault(batch_size(inputs), "its val_loaders give")
    pilot = batch_size(sample)
    for batch, giver in sorted(given.items()):
        for size in set(split_sizes(batch, args.options.microbatches)) - {pilot}:
            shaped = tree_map(lambda leaf, size=size: torch.empty((size, *leaf.shape[1:]), device="meta")
                              if isinstance(leaf, torch.Tensor) else leaf, sample)
            try:
                first.shapes.check(shaped)
            except ShapeError as error:
                raise InputError(
                    f"{model_label(index, args.models[index])} does not fit the device whole, and torch.export's "
                    f"graph of it, cut into packs, holds for micro-batches of {pilot} samples but not {size} "
                    f"({giver} batches of {batch}): {error}; {REMEDY}") from None


def _kept(args: Arguments, index: int, sample: Any) -> Hashable:
    """Where model index's profile on sample is kept (timings.KEPT): the first profile of each architecture, whose
    timings the rest take, in this call and later ones."""
    return ("model", architecture(args.models[index]), timings.context(sample, args.options.precision))


def _cut(args: Arguments, index: int, sample: Any, target: Any, samples: int, budget: int,
         timed: ModelProfile | None) -> tuple[Decomposition, Any]:
    """Model index decomposed and cut into packs for budget (_decompose_and_cut): where a model of its architecture
    and configuration (runtime.array.configuration: what its graph bakes in) was exported and cut for budget on a
    sample of these shapes before in this planning (Arguments.cuts), as that model's stages rebound to its own
    weights (an export takes seconds); an exported model's cut kept there for the next."""
    key = (_kept(args, index, sample), configuration(args.models[index]), budget)
    source = args.cuts.get(key)
    made = None if source is None else _rebound_cut(args, index, sample, target, samples, budget, timed, source)
    decomposition, packing = made or _decompose_and_cut(args, index, sample, target, samples, budget, timed)
    exported = any(isinstance(module, Entry) for layer in decomposition.layers for module in layer.modules())
    if exported:
        args.cuts.setdefault(key, Cut(index, decomposition.layers, decomposition.notes, decomposition.profile))
    return decomposition, packing


def _decompose(args: Arguments, index: int, sample: Any, timed: ModelProfile | None, **how: Any) -> Decomposition:
    """Model index decomposed and profiled on sample (runtime.pilot.decompose, how: its options); an exception in its
    forward is the model's own (ModelError)."""
    model, label = args.models[index], model_label(index, args.models[index])
    try:
        return decompose(KeywordCall(model) if isinstance(sample, Mapping) else model, sample, label,
                         autocast=PRECISIONS[args.options.precision], timed=timed, exports=args.exports, **how)
    except Exception as error:
        raise ModelError(index, f"{label} raised {type(error).__name__}: {error} in its forward "
                         "during the pilot pass") from error


def _rebound_cut(args: Arguments, index: int, sample: Any, target: Any, samples: int, budget: int,
                 timed: ModelProfile | None, source: Cut) -> tuple[Decomposition, Any] | None:
    """Model index decomposed as source (a model of its architecture exported and cut for budget, and its
    decomposition): its chain rebound to this model's weights, with source's profile where every size it computes
    is fixed by its inputs' shapes (sized_by_shapes: its bytes are then source's) or else profiled, and cut into
    packs; None where they do not fit (it is then cut anew)."""
    label = model_label(index, args.models[index])
    chain = rebound(source.layers, args.models[source.origin], args.models[index])
    alike = source.profile if sized_by_shapes(source.layers) else None
    decomposition = _decompose(args, index, sample, timed, cut=(chain, source.notes), alike=alike)
    if args.loss_fns[index] is not None:
        _check_loss(args, index, label, decomposition.output, target)
    try:
        packing = cut_packs(decomposition.profile, budget, samples, args.ahead)
    except LayerTooLarge:
        return None
    return decomposition, packing


def _decompose_and_cut(args: Arguments, index: int, sample: Any, target: Any, samples: int,
                       budget: int, timed: ModelProfile | None = None) -> tuple[Decomposition, Any]:
    """Decompose model index and cut it into packs for budget, its blocks whole where they fit.

    When a layer does not fit, the blocks holding as many weights as it are cut at their children, finer and finer,
    until it fits or nothing is left to cut. When the packs fit only without room to prefetch, the largest blocks
    are cut finer once, and that decomposition is kept if its packs leave room. A model torch.fx cannot trace is
    exported with torch.export only when it does not fit whole (exporting is slow; a model that fits trains as
    it is)."""
    label = model_label(index, args.models[index])
    largest: int | None = None
    export = False
    layers = 0
    without_prefetch: tuple[Decomposition, Any] | None = None
    while True:
        decomposition = _decompose(args, index, sample, timed, largest=largest, export=export)
        if args.loss_fns[index] is not None and not layers:
            _check_loss(args, index, label, decomposition.output, target)
        try:
            packing = cut_packs(decomposition.profile, budget, samples, args.ahead)
        except LayerTooLarge as error:
            if without_prefetch is not None:
                return without_prefetch
            if not export and any("not traceable by torch.fx" in note for note in decomposition.notes):
                export = True  # it does not fit whole: worth the export
                continue
            if len(decomposition.layers) <= layers:
                raise cut_error(error, label) from None
            layers = len(decomposition.layers)
            largest = _finer(largest, decomposition.profile.layers[error.first : error.stop])
            continue
        if without_prefetch is not None:
            finer = packing.prefetch and len(decomposition.layers) > len(without_prefetch[0].layers)
            return (decomposition, packing) if finer else without_prefetch
        if packing.prefetch or len(packing.packs) == 1:
            return decomposition, packing
        without_prefetch = (decomposition, packing)
        layers = len(decomposition.layers)
        largest = _finer(largest, decomposition.profile.layers)


def _finer(largest: int | None, layers: Sequence[LayerProfile]) -> int:
    """A limit on a block's weights under which the largest of layers is cut."""
    limit = max(layer.param_bytes + layer.buffer_bytes for layer in layers) - 1  # its own, not what it borrows
    return limit if largest is None else min(largest, limit)


def groups_for(mode: str, devices: int, microbatches: int) -> int:
    """Micro-batch groups per step: one per device in vDP (at most one per micro-batch), else one."""
    return max(1, min(devices, microbatches)) if mode == "vdp" else 1


def ranking_run(jobs: list[Job], args: Arguments, budgets: dict[str, int], hardware: Hardware, mode: str
                ) -> Simulation:
    """The simulation the plan's choices compare: every job for a few steps (RANKING_STEPS, fewer where it trains
    fewer) under the run's options."""
    options = args.options
    steps = [min(job.steps or 1, RANKING_STEPS) for job in jobs]
    samples = [step_samples(args, job) for job in jobs]
    return simulate_jobs(jobs, steps, samples, budgets, hardware, options.prefetch, options.policy, mode,
                         options.stash)


def choose_mode(
    candidates: list[Candidate], args: Arguments, budgets: dict[str, int], hardware: Hardware
) -> tuple[str, dict[str, float]]:
    """The execution mode to run: the one given, or with "auto" the one the simulator predicts fastest on a few
    steps; returns it and the predicted seconds per step of every mode it simulated."""
    options = args.options
    candidates_modes = MODES if options.mode == "auto" else (options.mode,)
    if options.mode == "auto" and len(budgets) == 1:
        candidates_modes = ("free",)
    predicted = {}
    for mode in candidates_modes:
        groups = groups_for(mode, len(budgets), options.microbatches)
        jobs = [dataclasses.replace(candidate.job, groups=groups) for candidate in candidates]
        predicted[mode] = ranking_run(jobs, args, budgets, hardware, mode).step_seconds()
    chosen = min(predicted, key=lambda name: predicted[name])
    if options.mode == "auto":
        logger.info("mode auto: predicted %s per step; running %s",
                    ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in predicted.items()), chosen)
    return chosen, predicted


def settle_homes(candidates: list[Candidate], budgets: dict[str, int], machines: dict[str, str]) -> list[Candidate]:
    """Home every single-pack job that fits a device of its machine whole, and re-cut the others for the room
    left there."""
    settled = list(candidates)
    for machine in dict.fromkeys(candidate.job.machine for candidate in candidates):
        indices = [index for index, candidate in enumerate(candidates) if candidate.job.machine == machine]
        own = {device: budget for device, budget in budgets.items() if machines.get(device, "") == machine}
        for index, candidate in zip(indices, settle_machine([candidates[index] for index in indices], own)):
            settled[index] = candidate
    return settled


def settle_machine(candidates: list[Candidate], budgets: dict[str, int]) -> list[Candidate]:
    """settle_homes on one machine's devices."""
    packings = [candidate.job.packing for candidate in candidates]
    floors = [minimal_budget(c.profile, c.job.packing.microbatch_samples, prefetch=True) for c in candidates]
    homes, room = choose_homes(packings, [c.job.state_ratio for c in candidates], budgets, floors)
    left = min(room.values())
    settled = []
    for index, candidate in enumerate(candidates):
        job = dataclasses.replace(candidate.job, home=homes.get(index))
        if homes and job.home is None and left < min(budgets.values()):
            job = dataclasses.replace(job, packing=cut(candidate.profile, left, job.packing.microbatch_samples,
                                                       job.label, job.packing.ahead))
            logger.info("%s (re-cut beside homed models)", job.packing.explain())
        settled.append(dataclasses.replace(candidate, job=job))
    return settled


def with_depth(job: Job, depth: int | str, hardware: Hardware) -> Job:
    """A homed single-pack job with the steps each of its tasks runs: depth as given, or with "auto" from its
    predicted step time and the task's cost first, and re-cut from its measured step time as it runs. A task's
    cost is Dask's per task and the flush of the job's weights and optimizer state to the host store that ends
    every homed task."""
    if not runs_spans(job):
        return job
    if isinstance(depth, int):
        return dataclasses.replace(job, depth=depth)
    task_seconds = homed_task_seconds(job, hardware)
    return dataclasses.replace(job, task_seconds=task_seconds,
                               depth=steps_per_task(job.step_seconds, task_seconds, job.batch_bytes, job.steps))


def with_tasks(jobs: list[Job], args: Arguments, budgets: dict[str, int], hardware: Hardware, mode: str
               ) -> list[Job]:
    """The jobs with the packs each swapped job's task runs and their updates placed, chosen together: of every way
    of cutting the tasks (section_ways) with every placement of its updates (update_ways), the one the simulator
    predicts fastest (a whole pass a task leaves no later pack's backward for an update beside the device to
    overlap). A tie keeps the earlier: fewer recomputes, then fewer bytes across the link."""
    ways = {(cut, placed): placing
            for cut, cutting in section_ways(jobs, args, budgets, hardware, mode).items()
            for placed, placing in update_ways(cutting, args, budgets).items()}
    if len(ways) == 1 or all(job.home is not None for job in jobs):
        return next(iter(ways.values()))
    predicted = {key: ranking_run(way, args, budgets, hardware, mode).step_seconds() for key, way in ways.items()}
    chosen = min(predicted, key=lambda key: predicted[key])
    cuts = list(dict.fromkeys(cut for cut, _ in ways))
    if len(cuts) > 1:
        best = {cut: min((key for key in predicted if key[0] == cut), key=lambda key: predicted[key]) for cut in cuts}
        logger.info("packs_per_task auto: predicted %s per step; %s", ", ".join(
            f"{cut} {predicted[key] * 1e3:.1f} ms (updates {key[1]})" for cut, key in best.items()), chosen[0])
    placements = [key for key in predicted if key[0] == chosen[0]]
    if len(placements) > 1:
        logger.info("updates: predicted per step %s; %s", ", ".join(
            f"{key[1]} {predicted[key] * 1e3:.1f} ms" for key in placements), chosen[1])
    return ways[chosen]


def section_ways(jobs: list[Job], args: Arguments, budgets: dict[str, int], hardware: Hardware, mode: str
                 ) -> dict[str, list[Job]]:
    """The ways to cut the swapped jobs' passes into tasks worth comparing: packs_per_task as given, or with "auto" a
    pack a task; sections of as many packs as keep a task's cost (Hardware.task_cost: Dask's, measured on the
    cluster, and the runtime's handling, fitted) a small share of a section's forward (tasks.amortize; a pack's
    forward counted with the host's work for its call, Hardware.call_seconds), in at least one section per device in
    vpp (whose devices each run their own); and a whole pass a task (a section per device in vpp). Sections are left
    out where the task cost proposes none (a section other than a pass's last recomputes its packs' inputs: one more
    forward, and its weights read once more)."""
    per_task = args.options.packs_per_task
    cut = [job.home is None and len(job.packing.packs) > 1 for job in jobs]
    if isinstance(per_task, int):
        return {"as given": [dataclasses.replace(job, sections=even_sections(len(job.packing.packs), per_task))
                             if here else job for job, here in zip(jobs, cut)]}
    fewest = len(budgets) if mode == "vpp" else 1
    proposed = [
        dataclasses.replace(job, sections=pack_sections(
            [hardware.with_calls(pack.forward_seconds_per_sample * job.packing.microbatch_samples
                                 / hardware.compute_scale, 1) for pack in job.packing.packs], hardware.task_cost,
            fewest))
        if here else job
        for job, here in zip(jobs, cut)]
    if all(job.sections == () for job in proposed):
        return {"a pack a task": jobs}
    whole = [dataclasses.replace(job, sections=even_sections(len(job.packing.packs),
                                                             -(-len(job.packing.packs) // fewest))) if here else job
             for job, here in zip(jobs, cut)]
    ways = {"a pack a task": jobs, "sections": proposed}
    if [job.sections for job in whole] != [job.sections for job in proposed]:
        ways["a pass a task"] = whole
    return ways


def update_ways(jobs: list[Job], args: Arguments, budgets: dict[str, int]) -> dict[str, list[Job]]:
    """The placements of the jobs' updates the options leave to compare, the host's first: a swapped job's in its
    bwd tasks on the host store, in upd tasks beside its device (overlap_update, tasks.graph), or in its bwd tasks
    on its device (update_on, tasks.updates). With a scaled loss (fp16) or clipping, always upd tasks; a job that
    cannot update on its device updates on the host."""
    options = args.options
    swapped = [job.home is None for job in jobs]
    beside = True if any(job.whole_step for job in jobs) else options.overlap_update  # runtime.scaler, .clipping
    ways: dict[str, list[Job]] = {}
    if options.update_on != "device":
        for name, overlap in (("in backward", False), ("beside", True)):
            if beside is None or beside is overlap:
                ways[name] = [dataclasses.replace(job, overlap=overlap and here) for job, here in zip(jobs, swapped)]
    if beside is not True and options.update_on != "host":
        budget = min(budgets.values())
        device = []
        for job, here in zip(jobs, swapped):
            job = dataclasses.replace(job, overlap=False)
            packs = packs_on_device(job, budget) if here else ()
            stepped = [index for index, pack in enumerate(job.packing.packs) if pack.grad_bytes]
            if here and len(packs) < len(stepped):
                why = why_not_on_device(job) or "their optimizer state does not fit beside their weights and gradients"
                left = sorted(set(stepped) - set(packs))
                logger.info("%s: packs %s update on the host store: %s", job.label, left, why)
            device.append(dataclasses.replace(job, device_updates=packs))
        if any(job.device_update for job in device) or not ways:
            ways["on the device"] = device
    return ways


def with_stashes(jobs: list[Job], args: Arguments, budgets: dict[str, int], hardware: Hardware, mode: str
                 ) -> list[Job]:
    """The jobs with the packs whose forward stashes its activations for its backward (runtime.stash): those whose
    stash the simulator predicts still on the device when their backward runs, where the run stashes at all. A
    stash that does not last costs the forward autograd's bookkeeping, and the weights it pushes out their copies,
    for nothing."""
    if not args.options.stash or all(job.home is not None for job in jobs):
        return jobs
    run = ranking_run(jobs, args, budgets, hardware, mode)
    stashing = [dataclasses.replace(job, stashes=tuple(sorted(run.stashed.get(index, ()))))
                for index, job in enumerate(jobs)]
    for job in stashing:
        if job.home is None:
            logger.info("%s: stashes the activations of %d of its %d packs", job.label, len(job.stashes),
                        len(job.packing.packs))
    return stashing


def codes_for(plan: RunPlan, candidates: list[Candidate], args: Arguments, budget: int) -> list[JobCode]:
    """What each job of a recorded plan (a resumed run's) computes with: a model's own layers, or its array's."""
    codes = []
    for job in plan.jobs:
        if len(job.members) == 1:
            codes.append(candidates[job.members[0]].code)
        else:
            codes.append(build_array(list(job.members), candidates, args, budget, cutter=member_cutter(args)).code)
    return codes


def on_machines(jobs: list[Job], budgets: dict[str, int], machines: dict[str, str]) -> list[Job]:
    """The jobs, each homed on a machine (tasks.homes.assign_machines) where the devices are on more than the
    driver's; a job already homed on a device (a resumed plan's) stays on that device's machine."""
    if not any(machines.values()):
        return [dataclasses.replace(job, machine="") for job in jobs]
    work = [job.step_seconds * (job.steps or 1) for job in jobs]
    placed = assign_machines(work, [machines.get(device, "") for device in budgets])
    return [dataclasses.replace(job, machine=machines.get(job.home or "", machine))
            for job, machine in zip(jobs, placed)]


def clips(args: Arguments, members: tuple[int, ...]) -> tuple[float, ...]:
    """A job's clip: each member's largest gradient norm (inf where it is not clipped), empty where none is."""
    chosen = [args.clips[member] if args.clips else None for member in members]
    if all(clip is None for clip in chosen):
        return ()
    return tuple(math.inf if clip is None else clip for clip in chosen)


def build(
    args: Arguments, candidates: list[Candidate], budgets: dict[str, int], hardware: Hardware,
    machines: dict[str, str] | None = None, arrays_hardware: Hardware | None = None,
) -> tuple[RunPlan, list[JobCode]]:
    """The run's plan for the piloted models on devices with these budgets, predicted for hardware; machines gives
    each device's machine ("" for the driver's) where they are on several. arrays_hardware: the hardware fused arrays
    are predicted on (fitted to runs that trained these models as arrays, harmony.calls.keyed; None: hardware), and
    the plan too where it fuses any."""
    options = args.options
    machines = machines or {}
    candidates, fusion = fuse(candidates, args, budgets, hardware, member_cutter(args), arrays_hardware)
    if arrays_hardware is not None and any(len(candidate.job.members) > 1 for candidate in candidates):
        hardware = arrays_hardware
    mode, predicted = choose_mode(candidates, args, budgets, hardware)
    jobs = on_machines([candidate.job for candidate in candidates], budgets, machines)
    candidates = [dataclasses.replace(candidate, job=job) for candidate, job in zip(candidates, jobs)]
    if options.resident and options.group and mode != "vdp":
        candidates = settle_homes(candidates, budgets, machines)
    groups = groups_for(mode, len(budgets), options.microbatches)
    scaled = options.precision == "fp16"
    jobs = [with_depth(dataclasses.replace(c.job, groups=groups, scaled=scaled, clip=clips(args, c.job.members)),
                       options.steps_per_task, hardware) for c in candidates]
    jobs = with_tasks(jobs, args, budgets, hardware, mode)
    jobs = with_stashes(jobs, args, budgets, hardware, mode)
    plan = RunPlan(
        jobs=tuple(jobs),
        budgets=tuple(budgets.items()),
        mode=mode,
        options=options,
        hardware=hardware,
        fusion=tuple(fusion),
        predicted_modes=tuple(predicted.items()),
        machines=tuple(machines.items()) if any(machines.values()) else (),
    )
    for machine in dict.fromkeys(job.machine for job in jobs if job.machine):
        labels = [job.label for job in jobs if job.machine == machine]
        logger.info("harmony: machine %s trains %d jobs: %s", machine, len(labels), ", ".join(labels))
    return plan, [candidate.code for candidate in candidates]


def replan_machines(plan: RunPlan, machines: dict[str, str]) -> RunPlan:
    """A recorded plan (a resumed run's) on the machines the devices are on now."""
    jobs = on_machines(list(plan.jobs), plan.devices, machines)
    return dataclasses.replace(plan, jobs=tuple(jobs),
                               machines=tuple(machines.items()) if any(machines.values()) else ())
