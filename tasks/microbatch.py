"""Split a mini-batch of B samples into micro-batches, and the loss weight of each."""

from __future__ import annotations


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


def group_sizes(microbatches: int, groups: int) -> list[int]:
    """How many of a step's micro-batches each of groups micro-batch groups takes (vDP): they are dealt out in
    turn, group g taking the g-th, the (g + groups)-th, ...

    Groups beyond the number of micro-batches (a short last batch) are empty.
    """
    base, extra = divmod(microbatches, groups)
    return [base + 1 if g < extra else base for g in range(groups)]
