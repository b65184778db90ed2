"""harmony.train: validate, pilot, start the devices, calibrate, plan, execute, return the result."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from harmony import calibration, calls, timings
from harmony.candidate import step_samples
from harmony.conventions import training_conventions
from harmony.errors import InputError, ModelError
from harmony.metrics import MetricsLog, learning_rates
from harmony.planner import build, codes_for, fewest_microbatches, pilot, replan_machines
from harmony.progress import EventLog, display, wants_progress
from harmony.result import TrainResult
from harmony.runtime import collector
from harmony.runtime.batching import unbatched
from harmony.runtime.checkpoint import Checkpoints, fingerprint
from harmony.runtime.cluster import LOOPBACK, ClusterHandle, connect, embedded, external_devices, worker_threads
from harmony.runtime.cluster import shutdown as close_warm
from harmony.runtime.code import JobCode
from harmony.runtime.data import LoaderFeed, SharedFeed, batch_size
from harmony.runtime.devices import DeviceSpec, build_specs, device_threads
from harmony.runtime.driver import Ranking
from harmony.runtime.errors import ModelFailure
from harmony.runtime.files import estimate
from harmony.runtime.hoststore import shm_directory
from harmony.runtime.interrupt import raise_if_interrupted, watching_interrupts
from harmony.runtime.replicas import replicas_kept
from harmony.runtime.run import RunOutcome, execute
from harmony.runtime.shipping import SPARE_FILES
from harmony.runtime.view import RunView, model_name
from harmony.runtime.worker import wait_for_warmup
from harmony.tasks.pruning import Pruner, Standing
from harmony.tasks.runplan import Job, RunPlan
from harmony.validate import (
    Arguments,
    check_checkpoints,
    check_devices,
    check_models,
    check_options,
    check_prune,
    check_validation,
    describe_run,
    read_options,
    validate,
)

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


class Starting:
    """The embedded cluster, started in a thread of its own while the driver checks the data, losses and optimizers
    (the warm one at once where it has these devices, see runtime.cluster). That check builds the first optimizer of
    the driver's process, which imports torch._dynamo, an import the workers' own start overlaps. The
    pilot pass waits for the workers to be ready (their own imports done), since its layer timings, which plan the
    run, would be skewed by processes starting on the same cores (docs/performance.md, "Start-up"). A call that
    fails on its input leaves the cluster up, warm for the call that follows."""

    def __init__(self, specs: list[DeviceSpec], host: str, dashboard_address: str) -> None:
        self.handle: ClusterHandle | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._start, args=(specs, host, dashboard_address),
                                       name="harmony-cluster-start", daemon=True)
        self.thread.start()

    def _start(self, specs: list[DeviceSpec], host: str, dashboard_address: str) -> None:
        try:
            self.handle = embedded(specs, dashboard_address=dashboard_address, host=host)
        except BaseException as error:
            self.error = error

    def ready(self) -> None:
        """Return once the cluster's workers have started and finished their background imports."""
        self.result().client.run(wait_for_warmup)

    def result(self) -> ClusterHandle:
        """The started cluster (waiting for its workers), or what stopped it from starting."""
        while self.thread.is_alive():
            self.thread.join(timeout=1.0)
            raise_if_interrupted()
        if self.error is not None:
            raise self.error
        assert self.handle is not None
        return self.handle


@contextmanager
def device_cluster(user: ClusterHandle | None, starting: Starting | None) -> Iterator[ClusterHandle]:
    """The cluster the run's tasks go to: the user's, or the embedded one with a worker per device.

    execute keeps the embedded one warm after a clean run or stops it before removing the run's files; stopping it
    here as well covers a failure before the run starts."""
    if user is not None:
        yield user
        return
    assert starting is not None
    handle = starting.result()
    clean = False
    try:
        yield handle
        clean = True
    finally:
        handle.finish(clean)


