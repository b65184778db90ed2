"""Mini-batches for tasks, written into recycled shared-memory files of the run's host store; a task carries a name.

Arguments given to ``client.submit`` travel with the task from the client through the scheduler to the worker,
per task (a large GPU batch would cross two sockets and the scheduler's memory twice a step). Instead the
driver packs every tensor of a batch into one file of the host store (the workers already map its files, on the
same machine), and the task's argument is the file's name with the tree's structure: a few hundred bytes.

A multi-step task's batches (a span of a homed model's steps) usually have one layout, step after step: they
are stacked, each tensor of the step's tree one array in the file with a leading step dimension, and the task
gets each step's tree as views of those arrays (``StackedSteps``). The driver then lays out, and the worker
unpickles and rebuilds, one step's structure instead of every step's, on the cores the device computes on.

The files are recycled (``BatchFiles``): a fresh file costs its pages' faults on both sides (more than the copy
itself), a file used before costs only the copy, and a worker maps each one once. Figures: docs/performance.md,
"Batches through shared-memory files". A file is written again only after every task that read it has finished, and
what a task reads from it are views it must not write: the device copy the model sees is made by the
worker's cache (``copy_in``), and the task has synchronized with any asynchronous copy before it finishes.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from harmony.runtime.hoststore import HostStore
from harmony.runtime.serial_copy import copy_to_address, is_plain

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

    def view(self, typed: torch.Tensor) -> torch.Tensor:
        """The tensor, read from typed: the whole file viewed as this slot's dtype (one strided view, not a
        slice and two reinterpretations: on a small machine each torch view costs microseconds, per tensor of
        every step)."""
        strides, stride = [], 1
        for size in reversed(self.shape):
            strides.append(stride)
            stride *= size
        start = typed.storage_offset() + self.offset // self.dtype.itemsize
        tensor = typed.as_strided(self.shape, strides[::-1], start)
        if self.device != "cpu":
            tensor = tensor.to(self.device)
        return tensor.requires_grad_(True) if self.requires_grad else tensor


class StaleBatch(RuntimeError):
    """A task read a batch file that has since been given another batch."""


@dataclass(frozen=True)
class ShippedTensors:
    """A tree of values whose tensors are packed into one host-store file; ``unpack(store)`` gives the tree back.

    With stacked_steps = n it is n consecutive steps' trees of one layout: the structure is one step's, each
    slot holding that tensor of all n steps, and ``unpack`` gives the steps as a sequence (StackedSteps)."""

    name: str
    capacity: int
    structure: Any
    generation: int = 0
    stacked_steps: int = 0

    def unpack(self, store: HostStore) -> Any:
        """The tree, its tensors read-only views of the store's (cached, shared) mapping of the file, moved to
        their devices where those are not the CPU. A task run again after its batch's file was reused (Dask
        recomputing a result a dead worker held) gets an error, not another step's batch."""
        buffer = self.check(store)
        typed: dict[torch.dtype, torch.Tensor] = {}

        def read(slot: TensorSlot) -> torch.Tensor:
            if slot.dtype not in typed:
                typed[slot.dtype] = buffer.view(slot.dtype)
            return slot.view(typed[slot.dtype])

        tree = _replace_leaves(self.structure, TensorSlot, read)
        return StackedSteps(tree, self.stacked_steps) if self.stacked_steps else tree

    def check(self, store: HostStore) -> torch.Tensor:
        """The file's mapping, if it still holds this use; else StaleBatch. A file is marked with its next use before
        it is written again, so a reader that checks after reading knows that what it read was this use's, whole."""
        buffer = store.attach(self.name, self.capacity)
        found = int(buffer[:HEADER].view(torch.int64)[0])
        if found != self.generation:
            raise StaleBatch(f"batch file {self.name} now holds another batch (use {found}, not {self.generation}): "
                             "a task ran again after every reader of its batch had finished")
        return buffer


