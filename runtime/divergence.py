"""Models whose loss stops being finite: stopped at that step, with the weights they had before it.

A model alone (or an array all of whose members diverged) raises Diverged from the task that computed the loss,
before anything is updated: a step's losses are checked once, after its micro-batches (a swapped model's in its
last pack's backward, before that pack's gradients are written; a homed model's before its update), which spares a
GPU a sync per micro-batch. Its job then stops alone (the binding state) with the weights of its last complete
step. The members of a fused array stop one by one while the others train on: the host store keeps, per member,
the step at which its loss stopped being finite (``Members``); every later update of the array puts a stopped
member's weights back as they were before that step, so its slices of the stacks never change again. Members are
independent in an array (each its own slice of every stack), so a stopped member's non-finite gradients reach
nobody else. A member pruned at a step (tasks.pruning) stops the same way, from its own file: the driver writes it
while the job waits at that step, before any of the step's updates.
"""

from __future__ import annotations

import torch

from harmony.runtime.errors import ModelFailure
from harmony.runtime.files import diverged_name, pruned_name
from harmony.runtime.hoststore import HostStore

TRAINING = -1.0


class Diverged(ModelFailure):
    """A model's loss was not finite at a step: the model stops there."""

    def __init__(self, model: int, step: int, value: float) -> None:
        super().__init__(model, f"step {step}", f"its loss became {value} at step {step}", "")
        self.step = step


class Members:
    """Per member of a job, the step at which its loss stopped being finite, and the one at which it was pruned
    (TRAINING while it trains), as the host store keeps them for every process of the run."""

    def __init__(self, store: HostStore, model: int, members: int) -> None:
        self.model = model
        self.steps = store.attach(diverged_name(model), 8 * members).view(torch.float64)
        self.pruned = store.attach(pruned_name(model), 8 * members).view(torch.float64)

    def stopped(self) -> list[int]:
        """The members that stopped (their loss, or pruning), in order."""
        return [index for index, (step, pruned) in enumerate(zip(self.steps.tolist(), self.pruned.tolist()))
                if step != TRAINING or pruned != TRAINING]

    def training(self, step: int) -> list[int]:
        """The members that compute step, in order: those whose loss stopped being finite at a later step or not at
        all (one computes the step at which it stops), and that were not pruned at or before it. A function of the
        step alone, so that every task of a step agrees, whenever it reads the files."""
        return [index for index, (stopped, pruned) in enumerate(zip(self.steps.tolist(), self.pruned.tolist()))
                if (stopped == TRAINING or stopped >= step) and (pruned == TRAINING or pruned > step)]

    def evaluated(self, step: int) -> list[int]:
        """The members an evaluation with the weights after step steps computes, in order: those not pruned before
        it (one pruned at step is ranked by that evaluation; one whose loss diverged is evaluated on the weights it
        kept). A function of the step alone, as training is."""
        return [index for index, pruned in enumerate(self.pruned.tolist()) if pruned == TRAINING or pruned >= step]

    def pruned_members(self) -> list[int]:
        """The members that were pruned, in order."""
        return [index for index, step in enumerate(self.pruned.tolist()) if step != TRAINING]

    def prune(self, positions: tuple[int, ...], step: int) -> None:
        """The members at positions stop at step (pruned)."""
        for position in positions:
            self.pruned[position] = float(step)

    def check(self, losses: torch.Tensor, step: int) -> list[int]:
        """Take a step's per-member losses: members whose loss is not finite stop at step (the first time). Returns
        the members that stopped at this step; raises Diverged once no member trains."""
        finite = torch.isfinite(losses.detach().reshape(-1)).tolist()
        stopped = set(self.stopped())
        stopping = [index for index, ok in enumerate(finite) if not ok and index not in stopped]
        for index in stopping:
            self.steps[index] = float(step)
        if all(not ok or index in stopped for index, ok in enumerate(finite)):
            value = losses.detach().reshape(-1)[stopping[0] if stopping else 0].item()
            raise Diverged(self.model, step, value)
        return stopping


def first_not_finite(losses: list[torch.Tensor]) -> torch.Tensor:
    """Per member, its first loss among a step's micro-batches (each a tensor of one loss per member) that is not
    finite, else its last: what Members.check takes for the whole step, so that a homed step syncs once."""
    stacked = torch.stack(losses)
    bad = ~torch.isfinite(stacked)
    last = torch.full_like(bad[0], len(losses) - 1, dtype=torch.int64)
    pick = torch.where(bad.any(0), bad.to(torch.int8).argmax(0), last)
    return stacked.gather(0, pick[None]).squeeze(0)


def keep_stopped(stacks: list[torch.Tensor], rows: list[torch.Tensor], stopped: list[int]) -> None:
    """Put the stopped members' slices of stacked tensors (members first) back: rows holds, per stack, the
    stopped members' slices in the order of stopped."""
    if stopped and stacks:
        index = torch.tensor(stopped, device=stacks[0].device)
        with torch.no_grad():
            for stack, kept in zip(stacks, rows):
                stack.index_copy_(0, index, kept.to(stack.device))
