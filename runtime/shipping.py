"""Mini-batches for tasks, written into recycled shared-memory files of the run's host store; a task carries a name.

Arguments given to ``client.submit`` travel with the task from the client through the scheduler to the worker:
a step's batch embedded there cost about 1.6 ms per megabyte per task on a 2-core machine (and a 134 MB GPU
batch would cross two sockets and the scheduler's memory twice a step). Instead the driver packs every
tensor of a batch into one file of the host store (the workers already map its files, on the same machine),
and the task's argument is the file's name with the tree's structure: a few hundred bytes.

The files are recycled (``BatchFiles``): a fresh file costs its pages' faults on both sides (about 1 ms per
megabyte on a 2-core VM, twice the copy itself, every step), a file used before costs only the copy, and a
worker maps each one once. A file is written again only after every task that read it has finished, and
what a task reads from it are views it must not write: the device copy the model sees is made by the
worker's cache (``copy_in``), and the task has synchronized with any asynchronous copy before it finishes.
"""

from __future__ import annotations

import bisect
import ctypes
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from harmony.runtime.hoststore import HostStore

ALIGNMENT = 64
HEADER = ALIGNMENT
PAGE = 4096
SPARE_FILES = 32


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


class StaleBatch(RuntimeError):
    """A task read a batch file that has since been given another batch."""


@dataclass(frozen=True)
class ShippedTensors:
    """A tree of values whose tensors are packed into one host-store file; ``unpack(store)`` gives the tree back."""

    name: str
    capacity: int
    structure: Any
    generation: int = 0

    def unpack(self, store: HostStore) -> Any:
        """The tree, its tensors read-only views of the store's (cached, shared) mapping of the file, moved to
        their devices where those are not the CPU. A task run again after its batch's file was reused (Dask
        recomputing a result a dead worker held) gets an error, not another step's batch."""
        buffer = store.attach(self.name, self.capacity)
        found = int(buffer[:HEADER].view(torch.int64)[0])
        if found != self.generation:
            raise StaleBatch(f"batch file {self.name} now holds another batch (use {found}, not {self.generation}): "
                             "a task ran again after every reader of its batch had finished")
        return tree_map(lambda leaf: leaf.view(buffer) if isinstance(leaf, TensorSlot) else leaf, self.structure)


def _layout(leaves: list[Any]) -> tuple[list[Any], int]:
    """The leaves of a tree with a TensorSlot in place of each tensor, and the bytes the file needs: a header
    (the use's generation), then the tensors packed."""
    offset = HEADER
    placed = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            slot = TensorSlot(offset, leaf.dtype, tuple(leaf.shape), str(leaf.device), leaf.requires_grad)
            offset += -(-slot.nbytes // ALIGNMENT) * ALIGNMENT
            leaf = slot
        placed.append(leaf)
    return placed, offset


def write(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy source into the contiguous CPU tensor destination of its dtype and shape, on this thread only.

    A torch copy of more than a few thousand elements wakes torch's CPU thread pool, whose threads then
    spin waiting for more work: about 10 ms of CPU per copy in an otherwise idle driver, taken from the cores
    the device workers compute on. A plain CPU tensor's bytes are copied with memmove instead.
    """
    plain = (
        source.device.type == "cpu"
        and source.layout == torch.strided
        and source.is_contiguous()
        and not source.is_conj()
        and not source.is_neg()
    )
    if plain:
        ctypes.memmove(destination.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
    else:
        destination.copy_(source)


class BatchFiles:
    """The driver's batch files: each shipped value takes the smallest free file that holds it (a new one when
    none does) and gives it back when no task will read it again; at most SPARE_FILES wait for reuse."""

    def __init__(self, store: HostStore, spare: int = SPARE_FILES) -> None:
        self.store = store
        self.spare = spare
        self.free: list[tuple[int, str]] = []
        self.created = 0
        self.generation = 0

    def ship(self, value: Any) -> Any:
        """value packed into a batch file if it holds any tensor, else value itself."""
        leaves, spec = tree_flatten(value)
        if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
            return value
        slots, nbytes = _layout(leaves)
        capacity, name = self._take(nbytes)
        buffer = self.store.attach(name, capacity)
        self.generation += 1
        buffer[:HEADER].view(torch.int64)[0] = self.generation
        for slot, leaf in zip(slots, leaves):
            if isinstance(slot, TensorSlot):
                write(buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape), leaf.detach())
        return ShippedTensors(name, capacity, tree_unflatten(slots, spec), self.generation)

    def release(self, value: Any) -> None:
        """A shipped value's file is free again (no task reads it any more); other values have none."""
        if not isinstance(value, ShippedTensors):
            return
        bisect.insort(self.free, (value.capacity, value.name))
        if len(self.free) > self.spare:
            _, name = self.free.pop(0)
            self.store.remove(name)

    def _take(self, nbytes: int) -> tuple[int, str]:
        index = bisect.bisect_left(self.free, (nbytes, ""))
        if index < len(self.free):
            return self.free.pop(index)
        capacity = max(PAGE, -(-nbytes // PAGE) * PAGE)
        name = f"batch-{self.created}"
        self.created += 1
        self.store.create(name, capacity)
        return capacity, name


def unship(value: Any, store: HostStore) -> Any:
    """What BatchFiles.ship packed, given back through the store's mappings (other values pass through)."""
    return value.unpack(store) if isinstance(value, ShippedTensors) else value
