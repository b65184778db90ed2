"""Shared by train and plan: profile every model with the pilot pass and cut it into packs."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from harmony.errors import InputError, ModelError
from harmony.runtime.cache import tree_nbytes
from harmony.runtime.data import batch_size, split_tree
from harmony.runtime.job import JobModel
from harmony.runtime.pilot import decompose
from harmony.tasks.amortize import steps_per_task
from harmony.tasks.binding import MODES
from harmony.tasks.microbatch import split_sizes
from harmony.tasks.packing import LayerTooLarge, PackPlan, minimal_budget, plan_packs
from harmony.tasks.residency import choose_homes
from harmony.tasks.simulator import Hardware, model_step_seconds, simulate
from harmony.validate import Arguments, model_label

logger = logging.getLogger("harmony")


def _model_device(model: nn.Module) -> torch.device:
    tensor = next(iter([*model.parameters(), *model.buffers()]), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def expected_steps(args: Arguments, model: int) -> int | None:
    """How many steps a model will train, when its loader knows its length (or steps= says)."""
    if args.steps is not None:
        return args.steps
    loader = args.loaders[args.loader_of[model]].loader
    try:
        return args.epochs * len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def _to_device(tree: Any, device: torch.device) -> Any:
    """A copy of tree's tensors on device (a copy, so that the pilot pass cannot alter the user's batch)."""
    return tree_map(lambda t: t.to(device, copy=True) if isinstance(t, torch.Tensor) else t, tree)


def _check_loss(args: Arguments, index: int, label: str, output: Any, target: Any) -> None:
    """Call the model's loss once on the pilot output: it must work and return a scalar tensor."""
    try:
        loss = args.loss_fns[index](output, target)
    except Exception as error:
        raise InputError(f"loss_fn for {label} raised {type(error).__name__}: {error} when called "
                         "as loss_fn(output, target) on the first micro-batch") from error
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = "" if not isinstance(loss, torch.Tensor) else f" of shape {tuple(loss.shape)}"
        raise InputError(f"loss_fn for {label} returned {type(loss).__name__}{shape}; "
                         "it must return a scalar tensor (the mean loss over the micro-batch)")


def pilot_batch(args: Arguments, index: int) -> tuple[Any, Any, list[int]]:
    """The first micro-batch of model index's loader (inputs, targets, on the model's device) and the sizes."""
    inputs, targets = args.loaders[args.loader_of[index]].first
    sizes = split_sizes(batch_size(inputs), args.microbatches)
    device = _model_device(args.models[index])
    return _to_device(split_tree(inputs, sizes)[0], device), _to_device(split_tree(targets, sizes)[0], device), sizes


def prepare(args: Arguments, budget: int) -> tuple[list[JobModel], list[PackPlan]]:
    """Pilot-profile every model on its first micro-batch and cut it into packs that fit budget."""
    jobs = []
    plans = []
    for index, model in enumerate(args.models):
        label = model_label(index, model)
        sample, target, sizes = pilot_batch(args, index)
        try:
            decomposition = decompose(model, sample, label)
        except Exception as error:
            raise ModelError(index, f"{label} raised {type(error).__name__}: {error} in its forward "
                             "during the pilot pass") from error
        if args.loss_fns[index] is not None:
            _check_loss(args, index, label, decomposition.output, target)
        try:
            plan = plan_packs(decomposition.profile, budget, sizes[0])
        except LayerTooLarge as error:
            raise InputError(
                f"device_memory is too small for {label}: {error}. Raise device_memory to at least "
                f"{error.need.total:,} bytes, or use more micro-batches to shrink the activations"
            ) from None
        logger.info("%s", plan.explain())
        plans.append(plan)
        jobs.append(
            JobModel(
                module=model,
                layers=decomposition.layers,
                plan=plan,
                loss_fn=args.loss_fns[index],
                optimizer=args.optimizers[index],
                feed=args.loader_of[index],
                seed=index,
                expected_steps=expected_steps(args, index),
                step_seconds=model_step_seconds(plan, sizes[0] * len(sizes), Hardware()),
                profile=decomposition.profile,
                samples=sizes[0],
                members=(index,),
                state_ratio=args.optimizer_state_ratios[index],
                label=label,
            )
        )
    return jobs, plans


