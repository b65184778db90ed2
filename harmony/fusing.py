"""Shared by train and plan: fuse models of one architecture on one loader into arrays of the best size."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from torch import nn

from harmony.errors import ModelError
from harmony.prepare import RANKING_STEPS, first_batch_samples, pilot_batch
from harmony.runtime.array import ArrayLayer, array_loss, layer_signature
from harmony.runtime.array_optimizer import ArrayOptimizer
from harmony.runtime.job import JobModel
from harmony.runtime.pilot import decompose
from harmony.tasks.fusion import FusionChoice, candidate_sizes, choose_size, fusion_groups, split
from harmony.tasks.packing import LayerTooLarge, minimal_budget, plan_packs
from harmony.tasks.residency import choose_homes
from harmony.tasks.simulator import Hardware, model_step_seconds, simulate
from harmony.validate import Arguments

logger = logging.getLogger("harmony")


def fusion_key(job: JobModel, args: Arguments) -> Hashable:
    """What must agree for two models to be fused: loader, optimizer class and every layer's signature."""
    index = job.members[0]
    return (job.feed, args.optimizer_classes[index], tuple(layer_signature(layer) for layer in job.layers))


def _label(members: list[int], jobs: list[JobModel]) -> str:
    names = sorted({jobs[m].module.__class__.__name__ for m in members})
    return f"array of models {','.join(map(str, members))} ({'/'.join(names)})"


def build_array(members: list[int], jobs: list[JobModel], args: Arguments, budget: int) -> JobModel:
    """Stack the members' layers into ArrayLayers, pilot the array and cut it into packs for budget.

    Raises LayerTooLarge when the array's largest layer does not fit budget.
    """
    member_jobs = [jobs[m] for m in members]
    label = _label(members, jobs)
    layers = [
        ArrayLayer([job.layers[position] for job in member_jobs], shared_input=position == 0)
        for position in range(len(member_jobs[0].layers))
    ]
    array = nn.Sequential(*layers)
    sample, target, sizes = pilot_batch(args, members[0])
    try:
        decomposition = decompose(array, sample, label)
    except Exception as error:
        raise ModelError(members[0], f"{label} raised {type(error).__name__}: {error} in its fused forward during "
                         "the pilot pass; pass fuse=False to train these models unfused") from error
    loss_fns = [args.loss_fns[m] for m in members]
    loss = array_loss(loss_fns, decomposition.output, target) if all(fn is not None for fn in loss_fns) else None
    factories = [args.optimizers[m] for m in members]
    optimizer = ArrayOptimizer(factories) if all(f is not None for f in factories) else None
    plan = plan_packs(decomposition.profile, budget, sizes[0])
    return JobModel(
        module=array,
        layers=decomposition.layers,
        plan=plan,
        loss_fn=loss,  # type: ignore[arg-type]
        optimizer=optimizer,  # type: ignore[arg-type]
        feed=member_jobs[0].feed,
        seed=members[0],
        expected_steps=member_jobs[0].expected_steps,
        step_seconds=model_step_seconds(plan, sizes[0] * len(sizes), Hardware()),
        profile=decomposition.profile,
        samples=sizes[0],
        members=tuple(members),
        member_layers=[job.layers for job in member_jobs],
        state_ratio=member_jobs[0].state_ratio,
        label=label,
    )


@dataclass(frozen=True)
class Sizing:
    """What choosing a sub-array size needs: the arguments, the devices' budgets and the simulator's settings."""

    args: Arguments
    budgets: dict[str, int]
    hardware: Hardware
    prefetch: bool
    policy: str


def _predict(arrays: list[JobModel], sizing: Sizing) -> float:
    """Predicted seconds for every array to advance one step, with the arrays that fit a device resident."""
    plans = [array.plan for array in arrays]
    floors = [minimal_budget(array.profile, array.samples) if array.profile else 0 for array in arrays]
    homes, _ = choose_homes(plans, [array.state_ratio for array in arrays], sizing.budgets, floors)
    run = simulate(plans, [RANKING_STEPS] * len(arrays), first_batch_samples(sizing.args, arrays), sizing.budgets,
                   sizing.hardware, prefetch=sizing.prefetch, policy=sizing.policy, mode="free",
                   groups=[1] * len(arrays), homes=homes)
    return run.makespan / RANKING_STEPS


def _choose(
    group: list[int], jobs: list[JobModel], sizing: Sizing, fuse: Any, built: dict[tuple[int, ...], JobModel]
) -> FusionChoice:
    """The sub-array size for one group: the best predicted ("auto"), or the largest that fits up to a cap.

    Every array it builds to predict with is left in built, keyed by its members, for reuse.
    """
    budget = min(sizing.budgets.values())
    sizes = candidate_sizes(len(group))
    if fuse != "auto":
        cap = len(group) if fuse is True else min(fuse, len(group))
        sizes = sorted({size for size in sizes if size < cap} | {cap}, reverse=True)
    predicted: dict[int, float | None] = {}
    for size in sizes:
        if size == 1:
            arrays = [jobs[m] for m in group]
        else:
            try:
                array = build_array(group[:size], jobs, sizing.args, budget)
            except LayerTooLarge:
                predicted[size] = None
                continue
            built[tuple(group[:size])] = array
            arrays = [array] * len(split(group, size))
        predicted[size] = _predict(arrays, sizing)
        if fuse != "auto":
            return FusionChoice(tuple(group), predicted, size)
    return choose_size(group, predicted)


def fuse_jobs(
    jobs: list[JobModel],
    args: Arguments,
    budgets: dict[str, int],
    hardware: Hardware,
    prefetch: bool,
    policy: str,
    fuse: Any,
) -> tuple[list[JobModel], list[FusionChoice]]:
    """Replace every group of fusable models by arrays of the chosen size; models that are not fused stay.

    Each array takes the place of its first member, so jobs keep the order of the models.
    """
    if fuse is False:
        return jobs, []
    groups = fusion_groups([fusion_key(job, args) for job in jobs])
    sizing = Sizing(args, budgets, hardware, prefetch, policy)
    built: dict[tuple[int, ...], JobModel] = {}
    choices = [_choose(group, jobs, sizing, fuse, built) for group in groups]
    first_of: dict[int, JobModel] = {}
    for choice in choices:
        logger.info("%s", choice.explain(type(args.models[choice.members[0]]).__name__))
        for array in choice.arrays:
            if len(array) == 1:
                first_of[array[0]] = jobs[array[0]]
                continue
            job = built.get(tuple(array)) or build_array(array, jobs, args, min(budgets.values()))
            logger.info("%s", job.plan.explain())
            first_of[array[0]] = job
    grouped = {model for choice in choices for model in choice.members}
    kept = [first_of.get(index, job) for index, job in enumerate(jobs) if index in first_of or index not in grouped]
    return kept, choices
