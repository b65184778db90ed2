"""One run from start to finish: the host store's files, the worker plugin, the driver, what it measured, cleanup.

Whatever happens (success, a model's exception, Ctrl-C) the run cancels its tasks, tears the plugin down on the
workers, stops an embedded cluster's workers (before its files go, so that no task of theirs outlives them) and
removes every shared-memory file it created.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import dask
from distributed import Scheduler, SchedulerPlugin
from distributed.protocol.pickle import dumps
from torch import nn

from harmony.runtime.checkpoint import Checkpoints
from harmony.runtime.cluster import ClusterHandle
from harmony.runtime.code import JobCode
from harmony.runtime.dashboard import PLUGIN, DashboardPage, Publisher
from harmony.runtime.data import SharedFeed
from harmony.runtime.devices import DeviceSpec, shared_threads
from harmony.runtime.driver import Driver, Ranking
from harmony.runtime.evaluation import Metrics
from harmony.runtime.files import RunFiles
from harmony.runtime.hoststore import HostStore, shm_directory
from harmony.runtime.machines import STORE_DIRECTORY, RemoteBatches, RemoteStore, group_machines, remove_run
from harmony.runtime.orphans import claim, claim_remote, sweep
from harmony.runtime.shipping import BatchFiles
from harmony.runtime.spec import RunSpec, describe
from harmony.runtime.view import RunView
from harmony.runtime.worker import RUNS, DevicePlugin
from harmony.tasks.binding import BindingState
from harmony.tasks.runplan import PRECISIONS, RunPlan

logger = logging.getLogger("harmony")
END = 2**62  # checkpoint_every when only the end of a job is checkpointed


@dataclass
class RunOutcome:
    """What a finished run measured, per job of its plan: history is per job, then per member, each step's loss.

    steps are the training steps each job ran; step_seconds when each finished and finish_seconds when the last
    did (from the moment the driver started); depths the steps its later tasks each ran; counters per device;
    failed the jobs that stopped alone (step, reason); stopped, per job, the members whose loss stopped being
    finite and the step; pruned, per job, the members pruned and the step; events the workers lost and joined, the
    jobs failed, the models pruned; traffic the bytes that crossed between the driver and machines it is not on.
    """

    history: list[list[list[float]]]
    steps: list[int]
    step_seconds: list[list[float]]
    finish_seconds: list[float]
    depths: list[int]
    counters: dict[str, dict[str, int]]
    tasks: int
    run_seconds: float
    schedule: dict[str, list[str]]
    failed: dict[int, dict[str, object]]
    stopped: dict[int, dict[int, int]]
    events: list[dict[str, object]]
    traffic: dict[str, int] = field(default_factory=dict)
    validation: list[list[tuple[int, dict[str, list[float]]]]] = field(default_factory=list)
    timeline: dict[str, list[tuple[float, float, float, str]]] = field(default_factory=dict)
    grad_norms: list[list[list[float]]] = field(default_factory=list)  # per job and member (clipped jobs')
    pruned: dict[int, dict[int, int]] = field(default_factory=dict)


def traffic(stores: Iterable[HostStore], batches: Iterable[BatchFiles | RemoteBatches]) -> dict[str, int]:
    """Bytes that crossed between the driver and machines it is not on: model state out, state home, batches."""
    remote = [store for store in stores if isinstance(store, RemoteStore)]
    return {"state": sum(store.bytes_pushed for store in remote), "home": sum(store.bytes_pulled for store in remote),
            "batches": sum(batch.bytes_shipped for batch in batches if isinstance(batch, RemoteBatches))}


def execute(
    plan: RunPlan,
    codes: list[JobCode],
    feeds: list[SharedFeed],
    devices: list[DeviceSpec],
    handle: ClusterHandle,
    on_progress: Callable[[RunView], None] | None = None,
    host_memory: int | None = None,
    checkpoints: Checkpoints | None = None,
    starts: list[int] | None = None,
    users: tuple[list[nn.Module], list[Any]] = ([], []),
    validation: list[list[tuple[Any, Any]] | None] | None = None,
    metrics: Metrics = None,
    names: list[str] | None = None,
    profile: tuple[str, int] | None = None,
    ranking: Ranking | None = None,
) -> RunOutcome:
    """Train the plan's jobs to completion on the cluster whose workers are the devices; cleans up whatever
    happens. The user's modules hold the trained weights when it returns.

    With checkpoints, every job is checkpointed as the plan's options say (users: the user's models and optimizer
    factories, whose state dicts each checkpoint writes too); with starts, each job first takes up its latest
    checkpoint, which holds that many steps. With validation (per job, its validation batches), every job is
    evaluated every eval_every steps of the plan's options and at its end, with metrics beside the loss; with ranking
    too, every evaluation within the run is a pruning step (tasks.pruning), at which ranking says which models stop.
    With profile (a directory, a number of steps), every device worker traces its tasks of that many steps there
    (runtime.profiling)."""
    run = secrets.token_hex(6)
    sweep()
    machines = group_machines({device.name: device.machine for device in devices})
    stores: dict[str, HostStore] = {}  # by machine identity ("" for the driver's)
    if any(machine.local for machine in machines):
        stores[""] = HostStore(run, budget=host_memory)
    owned = any(not machine.local for machine in machines)
    driver: Driver | None = None
    plugin = f"harmony-{run}"
    registered = paged = clean = False
    try:
        if "" in stores:
            claim(stores[""])
        if owned:
            handle.client.register_plugin(RunOwner(run, handle.client.id), name=f"harmony-owner-{run}")
        for machine in machines:
            if not machine.local:
                stores[machine.identity] = RemoteStore(run, machine, handle.client, handle.workers)
                claim_remote(stores[machine.identity], run)
        models = describe(plan, codes)
        job_stores = [stores[job.machine or ""] for job in plan.jobs]
        files = RunFiles(job_stores, [stores[d.machine] for d in devices], plan, models)
        files.create(codes)
        starts = starts or [0] * len(plan.jobs)
        pruned: dict[int, int] = {}  # jobs a resumed run finds pruned whole, at their step
        if checkpoints is not None:
            for job, start in enumerate(starts):
                if start and checkpoints.restore(job, files) != start:
                    raise RuntimeError(f"the checkpoint of job {job} changed while the run resumed it")
                members = files.pruned(job)
                if members and len({*members, *files.stopped(job)}) == len(plan.jobs[job].members):
                    pruned[job] = max(members.values())
        for store in stores.values():
            store.push_all()
        spec = RunSpec(run, str(stores[""].directory if "" in stores else shm_directory()), models, tuple(devices),
                       bool(plan.options.prefetch), plan.options.group, ahead=plan.options.ahead,
                       autocast=PRECISIONS[plan.options.precision],
                       scaler=files.settings, compile=plan.options.compile, profile=profile,
                       adaptive=plan.options.fixed_threads is None)
        handle.client.register_plugin(DevicePlugin(spec), name=plugin)
        registered = True
        try:
            handle.client.register_plugin(DashboardPage(run), name=PLUGIN)
            paged = True
        except Exception as error:  # a scheduler that cannot import harmony: no page, the run goes on
            logger.warning("harmony: no /harmony page on this cluster's dashboard (%s: %s)", type(error).__name__,
                           error)
        state = BindingState(list(plan.jobs), plan.devices, policy=plan.options.policy, mode=plan.mode,
                             hardware=plan.hardware, homes=plan.homes, fail_fast=plan.options.fail_fast,
                             checkpoint_every=(plan.options.checkpoint_every or END) if checkpoints else None,
                             start=starts,
                             allowed_failures=dask.config.get("distributed.scheduler.allowed-failures"),
                             machines=dict(plan.machines), evaluate=validation is not None,
                             eval_every=plan.options.eval_every, prune=ranking is not None, pruned=pruned)

        def checkpoint(job: int, step: int) -> None:
            assert checkpoints is not None
            if checkpoints.save(job, step, files, codes, *users):
                logger.info("harmony: checkpointed %s at step %d in %s", plan.jobs[job].label, step,
                            checkpoints.directory)

        def share(idle: frozenset[str]) -> None:
            threads = shared_threads(devices, idle)
            own = {device.name: device.threads for device in devices}
            lent = {name: count for name, count in threads.items() if count != own[name]}
            if lent:
                logger.info("harmony: nothing left to compute on %s: %s", ", ".join(sorted(idle)),
                            ", ".join(f"{name} now computes with {count} threads" for name, count in lent.items()))
            files.share_threads(threads)

        batches = {identity: RemoteBatches(store) if isinstance(store, RemoteStore) else BatchFiles(store)
                   for identity, store in stores.items()}
        driver = Driver(handle.client, run, job_stores, [batches[job.machine or ""] for job in plan.jobs], state,
                        [feeds[job.feed] for job in plan.jobs], handle.workers,
                        plan.options.microbatches, on_step=files.open_step,
                        on_progress=lambda _: watch(view),
                        on_checkpoint=checkpoint if checkpoints is not None else None,
                        on_idle=share if spec.adaptive else None,  # a count of threads stays each device's
                        validation=validation, metrics=metrics, executing=files.executing, ranking=ranking)
        publisher = Publisher(handle.client, run, names)

        def watch(view: RunView) -> None:
            if paged:
                publisher(view)
            if on_progress is not None:
                on_progress(view)

        started = time.perf_counter()
        wall = time.time()
        view = RunView(state, files, driver.evaluations.results, started)
        driver.run_to_completion()
        run_seconds = time.perf_counter() - started
        files.pull_results()
        files.copy_back(codes)
        executed = handle.client.run(_executed, run)
        device_of = {address: name for name, address in handle.workers.items() if name in plan.devices}
        outcome = RunOutcome(
            history=[files.history(m, files.trained(m)) for m in range(len(plan.jobs))],
            grad_norms=[files.grad_norms(m, files.trained(m)) for m in range(len(plan.jobs))],
            steps=[files.trained(m) for m in range(len(plan.jobs))],
            step_seconds=state.step_times,
            finish_seconds=[state.finish_times.get(m, run_seconds) for m in range(len(plan.jobs))],
            depths=[spans.depth for spans in state.spans],
            counters=files.counters(),
            tasks=state.tasks_finished,
            run_seconds=run_seconds,
            schedule={device_of[address]: [key for key, *_ in tasks] for address, tasks in executed.items()
                      if address in device_of},
            timeline={device_of[address]: [(begin - wall, end - wall, wait, key) for key, begin, end, wait in tasks]
                      for address, tasks in executed.items() if address in device_of},
            failed=dict(state.failed),
            stopped={m: stopped for m in range(len(plan.jobs)) if (stopped := files.stopped(m))},
            pruned={m: members for m in range(len(plan.jobs)) if (members := files.pruned(m))},
            events=list(state.events),
            traffic=traffic(stores.values(), batches.values()),
            validation=driver.evaluations.results,
        )
        clean = True
        return outcome
    finally:
        if driver is not None:
            with contextlib.suppress(Exception):
                driver.cancel()
        if registered:
            with contextlib.suppress(Exception):
                handle.client.unregister_worker_plugin(plugin)
        if paged:
            with contextlib.suppress(Exception):
                handle.client.unregister_scheduler_plugin(PLUGIN)
        if owned:
            with contextlib.suppress(Exception):
                handle.client.run(remove_run, run, STORE_DIRECTORY)
            with contextlib.suppress(Exception):
                handle.client.unregister_scheduler_plugin(f"harmony-owner-{run}")
        handle.finish(clean)  # before the files go: no task of the run may outlive them
        for store in stores.values():
            store.unlink_all()


def _executed(run: str, dask_worker: Any) -> list[tuple[str, float, float, float]]:
    """On a worker (through client.run): this run's tasks in the order it ran them, each as its key, wall-clock
    start and end, and the seconds it waited for copies."""
    context = RUNS.get((run, dask_worker.address))
    return list(context.timeline) if context is not None else []


class RunOwner(SchedulerPlugin):
    """On the scheduler: when the driver's client goes (its process ended, however), remove the run's files on
    every worker; a machine the driver is not on has no other way to know that its driver is gone."""

    def __init__(self, run: str, client: str) -> None:
        self.run = run
        self.client = client

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        if client == self.client:
            message = {"op": "run", "function": dumps(remove_run), "args": dumps((self.run, STORE_DIRECTORY))}
            self.removal = asyncio.ensure_future(scheduler.broadcast(msg=message))  # held: a task must be kept
