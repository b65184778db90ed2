"""harmony.train: validate, profile and plan every model, then run the plan on device workers."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from harmony.errors import InputError, ModelError
from harmony.progress import ProgressLine, wants_progress
from harmony.result import Stats, TrainResult
from harmony.runtime.counters import IN_KINDS, OUT_KINDS
from harmony.runtime.data import LoaderFeed, SharedFeed, batch_size, split_tree
from harmony.runtime.devices import build_specs
from harmony.runtime.errors import ModelFailure
from harmony.runtime.job import JobModel, run_job
from harmony.runtime.pilot import decompose
from harmony.sizes import parse_bandwidths
from harmony.tasks.binding import POLICIES
from harmony.tasks.graph import TaskId
from harmony.tasks.microbatch import split_sizes
from harmony.tasks.packing import LayerTooLarge, PackPlan, plan_packs
from harmony.tasks.simulator import Hardware, task_seconds
from harmony.validate import Arguments, model_label, validate

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


def simulator_step_seconds(plan: PackPlan, samples: int) -> float:
    """Predicted compute seconds of one step of a model on this machine (for Sharded-LRTF)."""
    hardware = Hardware()
    return sum(
        task_seconds(TaskId(kind, 0, pack, 0), plan, samples, hardware)
        for pack in range(len(plan.packs))
        for kind in ("fwd", "bwd", "upd")
    )


def _to_device(tree: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def _prepare(args: Arguments, budget: int) -> tuple[list[JobModel], list[PackPlan]]:
    """Pilot-profile every model on its first micro-batch and cut it into packs that fit budget."""
    jobs = []
    plans = []
    for index, model in enumerate(args.models):
        label = model_label(index, model)
        inputs, targets = args.loaders[args.loader_of[index]].first
        sizes = split_sizes(batch_size(inputs), args.microbatches)
        device = _model_device(model)
        sample = _to_device(split_tree(inputs, sizes)[0], device)
        target = _to_device(split_tree(targets, sizes)[0], device)
        try:
            decomposition = decompose(model, sample, label)
        except Exception as error:
            raise ModelError(index, f"{label} raised {type(error).__name__}: {error} in its forward "
                             "during the pilot pass") from error
        try:
            loss = args.loss_fns[index](decomposition.output, target)
        except Exception as error:
            raise InputError(f"loss_fn for {label} raised {type(error).__name__}: {error} when called "
                             "as loss_fn(output, target) on the first micro-batch") from error
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InputError(f"loss_fn for {label} returned {type(loss).__name__}"
                             f"{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}; "
                             "it must return a scalar tensor (the mean loss over the micro-batch)")
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
                step_seconds=simulator_step_seconds(plan, sizes[0] * len(sizes)),
            )
        )
    return jobs, plans


def train(
    models: nn.Module | list[nn.Module],
    loaders: Any,
    loss_fn: Any = None,
    optimizer: Any = None,
    epochs: int = 1,
    steps: int | None = None,
    microbatches: int = 1,
    devices: int | str | list[str] | None = None,
    device_memory: int | str | None = None,
    cluster: Any = None,
    progress: bool | None = None,
    link_bandwidth: Any = None,
    prefetch: bool = True,
    policy: str = "lrtf",
) -> TrainResult:
    """Train every model on its data through fine-grained tasks on Dask device workers.

    Gives the weights plain PyTorch training would give: one step is one mini-batch per model, split
    into `microbatches` micro-batches whose gradients are accumulated, with the loss the mean over the
    mini-batch. The user's modules are updated in place and also returned in result.models.

    link_bandwidth ("12GB/s", bytes per second, or one per device) holds every host<->device copy to
    that speed, a simulated link that makes swap costs visible on CPU devices. prefetch=False turns off
    copying the next task's weights in while the current one computes. policy picks which model a
    free device serves: "lrtf" (Sharded-LRTF, the longest remaining time first) or "round_robin".
    """
    args = validate(models, loaders, loss_fn, optimizer, epochs, steps, microbatches, devices,
                    device_memory, cluster)
    try:
        links = parse_bandwidths(link_bandwidth, len(args.devices))
    except ValueError as error:
        raise InputError(str(error)) from None
    specs = build_specs(args.devices, args.device_memory, links)
    budget = min(spec.budget for spec in specs)
    if policy not in POLICIES:
        raise InputError(f"policy={policy!r} is not a scheduling policy; use one of {POLICIES}")
    jobs, plans = _prepare(args, budget)
    feeds = []
    for index, loader in enumerate(args.loaders):
        readers = args.loader_of.count(index)
        feed = LoaderFeed(loader.loader, loader.iterator, loader.first, args.epochs, args.steps)
        feeds.append(SharedFeed(feed, readers))
    line = ProgressLine() if wants_progress(progress) else None
    try:
        outcome = run_job(
            jobs,
            feeds,
            specs,
            args.cluster,
            args.microbatches,
            args.device_memory,
            prefetch=bool(prefetch),
            policy=policy,
            on_progress=line,
            on_ready=lambda link: logger.info("harmony: dashboard at %s", link),
        )
    except ModelFailure as failure:
        label = model_label(failure.model, args.models[failure.model])
        raise ModelError(failure.model, f"{label} raised {failure.error} in {failure.where}",
                         failure.traceback_text) from None
    finally:
        if line is not None:
            line.close()
    counters = outcome.counters
    stats = Stats(
        peak_device_bytes={name: values["peak"] for name, values in counters.items()},
        bytes_in={kind: sum(values[f"in_{kind}"] for values in counters.values()) for kind in IN_KINDS},
        bytes_out={kind: sum(values[f"out_{kind}"] for values in counters.values()) for kind in OUT_KINDS},
        steps=outcome.steps,
        tasks=outcome.tasks,
        wall_seconds=outcome.wall_seconds,
        busy_seconds={name: values["busy_ns"] / 1e9 for name, values in counters.items()},
        idle_seconds={
            name: max(0.0, outcome.run_seconds - values["busy_ns"] / 1e9) for name, values in counters.items()
        },
        bytes_p2p=sum(values["p2p"] for values in counters.values()),
        bytes_prefetched=sum(values["prefetched"] for values in counters.values()),
        budgets={device.name: device.budget for device in outcome.devices},
        schedule=outcome.schedule,
    )
    return TrainResult(
        models=args.models,
        history=outcome.history,
        stats=stats,
        dashboard_link=outcome.dashboard_link,
        plans=plans,
    )