class StackedSteps(Sequence[Any]):
    """Consecutive steps' trees of one layout, from one tree of stacked tensors: step i's tree has each
    stacked tensor's i-th entry (a view, made when the step is asked for)."""

    def __init__(self, stacked: Any, count: int) -> None:
        self.stacked = stacked
        self.count = count

    def __len__(self) -> int:
        return self.count

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.count))]
        if not -self.count <= index < self.count:
            raise IndexError(f"step {index} of {self.count} stacked steps")
        return _replace_leaves(self.stacked, torch.Tensor, lambda stacked: stacked[index])


@dataclass(slots=True)
class TensorLayout:
    """A tensor of a step's tree as stacking compares it: its place among the tree's tensors and what it is
    (made for every tensor of every step of a span: a plain slotted class, the cheapest to build)."""

    position: int
    dtype: torch.dtype
    shape: torch.Size
    device: torch.device
    requires_grad: bool


def _layout(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """value's tree with every tensor replaced by its TensorLayout, and the tensors in order."""
    tensors: list[torch.Tensor] = []

    def mark(tensor: torch.Tensor) -> TensorLayout:
        tensors.append(tensor)
        return TensorLayout(len(tensors) - 1, tensor.dtype, tensor.shape, tensor.device, tensor.requires_grad)

    return _replace_leaves(value, torch.Tensor, mark), tensors


def _same(first: Any, second: Any) -> bool:
    """Whether two layouts are equal (a leaf whose comparison is not a truth value, an array's, is not)."""
    try:
        return bool(first == second)
    except Exception:
        return False


SCALARS = (str, bytes, int, float, bool, type(None))


def _replace_leaves(tree: Any, kind: type, replace: Callable[[Any], Any]) -> Any:
    """tree with replace(leaf) for every leaf of the given kind. Lists, tuples and dicts are walked here, any
    other container (a namedtuple, an OrderedDict) by torch's pytree: a span of steps holds dozens of small
    lists, and pytree's generic walk costs more than writing their tensors."""
    if isinstance(tree, kind):
        return replace(tree)
    container = type(tree)
    if container is list or container is tuple:
        return container(_replace_leaves(item, kind, replace) for item in tree)
    if container is dict:
        return {key: _replace_leaves(item, kind, replace) for key, item in tree.items()}
    if isinstance(tree, SCALARS):
        return tree
    leaves, spec = tree_flatten(tree)
    if len(leaves) == 1 and leaves[0] is tree:
        return tree
    return tree_unflatten([_replace_leaves(leaf, kind, replace) for leaf in leaves], spec)


class _Packing:
    """The tensors of a tree being laid out in a file: a header (the use's generation), then the tensors
    packed at ALIGNMENT, each replaced by its TensorSlot."""

    def __init__(self) -> None:
        self.nbytes = HEADER
        self.tensors: list[tuple[TensorSlot, torch.Tensor]] = []

    def place(self, tensor: torch.Tensor) -> TensorSlot:
        slot = self.reserve(tensor.dtype, tuple(tensor.shape), str(tensor.device), tensor.requires_grad)
        self.tensors.append((slot, tensor))
        return slot

    def reserve(self, dtype: torch.dtype, shape: tuple[int, ...], device: str, requires_grad: bool) -> TensorSlot:
        """The next slot of the file, for a tensor written by the caller."""
        slot = TensorSlot(self.nbytes, dtype, shape, device, requires_grad)
        self.nbytes += -(-slot.nbytes // ALIGNMENT) * ALIGNMENT
        return slot


def write(buffer: torch.Tensor, offset: int, source: torch.Tensor) -> None:
    """Copy source into its slot of the CPU buffer, on this thread only (see serial_copy: a torch copy of more
    than a few thousand elements wakes torch's CPU thread pool, whose threads then spin for more work on the
    cores the device workers compute on). A plain CPU tensor's bytes go straight to the slot's address (no view
    of the buffer made for it)."""
    if is_plain(source):
        copy_to_address(buffer.data_ptr() + offset, source)
    else:
        target = buffer[offset : offset + source.numel() * source.element_size()]
        target.view(source.dtype).view(source.shape).copy_(source.detach())


class BatchFiles:
    """The driver's batch files: each shipped value takes the smallest free file that holds it (a new one when
    none does) and gives it back when no task will read it again; at most SPARE_FILES wait for reuse."""

    def __init__(self, store: HostStore, spare: int = SPARE_FILES, prefix: str = "batch-") -> None:
        self.store = store
        self.spare = spare
        self.prefix = prefix
        self.free: list[tuple[int, str]] = []
        self.created = 0
        self.generation = 0

    def ship(self, value: Any) -> Any:
        """value packed into a batch file if it holds any tensor, else value itself."""
        packing = _Packing()
        structure = _replace_leaves(value, torch.Tensor, packing.place)
        if not packing.tensors:
            return value
        name, capacity, buffer = self._begin(packing.nbytes)
        for slot, tensor in packing.tensors:
            write(buffer, slot.offset, tensor)
        return ShippedTensors(name, capacity, structure, self.generation)

    def reserve(self, value: Any) -> ShippedTensors:
        """A file laid out for value's tensors and taken for it, not yet written: fill writes it later (a device's
        result that is copied to the host only if it must leave the device, runtime.ipc). Its tensors read back
        as host tensors whatever device value's are on, without gradients."""
        packing = _Packing()
        structure = _replace_leaves(
            value, torch.Tensor, lambda tensor: packing.reserve(tensor.dtype, tuple(tensor.shape), "cpu", False))
        name, capacity, _ = self._begin(packing.nbytes)
        return ShippedTensors(name, capacity, structure, self.generation)

    def fill(self, shipped: ShippedTensors, value: Any) -> None:
        """Write value's tensors (of the layout reserve gave shipped, on any device) into shipped's file."""
        buffer = shipped.check(self.store)
        slots, _ = tree_flatten(shipped.structure)
        tensors, _ = tree_flatten(value)
        for slot, tensor in zip(slots, tensors):
            if isinstance(slot, TensorSlot):
                write(buffer, slot.offset, tensor.detach())

    def ship_steps(self, steps: list[Any]) -> Any:
        """Consecutive steps' values for one task: stacked when every step's tree has the first one's layout
        (the same containers, scalars, and tensors of the same dtype, shape and device, none requiring grad),
        else the list of them packed as ship does."""
        if len(steps) < 2:
            return self.ship(steps)
        skeleton, first = _layout(steps[0])
        columns = [[tensor] for tensor in first]
        for value in steps[1:]:
            other, tensors = _layout(value)
            if not _same(other, skeleton):
                return self.ship(steps)
            for column, tensor in zip(columns, tensors):
                column.append(tensor)
        if not first or any(tensor.requires_grad for tensor in first):
            return self.ship(steps)
        packing = _Packing()
        slots = [packing.reserve(t.dtype, (len(steps), *t.shape), str(t.device), False) for t in first]
        structure = _replace_leaves(skeleton, TensorLayout, lambda layout: slots[layout.position])
        name, capacity, buffer = self._begin(packing.nbytes)
        for slot, column in zip(slots, columns):
            stride = slot.nbytes // len(steps)
            for index, tensor in enumerate(column):
                write(buffer, slot.offset + index * stride, tensor)
        return ShippedTensors(name, capacity, structure, self.generation, stacked_steps=len(steps))

    def _begin(self, nbytes: int) -> tuple[str, int, torch.Tensor]:
        """A free file of at least nbytes marked with a new generation: its name, capacity and buffer."""
        capacity, name = self._take(nbytes)
        buffer = self.store.attach(name, capacity)
        self.generation += 1
        buffer[:HEADER].view(torch.int64)[0] = self.generation
        return name, capacity, buffer

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
        name = f"{self.prefix}{self.created}"
        self.created += 1
        self.store.create(name, capacity)
        return capacity, name


def unship(value: Any, store: HostStore) -> Any:
    """What BatchFiles.ship packed, given back through the store's mappings (other values pass through)."""
    return value.unpack(store) if isinstance(value, ShippedTensors) else value
