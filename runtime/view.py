"""What a display reads while a run goes: losses so far, evaluations, devices' counters, stopped members, events.

The progress display, the metrics log and the dashboard's feed are handed one RunView with the binding state after
the driver's events. Reading is cheap where the driver maps the host store (its own machine): losses and counters
are views of shared memory. A job on a machine the driver does not map has no losses here until the run ends
(None), and its devices' counters are as last brought home.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from harmony.runtime.files import RunFiles
from harmony.runtime.machines import RemoteStore
from harmony.tasks.binding import BindingState
from harmony.tasks.runplan import Job


def model_name(model: int, names: list[str] | None) -> str:
    """How displays, the metrics log and the result call a model: its name (names=), else "model <index>"."""
    return names[model] if names else f"model {model}"


def finite(value: float | None) -> float | None:
    """value where it is a finite number, else None (JSON and the page have no NaN or infinity)."""
    return value if value is not None and math.isfinite(value) else None


def event_line(event: dict[str, Any], jobs: list[Job]) -> str:
    """One of the binding state's events as a line: a device worker lost (the jobs it was busy with, what is redone
    where) or joined, a job failed, models pruned."""
    at = f"{float(event['at']):.1f} s into the run"
    if event["event"] == "job failed":
        return f"{jobs[event['job']].label} stopped at step {event['step']} ({at}): {event['reason']}"
    if event["event"] == "models pruned":
        models = ", ".join(str(model) for model in event["models"])
        return f"model{'s' if len(event['models']) > 1 else ''} {models} pruned at step {event['step']} ({at})"
    if event["event"] == "worker joined":
        return f"{event['device']}'s worker joined {at}"
    line = f"{event['device']}'s worker was lost {at}"
    if event["suspects"]:
        line += ", busy with " + ", ".join(jobs[job].label for job in event["suspects"])
    redone = [f"{jobs[job].label}: {where}" if where.startswith("its ") else f"{jobs[job].label} on {where}"
              for job, where in event["jobs redone"].items()]
    return line + ("; redoing " + ", ".join(redone) if redone else "")


@dataclass(frozen=True)
class Latest:
    """One model's latest figures: its steps trained, its last step's loss, and its last validation loss and the
    step it was taken at (None where there is none yet, or the job's losses cannot be read here)."""

    model: int
    steps: int
    loss: float | None
    val_loss: float | None
    val_step: int | None


@dataclass
class RunView:
    """A run as it goes; state is the binder's (steps trained, failures), files the host store's, validation the
    evaluations found so far per job as (step, {figure: per-member values})."""

    state: BindingState
    files: RunFiles
    validation: list[list[tuple[int, dict[str, list[float]]]]]
    started: float

    @property
    def seconds(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.started

    def stopped_members(self) -> dict[int, int]:
        """Per model (as the user numbered them) that stopped as a member of a fused array, the step it stopped at."""
        return self.files.members_stopped()

    def mapped(self, job: int) -> bool:
        """Whether the job's losses can be read here while it runs (its host store is the driver's)."""
        return not isinstance(self.files.stores[job], RemoteStore)

    def losses(self, job: int, steps: int, first: int = 0) -> list[list[float]] | None:
        """Per member of a job, the loss of its steps first .. steps - 1 (None where they cannot be read yet)."""
        if not self.mapped(job):
            return None
        return self.files.history(job, steps, first)

    def grad_norms(self, job: int, steps: int, first: int = 0) -> list[list[float]] | None:
        """Per member of a clipped job, its gradient norm at steps first .. steps - 1 (empty lists for a job that
        is not clipped; None where they cannot be read yet)."""
        if not self.mapped(job):
            return None
        return self.files.grad_norms(job, steps, first)

    def latest(self) -> list[Latest]:
        """Every model's latest figures, job by job (a fused array's members in order; a member pruned at a step
        has its figures of that step, although its array computes on)."""
        figures = []
        for job, spec in enumerate(self.state.jobs):
            trained = self.state.steps_trained[job]
            pruned = self.state.pruned_members.get(job, {})
            read: dict[int, list[list[float]] | None] = {}
            for position, model in enumerate(spec.members):
                steps = min(trained, pruned.get(position, trained))
                if steps and steps not in read:
                    read[steps] = self.losses(job, steps, steps - 1)
                losses = read.get(steps)
                loss = losses[position][-1] if losses and losses[position] else None
                validation = self.validation[job] if job < len(self.validation) else []
                evaluated = next((entry for entry in reversed(validation) if entry[0] <= steps), None)
                val = evaluated[1]["loss"][position] if evaluated else None
                figures.append(Latest(model, steps, loss, val, evaluated[0] if evaluated else None))
        return figures

    def devices(self) -> dict[str, dict[str, int]]:
        """Per device, its budget and what its worker last published (bytes moved, accounted bytes, busy time)."""
        budgets = dict(self.files.plan.budgets)
        return {name: {**values, "budget": budgets[name]} for name, values in self.files.counters().items()}