def check_host_memory(jobs: list[Job], budget: int | None) -> None:
    """Refuse, before any worker starts, a sweep whose host store would not fit host_memory or the machine's
    shared memory, saying how much it needs."""
    need = estimate(jobs, batch_files=2 * len(jobs) + SPARE_FILES)
    free = shutil.disk_usage(shm_directory()).free
    if budget is not None and need > budget:
        raise InputError(f"host_memory={budget:,} bytes is too small: the host store of these models needs about "
                         f"{need:,} bytes (two copies of every weight and optimizer state, the gradients, the "
                         "batches); raise host_memory or train fewer or smaller models at once")
    if need > free:
        raise InputError(f"the host store of these models needs about {need:,} bytes of shared memory but "
                         f"{shm_directory()} has {free:,} free; give the machine more (in a container, --shm-size), "
                         "or train fewer or smaller models at once")


def _execute(
    plan: RunPlan, codes: list[JobCode], args: Arguments, specs: list[DeviceSpec], handle: ClusterHandle,
    progress: bool | None, checkpoints: Checkpoints | None, starts: list[int], log: MetricsLog | None,
    profile: tuple[str, int] | None = None,
) -> RunOutcome:
    """Run the plan with a progress display when wanted, the metrics log and the workers' profiles when asked, and
    the pruner when given; a model's failure is a ModelError naming the model."""
    feeds = []
    for index, loader in enumerate(args.loaders):
        readers = [start for job, start in zip(plan.jobs, starts) if job.feed == index]
        feed = LoaderFeed(loader.loader, loader.iterator, loader.first, args.options.epochs, args.options.steps)
        feeds.append(SharedFeed(feed, readers))
    line = display(names=args.names) if wants_progress(progress) else None
    if line is not None and handle.dashboard_link:
        page = handle.dashboard_link.rsplit("/", 1)[0] + "/harmony"
        line.note(f"harmony: dashboard at {handle.dashboard_link} (Harmony's page: {page})")
    watchers = [watcher for watcher in (line if line is not None else EventLog(logger), log) if watcher is not None]

    def watch(view: RunView) -> None:
        for watcher in watchers:
            watcher(view)

    try:
        validation = ([args.validation[args.validation_of[job.members[0]]] for job in plan.jobs]
                      if args.validation else None)
        outcome = execute(plan, codes, feeds, specs, handle, on_progress=watch if watchers else None,
                          host_memory=args.host_memory,
                          checkpoints=checkpoints, starts=starts, users=(args.models, args.optimizers),
                          validation=validation, metrics=args.metrics, names=args.names, profile=profile,
                          ranking=None if args.pruner is None else ranking(args.pruner, args.names))
    except ModelFailure as failure:
        raise model_error(plan, failure) from None
    finally:
        if line is not None:
            line.close()
    errors = [failure.get("error") for failure in outcome.failed.values()]
    if len(outcome.failed) == len(plan.jobs) and isinstance(errors[0], ModelFailure):
        raise model_error(plan, errors[0])  # nothing trained: the first model's own error is the run's
    for job, failure in sorted(outcome.failed.items()):
        logger.warning("harmony: %s stopped at step %s: %s", plan.jobs[job].label, failure["step"], failure["reason"])
    for job, members in sorted(outcome.stopped.items()):
        for position, step in sorted(members.items()):
            logger.warning("harmony: model %d (member %d of %s) stopped at step %d: its loss stopped being finite",
                           plan.jobs[job].members[position], position, plan.jobs[job].label, step)
    for job, members in sorted(outcome.pruned.items()):
        for position, step in sorted(members.items()):
            logger.info("harmony: model %d (%s) was pruned at step %d", plan.jobs[job].members[position],
                        plan.jobs[job].label, step)
    return outcome


def ranking(pruner: Pruner, names: list[str] | None) -> Ranking:
    """The driver's ranking from the user's pruner: the models still training as Standings, its answer checked."""

    def rank(step: int, entries: list[tuple[int, float, dict[str, float]]]) -> set[int]:
        standings = [Standing(model, model_name(model, names), loss, metrics) for model, loss, metrics in entries]
        answer = pruner(step, standings)
        try:
            chosen = set(answer)
        except TypeError:
            raise InputError(f"prune returned {answer!r} at step {step}; it must return the indices of the models "
                             "to stop (an empty list: none)") from None
        training = {standing.index for standing in standings}
        if not chosen <= training or any(isinstance(model, bool) for model in chosen):
            raise InputError(f"prune returned {sorted(chosen, key=repr)} at step {step}; it may stop only models "
                             f"still training, by index: {sorted(training)}")
        return chosen

    return rank


