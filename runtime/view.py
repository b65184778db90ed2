"""What a display reads while a run goes: losses so far, evaluations, devices' counters, stopped members.

The progress display, the metrics log and the dashboard's feed are handed one RunView with the binding state after
the driver's events. Reading is cheap where the driver maps the host store (its own machine): losses and counters
are views of shared memory. A job on a machine the driver does not map has no losses here until the run ends
(None), and its devices' counters are as last brought home.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from harmony.runtime.files import RunFiles
from harmony.runtime.machines import RemoteStore
from harmony.tasks.binding import BindingState


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

    def losses(self, job: int, steps: int) -> list[list[float]] | None:
        """Per member of a job, the loss of its first steps steps (None where they cannot be read yet)."""
        if not self.mapped(job):
            return None
        return self.files.history(job, steps)

    def devices(self) -> dict[str, dict[str, int]]:
        """Per device, its budget and what its worker last published (bytes moved, accounted bytes, busy time)."""
        budgets = dict(self.files.plan.budgets)
        return {name: {**values, "budget": budgets[name]} for name, values in self.files.counters().items()}
