"""harmony.plan: the run's plan for a sweep and what it would take, predicted by the simulator; trains nothing."""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from harmony.api import train
from harmony.calibration import stored
from harmony.calls import architectures, fitted, keyed, kind_of
from harmony.candidate import step_samples
from harmony.conventions import training_conventions
from harmony.errors import InputError
from harmony.planner import build, fewest_microbatches, pilot
from harmony.runtime.devices import DeviceSpec, build_specs, device_threads
from harmony.runtime.measure import accelerator_speed, this_machine, with_accelerator
from harmony.tasks.fusion import FusionChoice
from harmony.tasks.hardware import Hardware
from harmony.tasks.microbatch import split_sizes
from harmony.tasks.packing import Packing
from harmony.tasks.pruning import PRUNERS, computed_share, every_member, live_members
from harmony.tasks.runplan import Options, RunPlan
from harmony.tasks.simulator import MemoryReport, ScheduleExceedsBudget, Simulation, replay_memory, simulate_machines
from harmony.validate import check_prune, read_options, validate


@dataclass
class Forecast:
    """The run's plan and what the simulator predicts of it: step time, peak bytes per device, swap volume.

    plan is the RunPlan train would run; a job is one model or a fused array: arrays lists the models of each
    job (in the order of packings), fusion the sub-array size chosen for each group of fusable models and the
    throughput predicted per size; steps the steps each job was simulated for (every model to its end); computed,
    under a built-in pruner, the share of those steps it is expected to leave computed, and pruned_seconds the run's
    seconds simulated with each job computing its expected share of its steps, a swapped array's task costs whole
    every step any of its members trains (None without one).
    """

    plan: RunPlan
    simulation: Simulation
    memory: MemoryReport
    steps: list[int]
    names: list[str] = field(default_factory=list)
    computed: float | None = None
    prune: str | None = None
    pruned_seconds: float | None = None

    @property
    def packings(self) -> list[Packing]:
        return [job.packing for job in self.plan.jobs]

    @property
    def budgets(self) -> dict[str, int]:
        return self.plan.devices

    @property
    def hardware(self) -> Hardware:
        return self.plan.hardware

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def predicted_modes(self) -> dict[str, float]:
        return dict(self.plan.predicted_modes)

    @property
    def arrays(self) -> list[list[int]]:
        return [list(job.members) for job in self.plan.jobs]

    @property
    def fusion(self) -> list[FusionChoice]:
        return list(self.plan.fusion)

    @property
    def step_seconds(self) -> float:
        """Predicted seconds per step of the whole sweep (every model advancing one step)."""
        return self.simulation.step_seconds()

    @property
    def total_seconds(self) -> float:
        return self.simulation.makespan

    @property
    def peak_device_bytes(self) -> dict[str, int]:
        return self.memory.peak

    @property
    def model_steps(self) -> int:
        """The steps of every model (a fused array's step is one of each of its members)."""
        return sum(count * len(job.members) for count, job in zip(self.steps, self.plan.jobs))

    @property
    def weights_in_per_step(self) -> float:
        """Weight bytes copied in per model-step."""
        return self.memory.weights_in / max(self.model_steps, 1)

    @property
    def grads_out_per_step(self) -> float:
        """Gradient bytes copied out per model-step."""
        return self.memory.grads_out / max(self.model_steps, 1)

    def devices_of(self, model: int) -> list[str]:
        """The devices that run some task of model in the predicted schedule."""
        return sorted(d for d, tasks in self.simulation.order.items() if any(t.model == model for t in tasks))

    def __str__(self) -> str:
        lines = [
            f"Harmony plan on {len(self.budgets)} device{'s' if len(self.budgets) != 1 else ''} "
            f"({self.hardware.name}), {self.model_steps} model-steps"
            + (f" (about {self.computed:.0%} of them computed under prune={self.prune!r}, the survivors unknown "
               "until the run)" if self.computed is not None else "")
            + f", mode {self.mode}"
            + (f", {self.plan.options.microbatches} micro-batches a step" if self.plan.options.microbatches != 1
               else "")
            + (", every pack through torch.compile" if self.plan.options.compile else ""),
        ]
        if self.predicted_modes and len(self.predicted_modes) > 1:
            lines.append(
                "  modes (predicted per step): "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.predicted_modes.items())
            )
        for choice in self.fusion:
            lines.append(f"  {choice.explain(self.names[choice.members[0]])}")
        for index, packing in enumerate(self.packings):
            packs = " | ".join(f"{p.first}-{p.stop - 1}" for p in packing.packs)
            weights = sum(p.float_bytes for p in packing.packs)
            job = self.plan.jobs[index]
            updates = ", updates beside the device" if job.overlap else ""
            if job.device_update:
                share = ("" if len(job.device_updates) == len(packing.packs)
                         else f" for {len(job.device_updates)} of its packs, on the host for the others")
                updates = f", updates on the device{share} (optimizer state copied in and out)"
            if job.clip:
                limits = ", ".join("not clipped" if math.isinf(limit) else f"{limit:g}" for limit in job.clip)
                updates += (f", gradients clipped at norm {limits}"
                            + (" (every update after the whole backward)" if job.home is None else ""))
            if job.sections:
                count = job.section_count
                updates += (f", one task a pass ({len(packing.packs)} packs)" if count == 1
                            else f", {count} tasks a pass ({len(packing.packs)} packs)")
            if job.stashes:
                updates += f", stashes the activations of {len(job.stashes)} of its packs for their backward"
            halved = sum(job.halved_bytes(pack) for pack in range(len(packing.packs)))
            if halved:
                updates += f", {halved:,} of them copied in as {self.plan.options.precision} (half the bytes)"
            stepped = [pack.update_seconds for pack in packing.packs]
            timed = (f"; pilot: a backward {packing.packs[0].backward_ratio:.1f}x its forward"
                     + ("" if None in stepped else f", its optimizer's step {sum(stepped) * 1e3:.2f} ms"))
            lines.append(
                f"  {packing.model}: {len(packing.packs)} packs [{packs}], {weights:,} weight bytes, "
                f"{self.steps[index]} steps on {', '.join(self.devices_of(index))}{updates}{timed}"
            )
        lines.append("  device      budget         predicted peak")
        for device, budget in self.budgets.items():
            lines.append(f"  {device:<10}{budget:>14,}{self.memory.peak.get(device, 0):>20,}")
        pruned = ("" if self.pruned_seconds is None else
                  f" (about {self.pruned_seconds:.2f} s with prune={self.prune!r} stopping models)")
        lines.append(
            f"  predicted: {self.step_seconds * 1e3:.2f} ms per step, {self.total_seconds:.2f} s in all{pruned}; "
            f"per model-step {self.weights_in_per_step:,.0f} weight bytes in, "
            f"{self.grads_out_per_step:,.0f} gradient bytes out"
            + (f", {self.memory.weights_out / max(self.model_steps, 1):,.0f} weight bytes out"
               if self.memory.weights_out else "")
            + (f"; with {self.hardware.call_seconds * 1e6:,.0f} µs of the runtime's host work per pack call and "
               f"{self.hardware.handling_seconds * 1e6:,.0f} µs per task"
               if self.hardware.call_seconds or self.hardware.handling_seconds else "")
            + (f" ({self.hardware.update_call_seconds * 1e6:,.0f} µs per update of a pack)"
               if self.hardware.update_call_seconds else "")
        )
        return "\n".join(lines)


