"""A resident model on its home device: master weights, a gradient buffer and the optimizer, all on the device.

Its weights are copied in once and pinned; its module is bound to them once (parameters that view the
device weights, with gradients that view a device gradient buffer which backward accumulates into), so
that every step runs the module directly, as a plain PyTorch loop would; the update steps a torch
optimizer over the same parameters, whose state is charged to the device budget after its first step;
the trained weights go to the host store once, at the end of the run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from harmony.runtime.array_optimizer import build_optimizer
from harmony.runtime.cache import DeviceCache
from harmony.runtime.hoststore import tensors_at
from harmony.runtime.spec import PackRuntime


def bind(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make every parameter and buffer of module (under each of its names, tied ones too) the given tensor."""
    aliases: dict[int, list[str]] = {}
    members = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, value in members:
        aliases.setdefault(id(value), []).append(name)
    for names in aliases.values():
        value = next(tensors[name] for name in names if name in tensors)
        for name in names:
            owner, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(owner), attribute, value)


class ResidentModel:
    """One resident single-pack model's state on its device."""

    def __init__(
        self, cache: DeviceCache, model: int, runtime: PackRuntime, weights: torch.Tensor, module: nn.Module
    ) -> None:
        self.cache = cache
        self.model = model
        self.runtime = runtime
        self.weights = weights
        cache.hold((model, 0))
        self.grad_bytes = cache.allocate(runtime.grads.nbytes, f"resident gradients of model {model}")
        grads = tensors_at(self.grad_bytes, runtime.grads)
        parameter_names = {name for name, _ in module.named_parameters()}
        bound: dict[str, torch.Tensor] = {}
        for name, view in tensors_at(weights, runtime.weights).items():
            if name in parameter_names:
                param = nn.Parameter(view, requires_grad=name in grads)
                param.grad = grads.get(name)
                bound[name] = param
            else:
                bound[name] = view
        bind(module, bound)
        self.module = module
        self.names = [slot.spec.name for slot in runtime.grads.slots]
        self.params = [bound[name] for name in self.names]
        self.optimizer: torch.optim.Optimizer | None = None
        self.state_bytes = 0

    def step(self, factory: Callable[..., torch.optim.Optimizer], step: int) -> None:
        """Apply the update on the device; the device weights become version step + 1."""
        if self.optimizer is None:
            self.optimizer = build_optimizer(factory, self.params, self.names)  # type: ignore[arg-type]
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
