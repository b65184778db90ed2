"""harmony.train: validate, pilot, start the devices, calibrate, plan, execute, return the result."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from harmony.errors import InputError, ModelError
from harmony.planner import build, pilot
from harmony.progress import ProgressLine, wants_progress
from harmony.result import TrainResult
from harmony.runtime.batching import unbatched
from harmony.runtime.calibrate import measured_hardware
from harmony.runtime.cluster import ClusterHandle, connect, external_devices, start_embedded, worker_threads
from harmony.runtime.code import JobCode
from harmony.runtime.data import LoaderFeed, SharedFeed
from harmony.runtime.devices import DeviceSpec, build_specs
from harmony.runtime.errors import ModelFailure
from harmony.runtime.interrupt import watching_interrupts
from harmony.runtime.run import RunOutcome, execute
from harmony.tasks.runplan import RunPlan
from harmony.validate import Arguments, read_options, validate

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

    execute stops an embedded cluster itself before removing the run's files; closing it here as well covers a
    failure before the run starts (closing twice is harmless)."""
    if user is not None:
        yield user
        return
    handle = start_embedded(specs)
    try:
        yield handle
    finally:
        handle.close()


def _execute(
    plan: RunPlan, codes: list[JobCode], args: Arguments, specs: list[DeviceSpec], handle: ClusterHandle,
    progress: bool | None,
) -> RunOutcome:
    """Run the plan with a progress line when wanted; a model's failure is a ModelError naming the model."""
    feeds = []
    for index, loader in enumerate(args.loaders):
        readers = sum(1 for job in plan.jobs if job.feed == index)
        feed = LoaderFeed(loader.loader, loader.iterator, loader.first, args.options.epochs, args.options.steps)
        feeds.append(SharedFeed(feed, readers))
    line = ProgressLine() if wants_progress(progress) else None
    try:
        return execute(plan, codes, feeds, specs, handle, on_progress=line)
    except ModelFailure as failure:
        job = plan.jobs[failure.model]
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
    swapped, none homed on a device). mode places work
    on several devices: "vpp" spreads packs over devices, "vdp" spreads micro-batch groups (each device
    runs every pack, gradients are reduced before the update), "free" binds any task anywhere, and
    "auto" runs the one the simulator predicts fastest. resident=True homes every model that fits a
    device whole (weights, gradients, optimizer state) on that device for the run, so its weights
    cross to the device once and its gradients never leave; False swaps every model every step.
    fuse="auto" trains models of the same architecture that share a loader (and optimizer class) as fused
    arrays, sized by the simulator's predicted throughput; True uses the largest sub-arrays whose layers
    fit the budget (the whole group when it fits), an int k the largest that fit up to k, and False trains
    every model on its own. steps_per_task is how many consecutive steps one task of a homed
    single-pack model or array runs (all their batches in one file): "auto" picks enough to keep
    Dask's per-task cost (measured on the cluster before the run) near 1% of the measured step time.
    Every model keeps its own loss, optimizer and hyperparameters, and gets the weights it would get alone.
    """
    options = read_options(locals())  # first: locals() are the arguments alone
    args = validate(models, loaders, loss_fn, optimizer, options, devices, device_memory, cluster, link_bandwidth)
    with watching_interrupts(), user_cluster(args.cluster) as user:
        specs = (build_specs(args.devices, args.device_memory, args.links) if user is None
                 else external_devices(user, args.device_memory))
        budgets = {spec.name: spec.budget for spec in specs}
        candidates = pilot(args, min(budgets.values()))
        started = time.perf_counter()
        with (
            device_cluster(user, specs) as handle,
            unbatched(handle.client, list(handle.workers.values()), restore=not handle.embedded),
        ):
            hardware = measured_hardware(handle.client, handle.workers,
                                         cpu_compute=any(spec.kind == "cpu" for spec in specs))
            plan, codes = build(args, candidates, budgets, hardware)
            logger.info("harmony: dashboard at %s", handle.dashboard_link)
            outcome = _execute(plan, codes, args, specs, handle, progress)
            wall_seconds = time.perf_counter() - started
    return TrainResult.assemble(args.models, plan, outcome, wall_seconds, handle.dashboard_link)
