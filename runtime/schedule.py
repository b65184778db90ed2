"""Learning-rate schedules: each optimizer step's learning rate from the number of the step it applies, as torch's
``LambdaLR`` sets it.

A schedule is a function of the step (0 for the first update) giving a factor of each param group's initial
learning rate: the update of step s uses ``initial_lr * schedule(s)``, which is what a plain loop that calls
``LambdaLR.step()`` after each ``optimizer.step()`` uses. Harmony builds a model's optimizer once per pack (and per
host slot, and again after a resume), so the learning rate cannot be state carried from step to step: every
update sets it from its own step number just before it steps (``at_step``). A built optimizer carries its groups'
schedules as ``lr_schedules``, one entry per param group: a schedule, None (constant), or for a fused array's
stacked group (whose hyperparameters are lists, one value per member) a list of the members' entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Schedule = Callable[[int], float]


@dataclass(frozen=True)
class Scheduled:
    """An optimizer factory whose optimizers step on schedule: each group keeps its learning rate as
    ``initial_lr`` (as LambdaLR records it) and ``at_step`` sets ``lr`` from it."""

    factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    schedule: Schedule

    def __call__(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = self.factory(params)
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        optimizer.lr_schedules = [self.schedule] * len(optimizer.param_groups)  # type: ignore[attr-defined]
        return optimizer


def schedules(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The schedule entry of each of optimizer's param groups (None for every group of an unscheduled one)."""
    return getattr(optimizer, "lr_schedules", None) or [None] * len(optimizer.param_groups)


def at_step(optimizer: torch.optim.Optimizer, step: int) -> None:
    """Set every scheduled group's learning rate for the update of step."""
    for group, schedule in zip(optimizer.param_groups, schedules(optimizer)):
        if isinstance(schedule, list):  # a stacked group: one schedule and initial lr per member
            group["lr"] = [lr if each is None else lr * float(each(step))
                           for lr, each in zip(group["initial_lr"], schedule)]
        elif schedule is not None:
            group["lr"] = group["initial_lr"] * float(schedule(step))
