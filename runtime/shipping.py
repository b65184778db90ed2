"""Mini-batches for tasks, written once into a shared-memory file of the run's host store; a task carries its name.

Arguments given to ``client.submit`` travel with the task from the client through the scheduler to the worker:
a step's batch embedded there cost about 1.6 ms per megabyte per task on a 2-core machine (and a 134 MB GPU
batch would cross two sockets and the scheduler's memory twice a step). Instead the driver packs every
tensor of a batch into one file of the host store (the workers already map its files, on the same machine),
and the task's argument is the file's path with the tree's structure: a few hundred bytes. The worker maps
the file copy-on-write, so a model that changes its input in place cannot change what a later task of the
same step reads; the driver removes the file once no task will read it again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from harmony.runtime.hoststore import HostStore

ALIGNMENT = 64


@dataclass(frozen=True)
class TensorSlot:
    """Where one packed tensor lies in the file, and what it is."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        tensor = buffer[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)
        if self.device != "cpu":
            tensor = tensor.to(self.device)
        return tensor.requires_grad_(True) if self.requires_grad else tensor


@dataclass(frozen=True)
class ShippedTensors:
    """A tree of values whose tensors are packed into one host-store file; ``unpack()`` gives the tree back."""

    name: str
    path: str
    nbytes: int
    structure: Any

    @classmethod
    def pack(cls, tree: Any, store: HostStore, name: str) -> ShippedTensors:
        """Copy every tensor of tree (on any device) into the store's file name; other leaves are kept as is."""
        offset = 0

        def place(leaf: Any) -> Any:
            nonlocal offset
            if not isinstance(leaf, torch.Tensor):
                return leaf
            slot = TensorSlot(offset, leaf.dtype, tuple(leaf.shape), str(leaf.device), leaf.requires_grad)
            offset += -(-slot.nbytes // ALIGNMENT) * ALIGNMENT
            return slot

        structure = tree_map(place, tree)
        buffer = store.create(name, offset)
        for slot, leaf in zip(tree_leaves(structure), tree_leaves(tree)):
            if isinstance(slot, TensorSlot):
                buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape).copy_(leaf.detach())
        store.forget(name)
        return cls(name, str(store.path(name)), offset, structure)

    def unpack(self) -> Any:
        """The tree, its tensors views of a private (copy-on-write) mapping of the file, moved to their devices
        where those are not the CPU; the mapping goes when the last view does."""
        buffer = torch.from_file(self.path, shared=False, size=max(self.nbytes, 1), dtype=torch.uint8)
        return tree_map(lambda leaf: leaf.view(buffer) if isinstance(leaf, TensorSlot) else leaf, self.structure)


def ship(value: Any, store: HostStore, name: str) -> Any:
    """value packed into the store's file name if it holds any tensor, else value itself."""
    if any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value)):
        return ShippedTensors.pack(value, store, name)
    return value


def unship(value: Any) -> Any:
    """What ship packed, given back (other values pass through)."""
    return value.unpack() if isinstance(value, ShippedTensors) else value


def discard(value: Any, store: HostStore) -> None:
    """Remove a shipped value's file (no task reads it any more); other values have none."""
    if isinstance(value, ShippedTensors):
        store.remove(value.name)
