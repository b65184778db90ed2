"""Fuse models of one architecture on one loader into arrays of the best predicted size (a step of the plan).

For every group of fusable models (tasks.fusion), each candidate sub-array size is built as an array (runtime.array),
piloted, cut for the budget and simulated; the size with the best predicted throughput wins ("auto"), or the
largest that fits up to a cap (True, or an int). Under a built-in pruner the throughput counts only what each size
is expected to compute (tasks.pruning.computed_share): an array computes its members still training (at what an
array of that many is predicted to cost), a compiled one every member until all have stopped.
Each array takes the place of its first member, so jobs keep the order of the models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

import psutil
import torch
from torch import nn

from harmony import timings
from harmony.candidate import RANKING_STEPS, Candidate, model_device, pilot_batch, step_samples
from harmony.errors import BudgetTooSmall, ModelError
from harmony.runtime.array import ArrayLayer, array_kind, array_loss, layer_signature
from harmony.runtime.array_optimizer import ArrayOptimizer
from harmony.runtime.code import JobCode
from harmony.runtime.measure import update_rate
from harmony.runtime.pilot import borrowings, decompose
from harmony.runtime.stages import quiet_failures, sized_by_shapes
from harmony.tasks.amortize import even_sections
from harmony.tasks.fusion import (
    FusionChoice,
    candidate_sizes,
    choose_size,
    fusion_groups,
    narrowed_cost,
    split,
    trial_bytes,
)
from harmony.tasks.hardware import Hardware
from harmony.tasks.homes import choose_homes
from harmony.tasks.packing import LayerTooLarge, Packing, cut_packs, minimal_budget, with_update_rate
from harmony.tasks.profile import ModelProfile
from harmony.tasks.pruning import PRUNERS, computed_share, every_member
from harmony.tasks.runplan import PRECISIONS, Job
from harmony.tasks.simulator import model_step_seconds, simulate
from harmony.validate import Arguments, Cut

logger = logging.getLogger("harmony")


UNFUSED = {  # why a model is never fused, by the first item of its fusion key
    "loss-scaled": "precision='fp16' skips each model's steps by its own loss scale, not an array's",
}


def fusion_key(candidate: Candidate, args: Arguments) -> Hashable:
    """What must agree for two models to be fused: loader, validation loader, optimizer class and every layer's
    signature; for a model never fused, why (a key of UNFUSED) and its index."""
    index = candidate.job.members[0]
    if args.options.precision == "fp16":
        return ("loss-scaled", index)
    layers = tuple(layer_signature(layer) for layer in candidate.code.layers)
    ties = tuple(tuple(sorted(tied.items())) for tied in borrowings(list(candidate.code.layers)))
    validation = args.validation_of[index] if args.validation_of else None
    return (candidate.job.feed, validation, args.optimizer_classes[index], layers, ties)


def _label(members: list[int], args: Arguments) -> str:
    names = sorted({type(args.models[m]).__name__ for m in members})
    return f"array of models {','.join(map(str, members))} ({'/'.join(names)})"


class Unfusable(ModelError):
    """The members' layers fail as an array (a layer whose forward cannot run batched under vmap: a .item(), an out=
    operator): fuse="auto" trains such models unfused, fuse=True or k reports it."""


Cutter = Callable[[int, int], Candidate]  # a model piloted and cut for a budget (harmony.planner.member_cutter)


def build_array(members: list[int], candidates: list[Candidate], args: Arguments, budget: int,
                timed: ModelProfile | None = None, cutter: Cutter | None = None) -> Candidate:
    """Stack the members' layers into ArrayLayers, pilot the array (its layers' times and its update's from timed,
    an array of as many members of the same group, where given) and cut it into packs for budget.

    Each array layer holds its members' layers: where one does not fit budget, or the array fits only without
    room to prefetch where its members prefetch, the members are cut again by cutter for their share of budget
    (a traced model at finer blocks, one that fit whole exported), and the array built of those layers instead.

    Raises LayerTooLarge when the array's largest layer does not fit budget, Unfusable when it fails in its pilot
    (an array of whole models that vmap refuses is first built of the members cut apart: _cut_apart).
    """
    parts = [candidates[m] for m in members]
    if cutter is not None and _outgrows(parts, budget):
        return _recut(members, candidates, args, budget, timed, cutter, None)
    try:
        array = _stacked(members, parts, candidates, args, budget, timed)
    except LayerTooLarge as error:
        if cutter is None:
            raise
        return _recut(members, candidates, args, budget, timed, cutter, error)
    except Unfusable as refused:
        if cutter is None or len(parts[0].code.layers) > 1:
            raise
        try:
            with quiet_failures():  # an export that fails is an answer, not an error to show
                apart = _cut_apart(members, candidates, args, budget, timed, cutter)
        except (BudgetTooSmall, ModelError):  # not cut, or its stages fail too: the whole model's refusal says why
            apart = None
        if apart is None:
            raise refused
        return apart
    if cutter is None or array.job.packing.prefetch or not all(part.job.packing.prefetch for part in parts):
        return array
    return _recut(members, candidates, args, budget, timed, cutter, array)


def _cut_apart(members: list[int], candidates: list[Candidate], args: Arguments, budget: int,
               timed: ModelProfile | None, cutter: Cutter) -> Candidate | None:
    """The array of members whose whole forward vmap refuses (gradient checkpointing inside a model calls
    requires_grad_), built of the members cut by cutter: exported, their stages compute the forward without the
    calls vmap refuses. A member that fits its share of budget whole is cut for a budget just under its pack, which
    only its export (or finer blocks) fits. None where that does not cut it finer."""
    share = min(budget // len(members), candidates[members[0]].job.packing.packs[0].cost.total - 1)
    finer = [cutter(m, share) for m in members]
    if len(finer[0].code.layers) == 1:
        return None
    return _stacked(members, finer, candidates, args, budget, timed)


def _outgrows(parts: list[Candidate], budget: int) -> bool:
    """Whether the array of parts, as they are cut, cannot fit budget: a layer's stacked parameters, their gradients
    and the largest one's fresh gradient alone hold more (a part of what tasks.packing counts for a pack of it).
    Such an array is not piloted: its pilot would run every member forward and backward only to learn that."""
    largest = max(layer.param_bytes + sum(spec.nbytes for spec in layer.params if spec.name not in layer.frozen)
                  + max((spec.nbytes for spec in layer.params), default=0) for layer in parts[0].profile.layers)
    return len(parts) * largest > budget


def _recut(members: list[int], candidates: list[Candidate], args: Arguments, budget: int,
           timed: ModelProfile | None, cutter: Cutter, built: Candidate | LayerTooLarge | None) -> Candidate:
    """The array of members cut again by cutter for their share of budget, where that cuts them finer and the array
    then prefetches; else built (the array of the members as they were cut, which fits only without prefetching),
    or where that did not fit, its error raised (None: not built, as it outgrows budget; built then for its
    error)."""
    parts = [candidates[m] for m in members]
    try:
        finer = [cutter(m, budget // len(members)) for m in members]
    except BudgetTooSmall:
        finer = None
    recut: Candidate | LayerTooLarge = built
    if finer is not None and len(finer[0].code.layers) > len(parts[0].code.layers):
        try:
            recut = _stacked(members, finer, candidates, args, budget, timed)
        except LayerTooLarge as error:
            recut = error
    if isinstance(recut, Candidate) and (recut.job.packing.prefetch or not isinstance(built, Candidate)):
        return recut
    if built is None:
        return _stacked(members, parts, candidates, args, budget, timed)
    if isinstance(built, LayerTooLarge):
        raise built
    return built


def _stacked(members: list[int], parts: list[Candidate], candidates: list[Candidate], args: Arguments, budget: int,
             timed: ModelProfile | None) -> Candidate:
    """The array of parts (the members as cut), piloted and cut into packs for budget (see build_array). An array of
    as many members of its architecture, cut alike, piloted before in this planning (Arguments.cuts) gives it its
    profile where every size the members' chains compute is fixed by their inputs' shapes (sized_by_shapes): only
    its output is computed."""
    label = _label(members, args)
    layers = _array_layers([part.code.layers for part in parts])
    sample, target, sizes = pilot_batch(args, members[0])
    key = ("array", _kept_key(members, candidates, args), tuple(layer.description for layer in parts[0].profile.layers))
    sized = sized_by_shapes(parts[0].code.layers)
    alike = args.cuts.get(key) if sized else None
    try:
        with quiet_failures():  # a failure is reported below, as this array's
            decomposition = decompose(nn.Sequential(*layers), sample, label,
                                      autocast=PRECISIONS[args.options.precision], timed=timed,
                                      shares=parts[0].profile, cut=(list(layers), []) if alike else None,
                                      alike=alike.profile if alike else None)
    except Exception as error:
        raise Unfusable(members[0], f"{label} raised {type(error).__name__}: {error} in its fused forward during "
                        "the pilot pass; pass fuse=False to train these models unfused") from error
    stacked = tuple(replace(layer, halved=frozenset()) for layer in decomposition.profile.layers)
    decomposition = replace(decomposition, profile=replace(decomposition.profile, layers=stacked))  # float32 stacks
    if sized:
        args.cuts.setdefault(key, Cut(members[0], [], [], decomposition.profile))
    loss_fns = [args.loss_fns[m] for m in members]
    loss = array_loss(loss_fns, decomposition.output, target) if all(fn is not None for fn in loss_fns) else None
    factories = [args.optimizers[m] for m in members]
    optimizer = ArrayOptimizer(factories) if all(f is not None for f in factories) else None  # type: ignore[arg-type]
    packing = cut_packs(decomposition.profile, budget, sizes[0], args.ahead)
    rate = (timed.update_seconds_per_byte if timed else
            update_rate(optimizer, decomposition.layers) if optimizer else None)
    profile, packing = with_update_rate(decomposition.profile, packing, rate)
    code = JobCode(tuple(decomposition.layers), loss, optimizer, tuple(part.code.layers for part in parts))
    return Candidate(_array_job(members, candidates, args, packing, sizes), code, profile)


def _array_layers(chains: list[tuple[nn.Module, ...]]) -> list[ArrayLayer]:
    """An ArrayLayer per position of the members' chains, a weight that two positions read (tied) stacked once, by
    the first, and read from its stack by the later ones; where the layers it joins would lay their stacks out
    differently (a linear layer's transposed, another's not: an embedding and the head tied to it), both run through
    vmap."""
    ties = borrowings(list(chains[0]))
    kinds = [array_kind(layer, position == 0) for position, layer in enumerate(chains[0])]
    general = set()
    for position, tied in enumerate(ties):
        for lender, _ in tied.values():
            if kinds[position] != kinds[lender]:
                general |= {position, lender}
    layers: list[ArrayLayer] = []
    for position in range(len(chains[0])):
        stacks = {name: getattr(layers[lender], layers[lender].attribute(held))
                  for name, (lender, held) in ties[position].items()}
        layers.append(ArrayLayer([chain[position] for chain in chains], shared_input=position == 0, tied=stacks,
                                 general=position in general))
    return layers


@dataclass(frozen=True)
class Predicted:
    """A trial array predicted from timings a previous call kept (harmony.timings), never built: its job and
    profile, what a prediction reads of a Candidate."""

    job: Job
    profile: ModelProfile


def predicted_array(members: list[int], candidates: list[Candidate], args: Arguments, budget: int,
                    profile: ModelProfile) -> Predicted:
    """An array of members as build_array would plan it, from the profile of an array of as many members of the same
    architecture (kept timings), without stacking its layers. Raises LayerTooLarge as build_array does."""
    sizes = pilot_batch(args, members[0])[2]
    packing = cut_packs(profile, budget, sizes[0], args.ahead)
    profile, packing = with_update_rate(profile, packing, profile.update_seconds_per_byte)
    return Predicted(_array_job(members, candidates, args, packing, sizes), profile)


def _array_job(members: list[int], candidates: list[Candidate], args: Arguments, packing: Packing,
               sizes: list[int]) -> Job:
    """The job of an array of members cut into packing (sizes: its micro-batches' samples)."""
    first = candidates[members[0]].job
    return Job(
        members=tuple(members),
        label=_label(members, args),
        feed=first.feed,
        seed=members[0],
        packing=packing,
        steps=first.steps,
        step_seconds=model_step_seconds(packing, sum(sizes), Hardware()),
        batch_bytes=first.batch_bytes,
        state_ratio=first.state_ratio,
    )


def _kept_key(members: list[int], candidates: list[Candidate], args: Arguments) -> Hashable:
    """Under which key harmony.timings keeps the timings of an array of as many members of this architecture."""
    sample = pilot_batch(args, members[0])[0]
    return ("trial", fusion_key(candidates[members[0]], args)[2:], len(members),
            timings.context(sample, args.options.precision))


@dataclass(frozen=True)
class Sizing:
    """What choosing a sub-array size needs: the arguments, the devices' budgets, the hardware models are predicted
    on, how a member is cut finer for an array (build_array), and the hardware arrays are predicted on (None:
    hardware; harmony.calls.keyed: each way with the host costs fitted to runs of it)."""

    args: Arguments
    budgets: dict[str, int]
    hardware: Hardware
    cutter: Cutter | None = None
    arrays: Hardware | None = None


def _homes(arrays: Sequence[Candidate | Predicted], sizing: Sizing) -> dict[int, str]:
    """The arrays (by index) that fit a device whole, homed there, as the plan would home them."""
    packings = [array.job.packing for array in arrays]
    floors = [minimal_budget(array.profile, array.job.packing.microbatch_samples, prefetch=True) for array in arrays]
    homes, _ = choose_homes(packings, [array.job.state_ratio for array in arrays], sizing.budgets, floors)
    return homes


def _predict(arrays: Sequence[Candidate | Predicted], sizing: Sizing) -> float:
    """Predicted seconds for every array to advance one step, with the arrays that fit a device homed, and the tasks
    of those swapped as the plan may cut them (harmony.planner.with_tasks): with packs_per_task="auto" a pack a task
    or a whole pass a task, the faster (Dask's cost per task weighs on a pack a task); a count, as given."""
    options = sizing.args.options
    homes = _homes(arrays, sizing)
    packs = [len(array.job.packing.packs) for array in arrays]
    per_task = options.packs_per_task
    ways = ["auto", 1] if per_task == "auto" else [int(per_task)]  # "auto": a whole pass a task, or a pack a task
    cuts = {tuple(() if index in homes else even_sections(count, count if way == "auto" else way)
                  for index, count in enumerate(packs)) for way in ways}  # alike where no array is cut: simulated once
    return min(simulate([array.job.packing for array in arrays], [RANKING_STEPS] * len(arrays),
                        [step_samples(sizing.args, a.job) for a in arrays], sizing.budgets, sizing.hardware,
                        prefetch=options.prefetch, policy=options.policy, mode="free", groups=[1] * len(arrays),
                        homes=homes, stash=options.stash, sections=list(sections)).makespan / RANKING_STEPS
               for sections in cuts)


def _choose(
    group: list[int], candidates: list[Candidate], sizing: Sizing, built: dict[tuple[int, ...], Candidate]
) -> FusionChoice:
    """The sub-array size for one group: the best predicted ("auto"), or the largest that fits up to a cap.

    Of the arrays it builds to predict with, only the best predicted one is left in built, keyed by its members,
    for reuse: each holds a stacked copy of its members' weights, and a group of large models cannot hold one
    copy per candidate size at once.
    """
    fuse = sizing.args.options.fuse
    sizing, devices = _share_of_devices(group, candidates, sizing)
    sizes = candidate_sizes(len(group))
    if fuse != "auto":
        cap = len(group) if fuse is True else min(int(fuse), len(group))
        sizes = sorted({size for size in sizes if size < cap} | {cap}, reverse=True)
    predicted: dict[int, float | None] = {}
    unbuilt: dict[int, int] = {}
    shares: dict[int, float] = {}
    interleaved = sizing.args.pruner is not None  # see FusionChoice
    best: tuple[float, int] | None = None  # the best array's (cost, -size), the order choose_size ranks by
    samples = pilot_batch(sizing.args, group[0])[2][0]
    for size in sizes:
        need, free = _trial_room(group, size, candidates, sizing.args, samples)
        if need > free:
            logger.info("sub-arrays of %d not tried: the trial array needs %.1f GB, %.1f GB are free", size,
                        need / 1e9, free / 1e9)
            predicted[size], unbuilt[size] = None, need
            continue
        predicted[size], array = _trial(group, size, candidates, sizing)
        share = _share(group, size, array, predicted, candidates, sizing)
        if share is not None:
            shares[size] = share
        rank = (predicted[size] * shares.get(size, 1.0), -size) if array is not None else None
        if rank is not None and (best is None or rank < best):
            if best is not None:
                built.pop(tuple(group[: -best[1]]), None)
            if isinstance(array, Candidate):
                built[tuple(group[:size])] = array
            best = rank
        del array  # before the next size's array is built
        if fuse != "auto" and predicted[size] is not None:
            return FusionChoice(tuple(group), predicted, size, unbuilt, shares, interleaved, *devices)
    return choose_size(group, predicted, unbuilt, shares, interleaved, devices)


def _share_of_devices(group: list[int], candidates: list[Candidate], sizing: Sizing
                      ) -> tuple[Sizing, tuple[int, int]]:
    """sizing on the devices a group's sizes are predicted on, and (how many, of how many; (0, 0) for all): as many
    of the run's devices (those of the largest budgets) as the group's share of the run's compute, every model's
    unfused (its steps' work, as the pilot predicts it), at least one. Groups that train beside each other are then
    each sized for the devices they will have: on two devices, two groups of three small models train fastest as
    an array each, one to a device, though either alone would train faster unfused across both. Under a pruner, all
    of them: the models that stop free their devices for those left, whichever group those are in
    (docs/performance.md, "A group sized on its share of the devices")."""
    if sizing.args.pruner is not None:
        return sizing, (0, 0)
    counted = all(candidate.job.steps is not None for candidate in candidates)

    def work(candidate: Candidate) -> float:
        seconds = model_step_seconds(candidate.job.packing, step_samples(sizing.args, candidate.job), sizing.hardware)
        return seconds * (candidate.job.steps or 1) if counted else seconds

    total = sum(work(candidate) for candidate in candidates)
    share = sum(work(candidates[member]) for member in group) / total if total > 0 else 1.0
    count = max(1, round(share * len(sizing.budgets)))
    if count >= len(sizing.budgets):
        return sizing, (0, 0)
    largest = sorted(sizing.budgets, key=lambda name: -sizing.budgets[name])[:count]
    return replace(sizing, budgets={name: sizing.budgets[name] for name in largest}), (count, len(sizing.budgets))


def _share(group: list[int], size: int, array: Candidate | Predicted | None, predicted: dict[int, float | None],
           candidates: list[Candidate], sizing: Sizing) -> float | None:
    """The share of its steps the group in sub-arrays of size (array: one of them, None for size 1) is expected to
    compute under the run's built-in pruner (tasks.pruning.computed_share): uncompiled arrays, homed or swapped,
    compute their members still training alone (runtime.array.narrowed, runtime.rows), at what the sizes predicted
    so far say an array of that many costs (tasks.fusion.narrowed_cost); compiled ones every member until all have
    stopped. None where nothing is pruned, the pruner is the user's own (how many it stops is not known) or the
    run's length is not known."""
    args = sizing.args
    steps = candidates[group[0]].job.steps
    every = args.options.eval_every
    if args.pruner not in PRUNERS.values() or steps is None or every is None:
        return None
    arrays = split(group, size)
    narrowed = array is not None and not args.options.compile
    cost = narrowed_cost(len(group), predicted, len(sizing.budgets)) if narrowed else every_member
    return computed_share([len(members) for members in arrays], len(args.models), steps, every, cost)


def _trial_room(group: list[int], size: int, candidates: list[Candidate], args: Arguments, samples: int
                ) -> tuple[int, int]:
    """The bytes a trial array of size members of group would hold while it is piloted at samples a micro-batch (0
    for size 1, which builds none), and the bytes free where it would be built (the host, or the members' GPU)."""
    if size == 1:
        return 0, 0
    need = trial_bytes(candidates[group[0]].profile, size, samples)
    device = model_device(args.models[group[0]])
    if device.type == "cuda":
        return need, torch.cuda.mem_get_info(device)[0]
    return need, psutil.virtual_memory().available


def _trial(group: list[int], size: int, candidates: list[Candidate], sizing: Sizing
           ) -> tuple[float | None, Candidate | Predicted | None]:
    """The group's predicted seconds a step in sub-arrays of size (None where they do not fit), and the array
    built to predict it, or predicted from kept timings (None for size 1, or where it does not fit)."""
    if size == 1:
        return _predict([candidates[m] for m in group], sizing), None
    key = _kept_key(group[:size], candidates, sizing.args)
    kept = timings.KEPT.get(key)
    budget = min(sizing.budgets.values())
    array: Candidate | Predicted | None = None
    try:
        if kept is not None:  # an array of members cut as they are now, or as build_array cut them finer
            try:
                array = predicted_array(group[:size], candidates, sizing.args, budget, kept)
            except LayerTooLarge:
                array = None
        if array is None or (not array.job.packing.prefetch and sizing.cutter is not None):  # members cut finer?
            if (key, budget) in timings.NO_ROOM:  # an earlier call built it at this budget
                if array is None:
                    return None, None
            else:
                try:
                    array = build_array(group[:size], candidates, sizing.args, budget, kept, sizing.cutter)
                except LayerTooLarge:
                    timings.NO_ROOM.add((key, budget))
                    raise
                timings.KEPT[key] = array.profile
                if not array.job.packing.prefetch and sizing.cutter is not None:
                    timings.NO_ROOM.add((key, budget))
    except LayerTooLarge:
        return None, None
    except Unfusable as error:
        if sizing.args.options.fuse != "auto":
            raise
        logger.warning("%s: fuse='auto' trains them unfused, as their array raised %s: %s",
                       _label(group[:size], sizing.args), type(error.__cause__).__name__, error.__cause__)
        return None, None
    if not array.job.packing.prefetch and all(candidates[m].job.packing.prefetch for m in group):
        return None, None  # it fits only without prefetching, where its members prefetch alone
    arrays = replace(sizing, hardware=sizing.arrays or sizing.hardware)  # with the host costs runs of arrays fitted
    return _predict([array] * len(split(group, size)), arrays), array


def fuse(
    candidates: list[Candidate], args: Arguments, budgets: dict[str, int], hardware: Hardware,
    cutter: Cutter | None = None, arrays: Hardware | None = None,
) -> tuple[list[Candidate], list[FusionChoice]]:
    """The jobs with every group of fusable models replaced by arrays of the chosen size, and the choices (cutter:
    how a member is cut finer for an array, see build_array; arrays: the hardware arrays are predicted on, see
    Sizing)."""
    if args.options.fuse is False:
        return candidates, []
    keys = [fusion_key(candidate, args) for candidate in candidates]
    if args.options.fuse is True and len(candidates) > 1:
        for index, key in enumerate(keys):
            if isinstance(key, tuple) and len(key) == 2 and key[0] in UNFUSED:
                logger.warning("model %d (%s): fuse=True trains it unfused: %s", index,
                               type(args.models[index]).__name__, UNFUSED[key[0]])
    groups = fusion_groups(keys)
    sizing = Sizing(args, budgets, hardware, cutter, arrays)
    built: dict[tuple[int, ...], Candidate] = {}
    choices = [_choose(group, candidates, sizing, built) for group in groups]
    first_of: dict[int, Candidate] = {}
    for choice in choices:
        logger.info("%s", choice.explain(type(args.models[choice.members[0]]).__name__))
        for members in choice.arrays:
            if len(members) == 1:
                first_of[members[0]] = candidates[members[0]]
                continue
            key = _kept_key(members, candidates, args)  # arrays of a size take the timings of the first one timed
            array = built.get(tuple(members)) or build_array(members, candidates, args, min(budgets.values()),
                                                             timings.KEPT.get(key), cutter)
            timings.KEPT.setdefault(key, array.profile)
            logger.info("%s", array.job.packing.explain())
            first_of[members[0]] = array
    grouped = {model for choice in choices for model in choice.members}
    return [first_of.get(index, candidate) for index, candidate in enumerate(candidates)
            if index in first_of or index not in grouped], choices
