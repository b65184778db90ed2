"""Weights copied to the device in autocast's dtype: which ones may be, found by watching a layer run under autocast.

Under precision="bf16" or "fp16" a plain loop keeps float32 weights and autocast casts them to the lower dtype where
an op computes in it (a linear, a matmul, a convolution). A weight whose every use is such an op may as well be
cast once on the host and copied in halved: the device computes with the very values autocast would have made, the
swap moves half the bytes, and its gradient, which autocast would have cast back to float32 after the op, is cast
when it is added to the float32 gradient buffer (runtime.bodies). A weight with any other use (an embedding, a
layer norm, an elementwise op, a view, a use where the model turns autocast off) stays float32. The ops watched are
those that autocast casts on CPU and on CUDA alike, seen as the layer's code (or an exported stage's graph) calls
them, through a torch function mode above autocast, and only where the op's result did come out in that dtype; a
function the mode cannot see into (multi-head attention's fused path) counts as another use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from harmony.runtime.stages import quiet_failures

CAST_BY_AUTOCAST: frozenset[Callable[..., Any]] = frozenset({
    torch.nn.functional.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
    torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d,
    torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.mm, torch.Tensor.bmm,
    torch.Tensor.addmm, torch.Tensor.baddbmm,
    *(getattr(torch.ops.aten, name).default for name in (  # as an exported stage calls them
        "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d", "conv3d")),
})
METADATA = frozenset({"size", "dim", "numel", "stride", "is_floating_point", "is_contiguous", "element_size",
                      "shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "layout", "is_cuda"})


class _Uses(TorchFunctionMode):
    """Records, per watched weight, whether it was an argument of an op autocast casts it for (cast), of anything else
    (other), and whether it or a view of it was cast by such an op (some: autocast made a copy)."""

    def __init__(self, weights: dict[int, str], storages: dict[int, str], device_type: str, dtype: torch.dtype
                 ) -> None:
        super().__init__()
        self.weights = weights  # by id: the parameter itself
        self.storages = storages  # by storage: the parameter or a view of it
        self.device_type = device_type
        self.dtype = dtype
        self.cast: set[str] = set()
        self.other: set[str] = set()
        self.some: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        used = {self.weights[id(leaf)] for leaf in tensors if id(leaf) in self.weights}
        read = {self.storages[pointer] for leaf in tensors if leaf.dtype == torch.float32
                and (pointer := leaf.untyped_storage().data_ptr()) in self.storages}
        result = func(*args, **kwargs)
        if read and not _metadata(func):
            cast = (func in CAST_BY_AUTOCAST and torch.is_autocast_enabled(self.device_type)
                    and torch.get_autocast_dtype(self.device_type) == self.dtype
                    and isinstance(result, torch.Tensor) and result.dtype == self.dtype)  # it did compute in dtype
            (self.cast if cast else self.other).update(used)
            if cast:
                self.some.update(read)
        return result


def _metadata(func: Any) -> bool:
    """Whether func only reads a tensor's metadata (its shape, dtype, ...), not its values."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name in METADATA


class Casts(NamedTuple):
    """Which float32 parameters one forward under autocast reads through ops autocast casts them for."""

    only: frozenset[str]  # read through those ops alone: their device copy may be in autocast's dtype
    some: frozenset[str]  # read by at least one of them: a float32 copy of one is cast in each forward, held to the
    # end of its backward (saved for it, or in autocast's cache)


def casts(layer: nn.Module, x: Any, dtype: torch.dtype, names: set[str]) -> Casts:
    """The float32 parameters among names that one forward of layer on x under autocast(dtype) reads only, and at
    least once, through ops autocast casts them for (neither where the forward raises under autocast)."""
    device = next((leaf.device for leaf in tree_leaves(x) if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
    watched = [(name, parameter) for name, parameter in layer.named_parameters()
               if name in names and parameter.dtype == torch.float32]
    if not watched:
        return Casts(frozenset(), frozenset())
    storages = {parameter.untyped_storage().data_ptr(): name for name, parameter in watched if parameter.numel()}
    uses = _Uses({id(parameter): name for name, parameter in watched}, storages, device.type, dtype)
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype), uses, quiet_failures():
            layer(x)
    except Exception:
        return Casts(frozenset(), frozenset())
    return Casts(frozenset(uses.cast - uses.other), frozenset(uses.some))


def unhalved(layer: nn.Module, x: Any, dtype: torch.dtype, names: set[str]) -> Casts:
    """casts with nothing halved (every weight copied in float32, autocast casting it): what a run that patches the
    pilot's casts with it copies, to measure or test what halving saves."""
    return casts(layer, x, dtype, names)._replace(only=frozenset())
