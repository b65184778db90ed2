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


SPLIT_ALIGNMENT = 16  # a multiple of every itemsize: what follows a split lines up on both sides of it


@dataclass(frozen=True)
class Halved:
    """A pack's weights whose device copy holds some of them in a lower dtype (see runtime.halving).

    host is the host slot's layout: the halved tensors first, in their float32, then from host_split everything else
    (the other parameters, then the buffers); device is the device copy's: the same tensors in dtype up to
    device_split, then everything else exactly as in host from host_split, so that the rest is one copy."""

    names: frozenset[str]
    dtype: str
    host: BufferLayout
    device: BufferLayout
    host_split: int
    device_split: int


def halve(specs: list[TensorSpec] | tuple[TensorSpec, ...], names: frozenset[str], dtype: str) -> Halved:
    """Lay out specs for a device copy holding names in dtype (the rest as they are); the host layout keeps every
    tensor's own dtype, names first."""
    halved = [spec for spec in specs if spec.name in names]
    rest = [spec for spec in specs if spec.name not in names]
    front = lay_out(halved)
    lower = lay_out([TensorSpec(spec.name, dtype, spec.shape) for spec in halved])
    host_split, device_split = align(front.nbytes, SPLIT_ALIGNMENT), align(lower.nbytes, SPLIT_ALIGNMENT)
    back = lay_out(rest)
    host = BufferLayout(front.slots + tuple(Slot(slot.spec, host_split + slot.offset) for slot in back.slots),
                        host_split + back.nbytes)
    device = BufferLayout(lower.slots + tuple(Slot(slot.spec, device_split + slot.offset) for slot in back.slots),
                          device_split + back.nbytes)
    return Halved(frozenset(names), dtype, host, device, host_split, device_split)
