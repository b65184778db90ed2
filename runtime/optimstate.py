"""An optimizer's state in the host store, one copy per slot of its pack, so that any worker can take it up.

A pack's weights have two slots in the host store (runtime.files): the version a step reads and the one its
update writes. The optimizer's state follows the same slots: ``save`` writes a torch optimizer's state into one
slot (its tensors into the slot's file, laid out once for the pack when the state first appears; its other
values in a small msgpack description beside it), ``load`` gives an optimizer the state of a slot. A host-side
optimizer (runtime.optimizer) steps the slot's tensors in place (``bind``: its state tensors are views of the
file); a homed model's optimizer on a device gets copies (``copy``). Every file is replaced whole or written
before the version that names it is published, so a worker that dies in the middle leaves the other slot intact.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from harmony.runtime.files import optimizer_layout_name, optimizer_meta_name, optimizer_name
from harmony.runtime.hoststore import HostStore, dtype_name, tensor_at
from harmony.runtime.serial_copy import copy_serially
from harmony.tasks.layout import BufferLayout, Slot, TensorSpec, lay_out


class OptimizerState:
    """The two slots of one pack's optimizer state in the host store."""

    def __init__(self, store: HostStore, model: int, pack: int) -> None:
        self.store = store
        self.model = model
        self.pack = pack
        self.entries: list[tuple[int, str]] = []
        self.layout: BufferLayout | None = None

    def _read_layout(self) -> BufferLayout | None:
        if self.layout is None:
            raw = self.store.read_bytes(optimizer_layout_name(self.model, self.pack))
            if raw is not None:
                described = msgpack.unpackb(raw)
                self.entries = [(index, key) for index, key in described["entries"]]
                slots = [Slot(TensorSpec(name, dtype, tuple(shape)), offset)
                         for name, dtype, shape, offset in described["slots"]]
                self.layout = BufferLayout(tuple(slots), described["nbytes"])
        return self.layout

    def tensors(self, slot: int) -> list[torch.Tensor]:
        """The state tensors of a slot, as views of its file, in the layout's order (none before any state)."""
        layout = self._read_layout()
        if layout is None:
            return []
        buffer = self.store.attach(optimizer_name(self.model, self.pack, slot), layout.nbytes)
        return [tensor_at(buffer, entry) for entry in layout.slots]

    def copy_slot(self, source: int, target: int) -> None:
        """Make target's state what source's is (its tensors' bytes and its other values)."""
        layout = self._read_layout()
        if layout is None:
            return
        origin = self.store.attach(optimizer_name(self.model, self.pack, source), layout.nbytes)
        copy_serially(self.store.attach(optimizer_name(self.model, self.pack, target), layout.nbytes), origin)
        meta = self.store.read_bytes(optimizer_meta_name(self.model, self.pack, source))
        if meta is not None:
            self.store.write_bytes(optimizer_meta_name(self.model, self.pack, target), meta)

    def load(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], slot: int, bind: bool) -> None:
        """Give optimizer (stepping params, in the order state is indexed by) the state of slot: with bind its
        state tensors become views of the slot's file, else copies on the parameters' device."""
        raw = self.store.read_bytes(optimizer_meta_name(self.model, self.pack, slot))
        if raw is None:
            return
        tensors = self.tensors(slot)  # reads the layout (and the entries) first
        for (index, key), tensor in zip(self.entries, tensors):
            state = optimizer.state[params[index]]
            if bind:
                state[key] = tensor
            else:
                state[key] = tensor.to(params[index].device if tensor.dim() else "cpu", copy=True)
        for index, key, value in msgpack.unpackb(raw)["scalars"]:
            optimizer.state[params[index]][key] = value

    def save(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], slot: int) -> None:
        """Write optimizer's state into slot (tensors bound to the slot already are left where they are)."""
        items = [(index, key, value) for index, param in enumerate(params)
                 for key, value in optimizer.state.get(param, {}).items()]
        tensors = [(index, key, value) for index, key, value in items if isinstance(value, torch.Tensor)]
        scalars = [[index, key, value] for index, key, value in items if not isinstance(value, torch.Tensor)]
        if tensors and self._read_layout() is None:
            self._create_layout(tensors)
        if [(index, key) for index, key, _ in tensors] != self.entries:
            raise RuntimeError(f"the optimizer state of pack {self.pack} of job {self.model} changed its tensors "
                               "after its first step; Harmony keeps optimizers whose state is created once")
        with torch.no_grad():
            for target, (_, _, value) in zip(self.tensors(slot), tensors):
                if value.data_ptr() != target.data_ptr():
                    target.copy_(value.detach())
        meta = msgpack.packb({"scalars": scalars}, default=_plain)
        self.store.write_bytes(optimizer_meta_name(self.model, self.pack, slot), meta)

    def _create_layout(self, tensors: list[tuple[int, str, torch.Tensor]]) -> None:
        layout = lay_out([TensorSpec(f"{index}.{key}", dtype_name(value.dtype), tuple(value.shape))
                          for index, key, value in tensors])
        for slot in (0, 1):
            self.store.create(optimizer_name(self.model, self.pack, slot), layout.nbytes)
        described = {
            "entries": [[index, key] for index, key, _ in tensors],
            "slots": [[s.spec.name, s.spec.dtype, list(s.spec.shape), s.offset] for s in layout.slots],
            "nbytes": layout.nbytes,
        }
        self.store.write_bytes(optimizer_layout_name(self.model, self.pack), msgpack.packb(described))
        self.entries = [(index, key) for index, key, _ in tensors]
        self.layout = layout


def _plain(value: Any) -> Any:
    """Scalars of an optimizer's state that msgpack does not know (a torch dtype, a tuple)."""
    if isinstance(value, torch.dtype):
        return str(value)
    raise TypeError(f"an optimizer's state holds a {type(value).__name__}, which Harmony cannot keep in the host "
                    "store")
