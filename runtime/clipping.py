"""Gradient clipping by the total norm of a model's gradients, as torch.nn.utils.clip_grad_norm_ does it, for a
model updated pack by pack.

A plain loop takes every gradient's norm, their norm as the total, and multiplies every gradient by
``min(1, max_norm / (total + 1e-6))`` before the optimizer steps (after GradScaler.unscale_ with fp16). A fused
array's members are clipped each by their own gradients (their slices of the stacks, runtime.array.member_layout).

A homed model clips its gradients on its device before it steps. A swapped model's packs update one by one, each in
an upd task that waits for every bwd of the step (tasks.graph): the first of them to need the step's norm computes
it, and writes it into the job's norms file; the others read it there. It is computed before any pack of the step
updates (every update reads it first), while every pack's gradients are still the step's: a pack's gradients are
written again only by the next step's backward, which comes after that pack's update.

Where the gradients a pack's optimizer steps are those its backward computed (one micro-batch group: ``on_device``),
each pack's bwd takes its gradients' norms on the device as it writes them out, and the total is made from those: the
host reads no gradient for it. fp16's gradients are still scaled then: their norms are multiplied by the step's inverse
scale, which is the norm of the unscaled gradients exactly where the scale is a power of two (GradScaler's, unless its
growth or backoff factor says otherwise) and no square falls below the smallest normal float. With vDP's micro-batch
groups the first update computes every norm from the gradients in the host store, as its optimizer would read them
(fp16's unscaled): it sums each pack's groups into the pack's reduced file as it goes, and the pack's update steps that
sum rather than summing them again: so that no update holds a pack's lock while it waits for the norm, a clipped vDP
update takes the norm before it takes its pack's lock.

  norms   two slots of (step, then each member's total norm), float64, under a lock (the file's): slot step % 2
          holds step's once computed. The updates of a step all read it before any update of step + 2 can be due.
          Then two slots per pack of (step, then each member's norm of each gradient it steps): with on_device
          written by the pack's bwd under the pack's lock, the first update of the step reading them all; with
          groups written by the norm computation once it summed the pack's groups, the step taken back (-1) by
          the pack's update as it uses that sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from harmony.runtime.array import member_layout
from harmony.runtime.hoststore import HostStore

EPSILON = 1e-6  # clip_grad_norm_'s, added to the total norm

Named = Sequence[tuple[str, torch.Tensor]]  # gradients by their tensors' names in the pack or model


def norms_name(model: int) -> str:
    return f"m{model}-norms"


def norms_bytes(members: int, widths: Sequence[int] = ()) -> int:
    """The norms file's bytes: the totals' slots, then each pack's (widths: how many gradients each pack steps)."""
    return 8 * (2 * (1 + members) + 2 * len(widths) * (1 + members * max(widths, default=0)))


def on_device(groups: int) -> bool:
    """Whether a swapped job's packs take their gradients' norms on the device (see the module)."""
    return groups == 1


def tensor_norms(grads: Named, members: int) -> list[list[torch.Tensor]]:
    """Per member, the norm of each gradient (its slice of a stacked one, where members > 1)."""
    if members == 1:
        return [[torch.linalg.vector_norm(grad) for _, grad in grads]]
    return [[torch.linalg.vector_norm(member_layout(name, grad)[member]) for name, grad in grads]
            for member in range(members)]


def total_norms(norms: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Per member, the norm of its gradients' norms (as clip_grad_norm_ stacks them)."""
    return [torch.linalg.vector_norm(torch.stack(each)) if each else torch.zeros(()) for each in norms]


def coefficients(totals: Sequence[torch.Tensor], clip: Sequence[float]) -> list[torch.Tensor]:
    """Per member, what its gradients are multiplied by: max_norm / (total + 1e-6), at most 1 (1 where it is not
    clipped)."""
    return [torch.ones_like(total) if math.isinf(limit)
            else torch.clamp(limit / (total + EPSILON), max=1.0) for total, limit in zip(totals, clip)]


def scale(grads: Named, factors: Sequence[torch.Tensor]) -> None:
    """Multiply each member's gradients (slices, where there are several) by its factor, in place."""
    for name, grad in grads:
        if len(factors) == 1:
            grad.mul_(factors[0].to(grad.device))
            continue
        for member, factor in enumerate(factors):
            member_layout(name, grad)[member].mul_(factor.to(grad.device))


def clip_in_place(grads: Named, clip: Sequence[float]) -> list[torch.Tensor]:
    """Clip gradients (all of a model's, on one device) to each member's largest norm; returns the total norms."""
    totals = total_norms(tensor_norms(grads, len(clip)))
    scale(grads, coefficients(totals, clip))
    return totals


class Norms:
    """A swapped job's total gradient norm per step and member, computed once per step, and its packs' gradient
    norms taken on the device (see the module). widths: how many gradients each pack steps."""

    def __init__(self, store: HostStore, model: int, members: int, widths: Sequence[int]) -> None:
        self.store = store
        self.name = norms_name(model)
        self.members = members
        values = store.attach(self.name, norms_bytes(members, widths)).view(torch.float64)
        self.slots = values[: 2 * (1 + members)].view(2, 1 + members)
        self.packs = values[2 * (1 + members):].view(2, len(widths), 1 + members * max(widths, default=0))

    @staticmethod
    def create(store: HostStore, model: int, members: int, widths: Sequence[int]) -> None:
        store.create(norms_name(model), norms_bytes(members, widths)).view(torch.float64).fill_(-1.0)

    def record(self, step: int, pack: int, norms: list[list[torch.Tensor]]) -> None:
        """Write a pack's gradient norms of step (tensor_norms of the gradients it steps, on any device). The caller
        holds the pack's lock."""
        row = self.packs[step % 2, pack]
        if norms and norms[0]:
            values = torch.stack([torch.stack(each) for each in norms])
            row[1 : 1 + values.numel()] = values.flatten().to("cpu", torch.float64)
        row[0] = float(step)

    def reduced(self, step: int, pack: int) -> bool:
        """Whether the step's norm computation summed the pack's micro-batch groups into its reduced file (it
        recorded the pack's row, see totals' caller), taking the answer: once the pack's update has begun to use
        that sum (and may scale it in place), an update run again sums the groups again. The caller holds the
        pack's lock."""
        row = self.packs[step % 2, pack]
        if int(row[0]) != step:
            return False
        row[0] = -1.0
        return True

    def recorded(self, step: int, pack: int, dtypes: Sequence[torch.dtype]) -> list[list[torch.Tensor]]:
        """Per member, the norm of each gradient of pack (of dtypes) its bwd of step recorded."""
        row = self.packs[step % 2, pack]
        if int(row[0]) != step:
            raise RuntimeError(f"pack {pack}'s gradient norms of step {step} were never recorded (its slot holds "
                               f"step {int(row[0])}'s): its bwd must record them before the step's first update")
        values = row[1 : 1 + self.members * len(dtypes)].view(self.members, len(dtypes))
        return [[value.to(dtype) for value, dtype in zip(each, dtypes)] for each in values]

    def totals(self, step: int, dtype: torch.dtype, compute: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """Each member's total norm of step's gradients, in their dtype: read, or computed (compute) and written
        by the first caller of the step. Callers in any process of the machine take turns on the file's lock."""
        with self.store.locked(self.name):
            row = self.slots[step % 2]
            if int(row[0]) != step:
                row[1:] = torch.tensor([float(total) for total in compute()], dtype=torch.float64)
                row[0] = float(step)
            return [torch.tensor(float(value), dtype=dtype) for value in row[1:]]
