"""Byte layouts of a pack's tensors inside one flat buffer (weights, gradients, optimizer state)."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor: its dtype (as a string such as "float32") and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in a flat buffer."""

    spec: TensorSpec
    offset: int


@dataclass(frozen=True)
class BufferLayout:
    """Tensors laid out one after another in a byte buffer, each at a multiple of its itemsize.

    Natural alignment is all a typed view needs, and it leaves no padding between tensors of one dtype,
    so the bytes copied for a buffer are exactly the bytes of its tensors.
    """

    slots: tuple[Slot, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [slot.spec.name for slot in self.slots]

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data, not counting alignment padding."""
        return sum(slot.spec.nbytes for slot in self.slots)


def align(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


def lay_out(specs: list[TensorSpec] | tuple[TensorSpec, ...]) -> BufferLayout:
    """Place tensors back to back, each starting at a multiple of its own itemsize."""
    offset = 0
    slots = []
    for spec in specs:
        offset = align(offset, ITEMSIZE[spec.dtype])
        slots.append(Slot(spec, offset))
        offset += spec.nbytes
    return BufferLayout(tuple(slots), offset)
