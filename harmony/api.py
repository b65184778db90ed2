"""harmony.train: validate, profile and plan every model, then run the plan on device workers."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from harmony.errors import InputError, ModelError
from harmony.fusing import fuse_jobs
from harmony.prepare import arrange, prepare
from harmony.progress import ProgressLine, wants_progress
from harmony.result import Stats, TrainResult
from harmony.runtime.batching import unbatched
from harmony.runtime.calibrate import measured_hardware
from harmony.runtime.cluster import ClusterHandle, connect, external_devices, start_embedded, worker_threads
from harmony.runtime.counters import IN_KINDS, OUT_KINDS
from harmony.runtime.data import LoaderFeed, SharedFeed
from harmony.runtime.devices import DeviceSpec, build_specs
from harmony.runtime.errors import ModelFailure
from harmony.runtime.interrupt import watching_interrupts
from harmony.runtime.job import JobModel, JobOutcome, run_job
from harmony.sizes import parse_bandwidths
from harmony.validate import Arguments, check_fuse, check_scheduling, check_steps_per_task, validate

logger = logging.getLogger("harmony")


@contextmanager
def user_cluster(cluster: Any) -> Iterator[ClusterHandle | None]:
    """A connection to the user's cluster for the whole run (its workers are the devices), or None."""
    if cluster is None:
        yield None
        return
    handle = connect(cluster)
    try:
        crowded = {name: threads for name, threads in worker_threads(handle).items() if threads != 1}
        if crowded:
            listed = ", ".join(f"{name} ({threads} threads)" for name, threads in sorted(crowded.items()))
            raise InputError(
                f"cluster: every worker is one device and runs one task at a time, but {listed} would run "
                "several at once; start the workers with one thread each (dask worker --nthreads 1, or "
                "LocalCluster(threads_per_worker=1)); torch still uses the machine's cores inside each task"
            )
        yield handle
    finally:
        handle.close()


@contextmanager
def device_cluster(user: ClusterHandle | None, specs: list[DeviceSpec]) -> Iterator[ClusterHandle]:
    """The cluster the run's tasks go to: the user's, or an embedded one with a worker per device.

    run_job stops an embedded cluster itself before removing the run's files; closing it here as well
    covers a failure before the run starts (closing twice is harmless)."""
    if user is not None:
        yield user
        return
    handle = start_embedded(specs)
    try:
        yield handle
    finally:
        handle.close()


