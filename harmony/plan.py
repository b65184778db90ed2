"""harmony.plan: what a sweep would do and take, predicted by the simulator, without training anything."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from harmony.errors import InputError
from harmony.fusing import fuse_jobs
from harmony.prepare import arrange, first_batch_samples, prepare
from harmony.runtime.devices import build_specs
from harmony.runtime.measure import this_machine
from harmony.sizes import parse_size
from harmony.tasks.fusion import FusionChoice
from harmony.tasks.microbatch import split_sizes
from harmony.tasks.packing import PackPlan
from harmony.tasks.simulator import Hardware, MemoryReport, ScheduleExceedsBudget, Simulation, replay_memory, simulate
from harmony.validate import check_fuse, check_scheduling, validate


@dataclass
class Plan:
    """Packs per job, device assignment, predicted peak bytes, step time and swap volume.

    A job is one model or a fused array: arrays lists the models of each job (in the order of plans),
    fusion the sub-array size chosen for each group of fusable models and the throughput predicted per size.
    """

    plans: list[PackPlan]
    budgets: dict[str, int]
    hardware: Hardware
    simulation: Simulation
    memory: MemoryReport
    steps: list[int]
    mode: str = "free"
    predicted_modes: dict[str, float] | None = None
    arrays: list[list[int]] = field(default_factory=list)
    fusion: list[FusionChoice] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

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
    def weights_in_per_step(self) -> float:
        return self.memory.weights_in / max(sum(self.steps), 1)

    @property
    def grads_out_per_step(self) -> float:
        return self.memory.grads_out / max(sum(self.steps), 1)

    def devices_of(self, model: int) -> list[str]:
        """The devices that run some task of model in the predicted schedule."""
        return sorted(d for d, tasks in self.simulation.order.items() if any(t.model == model for t in tasks))

    def __str__(self) -> str:
        lines = [
            f"Harmony plan on {len(self.budgets)} device{'s' if len(self.budgets) != 1 else ''} "
            f"({self.hardware.name}), {sum(self.steps)} model-steps, mode {self.mode}",
        ]
        if self.predicted_modes and len(self.predicted_modes) > 1:
            lines.append(
                "  modes (predicted per step): "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.predicted_modes.items())
            )
        for choice in self.fusion:
            lines.append(f"  {choice.explain(self.names[choice.members[0]])}")
        for index, plan in enumerate(self.plans):
            packs = " | ".join(f"{p.first}-{p.stop - 1}" for p in plan.packs)
            weights = sum(p.weight_bytes for p in plan.packs)
            lines.append(
                f"  {plan.model}: {len(plan.packs)} packs [{packs}], {weights:,} weight bytes, "
                f"{self.steps[index]} steps on {', '.join(self.devices_of(index))}"
            )
        lines.append("  device      budget         predicted peak")
        for device, budget in self.budgets.items():
            lines.append(f"  {device:<10}{budget:>14,}{self.memory.peak.get(device, 0):>20,}")
        lines.append(
            f"  predicted: {self.step_seconds * 1e3:.2f} ms per step, {self.total_seconds:.2f} s in all; "
            f"per model-step {self.weights_in_per_step:,.0f} weight bytes in, "
            f"{self.grads_out_per_step:,.0f} gradient bytes out"
        )
        return "\n".join(lines)


def plan(
    models: nn.Module | list[nn.Module],
    loaders: Any,
    loss_fn: Any = None,
    optimizer: Any = None,
    epochs: int = 1,
    steps: int | None = None,
    microbatches: int = 1,
    devices: int | str | list[str] | None = None,
    device_memory: int | str | None = None,
    hardware: Hardware | None = None,
    prefetch: bool = True,
    policy: str = "lrtf",
    mode: str = "auto",
    resident: bool = True,
    fuse: bool | int | str = "auto",
) -> Plan:
    """Plan a sweep as harmony.train would run it and predict it with the simulator; trains nothing.

    With a hardware description, devices is a count of such devices (which need not exist here) and
    device_memory their budget: "what would this take on 4 GPUs on PCIe 4" is
    ``harmony.plan(models, loader, devices=4, device_memory="40GB", hardware=Hardware(...))``.
    """
    if hardware is not None and not isinstance(devices, int):
        raise InputError("with a hardware description, pass devices as a count, e.g. devices=4")
    if hardware is not None and device_memory is None:
        raise InputError("with a hardware description, pass device_memory: the budget of each device")
    check_scheduling(policy, mode)
    check_fuse(fuse)
    args = validate(models, loaders, loss_fn, optimizer, epochs, steps, microbatches, devices, device_memory,
                    None, for_training=False)
    if hardware is None:
        budgets = {spec.name: spec.budget for spec in build_specs(args.devices, args.device_memory)}
        hardware = this_machine()
    else:
        budget = parse_size(device_memory, "device_memory")  # type: ignore[arg-type]
        budgets = {f"dev-{i}": budget for i in range(len(args.devices))}
    jobs, _ = prepare(args, min(budgets.values()))
    for index, job in enumerate(jobs):
        if job.expected_steps is None:
            raise InputError(f"loaders for model {index} have no length; pass steps= to plan a fixed number of steps")
    jobs, choices = fuse_jobs(jobs, args, budgets, hardware, prefetch, policy, fuse)
    counts = [job.expected_steps or 0 for job in jobs]
    chosen, predicted = arrange(jobs, args, budgets, counts, hardware, mode, prefetch, policy, resident)
    plans = [job.plan for job in jobs]
    homes = {index: job.home for index, job in enumerate(jobs) if job.home is not None}
    simulation = simulate(plans, counts, first_batch_samples(args, jobs), budgets, hardware, prefetch=prefetch,
                          policy=policy, mode=chosen, groups=[job.groups for job in jobs], homes=homes)
    try:
        memory = replay_memory(simulation.order, plans, budgets, homes, [job.state_ratio for job in jobs],
                               [split_sizes(n, args.microbatches) for n in first_batch_samples(args, jobs)])
    except ScheduleExceedsBudget as error:
        raise InputError(f"the planned schedule would not fit: {error}") from None
    return Plan(plans, budgets, hardware, simulation, memory, counts, chosen, predicted,
                arrays=[list(job.members) for job in jobs], fusion=choices,
                names=[type(model).__name__ for model in args.models])
