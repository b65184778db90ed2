"""Task arguments that carry tensors (mini-batches), packed into one buffer that travels as raw bytes.

Arguments given to ``client.submit`` are pickled with the task, and plain pickling serializes every tensor's
storage through ``torch.save``: a multi-step task's 126 small batch tensors took ~90 ms to reach a worker.
Packed, their bytes are one pickle protocol-5 out-of-band buffer (one frame, no per-tensor work) that the
scheduler forwards as is, and the worker unpacks them into views of that one buffer.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

ALIGNMENT = 64


@dataclass(frozen=True)
class TensorSlot:
    """Where one packed tensor lies in the buffer, and what it is."""

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


class ShippedTensors:
    """A tree of values whose tensors are packed into one byte buffer; ``unpack()`` gives the tree back."""

    def __init__(self, buffer: torch.Tensor, structure: Any) -> None:
        self.buffer = buffer
        self.structure = structure

    @classmethod
    def pack(cls, tree: Any) -> ShippedTensors:
        """Copy every tensor of tree (on any device) into one CPU buffer; other leaves are kept as they are."""
        offset = 0

        def place(leaf: Any) -> Any:
            nonlocal offset
            if not isinstance(leaf, torch.Tensor):
                return leaf
            slot = TensorSlot(offset, leaf.dtype, tuple(leaf.shape), str(leaf.device), leaf.requires_grad)
            offset += -(-slot.nbytes // ALIGNMENT) * ALIGNMENT
            return slot

        structure = tree_map(place, tree)
        buffer = torch.empty(offset, dtype=torch.uint8)
        for slot, leaf in zip(tree_leaves(structure), tree_leaves(tree)):
            if isinstance(slot, TensorSlot):
                buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape).copy_(leaf.detach())
        return cls(buffer, structure)

    def unpack(self) -> Any:
        """The tree, its tensors views of the one buffer (moved to their devices where those are not the CPU)."""
        return tree_map(lambda leaf: leaf.view(self.buffer) if isinstance(leaf, TensorSlot) else leaf, self.structure)

    def __reduce_ex__(self, protocol: int) -> tuple[Any, ...]:
        data = self.buffer.numpy()
        return _rebuild, (pickle.PickleBuffer(data) if protocol >= 5 else data.tobytes(), self.structure)


def _rebuild(frame: Any, structure: Any) -> ShippedTensors:
    raw = bytearray(frame)
    buffer = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return ShippedTensors(buffer, structure)


def ship(value: Any) -> Any:
    """value packed for a task's arguments if it holds any tensor, else value itself."""
    return ShippedTensors.pack(value) if any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value)) else value


def unship(value: Any) -> Any:
    """What ship packed, given back (other values pass through)."""
    return value.unpack() if isinstance(value, ShippedTensors) else value
