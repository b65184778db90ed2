"""The members a swapped fused array's step computes once some of them stopped: their rows of every stack.

A homed array narrows its one module for a step (runtime.array.narrowed, runtime.homed). A swapped array's step is
many tasks, on any devices, whose values cross between packs with the members first, so every task of a step must
compute the same members: they are a function of the step alone (``Members.training``: who trains at that step does
not depend on when a task reads it) and of the packs' planned sizes, never of what a device holds at the time.

Members that follow one another are computed on views of their rows (the gradients accumulate into their rows of
the gradient buffer, the buffers the layers update change in place). Others need copies of their rows for each
call, which the call holds through its backward beside its activations: they are used where, in every pack, those
copies take no more than the room the stopped members' activations leave in its workspace (the workspace is then
reserved as for every member, so the budget holds); else the step computes every member from the first training to
the last (views again). The members computed but not training, and those not computed, lose nothing: every update
puts a stopped member's weights back (runtime.divergence), and their losses are recorded as NaN.

Only the computed members' rows cross the link (``Rows.spans``): a task copies those rows of its pack's weights in
(runtime.cache.Part; the buffers whole, which the step writes back whole) and writes those rows of its gradients
back, the host's other rows zeroed as a whole write of the step's gradients would leave them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from harmony.runtime.array import consecutive
from harmony.tasks.layout import BufferLayout


@dataclass(frozen=True)
class Rows:
    """The members (increasing positions in the array) a step computes, of members, and which of them train."""

    computing: tuple[int, ...]
    training: tuple[int, ...]
    members: int

    @property
    def viewed(self) -> bool:
        """Whether the computed members follow one another: their rows of a stack are one view of it."""
        return consecutive(list(self.computing))

    def views(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stacks (members first) as the views of the computed members' rows where they follow one another; else as
        they are (a call selects their rows, see selected)."""
        if not self.viewed:
            return tensors
        first, count = self.computing[0], len(self.computing)
        return {name: tensor.narrow(0, first, count) for name, tensor in tensors.items()}

    @contextmanager
    def selected(self, tensors: dict[str, torch.Tensor], buffers: Collection[str]) -> Iterator[dict[str, torch.Tensor]]:
        """The tensors one call computes with: where the computed members do not follow one another, copies of
        their rows (whose gradients reach the stacks' rows), the copies of buffers written back to their rows as the
        block ends (a layer's running statistics); else the tensors themselves (views already, see views)."""
        if self.viewed or not tensors:
            yield tensors
            return
        index = torch.tensor(self.computing, device=next(iter(tensors.values())).device)
        copies = {name: tensor.index_select(0, index) for name, tensor in tensors.items()}
        try:
            yield copies
        finally:
            with torch.no_grad():
                for name in buffers:
                    if name in tensors:
                        tensors[name].index_copy_(0, index, copies[name])

    def spans(self, layout: BufferLayout, end: int | None = None) -> tuple[tuple[int, int], ...]:
        """The byte ranges of layout (stacks, members first) that hold the computed members' rows, with what every
        member reads whole (member_spans): what a copy of those rows moves."""
        return member_spans(layout, self.members, self.computing, end)

    def clear(self, grads: dict[str, torch.Tensor]) -> None:
        """Zero the gradients' rows (members first) of the members computed but not training: a stopped member's
        gradient, however it came out (not finite, for one that diverged), reaches no norm, scale check or update."""
        idle = [member for member in self.computing if member not in self.training]
        if idle:
            with torch.no_grad():
                for grad in grads.values():
                    grad[idle] = 0

    def spread(self, losses: torch.Tensor) -> torch.Tensor:
        """The computed members' losses (one each) as one per member of the array: NaN for a member not training
        (computed or not), whose loss nobody keeps."""
        every = torch.full((self.members,), float("nan"), dtype=losses.dtype, device=losses.device)
        positions = [row for row, member in enumerate(self.computing) if member in self.training]
        every[list(self.training)] = losses.detach().reshape(-1)[positions]
        return every


def computed_rows(training: Sequence[int], members: int, packs: Sequence[tuple[int, int]]) -> Rows | None:
    """What a swapped array's step (or an array's evaluation) computes with training (increasing) of its members to
    compute, given per pack its weights' device bytes (those it borrows too) and its workspace: those members alone
    where they follow one another or where copying their rows fits every pack's room (see the module), else every
    member from the first of them to the last; None where that is every member (or there are none)."""
    if not 0 < len(training) < members:
        return None
    share = len(training) / members
    if consecutive(list(training)) or all(weights * share <= workspace * (1 - share) for weights, workspace in packs):
        return Rows(tuple(training), tuple(training), members)
    return Rows(tuple(range(training[0], training[-1] + 1)), tuple(training), members)


def member_spans(layout: BufferLayout, members: int, chosen: Iterable[int], end: int | None = None,
                 shared: bool = True) -> tuple[tuple[int, int], ...]:
    """The byte ranges of layout (stacks of members rows, members first; up to end) that hold chosen members' rows
    (increasing), merged where they touch; with shared, also what every member reads whole: a tensor that is not a
    stack of the members, and everything from end on (a pack's buffers)."""
    end = layout.nbytes if end is None else end
    runs: list[tuple[int, int]] = []  # (first, stop) of each run of consecutive chosen members
    for member in chosen:
        if runs and runs[-1][1] == member:
            runs[-1] = (runs[-1][0], member + 1)
        else:
            runs.append((member, member + 1))
    ranges = []
    for slot in layout.slots:
        if slot.offset >= end:
            continue
        if not slot.spec.shape or slot.spec.shape[0] != members:
            if shared:
                ranges.append((slot.offset, slot.offset + slot.spec.nbytes))
            continue
        row = slot.spec.nbytes // members
        ranges.extend((slot.offset + first * row, slot.offset + stop * row) for first, stop in runs)
    if shared and end < layout.nbytes:
        ranges.append((end, layout.nbytes))
    merged: list[tuple[int, int]] = []
    for first, stop in sorted(ranges):
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        elif stop > first:
            merged.append((first, stop))
    return tuple(merged)


def gaps(spans: Sequence[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
    """The byte ranges of nbytes that spans (sorted, apart) leave out."""
    left, start = [], 0
    for first, stop in spans:
        if first > start:
            left.append((start, first))
        start = stop
    if start < nbytes:
        left.append((start, nbytes))
    return left
