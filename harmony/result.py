"""What harmony.train returns: the trained models, per-step losses and measured statistics."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from harmony.report import to_dataframe, write_report
from harmony.runtime.counters import IN_KINDS, OUT_KINDS
from harmony.runtime.run import RunOutcome
from harmony.runtime.view import model_name
from harmony.tasks.fusion import FusionChoice
from harmony.tasks.packing import Packing
from harmony.tasks.runplan import RunPlan


def steady_window(times: Sequence[float], skip: float = 0.2, what: str = "the run") -> tuple[int, int]:
    """The steps between which a run is steady, from the steps' finishing times in order: the step that ends the
    first skip share of them (start-up, the first task's warm-up; of steps that finished together, one multi-step
    task, the last) and the last step."""
    last = len(times) - 1
    first = max(0, int(len(times) * skip) - 1)
    while first < last and times[first + 1] == times[first]:
        first += 1
    if first >= last:
        raise ValueError(f"{what}: its {len(times)} steps did not finish at two different times after the "
                         f"first {skip:.0%}; a steady rate needs more steps (or fewer steps per task)")
    return first, last


def steady_seconds(times: Sequence[float], skip: float = 0.2, what: str = "the run") -> float:
    """Seconds per step once running, from the steps' finishing times in order: the time between the steps of
    steady_window, over the steps in between."""
    first, last = steady_window(times, skip, what)
    return (times[last] - times[first]) / (last - first)


@dataclass
class Stats:
    """Measured, not estimated: bytes are sums of what was actually copied, peaks what devices accounted.

    bytes_in kinds (host to device): "weights", "activations", "inputs", "grads" (a tied weight's gradient from the
    later pack that borrowed it), "state" (optimizer state, for updates on the device).
    bytes_out kinds (device to host): "grads", "activations", "buffers" (running statistics written back),
    "weights" and "state" (what homed models flush after their tasks, and what updates on the device write).
    bytes_remote: activation and gradient bytes a device's task received from another device's worker through host
    memory: through Dask's comms, or on one machine a GPU's page-locked copy in the producer's host-store file
    (then copied in: part of bytes_in).
    bytes_p2p: bytes a device's task read straight from the producing device's memory, not through Dask's comms:
    between CPU devices (whose memory is the host's) the producer's host-store file (runtime.peer). GPU to GPU
    without the host (CUDA IPC, NCCL) is not built, so between GPUs this stays 0.
    bytes_prefetched: the part of bytes_in["weights"] copied by the copy engine while a task computed.
    bytes_halved: the part of bytes_in["weights"] copied in autocast's dtype (precision "bf16" or "fp16") from the
    host's mirror of those weights: float32 copies would have taken twice these bytes.
    bytes_ahead: the part of bytes_in["activations"] and ["inputs"] copied in by the copy engine while the micro-batch
    before the one that read them computed; bytes_behind: the part of bytes_out["activations"] copied out while the
    micro-batch after the one that made them computed (on a GPU, or a CPU device with link_bandwidth; prefetch=True).
    bytes_kept: boundary activations and gradients that stayed on their device for the task that read them
    next, instead of being copied in again from their host copy (not part of bytes_in).
    stashed / recomputed: micro-batch passes through a swapped pack's backward (all but each model's last pack)
    that backpropagated the activations its forward task kept on the device (harmony.train's stash), and those
    that recomputed the pack's forward instead. inputs_recomputed: micro-batch forwards that the bwd task of a
    section of several packs (not a pass's last) ran first to recompute its later packs' inputs; none where those
    packs' stashes were all on the device.
    computed: model-steps the devices computed, a job's step counting each member that computed it: a fused array
    homed on its device computes its members still training, a swapped one every member until all have stopped (a
    step run again after a lost worker counts again).
    busy_seconds / idle_seconds: per device, time running tasks and time without one, from the moment
    the workers were ready; room_seconds: per device, the part of its tasks' time their compute thread waited for
    room on the device (a value sent out to land, weights on their way in to arrive; part of the timeline's waits);
    gc_seconds: per device, the part its worker process spent in Python's garbage collector (which stops every
    thread of it); updates / update_seconds: per device, the host updates of swapped packs its worker applied (in
    its bwd tasks or its upd tasks beside them: runtime.optimizer) and the seconds they took, locks, copies and
    checks included; device_updates / device_update_seconds the same of the updates its bwd tasks applied on the
    device; one_thread: per CPU device of more than one thread that timed its tasks both ways, whether it went on
    with one thread rather than all (runtime.threads);
    reserved_device_bytes: per GPU, the most memory its worker's CUDA caching allocator held at once in the run
    (peak_device_bytes is what the budget accounted); schedule: per device, the keys of the tasks in the
    order it ran them;
    finish_seconds: per model, when its last step finished, counted from the same moment;
    step_seconds: per model, when each of its steps finished (its update applied), from the same moment
    (the steps of a multi-step task finish together); steps_per_task: per model, how many consecutive
    steps one of its tasks ran (with "auto", its later tasks: its first ones ran the depth its predicted step
    time gave, until finished tasks measured its step time); task_seconds: what one task cost on this cluster,
    measured before the run (a chain of dependent empty tasks per device worker), from which
    steps_per_task="auto" chose those depths and the simulator predicted; bytes_machines: what crossed between
    the driver and machines it is not on (a cluster of several), "state" (model state out), "home" (state back,
    the trained weights and checkpoints), "batches" (each step's batches, once per machine); timeline: per device,
    each task it ran as (start, end, seconds waiting for copies, key), an upd task (key "upd-...") on its host
    thread beside the device's tasks, seconds from the moment the driver started
    (wall clocks: across machines as close as theirs agree); run_seconds: the training itself, from the driver's
    first instruction to every model's end (wall_seconds less it is what the call cost besides: the cluster's
    start, calibration, planning, setting the run up and taking it down).
    """

    peak_device_bytes: dict[str, int]
    bytes_in: dict[str, int]
    bytes_out: dict[str, int]
    steps: list[int]
    tasks: int
    wall_seconds: float
    busy_seconds: dict[str, float] = field(default_factory=dict)
    idle_seconds: dict[str, float] = field(default_factory=dict)
    room_seconds: dict[str, float] = field(default_factory=dict)
    gc_seconds: dict[str, float] = field(default_factory=dict)
    updates: dict[str, int] = field(default_factory=dict)
    update_seconds: dict[str, float] = field(default_factory=dict)
    device_updates: dict[str, int] = field(default_factory=dict)
    device_update_seconds: dict[str, float] = field(default_factory=dict)
    one_thread: dict[str, bool] = field(default_factory=dict)
    reserved_device_bytes: dict[str, int] = field(default_factory=dict)
    bytes_remote: int = 0
    bytes_p2p: int = 0
    bytes_prefetched: int = 0
    bytes_halved: int = 0
    bytes_ahead: int = 0
    bytes_behind: int = 0
    bytes_kept: int = 0
    stashed: int = 0
    recomputed: int = 0
    inputs_recomputed: int = 0
    computed: int = 0
    budgets: dict[str, int] = field(default_factory=dict)
    schedule: dict[str, list[str]] = field(default_factory=dict)
    finish_seconds: list[float] = field(default_factory=list)
    step_seconds: list[list[float]] = field(default_factory=list)
    steps_per_task: list[int] = field(default_factory=list)
    task_seconds: float = 0.0
    bytes_machines: dict[str, int] = field(default_factory=dict)
    timeline: dict[str, list[tuple[float, float, float, str]]] = field(default_factory=dict)
    run_seconds: float = 0.0

    def steady_seconds_per_step(self, model: int = 0, skip: float = 0.2) -> float:
        """Seconds per step of model once running: the time between the step that ends the first skip share of
        its steps (start-up, the first task's warm-up) and its last step, over the steps in between."""
        return steady_seconds(self.step_seconds[model], skip, f"model {model}")

    def utilization(self) -> dict[str, float]:
        """Per device, the fraction of the training time it spent running tasks."""
        return {
            name: busy / (busy + self.idle_seconds.get(name, 0.0)) if busy else 0.0
            for name, busy in self.busy_seconds.items()
        }


@dataclass(frozen=True)
class Best:
    """The model with the lowest final validation loss: its index, name (when names were given), final
    validation loss and metrics, the step they were measured at, and its last training loss."""

    index: int
    name: str | None
    val_loss: float
    step: int
    loss: float | None
    metrics: dict[str, float]


class HostCosts(Protocol):
    """Where a run's fitted host costs come from (harmony.calls.Pending): fitted when first asked."""

    def costs(self) -> tuple[float, float, float | None] | None:
        """(seconds per pack call, seconds per task, seconds per update of a pack or None where the run made none), or
        None where no costs explain the run's steps."""
        ...


@dataclass
class TrainResult:
    """The outcome of harmony.train.

    plan is the run's plan (jobs, devices, mode, options); packings is per job how it was cut (its layer packs,
    in the order of the plan's jobs and of the ``m<job>`` in task keys); arrays lists the jobs, each as the
    models it trained (several for a fused array); mode is the execution mode that ran; homes maps each model
    homed on a device for the whole run to that device (its weights crossed once and its gradients never left
    it); fusion says, per group of fusable models, which sub-array size was chosen and why. failed maps each model
    that stopped before the end to the step it stopped at and why (its weights are those of its last complete
    step); events lists, in order, the device workers lost and joined (and what was run again) and the failures.
    val_history is per model its (step, validation loss) pairs, val_metrics its (step, {metric: value}) pairs (with
    val_loaders); names the models' names (names=), or None; samples each model's samples per step (its first batch).
    grad_norms is per model (clip_grad_norm) each step's total gradient norm before clipping, as clip_grad_norm_
    returns it; empty for a model that is not clipped. pruned maps each model that prune= stopped to the step it
    stopped at (its weights, history and validation figures end there; it is not in failed). call_seconds and
    handling_seconds are the runtime's host cost per pack call and per task fitted to this run's steady steps (the
    first to its tasks' durations, the second to the rest of the step: harmony.calls), update_call_seconds its
    work per update of a swapped pack besides the optimizer's passes, as measured; later plans on such
    devices take the medians of the last few runs'; None where the run said nothing of them (no swapped model, too
    few steps). They are fitted when first asked for (host_costs, harmony.calls.Pending), here or by a later plan.
    """

    models: list[nn.Module]
    history: list[list[float]]
    stats: Stats
    dashboard_link: str | None
    plan: RunPlan
    packings: list[Packing]
    mode: str = "free"
    homes: dict[int, str] = field(default_factory=dict)
    arrays: list[list[int]] = field(default_factory=list)
    fusion: list[FusionChoice] = field(default_factory=list)
    failed: dict[int, dict[str, object]] = field(default_factory=dict)
    events: list[dict[str, object]] = field(default_factory=list)
    val_history: list[list[tuple[int, float]]] = field(default_factory=list)
    val_metrics: list[list[tuple[int, dict[str, float]]]] = field(default_factory=list)
    names: list[str] | None = None
    samples: list[int] = field(default_factory=list)
    grad_norms: list[list[float]] = field(default_factory=list)
    pruned: dict[int, int] = field(default_factory=dict)
    host_costs: HostCosts | None = field(default=None, repr=False)

    @property
    def call_seconds(self) -> float | None:
        """The runtime's host cost per pack call fitted to this run's steady steps (fitted when first asked)."""
        costs = None if self.host_costs is None else self.host_costs.costs()
        return None if costs is None else costs[0]

    @property
    def handling_seconds(self) -> float | None:
        """The runtime's host cost per task fitted to this run's steady steps (fitted when first asked)."""
        costs = None if self.host_costs is None else self.host_costs.costs()
        return None if costs is None else costs[1]

    @property
    def update_call_seconds(self) -> float | None:
        """The runtime's work per update of a swapped pack (on the host store or its device) besides the optimizer's
        passes, as this run's workers measured it (None: no such update, or no fit of the run)."""
        costs = None if self.host_costs is None else self.host_costs.costs()
        return None if costs is None else costs[2]

    def report(self, path: str | os.PathLike[str]) -> Path:
        """Write the run on one page (path ending in .png: an image; .html: the image and the tables): every model's
        training and validation curves, a table of final losses, throughput and stops, and each device's timeline
        (computing, waiting for copies, idle). Needs matplotlib."""
        return write_report(self, path)

    def to_dataframe(self, kind: str = "models") -> Any:
        """The run's figures as a pandas DataFrame: "models" (per model: steps, final loss and validation loss,
        best validation loss, samples/s, why it stopped), "steps" (per model and step) or "devices" (per device:
        budget, peak bytes, busy and copy-waiting shares). Needs pandas."""
        return to_dataframe(self, kind)

    def name(self, model: int) -> str:
        """The model's name (names=), else "model <index>"."""
        return model_name(model, self.names)

    def best(self) -> Best:
        """The model with the lowest final validation loss (among those whose loss is finite); needs val_loaders."""
        finals = [(history[-1][1], model) for model, history in enumerate(self.val_history)
                  if history and math.isfinite(history[-1][1])]
        if not finals:
            raise ValueError("best() ranks models by their final validation loss: train with val_loaders= "
                             "(and a model whose validation loss is finite)")
        val_loss, model = min(finals)
        step = self.val_history[model][-1][0]
        metrics = self.val_metrics[model][-1][1] if self.val_metrics[model] else {}
        loss = self.history[model][-1] if self.history[model] else None
        return Best(model, self.names[model] if self.names else None, val_loss, step, loss, dict(metrics))

    def job_of(self, model: int) -> int:
        """The index of the job (in packings and arrays, and the m<job> of task keys) that trained model."""
        return self.plan.job_of(model)

    def packing_of(self, model: int) -> Packing:
        """The packs model ran as: its own, or its array's."""
        return self.packings[self.job_of(model)]

    @staticmethod
    def assemble(
        models: list[nn.Module], plan: RunPlan, outcome: RunOutcome, wall_seconds: float, dashboard_link: str | None,
        names: list[str] | None = None, samples: list[int] | None = None,
    ) -> TrainResult:
        """The result of a finished run: every job's figures handed to each of its models."""
        history: list[list[float]] = [[] for _ in models]
        grad_norms: list[list[float]] = [[] for _ in models]
        val_history: list[list[tuple[int, float]]] = [[] for _ in models]
        val_metrics: list[list[tuple[int, dict[str, float]]]] = [[] for _ in models]
        for index, evaluations in enumerate(outcome.validation):
            for position, model in enumerate(plan.jobs[index].members):
                for step, figures in evaluations:
                    val_history[model].append((step, figures["loss"][position]))
                    others = {name: values[position] for name, values in figures.items() if name != "loss"}
                    if others:
                        val_metrics[model].append((step, others))
        steps = [0] * len(models)
        finish = [0.0] * len(models)
        step_seconds: list[list[float]] = [[] for _ in models]
        depths = [1] * len(models)
        for index, job in enumerate(plan.jobs):
            for position, model in enumerate(job.members):
                history[model] = outcome.history[index][position]
                if outcome.grad_norms and job.clip and not math.isinf(job.clip[position]):
                    grad_norms[model] = outcome.grad_norms[index][position]
                steps[model] = outcome.steps[index]
                finish[model] = outcome.finish_seconds[index]
                step_seconds[model] = list(outcome.step_seconds[index])
                depths[model] = outcome.depths[index]
        failed = {model: {"step": failure["step"], "reason": failure["reason"]}
                  for job, failure in outcome.failed.items() for model in plan.jobs[job].members}

        def stop(model: int, step: int) -> None:
            """A model stopped at step (a fused member's array may have trained on): its figures end there."""
            history[model] = history[model][:step]
            grad_norms[model] = grad_norms[model][:step]
            steps[model] = min(steps[model], step)

        for job, members in outcome.stopped.items():
            for position, step in members.items():
                model = plan.jobs[job].members[position]
                stop(model, step)
                failed.setdefault(model, {"step": step, "reason": f"its loss stopped being finite at step {step}"})
        pruned: dict[int, int] = {}
        for job, members in outcome.pruned.items():
            for position, step in members.items():
                model = plan.jobs[job].members[position]
                stop(model, step)
                pruned[model] = step
                failed.pop(model, None)  # its array failed later, when the members left diverged
                val_history[model] = [entry for entry in val_history[model] if entry[0] <= step]
                val_metrics[model] = [entry for entry in val_metrics[model] if entry[0] <= step]
        counters = outcome.counters
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
            room_seconds={name: values["room_ns"] / 1e9 for name, values in counters.items()},
            gc_seconds={name: values["gc_ns"] / 1e9 for name, values in counters.items()},
            updates={name: values["updates"] for name, values in counters.items()},
            update_seconds={name: values["update_ns"] / 1e9 for name, values in counters.items()},
            device_updates={name: values["device_updates"] for name, values in counters.items()},
            device_update_seconds={name: values["device_update_ns"] / 1e9 for name, values in counters.items()},
            one_thread={name: bool(values["one_thread"]) for name, values in counters.items()
                        if values["threads_chosen"]},
            reserved_device_bytes={name: values["reserved"] for name, values in counters.items() if values["reserved"]},
            bytes_remote=sum(values["remote"] for values in counters.values()),
            bytes_p2p=sum(values["p2p"] for values in counters.values()),
            bytes_prefetched=sum(values["prefetched"] for values in counters.values()),
            bytes_halved=sum(values["halved"] for values in counters.values()),
            bytes_ahead=sum(values["ahead"] for values in counters.values()),
            bytes_behind=sum(values["behind"] for values in counters.values()),
            bytes_kept=sum(values["kept"] for values in counters.values()),
            stashed=sum(values["stashed"] for values in counters.values()),
            recomputed=sum(values["recomputed"] for values in counters.values()),
            inputs_recomputed=sum(values["inputs_recomputed"] for values in counters.values()),
            computed=sum(values["computed"] for values in counters.values()),
            budgets=plan.devices,
            schedule=outcome.schedule,
            finish_seconds=finish,
            step_seconds=step_seconds,
            steps_per_task=depths,
            task_seconds=plan.hardware.task_overhead,
            bytes_machines=dict(outcome.traffic),
            timeline=dict(outcome.timeline),
            run_seconds=outcome.run_seconds,
        )
        return TrainResult(
            models=models,
            history=history,
            stats=stats,
            dashboard_link=dashboard_link,
            plan=plan,
            packings=[job.packing for job in plan.jobs],
            mode=plan.mode,
            homes={model: job.home for job in plan.jobs if job.home is not None for model in job.members},
            arrays=[list(job.members) for job in plan.jobs],
            fusion=list(plan.fusion),
            failed=failed,
            events=list(outcome.events),
            val_history=val_history,
            val_metrics=val_metrics,
            names=names,
            samples=list(samples or []),
            grad_norms=grad_norms,
            pruned=pruned,
        )
