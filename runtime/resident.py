"""A resident model on its home device: master weights, a gradient buffer and the optimizer, all on the device.

Its weights are copied in once and pinned; backward accumulates into a gradient buffer that never
leaves the device; the update steps a torch optimizer built over the device weights, whose state is
charged to the device budget after its first step; the trained weights go to the host store once, at
the end of the run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from harmony.runtime.cache import DeviceCache
from harmony.runtime.hoststore import tensor_at, tensors_at
from harmony.runtime.spec import PackRuntime


class ResidentModel:
    """One resident single-pack model's state on its device."""

    def __init__(self, cache: DeviceCache, model: int, runtime: PackRuntime, weights: torch.Tensor) -> None:
        self.cache = cache
        self.model = model
        self.runtime = runtime
        self.weights = weights
        cache.hold((model, 0))
        self.grad_bytes = cache.allocate(runtime.grads.nbytes, f"resident gradients of model {model}")
        self.grads = tensors_at(self.grad_bytes, runtime.grads)
        self.optimizer: torch.optim.Optimizer | None = None
        self.state_bytes = 0

    def step(self, factory: Callable[..., torch.optim.Optimizer], step: int) -> None:
        """Apply the update on the device; the device weights become version step + 1."""
        if self.optimizer is None:
            by_name = {slot.spec.name: slot for slot in self.runtime.weights.slots}
            params = []
            for slot in self.runtime.grads.slots:
                param = nn.Parameter(tensor_at(self.weights, by_name[slot.spec.name]))
                param.grad = self.grads[slot.spec.name]
                params.append(param)
            self.optimizer = factory(params)
        self.optimizer.step()
        held = sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
        if held > self.state_bytes:
            self.cache.charge(held - self.state_bytes, f"optimizer state of model {self.model}")
            self.state_bytes = held
        self.cache.set_version((self.model, 0), step + 1)
