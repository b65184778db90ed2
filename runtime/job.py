"""One training job from start to finish: host store, cluster, worker plugin, driver, results, cleanup.

Whatever happens (success, a model's exception, Ctrl-C) the job cancels its tasks, tears the plugin
down on the workers, stops an embedded cluster's workers and removes every shared-memory file it created.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch
from distributed import get_worker
from torch import nn

from harmony.runtime.cluster import ClusterHandle
from harmony.runtime.counters import BLOCK_BYTES, Counters
from harmony.runtime.data import SharedFeed
from harmony.runtime.devices import DeviceSpec
from harmony.runtime.driver import Driver
from harmony.runtime.hoststore import HostStore, tensors_at
from harmony.runtime.skeleton import dump_skeleton
from harmony.runtime.spec import (
    LOSS_BLOCK,
    SPAN_TIMING_BYTES,
    ModelRuntime,
    PackRuntime,
    RunSpec,
    counters_name,
    grads_name,
    losses_name,
    span_timing_name,
    versions_name,
    weights_name,
)
from harmony.runtime.worker import RUNS, DevicePlugin
from harmony.tasks.binding import BindingState, ModelWork
from harmony.tasks.layout import lay_out
from harmony.tasks.packing import PackPlan
from harmony.tasks.profile import ModelProfile


@dataclass
class JobModel:
    """A model, or a fused array of models, ready to run: its chain of layers, pack plan, loss, optimizer, feed.

    members are the indices of the user's models it trains (one, or an array's); member_layers their own
    chains of layers, into which a fused array's trained weights are copied back. depth is how many
    consecutive steps each of its tasks runs (more than one only for a resident single-pack job); with
    task_seconds (what a task costs) and batch_bytes (one step's batch) that is the first tasks' depth,
    re-decided from their measured step time (see tasks.amortize).
    """

    module: nn.Module
    layers: list[nn.Module]
    plan: PackPlan
    loss_fn: Callable[..., torch.Tensor]
    optimizer: Callable[..., torch.optim.Optimizer]
    feed: int
    seed: int
    expected_steps: int | None = None
    step_seconds: float = 0.0
    groups: int = 1
    home: str | None = None
    profile: ModelProfile | None = None
    samples: int = 1
    members: tuple[int, ...] = ()
    member_layers: list[list[nn.Module]] = field(default_factory=list)
    state_ratio: float = 2.0
    label: str = ""
    depth: int = 1
    task_seconds: float = 0.0
    batch_bytes: int = 0

    @property
    def fused(self) -> bool:
        """Whether this job is a fused array of several models (their layers are ArrayLayers)."""
        return len(self.member_layers) > 1


@dataclass
class JobOutcome:
    """What a finished job measured; history is per job, then per member of the job, the loss of each step."""

    history: list[list[list[float]]]
    counters: dict[str, dict[str, int]]
    steps: list[int]
    tasks: int
    run_seconds: float
    dashboard_link: str | None
    devices: list[DeviceSpec] = field(default_factory=list)
    schedule: dict[str, list[str]] = field(default_factory=dict)
    finish_seconds: list[float] = field(default_factory=list)
    step_seconds: list[list[float]] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)


def pack_module(layers: list[nn.Module], plan: PackPlan, pack: int) -> nn.Sequential:
    spec = plan.packs[pack]
    return nn.Sequential(*layers[spec.first : spec.stop])


def _named_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _fill_store(store: HostStore, models: list[JobModel]) -> tuple[ModelRuntime, ...]:
    """Create every pack's weight and gradient files, copy the models' weights in, describe the packs."""
    runtimes = []
    for m, job in enumerate(models):
        packs = []
        for p, pack in enumerate(job.plan.packs):
            module = pack_module(job.layers, job.plan, p)
            weights = lay_out(pack.weights)
            grads = lay_out(pack.trainable)
            host = store.create(weights_name(m, p), weights.nbytes)
            for group in range(job.groups):
                store.create(grads_name(m, p, group), grads.nbytes)
            state = _named_state(module)
            with torch.no_grad():
                for name, view in tensors_at(host, weights).items():
                    view.copy_(state[name].detach().cpu())
            buffer_names = {spec.name for spec in pack.buffers}
            buffers_offset = min(
                (slot.offset for slot in weights.slots if slot.spec.name in buffer_names), default=weights.nbytes
            )
            packs.append(
                PackRuntime(
                    skeleton=dump_skeleton(module),
                    weights=weights,
                    grads=grads,
                    buffers_offset=buffers_offset,
                    workspace=pack.cost.workspace,
                )
            )
        runtimes.append(
            ModelRuntime(
                name=job.plan.model,
                packs=tuple(packs),
                loss_fn=cloudpickle.dumps(job.loss_fn),
                optimizer=cloudpickle.dumps(job.optimizer),
                seed=job.seed,
                groups=job.groups,
                home=job.home,
                members=max(1, len(job.member_layers)),
            )
        )
    return tuple(runtimes)


def _copy_back(store: HostStore, models: list[JobModel], spec: RunSpec) -> None:
    """Write the trained weights (and buffers) from the host store into the user's modules, in place."""
    with torch.no_grad():
        for m, job in enumerate(models):
            for p, runtime in enumerate(spec.models[m].packs):
                state = _named_state(pack_module(job.layers, job.plan, p))
                host = store.attach(weights_name(m, p), runtime.weights.nbytes)
                for name, view in tensors_at(host, runtime.weights).items():
                    state[name].copy_(view)
            if job.fused:
                for index, layer in enumerate(job.layers):
                    layer.unstack_into([layers[index] for layers in job.member_layers])


def _history(store: HostStore, model: int, steps: int, groups: int, members: int) -> list[list[float]]:
    """Per member of a job, the loss of every step: the sum over micro-batch groups of their shares."""
    blocks = []
    for block in range(-(-steps // LOSS_BLOCK)):
        size = min(LOSS_BLOCK, steps - block * LOSS_BLOCK)
        shares = [
            store.attach(losses_name(model, block, group), 8 * LOSS_BLOCK * members)
            .view(torch.float64)
            .view(LOSS_BLOCK, members)[:size]
            for group in range(groups)
        ]
        blocks.append(sum(shares[1:], shares[0].clone()))
    if not blocks:
        return [[] for _ in range(members)]
    return torch.cat(blocks).T.tolist()


def _executed(run: str, dask_worker: Any) -> list[str]:
    """On a worker (through client.run): the keys of this run's tasks in the order it ran them."""
    context = RUNS.get((run, dask_worker.address))
    return list(context.executed) if context is not None else []


def _flush_residents(run: str) -> None:
    """A task on a device worker: write its resident models' trained weights to the host store."""
    context = RUNS.get((run, get_worker().address))
    if context is not None:
        context.flush_residents()


def flush_residents(handle: ClusterHandle, run: str, devices: list[DeviceSpec]) -> None:
    """Every device's resident weights to the host store, each written by its worker's task thread, where the
    run's tasks computed: a copy that large on the worker's event loop (``client.run``) would give that thread
    an OpenMP team of its own for the rest of the process's life, and every later run's compute would slow
    down (serial_copy)."""
    flushes = [
        handle.client.submit(_flush_residents, run, key=f"harmony-flush-{run}-{device.name}", pure=False,
                             workers=[handle.workers[device.name]], allow_other_workers=False)
        for device in devices
    ]
    handle.client.gather(flushes)


def _check_same_machine(handle: ClusterHandle, store: HostStore, probe_name: str) -> None:
    path = str(store.path(probe_name))
    seen = handle.client.run(os.path.exists, path)
    remote = sorted(address for address, ok in seen.items() if not ok)
    if remote:
        raise RuntimeError(
            f"workers {remote} cannot see this machine's host store ({path}); Harmony's host store is per "
            "machine, so every worker must run on the machine that calls harmony.train"
        )


def run_job(
    models: list[JobModel],
    feeds: list[SharedFeed],
    devices: list[DeviceSpec],
    handle: ClusterHandle,
    microbatches: int,
    prefetch: bool = True,
    group: bool = True,
    policy: str = "lrtf",
    mode: str = "free",
    on_progress: Callable[[BindingState, int], None] | None = None,
    on_ready: Callable[[str | None], None] | None = None,
) -> JobOutcome:
    """Train models to completion and return what was measured; cleans up whatever happens.

    handle is a connected cluster whose workers are the devices. An embedded cluster's workers are stopped
    here, before the run's host store files are removed, so that no task of theirs can outlive the files; a
    user's cluster stays open, and its workers are first checked to see this machine's host store.
    """
    run = secrets.token_hex(3)
    store = HostStore(run)
    driver: Driver | None = None
    plugin_name = f"harmony-{run}"
    plugin_registered = False
    try:
        runtimes = _fill_store(store, models)
        if not handle.embedded:
            store.create("probe", 1)
            _check_same_machine(handle, store, "probe")
        if on_ready is not None:
            on_ready(handle.dashboard_link)
        for index in range(len(devices)):
            store.create(counters_name(index), BLOCK_BYTES)
        for m, job in enumerate(models):
            store.create(versions_name(m), 8 * len(job.plan.packs))
        spec = RunSpec(run, str(store.directory), runtimes, tuple(devices), prefetch, group)

        def create_loss_block(model: int, step: int) -> None:
            if step % LOSS_BLOCK == 0:
                for group in range(models[model].groups):
                    nbytes = 8 * LOSS_BLOCK * runtimes[model].members
                    store.create(losses_name(model, step // LOSS_BLOCK, group), nbytes)

        handle.client.register_plugin(DevicePlugin(spec), name=plugin_name)
        plugin_registered = True
        state = BindingState(
            [
                ModelWork(
                    tuple(pack.weight_bytes for pack in job.plan.packs),
                    job.expected_steps,
                    job.step_seconds,
                    job.groups,
                    job.depth,
                    job.task_seconds,
                    job.batch_bytes,
                )
                for job in models
            ],
            {device.name: device.budget for device in devices},
            policy=policy,
            mode=mode,
            homes={m: job.home for m, job in enumerate(models) if job.home is not None},
        )
        for m, plan in enumerate(state.spans):
            if plan.runs_spans:  # its span tasks add up their timing here (see bodies)
                store.create(span_timing_name(m), SPAN_TIMING_BYTES)
        driver = Driver(
            handle.client,
            run,
            store,
            state,
            [feeds[job.feed] for job in models],
            handle.workers,
            microbatches,
            on_batch=create_loss_block,
            on_progress=on_progress,
        )
        running = time.perf_counter()
        driver.run_to_completion()
        run_seconds = time.perf_counter() - running
        flush_residents(handle, run, devices)
        steps = list(driver.steps_fetched)
        history = [_history(store, m, count, models[m].groups, runtimes[m].members) for m, count in enumerate(steps)]
        counters = {
            device.name: Counters(store.attach(counters_name(i), BLOCK_BYTES)).read()
            for i, device in enumerate(devices)
        }
        _copy_back(store, models, spec)
        executed = handle.client.run(_executed, run)
        names = {address: name for name, address in handle.workers.items()}
        return JobOutcome(
            history=history,
            counters=counters,
            steps=steps,
            tasks=driver.tasks_run,
            run_seconds=run_seconds,
            dashboard_link=handle.dashboard_link,
            devices=devices,
            schedule={names[address]: keys for address, keys in executed.items() if address in names},
            finish_seconds=[driver.finish_seconds.get(m, run_seconds) for m in range(len(models))],
            step_seconds=driver.step_seconds,
            depths=[plan.depth for plan in state.spans],
        )
    finally:
        if driver is not None:
            with contextlib.suppress(Exception):
                driver.cancel()
        if plugin_registered:
            with contextlib.suppress(Exception):
                handle.client.unregister_worker_plugin(plugin_name)
        if handle.embedded:
            handle.close()
        store.unlink_all()