def _run(
    jobs: list[JobModel],
    args: Arguments,
    specs: list[DeviceSpec],
    handle: ClusterHandle,
    progress: bool | None,
    **options: Any,
) -> JobOutcome:
    """Run the arranged jobs on the cluster, with a progress line when wanted; a model's failure is a ModelError."""
    feeds = []
    for index, loader in enumerate(args.loaders):
        readers = sum(1 for job in jobs if job.feed == index)
        feed = LoaderFeed(loader.loader, loader.iterator, loader.first, args.epochs, args.steps)
        feeds.append(SharedFeed(feed, readers))
    line = ProgressLine() if wants_progress(progress) else None
    try:
        return run_job(jobs, feeds, specs, handle, args.microbatches, on_progress=line,
                       on_ready=lambda link: logger.info("harmony: dashboard at %s", link), **options)
    except ModelFailure as failure:
        job = jobs[failure.model]
        raise ModelError(job.members[0], f"{job.label} raised {failure.error} in {failure.where}",
                         failure.traceback_text) from None
    finally:
        if line is not None:
            line.close()


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
    group: bool = True,
    mode: str = "auto",
    resident: bool = True,
    fuse: bool | int | str = "auto",
    steps_per_task: int | str = "auto",
) -> TrainResult:
    """Train every model on its data through fine-grained tasks on Dask device workers.

    Gives the weights plain PyTorch training would give: one step is one mini-batch per model, split
    into `microbatches` micro-batches whose gradients are accumulated, with the loss the mean over the
    mini-batch. The user's modules are updated in place and also returned in result.models.

    link_bandwidth ("12GB/s", bytes per second, or one per device) holds every host<->device copy to
    that speed, a simulated link that makes swap costs visible on CPU devices. prefetch=False turns off
    copying the next task's weights in while the current one computes. policy picks which model a
    free device serves: "lrtf" (Sharded-LRTF, the longest remaining time first) or "round_robin".
    group=False swaps a pack's weights in again for every micro-batch, the per-micro-batch swapping
    that Harmony's grouping avoids (a baseline for benchmarks; results are the same; every model is then
    swapped, none kept resident). mode places work
    on several devices: "vpp" spreads packs over devices, "vdp" spreads micro-batch groups (each device
    runs every pack, gradients are reduced before the update), "free" binds any task anywhere, and
    "auto" runs the one the simulator predicts fastest. resident=True keeps every model that fits a
    device whole (weights, gradients, optimizer state) on a home device for the run, so its weights
    cross to the device once and its gradients never leave; False swaps every model every step.
    fuse="auto" trains models of the same architecture that share a loader (and optimizer class) as fused
    arrays, sized by the simulator's predicted throughput; True uses the largest sub-arrays whose layers
    fit the budget (the whole group when it fits), an int k the largest that fit up to k, and False trains
    every model on its own. steps_per_task is how many consecutive steps one task of a resident
    single-pack model or array runs (all their batches in one file): "auto" picks enough to keep
    Dask's per-task cost (measured on the cluster before the run) near 1% of the measured step time.
    Every model keeps its own loss, optimizer and hyperparameters, and gets the weights it would get alone.
    """
    args = validate(models, loaders, loss_fn, optimizer, epochs, steps, microbatches, devices,
                    device_memory, cluster)
    try:
        links = parse_bandwidths(link_bandwidth, len(args.devices))
    except ValueError as error:
        raise InputError(str(error)) from None
    check_scheduling(policy, mode)
    check_fuse(fuse)
    check_steps_per_task(steps_per_task)
    with watching_interrupts(), user_cluster(args.cluster) as user:
        specs = build_specs(args.devices, args.device_memory, links) if user is None else external_devices(
            user, args.device_memory
        )
        budgets = {spec.name: spec.budget for spec in specs}
        jobs, _ = prepare(args, min(budgets.values()))
        started = time.perf_counter()
        with (
            device_cluster(user, specs) as handle,
            unbatched(handle.client, list(handle.workers.values()), restore=not handle.embedded),
        ):
            hardware = measured_hardware(handle.client, handle.workers,
                                         cpu_compute=any(spec.kind == "cpu" for spec in specs))
            jobs, choices = fuse_jobs(jobs, args, budgets, hardware, bool(prefetch), policy, fuse)
            chosen, _ = arrange(jobs, args, budgets, [job.expected_steps or 1 for job in jobs], hardware, mode,
                                bool(prefetch), policy, resident and bool(group), steps_per_task)
            outcome = _run(jobs, args, specs, handle, progress, prefetch=bool(prefetch), group=bool(group),
                           policy=policy, mode=chosen)
            wall_seconds = time.perf_counter() - started
    plans = [job.plan for job in jobs]
    homes = {model: job.home for job in jobs if job.home is not None for model in job.members}
    counters = outcome.counters
    history: list[list[float]] = [[] for _ in args.models]
    steps = [0] * len(args.models)
    finish = [0.0] * len(args.models)
    step_seconds: list[list[float]] = [[] for _ in args.models]
    depths = [1] * len(args.models)
    for index, job in enumerate(jobs):
        for position, model in enumerate(job.members):
            history[model] = outcome.history[index][position]
            steps[model] = outcome.steps[index]
            finish[model] = outcome.finish_seconds[index]
            step_seconds[model] = list(outcome.step_seconds[index])
            depths[model] = outcome.depths[index]
    stats = Stats(
        peak_device_bytes={name: values["peak"] for name, values in counters.items()},
        bytes_in={kind: sum(values[f"in_{kind}"] for values in counters.values()) for kind in IN_KINDS},
        bytes_out={kind: sum(values[f"out_{kind}"] for values in counters.values()) for kind in OUT_KINDS},
        steps=steps,
        tasks=outcome.tasks,
        wall_seconds=wall_seconds,
        busy_seconds={name: values["busy_ns"] / 1e9 for name, values in counters.items()},
        idle_seconds={
            name: max(0.0, outcome.run_seconds - values["busy_ns"] / 1e9) for name, values in counters.items()
        },
        bytes_p2p=sum(values["p2p"] for values in counters.values()),
        bytes_prefetched=sum(values["prefetched"] for values in counters.values()),
        bytes_kept=sum(values["kept"] for values in counters.values()),
        budgets={device.name: device.budget for device in outcome.devices},
        schedule=outcome.schedule,
        finish_seconds=finish,
        step_seconds=step_seconds,
        steps_per_task=depths,
        task_seconds=hardware.task_overhead,
    )
    return TrainResult(
        models=args.models,
        history=history,
        stats=stats,
        dashboard_link=outcome.dashboard_link,
        plans=plans,
        mode=chosen,
        homes=homes,
        arrays=[list(job.members) for job in jobs],
        fusion=choices,
    )