PLANNED = ("devices", "device_memory", "clip_grad_norm", "prune",
           *(field.name for field in dataclasses.fields(Options)))


def plan(
    models: nn.Module | list[nn.Module],
    loaders: Any,
    loss_fn: Any = None,
    optimizer: Any = None,
    hardware: Hardware | None = None,
    machines: int = 1,
    **arguments: Any,
) -> Forecast:
    """Plan a sweep as harmony.train would run it and predict it with the simulator; trains nothing.

    Takes train's arguments that shape the run, with train's defaults: epochs, steps, microbatches, devices,
    device_memory, prefetch, policy, group, mode, resident, fuse, steps_per_task (loss_fn and optimizer may be
    left out). With a hardware description, devices is a count of such devices (which need not exist here)
    and device_memory their budget: "what would this take on 4 GPUs on PCIe 4" is
    ``harmony.plan(models, loader, devices=4, device_memory="40GB", hardware=Hardware(...))``. machines=k
    predicts k such machines of `devices` devices each: each job is homed on one machine (as train homes them on a
    cluster of several) and each machine's jobs are simulated on its devices; the run takes the longest machine's
    time. prune (with eval_every, as train takes them; no val_loaders needed) weighs each fusion size by the share of
    its steps it is expected to compute under a built-in pruner; the forecast's times are for every model to its end,
    and pruned_seconds the run simulated with each job computing its expected share of its steps (the survivors of
    each pruning step taken as any of the models, equally likely; a swapped array still pays a task's fixed costs
    every step any member trains, see _pruned).
    """
    unknown = sorted(set(arguments) - set(PLANNED))
    if unknown:
        raise InputError(f"harmony.plan takes no {', '.join(map(repr, unknown))}; it takes train's arguments that "
                         f"shape the run: {', '.join(PLANNED)}")
    given = {name: p.default for name, p in inspect.signature(train).parameters.items() if name in PLANNED}
    given.update(arguments)
    devices, device_memory = given["devices"], given["device_memory"]
    if hardware is not None and not isinstance(devices, int):
        raise InputError("with a hardware description, pass devices as a count, e.g. devices=4")
    if hardware is not None and isinstance(device_memory, dict):
        raise InputError("with a hardware description, pass device_memory as one size for every device")
    if hardware is not None and device_memory is None:
        raise InputError("with a hardware description, pass device_memory: the budget of each device")
    if isinstance(machines, bool) or not isinstance(machines, int) or machines < 1:
        raise InputError(f"machines={machines!r} must be a count of machines, at least 1")
    if machines > 1 and hardware is None:
        raise InputError("machines=k predicts machines that need not exist here: pass their hardware description")
    options = read_options(given)
    args = validate(models, loaders, loss_fn, optimizer, options, devices, device_memory, for_training=False,
                    clip_grad_norm=given["clip_grad_norm"])
    pruner, prune = check_prune(given["prune"], options, validation=True)  # what it would rank by is not needed here
    args = dataclasses.replace(args, pruner=pruner, prune=prune)
    specs: list[DeviceSpec] = []  # devices of this machine (none for hardware that need not exist here)
    arrays_hardware = None  # fitted to runs of these models as arrays (harmony.calls.keyed); None: hardware
    if hardware is not None:  # its devices copy micro-batch values ahead where they have a link to copy over
        args = dataclasses.replace(args, ahead=options.ahead and bool(hardware.host_link))
    if hardware is None:
        specs = build_specs(args.devices, args.device_memory, threads=options.fixed_threads)
        budgets = {spec.name: spec.budget for spec in specs}
        cpu = any(spec.kind == "cpu" for spec in specs)
        hardware = stored(specs)  # a train call's calibration, where one was kept
        if hardware is None:
            hardware = dataclasses.replace(this_machine(), shared_cores=cpu)
            if not cpu:  # the devices are this machine's GPUs
                hardware = with_accelerator(hardware, accelerator_speed())
        arrays_hardware = fitted(hardware, kind_of(specs), keyed(architectures(args.models), True))
        hardware = fitted(hardware, kind_of(specs), keyed(architectures(args.models), False))
    else:
        budgets = {f"dev-{k}-{i}" if machines > 1 else f"dev-{i}": args.device_memory  # type: ignore[misc]
                   for k in range(machines) for i in range(len(args.devices))}
    machine_of = {device: device.rsplit("-", 1)[0] if machines > 1 else "" for device in budgets}
    for index in range(len(args.models)):
        if args.expected_steps(index) is None:
            raise InputError(f"loaders for model {index} have no length; pass steps= to plan a fixed number of steps")
    with training_conventions(args.models), device_threads(specs):
        args, made = fewest_microbatches(args, min(budgets.values()))
        run_plan, _ = build(args, pilot(args, min(budgets.values()), made), budgets, hardware, machine_of,
                            arrays_hardware)
    args.planned()  # its exports kept for a train call that follows
    jobs = list(run_plan.jobs)
    counts = [job.steps or 0 for job in jobs]
    samples = [step_samples(args, job) for job in jobs]
    simulation = simulate_machines(run_plan, counts, samples, machine_of)
    microbatches = [split_sizes(n, run_plan.options.microbatches) for n in samples]
    try:
        memory = replay_memory(simulation.order, [job.device_packing for job in jobs], budgets, run_plan.homes,
                               [job.state_ratio for job in jobs], microbatches, [job.sections for job in jobs],
                               {index: job.device_updates for index, job in enumerate(jobs)},
                               {index: job.stashes for index, job in enumerate(jobs)})
    except ScheduleExceedsBudget as error:
        raise InputError(f"the planned schedule would not fit: {error}") from None
    computed = pruned_seconds = None
    if pruner in PRUNERS.values() and options.eval_every is not None:
        shares = [computed_share([len(job.members)], len(args.models), count, options.eval_every,
                                 every_member if options.compile else live_members)  # an array's live members
                  for job, count in zip(jobs, counts)]
        running = [computed_share([len(job.members)], len(args.models), count, options.eval_every, every_member)
                   for job, count in zip(jobs, counts)]
        model_steps = [count * len(job.members) for job, count in zip(jobs, counts)]
        computed = sum(steps * share for steps, share in zip(model_steps, shares)) / max(sum(model_steps), 1)
        pruned_plan, expected = _pruned(run_plan, counts, shares, running)
        pruned_seconds = simulate_machines(pruned_plan, expected, samples, machine_of).makespan
    return Forecast(run_plan, simulation, memory, counts, names=[type(model).__name__ for model in args.models],
                    computed=computed, prune=prune, pruned_seconds=pruned_seconds)


def _pruned(plan: RunPlan, counts: list[int], shares: list[float], running: list[float]
            ) -> tuple[RunPlan, list[int]]:
    """The plan and steps per job to simulate a pruned run by: a job that computes shares of its model-steps (its
    live members') and runs running of its steps at all (while any member trains). A homed job's pruned step
    shrinks whole (its weights stay on its device): it runs its computed share of its steps. A swapped array runs
    its running steps, each costing a task's fixed costs whole and the rest shrunk to the members it computes then
    (Job.narrowed)."""
    jobs, steps = [], []
    for job, count, share, runs in zip(plan.jobs, counts, shares, running):
        if job.home is not None or not job.fused or runs <= 0:
            jobs.append(job)
            steps.append(max(1, round(count * share)))  # a job's first rung runs
            continue
        jobs.append(job.narrowed(min(1.0, share / runs)))
        steps.append(max(1, round(count * runs)))
    return dataclasses.replace(plan, jobs=tuple(jobs)), steps