RANKING_STEPS = 3


def first_batch_samples(args: Arguments, jobs: list[JobModel]) -> list[int]:
    """Per job, the samples in its loader's first batch (what one step is planned for)."""
    return [batch_size(args.loaders[job.feed].first[0]) for job in jobs]


def groups_for(mode: str, devices: int, microbatches: int) -> int:
    """Micro-batch groups per step: one per device in vDP (at most one per micro-batch), else one."""
    return max(1, min(devices, microbatches)) if mode == "vdp" else 1


def choose_mode(
    mode: str,
    plans: list[PackPlan],
    steps: list[int],
    samples: list[int],
    budgets: dict[str, int],
    microbatches: int,
    hardware: Hardware,
    prefetch: bool,
    policy: str,
) -> tuple[str, dict[str, float]]:
    """The execution mode to run: the one given, or with "auto" the one the simulator predicts fastest.

    Modes are compared on a few steps (their ranking settles within two or three); returns the mode and
    the predicted seconds per step of every mode it simulated.
    """
    candidates = MODES if mode == "auto" else (mode,)
    if mode == "auto" and len(budgets) == 1:
        candidates = ("free",)
    sample_steps = [min(count, RANKING_STEPS) for count in steps]
    predicted = {}
    for candidate in candidates:
        groups = [groups_for(candidate, len(budgets), microbatches)] * len(plans)
        run = simulate(plans, sample_steps, samples, budgets, hardware, prefetch=prefetch, policy=policy,
                       mode=candidate, groups=groups)
        predicted[candidate] = run.step_seconds()
    chosen = min(predicted, key=lambda name: predicted[name])
    if mode == "auto":
        logger.info("mode auto: predicted %s per step; running %s",
                    ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in predicted.items()), chosen)
    return chosen, predicted


def arrange(
    jobs: list[JobModel],
    args: Arguments,
    budgets: dict[str, int],
    steps: list[int],
    hardware: Hardware,
    mode: str,
    prefetch: bool,
    policy: str,
    resident: bool,
    depth: int | str = "auto",
) -> tuple[str, dict[str, float]]:
    """Choose the execution mode, home the models that stay resident and set every job's groups, and the
    steps per task of resident single-pack jobs (depth, or with "auto" chosen from their predicted step time
    first and from their measured step time as they run).

    Returns the mode and what the simulator predicted for each mode it compared; jobs are updated in place.
    """
    plans = [job.plan for job in jobs]
    chosen, predicted = choose_mode(mode, plans, steps, first_batch_samples(args, jobs), budgets, args.microbatches,
                                    hardware, prefetch, policy)
    if resident and chosen != "vdp":
        settle_residency(jobs, args, budgets)
    for job in jobs:
        job.groups = groups_for(chosen, len(budgets), args.microbatches)
        if job.home is not None and len(job.plan.packs) == 1 and job.groups == 1:
            if isinstance(depth, int):
                job.depth = depth
                continue
            job.task_seconds = max(hardware.task_overhead, hardware.task_cpu)
            job.batch_bytes = tree_nbytes(args.loaders[job.feed].first)
            job.depth = steps_per_task(job.step_seconds, job.task_seconds, job.batch_bytes, job.expected_steps)
    return chosen, predicted


def settle_residency(jobs: list[JobModel], args: Arguments, budgets: dict[str, int]) -> None:
    """Home every single-pack model that fits a device whole, and re-cut the others for the room left.

    The jobs' homes (and the re-cut jobs' plans) are updated in place.
    """
    plans = [job.plan for job in jobs]
    floors = [minimal_budget(job.profile, job.samples) if job.profile else 0 for job in jobs]
    homes, room = choose_homes(plans, [job.state_ratio for job in jobs], budgets, floors)
    left = min(room.values())
    for index, job in enumerate(jobs):
        job.home = homes.get(index)
        if homes and job.home is None and job.profile is not None and left < min(budgets.values()):
            job.plan = plan_packs(job.profile, left, job.samples)
            logger.info("%s (re-cut beside resident models)", job.plan.explain())
