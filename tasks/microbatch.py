"""Split a mini-batch of B samples into micro-batches, and the loss weight of each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def split_sizes(batch: int, microbatches: int) -> list[int]:
    """Sizes of at most `microbatches` micro-batches covering batch samples, as even as possible.

    A batch smaller than microbatches (the short last batch of an epoch) gives one sample per micro-batch.
    """
    if batch < 1:
        raise ValueError(f"a batch needs at least one sample, got {batch}")
    count = min(batch, microbatches)
    base, extra = divmod(batch, count)
    return [base + 1 if i < extra else base for i in range(count)]


def loss_weights(sizes: list[int]) -> list[float]:
    """Weight of each micro-batch's mean loss in the mini-batch's mean loss: b_i / B."""
    total = sum(sizes)
    return [size / total for size in sizes]


def deal(items: Sequence[T], groups: int) -> list[list[T]]:
    """A step's micro-batches (or anything per micro-batch) dealt out among groups micro-batch groups (vDP) in turn:
    group g takes the g-th, the (g + groups)-th, ... (runtime.seeding numbers them so). Groups beyond the number of
    micro-batches (a short last batch) are empty."""
    return [list(items[group::groups]) for group in range(groups)]
