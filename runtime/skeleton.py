"""Ship a pack's modules to workers without their weights: parameters and buffers travel as meta tensors.

Workers run the skeleton with torch.func.functional_call, supplying every parameter and buffer from
the device copy of the pack's weights, so the bytes that travel are only the module structure.
"""

from __future__ import annotations

import io

import cloudpickle
import torch
from torch import nn


def _meta_tensor(shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool, parameter: bool) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device="meta")
    return nn.Parameter(tensor, requires_grad=requires_grad) if parameter else tensor


class _SkeletonPickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, stripped: set[int]) -> None:
        super().__init__(file, protocol=5)
        self.stripped = stripped

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, torch.Tensor) and id(obj) in self.stripped:
            return _meta_tensor, (tuple(obj.shape), obj.dtype, obj.requires_grad, isinstance(obj, nn.Parameter))
        return super().reducer_override(obj)


def dump_skeleton(module: nn.Module) -> bytes:
    """cloudpickle module with its parameters and buffers replaced by meta tensors of the same shape."""
    stripped = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    file = io.BytesIO()
    _SkeletonPickler(file, stripped).dump(module)
    return file.getvalue()


def load_skeleton(data: bytes) -> nn.Module:
    return cloudpickle.loads(data)
