"""Mini-batches for each model: loaders iterated in order, shared loaders read once for all their models."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

Batch = tuple[Any, Any]


class LoaderFeed:
    """Batches of one loader: epochs passes over it (or, with steps, as many passes as steps need).

    The first epoch continues the iterator the driver already took the first batch from, so the
    loader's shuffling draws exactly what a plain PyTorch loop would.
    """

    def __init__(
        self, loader: Iterable[Batch], first_iterator: Iterator[Batch], first: Batch, epochs: int, steps: int | None
    ) -> None:
        self.loader = loader
        self.steps = steps
        self.epochs = epochs
        self._iterator: Iterator[Batch] | None = first_iterator
        self._pending: Batch | None = first
        self._epoch = 0
        self._served = 0

    def next(self) -> Batch | None:
        """The next batch, or None when the epochs (or steps) are done."""
        if self.steps is not None and self._served >= self.steps:
            return None
        while True:
            if self._pending is not None:
                batch, self._pending = self._pending, None
                self._served += 1
                return batch
            if self._iterator is not None:
                try:
                    batch = next(self._iterator)
                except StopIteration:
                    self._iterator = None
                    self._epoch += 1
                else:
                    self._served += 1
                    return batch
            if self.steps is None and self._epoch >= self.epochs:
                return None
            if self.steps is not None and self._served == 0 and self._epoch > 0:
                return None
            iterator = iter(self.loader)
            if iterator is self.loader and self._epoch > 0:
                return None
            self._iterator = iterator


class SharedFeed:
    """One loader read once and handed to several models, each getting every batch in order from its start (the
    steps a resumed model has trained already)."""

    def __init__(self, feed: LoaderFeed, starts: list[int]) -> None:
        self.feed = feed
        self.starts = list(starts)
        self._batches: dict[int, list[Any]] = {}
        self._fetched = 0
        self._exhausted_at: int | None = None

    def get(self, step: int) -> Batch | None:
        while self._exhausted_at is None and self._fetched <= step:
            batch = self.feed.next()
            if batch is None:
                self._exhausted_at = self._fetched
            else:
                readers = sum(1 for start in self.starts if start <= self._fetched)
                if readers:
                    self._batches[self._fetched] = [batch, readers]
                self._fetched += 1
        if self._exhausted_at is not None and step >= self._exhausted_at:
            return None
        entry = self._batches[step]
        entry[1] -= 1
        if entry[1] == 0:
            del self._batches[step]
        return entry[0]

    def leave(self, step: int) -> None:
        """One reader stops at step: it takes none of the batches from step on (those read already, nor later)."""
        self.starts.remove(max(start for start in self.starts if start <= step))
        for index in [index for index in self._batches if index >= step]:
            entry = self._batches[index]
            entry[1] -= 1
            if entry[1] == 0:
                del self._batches[index]


def batch_size(tree: Any) -> int:
    leaves, _ = tree_flatten(tree)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 0


def split_tree(tree: Any, sizes: list[int]) -> list[Any]:
    """Split every tensor of tree along dim 0 into micro-batches of sizes (views; shipping copies them into a file).

    One micro-batch is the tree itself (a step's driver work is on the critical path of small models)."""
    if len(sizes) == 1:
        return [tree]
    leaves, spec = tree_flatten(tree)
    parts = [list(leaf.split(sizes)) if isinstance(leaf, torch.Tensor) else [leaf] * len(sizes) for leaf in leaves]
    return [tree_unflatten([part[i] for part in parts], spec) for i in range(len(sizes))]
