"""What a job computes with: its chain of layers, its loss and optimizer factory, and where its weights go back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harmony.tasks.packing import Packing


@dataclass(frozen=True)
class JobCode:
    """The modules and callables of one job of the run's plan (in the same order), which the plan itself leaves out.

    layers is the job's chain (an array's are ArrayLayers); member_layers, for a fused array, each member's own
    chain, into which the array's trained weights are copied back. loss_fn and optimizer are None when only
    planning.
    """

    layers: tuple[nn.Module, ...]
    loss_fn: Callable[..., torch.Tensor] | None
    optimizer: Callable[..., torch.optim.Optimizer] | None
    member_layers: tuple[tuple[nn.Module, ...], ...] = ()

    def pack_module(self, packing: Packing, pack: int) -> nn.Sequential:
        """The layers of one pack, as one module whose tensor names the pack's layouts use."""
        spec = packing.packs[pack]
        return nn.Sequential(*self.layers[spec.first : spec.stop])

    def copy_back(self) -> None:
        """Copy a fused array's trained stacks into each member's own layers (nothing for a single model)."""
        if len(self.member_layers) > 1:
            for index, layer in enumerate(self.layers):
                layer.unstack_into([layers[index] for layers in self.member_layers])


def named_state(module: nn.Module) -> dict[str, Any]:
    """A module's parameters and buffers by name, as a pack's layouts name them."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}
