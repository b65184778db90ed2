"""The optimizer of one pack, stepping parameters in the host store and keeping its state there too.

The user's factory builds a torch optimizer over the pack's parameters, which are tensors mapped on the
host store's weight file, with their .grad mapped on the gradient file. After a step, any state tensor
the optimizer created (momentum buffers, Adam moments, step counts) is moved into a state file of the
host store, with a small msgpack description beside it, so that any worker on the machine can rebuild
the optimizer exactly where the last one left off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import torch
from torch import nn

from harmony.runtime.array_optimizer import build_optimizer, optimizer_params, step_optimizer
from harmony.runtime.files import grads_name, optimizer_meta_name, optimizer_name, weights_name
from harmony.runtime.hoststore import HostStore, dtype_name, tensor_at
from harmony.runtime.spec import PackRuntime
from harmony.tasks.layout import Slot, TensorSpec, lay_out

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class PackOptimizer:
    """A torch optimizer over one pack's parameters in the host store, with its state in the host store."""

    def __init__(
        self, factory: OptimizerFactory, store: HostStore, model: int, pack: int, runtime: PackRuntime
    ) -> None:
        self.store = store
        self.model = model
        self.pack = pack
        weights = store.attach(weights_name(model, pack), runtime.weights.nbytes)
        grads = store.attach(grads_name(model, pack), runtime.grads.nbytes)
        by_name = {slot.spec.name: slot for slot in runtime.weights.slots}
        self.params = []
        for grad_slot in runtime.grads.slots:
            param = nn.Parameter(tensor_at(weights, by_name[grad_slot.spec.name]))
            param.grad = tensor_at(grads, grad_slot)
            self.params.append(param)
        self.optimizer = build_optimizer(factory, self.params, [slot.spec.name for slot in runtime.grads.slots])
        self.params = optimizer_params(self.optimizer)
        self.generation = -1
        self.last_step = -1
        self.layout: list[list[Any]] = []
        self.nbytes = 0
        self._load()

    def _load(self) -> None:
        raw = self.store.read_bytes(optimizer_meta_name(self.model, self.pack))
        if raw is None:
            return
        meta = msgpack.unpackb(raw)
        self.generation = meta["generation"]
        self.last_step = meta["step"]
        self.layout = meta["tensors"]
        self.nbytes = meta["nbytes"]
        buffer = self.store.attach(optimizer_name(self.model, self.pack, self.generation), self.nbytes)
        for index, key, dtype, shape, offset in meta["tensors"]:
            slot = Slot(TensorSpec(key, dtype, tuple(shape)), offset)
            self.optimizer.state[self.params[index]][key] = tensor_at(buffer, slot)
        for index, key, value in meta["scalars"]:
            self.optimizer.state[self.params[index]][key] = value

    def step(self, step: int) -> None:
        """Apply the update for step; the gradients in the host store are this step's."""
        assert self.last_step == step - 1, f"pack optimizer at step {self.last_step} asked for step {step}"
        step_optimizer(self.optimizer)
        self.last_step = step
        self._persist()

    def _state_items(self) -> list[tuple[int, str, Any]]:
        return [
            (index, key, value)
            for index, param in enumerate(self.params)
            for key, value in self.optimizer.state.get(param, {}).items()
        ]

    def _persist(self) -> None:
        items = self._state_items()
        tensors = [(i, k, v) for i, k, v in items if isinstance(v, torch.Tensor)]
        scalars = [[i, k, v] for i, k, v in items if not isinstance(v, torch.Tensor)]
        stored = self.generation >= 0 and all(self._in_store(v) for _, _, v in tensors)
        if not stored and tensors:
            self.generation += 1
            layout = lay_out([TensorSpec(key, dtype_name(v.dtype), tuple(v.shape)) for _, key, v in tensors])
            buffer = self.store.create(optimizer_name(self.model, self.pack, self.generation), layout.nbytes)
            for (index, key, value), slot in zip(tensors, layout.slots):
                shared = tensor_at(buffer, slot)
                shared.copy_(value)
                self.optimizer.state[self.params[index]][key] = shared
            self.layout = [
                [index, key, slot.spec.dtype, list(slot.spec.shape), slot.offset]
                for (index, key, _), slot in zip(tensors, layout.slots)
            ]
            self.nbytes = layout.nbytes
        meta = {
            "generation": self.generation,
            "step": self.last_step,
            "nbytes": self.nbytes,
            "tensors": self.layout,
            "scalars": scalars,
        }
        self.store.write_bytes(optimizer_meta_name(self.model, self.pack), msgpack.packb(meta))

    def _in_store(self, tensor: torch.Tensor) -> bool:
        if self.generation < 0:
            return False
        buffer = self.store.attach(optimizer_name(self.model, self.pack, self.generation), self.nbytes)
        start = buffer.data_ptr()
        return start <= tensor.data_ptr() < start + max(self.nbytes, 1)
