"""Embedding lookups with a padding row, computed so that vmap differentiates them right.

torch's batching rule for an embedding whose weights and indices are both batched (a fused array's members each
looking up their own copy of the indices) offsets each member's indices into one flattened table and keeps
``padding_idx`` as it is: in backward only the first member's padding row is left out, every other member's padding
row receives the gradient of the positions that hold the padding index. ``PaddedLookups`` computes such a lookup as
one without a padding row whose output at those positions is detached: the same values, and the gradient a plain
lookup with its padding row gives (no position that holds the padding index reaches the table).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

LOOKUPS = (nn.functional.embedding, torch.embedding, torch.ops.aten.embedding.default)


def lookup(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """weight's rows at indices, whose positions holding padding_idx (>= 0) pass no gradient to weight."""
    looked = torch.embedding(weight, indices)
    return torch.where((indices == padding_idx).unsqueeze(-1), looked.detach(), looked)


def pads(module: nn.Module) -> bool:
    """Whether module may look up rows of a table with a padding row: it holds an nn.Embedding with one, or a traced
    graph that calls an embedding (an exported model's graph names the operator, with its padding row as a number)."""
    for part in module.modules():
        if isinstance(part, nn.Embedding) and part.padding_idx is not None:
            return True
        if isinstance(part, fx.GraphModule) and any(node.op == "call_function" and node.target in LOOKUPS
                                                    for node in part.graph.nodes):
            return True
    return False


class PaddedLookups(TorchFunctionMode):
    """Within the block, every embedding lookup with a padding row (and no max_norm, frequency scaling or sparse
    gradient, which it leaves as they are) runs as ``lookup``."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                           ) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.embedding:
            call = _bound(("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
                          (None, None, None, None, 2.0, False, False), args, kwargs)
            padding, weight = call["padding_idx"], call["weight"]
            plain = call["max_norm"] is None and not call["scale_grad_by_freq"] and not call["sparse"]
            if padding is not None and plain:
                return lookup(weight, call["input"], padding if padding >= 0 else weight.shape[0] + padding)
        elif func is torch.embedding or func is torch.ops.aten.embedding.default:
            call = _bound(("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse"),
                          (None, None, -1, False, False), args, kwargs)
            if call["padding_idx"] >= 0 and not call["scale_grad_by_freq"] and not call["sparse"]:
                return lookup(call["weight"], call["indices"], call["padding_idx"])
        return func(*args, **kwargs)


def _bound(names: tuple[str, ...], defaults: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> dict[str, Any]:
    """A call's arguments by name."""
    return {**dict(zip(names, defaults)), **dict(zip(names, args)), **kwargs}