def model_error(plan: RunPlan, failure: ModelFailure) -> ModelError:
    """A model's own exception, as the user sees it: which model, where, and its traceback."""
    job = plan.jobs[failure.model]
    return ModelError(job.members[0], f"{job.label} raised {failure.error} in {failure.where}", failure.traceback_text)


def train(
    models: nn.Module | list[nn.Module],
    loaders: Any,
    loss_fn: Any = None,
    optimizer: Any = None,
    epochs: int = 1,
    steps: int | None = None,
    microbatches: int | str = 1,
    devices: int | str | list[str] | None = None,
    device_memory: int | str | dict[str, int | str] | None = None,
    cluster: Any = None,
    progress: bool | None = None,
    link_bandwidth: Any = None,
    prefetch: bool | str = True,
    policy: str = "lrtf",
    group: bool = True,
    mode: str = "auto",
    resident: bool = True,
    fuse: bool | int | str = "auto",
    steps_per_task: int | str = "auto",
    fail_fast: bool = False,
    host_memory: int | str | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    host: str = LOOPBACK,
    dashboard_address: str = ":8787",
    val_loaders: Any = None,
    eval_every: int | None = None,
    metrics: Any = None,
    names: list[str] | None = None,
    log_dir: str | os.PathLike[str] | None = None,
    precision: str = "fp32",
    overlap_update: bool | None = None,
    update_on: str = "auto",
    packs_per_task: int | str = "auto",
    grad_scaler: dict[str, float] | None = None,
    compile: bool = False,
    stash: bool = True,
    profile_steps: int = 0,
    lr_schedule: Any = None,
    clip_grad_norm: Any = None,
    prune: Any = None,
    threads: int | str = "auto",
) -> TrainResult:
    """Train every model on its data through fine-grained tasks on Dask device workers.

    Gives the weights plain PyTorch training would give: one step is one mini-batch per model, split
    into `microbatches` micro-batches whose gradients are accumulated, with the loss the mean over the
    mini-batch. The user's modules are updated in place and also returned in result.models. microbatches="auto"
    takes the fewest micro-batches at which every model's layers fit the device budget, chosen from sizes alone
    (result.plan.options.microbatches says how many).

    link_bandwidth ("12GB/s", bytes per second, or one per device) holds every host<->device copy to
    that speed, a simulated link that makes swap costs visible on CPU devices. prefetch=True copies the next
    task's weights in while the current one computes and, on a GPU or over such a link, each micro-batch's input in
    while the one before it computes and its output out while the one after it computes; prefetch="weights" only
    the weights; prefetch=False neither. policy picks which model a
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
    arrays, sized by the simulator's predicted throughput (unfused, with a warning, where their layers cannot run
    batched); True uses the largest sub-arrays whose layers
    fit the budget (the whole group when it fits), an int k the largest that fit up to k, and False trains
    every model on its own. steps_per_task is how many consecutive steps one task of a homed
    single-pack model or array runs (all their batches in one file): "auto" picks enough to keep
    Dask's per-task cost (measured on the cluster before the run) near 1% of the measured step time.
    Every model keeps its own loss, optimizer and hyperparameters, and gets the weights it would get alone.
    lr_schedule (one for every model, or one per model) is a callable(step) -> factor of each param group's initial
    learning rate, LambdaLR's lr_lambda: the update of step s (0 for the first) uses initial_lr * lr_schedule(s), as
    a plain loop that calls LambdaLR.step() after each optimizer.step() (for a transformers schedule, pass
    get_cosine_schedule_with_warmup(...).lr_lambdas[0], built on any optimizer). clip_grad_norm (one, or one per
    model) clips each step's gradients to that total norm before its update, as clip_grad_norm_(parameters,
    max_norm) in a plain loop (after GradScaler.unscale_ with fp16); a fused array's members each by their own
    gradients. The norm is of every pack's gradients, so a swapped model's packs then update in upd tasks once its
    whole backward is done.

    A model whose own code raises stops alone, with the weights of its last complete step, and is reported in
    result.failed while the others go on; fail_fast=True makes it a ModelError that ends the run instead (so does
    a run in which every model failed). A device worker that dies costs only the steps it was running: they run
    again on the devices left (or on it when it comes back), and result.events says what was lost and redone.
    host_memory ("8GB") caps the host store's shared memory; a sweep that needs more is refused before any
    worker starts.

    checkpoint_dir keeps a checkpoint of every model there, every checkpoint_every steps (at the end of the task
    that reaches them) and at the end: plain torch.save state dicts of each model and its optimizer
    (model-<i>.pt) and what the run resumes from. resume=True takes the run up from those checkpoints (it must be
    the same run: the same models, data and arguments; a directory with none starts afresh), with the plan the
    checkpoints recorded, and ends with the weights and losses an uninterrupted run would have.

    The embedded cluster (scheduler, workers and dashboard) listens on host, loopback unless you ask otherwise
    (host="0.0.0.0" lets other machines reach it: anyone who can reach them can run code as you); the dashboard on
    dashboard_address (":8787" is that port on host). On your own cluster (cluster=), the workers may be on many
    machines: each machine's workers share a host store, and each model is trained on one machine's devices.
    device_memory may then be a dict of worker name -> budget.

    val_loaders (one loader for every model, or one per model, like loaders) evaluates every model every eval_every
    steps and at its end: forward only, no gradients, in eval mode, with its weights after that step (a swapped model
    pack by pack, on its devices); the loss is the mean over the validation samples (result.val_history). metrics,
    a callable(output, target) -> number (or a dict of numbers), or a dict of name -> such callable, adds figures
    averaged the same way (result.val_metrics). names (one per model) label the models in result.best(), the
    metrics and the report.

    log_dir writes the run's metrics there as it goes, one JSON-lines file per run (per model and step its loss,
    validation loss, learning rate and samples/s; per device its cached bytes, bytes in and out, busy share: see
    harmony.metrics), and TensorBoard event files beside it where tensorboard is installed. With profile_steps=n,
    every device worker also records its tasks of n steps after the first with torch.profiler (each task a range
    named by its Dask key, with a GPU's kernels and copies) into log_dir/profile-<device>.json, a Chrome trace.

    precision="bf16" runs every forward and backward (and the loss) under torch.autocast in bfloat16, as a plain
    loop inside ``torch.autocast(device_type, torch.bfloat16)`` would; weights, gradients and optimizer state stay
    float32 (the host store's master copy). "fp16" does the same in float16 with a gradient scaler, as a plain loop
    with ``torch.amp.GradScaler`` does: the loss scaled, the gradients unscaled, a step whose gradients are not all
    finite skipped (for every pack of the model: its updates wait for its whole backward), the scale backed off
    and grown; grad_scaler takes GradScaler's arguments (init_scale, growth_factor, backoff_factor,
    growth_interval). fp16 models are not fused (each skips its own steps). "fp32" (the default) computes as the
    models' own dtypes say.

    overlap_update=True steps a swapped model's optimizer on the host store in a task of its own, on a host thread
    beside the device, which goes on with the backward of the model's earlier packs meanwhile (as ZeRO-Offload
    overlaps its CPU optimizer); False steps it in the pack's backward task; None (the default) chooses by the
    simulator's prediction, which on CPU devices (whose host threads take the same cores) keeps it in backward.
    The weights are the same either way.

    update_on="device" steps a swapped model's optimizer on its device instead, in each pack's backward task: the
    pack's optimizer state is copied in beside its weights and gradients, and the new weights and state go back to
    the host store (the gradients never leave), as DeepSpeed's Twin-Flow does for a share of the parameters. It
    pays where the host's cores step the optimizer slower than the link carries its state both ways (a GPU with
    few host cores). A model that cannot (several micro-batch groups, halved device copies, fp16, a state that does
    not fit beside its pack) updates on the host. "host" never does; "auto" (the default) chooses by the
    simulator's prediction, with overlap_update's choices. The weights are plain PyTorch's either way, up to the
    device optimizer's kernel.

    packs_per_task is how many consecutive packs one task of a swapped model runs, swapping them in one after the
    other inside the task (each one's weights copied in while the one before computes), so that Dask's cost per
    task is paid once for them all: "auto" takes a pack a task, as many as keep that cost (measured on the cluster,
    with the handling a run fitted) a tenth of their forward, or a whole pass, whichever the simulator predicts
    fastest with its updates placed. The budget holds as with one pack per task; a backward task of several packs
    recomputes their inputs first (one more forward of all but its last pack). The weights are the same either way.

    compile=True runs every pack (and a homed model) through torch.compile on its worker: each pack compiles once
    per worker for training, once for its recompute and once for evaluation (its first tasks take that time, a few
    seconds each on a CPU), and again for a new micro-batch size. Random draws go through eager's generator
    (inductor's ``fallback_random``), so that dropout draws the masks it draws uncompiled and a recompute its
    forward's; a pack with layers that draw compiles in segments, one from each such layer on (its stream is
    seeded between them). The weights are plain PyTorch's up to the compiled kernels' rounding. A fused array
    compiles as one.
    Whether it pays depends on the model and the device (benchmarks/compiled.py measures it).

    stash=True (the default) keeps a swapped pack's activations on its device from its forward to its backward where
    the budget has room for them beside what the tasks between need: that backward then backpropagates them instead
    of recomputing the pack's forward from its input. The plan stashes the packs whose stash the simulator predicts
    still there when their backward runs (harmony.plan says how many); a stash only uses spare room (it gives way to
    weights and reservations, and a backward that does not find its stash recomputes), so the budget holds as
    without; result.stats.stashed and .recomputed count which way each micro-batch went. A compiled pack always
    recomputes. False recomputes every pack's forward (a baseline).

    threads="auto" (the default) lets each CPU device choose how many of its share of the cores it computes with:
    it times its tasks with one thread and with all of them, and keeps the faster (result.stats.one_thread), and a
    device with nothing left to compute gives its threads to the others of its machine. Where a kernel splits a sum
    by threads (batch norm, a convolution's weight gradient) the last bits of the weights then depend on timings. A
    count, threads=1 say, makes every device worker compute with that many threads throughout (the pilot times the
    layers so too): two runs of one plan give the same weights bit for bit, as a plain loop run twice at
    ``torch.set_num_threads(1)`` does. On a GPU device it is the host threads its worker steps optimizers with.
    """
    options = read_options(locals())  # first: locals() are the arguments alone
    for name, value in (("host", host), ("dashboard_address", dashboard_address)):
        if not isinstance(value, str):
            raise InputError(f"{name}={value!r} must be a string such as '127.0.0.1' or ':8787'")
    if isinstance(profile_steps, bool) or not isinstance(profile_steps, int) or profile_steps < 0:
        raise InputError(f"profile_steps={profile_steps!r} must be a number of steps (0: no profile)")
    if profile_steps and log_dir is None:
        raise InputError("profile_steps writes its traces into log_dir: pass log_dir too")
    check_options(options)
    check_models(models)
    starting = specs = None
    if cluster is None:  # the embedded cluster's workers start while the rest is checked (see Starting)
        specs = build_specs(*check_devices(devices, device_memory, link_bandwidth, cluster),
                            threads=options.fixed_threads)
        starting = Starting(specs, host, dashboard_address)
    args = validate(models, loaders, loss_fn, optimizer, options, devices, device_memory, cluster, link_bandwidth,
                    host_memory=host_memory, lr_schedule=lr_schedule, clip_grad_norm=clip_grad_norm)
    validation, validation_of, names = check_validation(val_loaders, metrics, names, options, args.models)
    pruner, prune_name = check_prune(prune, options, val_loaders is not None)
    args = dataclasses.replace(args, validation=validation, validation_of=validation_of, metrics=metrics, names=names,
                               pruner=pruner, prune=prune_name)
    directory = check_checkpoints(checkpoint_dir, checkpoint_every, resume)
    with watching_interrupts(), training_conventions(args.models), user_cluster(args.cluster) as user:
        if user is not None:
            specs = external_devices(user, args.device_memory, options.fixed_threads)
        assert specs is not None
        budgets = {spec.name: spec.budget for spec in specs}
        if starting is not None:
            starting.ready()  # before the pilot times layers: workers starting on the same cores would skew them
        with device_threads(specs):
            args, made = fewest_microbatches(args, min(budgets.values()))
            candidates = pilot(args, min(budgets.values()), made)
        check_host_memory([candidate.job for candidate in candidates], args.host_memory)
        checkpoints, recorded = open_checkpoints(directory, args, budgets, resume)
        started = time.perf_counter()
        with (
            device_cluster(user, starting) as handle,
            unbatched(handle.client, list(handle.workers.values()), restore=not handle.embedded),
            replicas_kept(handle.client),
        ):
            hardware = calibration.hardware(handle, specs)
            kind = calls.kind_of(specs)
            architectures = calls.architectures(args.models)
            arrays_hardware = calls.fitted(hardware, kind, calls.keyed(architectures, True))
            hardware = calls.fitted(hardware, kind, calls.keyed(architectures, False))
            machines = {spec.name: spec.machine for spec in specs}
            if recorded is None:
                with device_threads(specs):  # fusion pilots its trial arrays
                    plan, codes = build(args, candidates, budgets, hardware, machines, arrays_hardware)
                if args.pruner is not None and any(len(job.members) > 1 and job.home is None for job in plan.jobs):
                    logger.info("harmony: prune= with swapped fused arrays: such an array computes its pruned members "
                                "until all of them have stopped (fuse=False frees what pruning stops)")
            else:
                plan = replan_machines(recorded, machines)
                with device_threads(specs):
                    codes = codes_for(recorded, candidates, args, min(budgets.values()))
            args.planned()
            starts = [0] * len(plan.jobs)
            if checkpoints is not None:
                checkpoints.begin(plan, ", ".join(job.label for job in plan.jobs))
                starts = [checkpoints.version(job) if recorded is not None else 0 for job in range(len(plan.jobs))]
            logger.info("harmony: dashboard at %s", handle.dashboard_link)
            samples = [batch_size(args.first_batch(model)[0]) for model in range(len(args.models))]
            log = None if log_dir is None else MetricsLog(
                log_dir, plan, names, [learning_rates(factory) for factory in args.optimizers], samples)
            try:
                profile = (str(log_dir), profile_steps) if profile_steps else None
                with collector.frozen():  # a full collection then scans only what the run made
                    outcome = _execute(plan, codes, args, specs, handle, progress, checkpoints, starts, log, profile)
                wall_seconds = time.perf_counter() - started
                result = TrainResult.assemble(args.models, plan, outcome, wall_seconds, handle.dashboard_link, names,
                                              samples)
                result.host_costs = calls.learn(result, [step_samples(args, job) for job in plan.jobs], kind,
                                                models=calls.keyed(architectures, any(
                                                    len(job.members) > 1 for job in plan.jobs)),
                                                local=all(spec.machine == "" for spec in specs))
                if log is not None:
                    log.finish(result.history, result.stats.step_seconds, outcome.validation, result.grad_norms)
                    logger.info("harmony: metrics in %s", log.path)
            finally:
                if log is not None:
                    log.close()
    return result


def open_checkpoints(
    directory: Path | None, args: Arguments, budgets: dict[str, int], resume: bool
) -> tuple[Checkpoints | None, RunPlan | None]:
    """The run's checkpoints, and with resume the plan they recorded (None when there is nothing to resume); a
    checkpoint of another run is an InputError."""
    if directory is None:
        return None, None
    checkpoints = Checkpoints(directory, args.options.checkpoint_every, fingerprint(describe_run(args, budgets)))
    try:
        recorded = checkpoints.recorded()
    except ValueError as error:
        raise InputError(str(error)) from None
    if recorded is not None and not resume:
        raise InputError(f"checkpoint_dir={str(directory)!r} holds a checkpoint of this run already: pass "
                         "resume=True to take it up, or use another directory")
    return checkpoints, recorded if resume else None


def shutdown() -> None:
    """Close the embedded cluster a call kept warm (runtime.cluster.shutdown), and forget the pilot timings kept for
    re-run calls (harmony.timings): the next call starts and times afresh."""
    close_warm()
    timings.forget()
    calls.forget()
