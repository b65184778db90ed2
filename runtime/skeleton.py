"""Ship a pack's modules to workers without their weights: parameters and buffers travel as meta tensors.

Workers run the skeleton with every parameter and buffer supplied from the device copy of the pack's weights
(runtime.reparametrize), so the bytes that travel are only the module structure. A parametrized module
(torch.nn.utils.parametrize: weight_norm, spectral_norm, orthogonal) refuses to be pickled, its class being made
when its parametrization was registered: it travels as its own class and state, and the class is made again where
it lands. A traced stage that calls a custom operator (torch.library.custom_op: transformers' grouped matrix product
in a mixture of experts) names the module that registers it, which is imported where the stage lands, before the
stage's code is rebuilt: a worker that never imported it would not know the operator.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable

import cloudpickle
import torch
from torch import fx, nn
from torch._library.custom_ops import OPDEFS
from torch.nn.utils import parametrize


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
        if isinstance(obj, nn.Module) and parametrize.is_parametrized(obj):
            return _parametrized, (type(obj).__bases__[0], obj.__dict__)
        if isinstance(obj, fx.GraphModule) and (modules := operator_modules(obj.graph)):
            return _importing, (modules, *obj.__reduce__())
        return super().reducer_override(obj)


def operator_modules(graph: fx.Graph) -> tuple[str, ...]:
    """The modules that register the custom operators graph calls (torch.library.custom_op's)."""
    names = {_operator_name(node.target) for node in graph.nodes if node.op == "call_function"}
    return tuple(sorted({OPDEFS[name]._init_fn.__module__ for name in names if name in OPDEFS}))


def _operator_name(target: object) -> str | None:
    """An operator's qualified name (namespace::name), as an exported graph (an overload) or a traced one (the
    operator) calls it; None for a Python function."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return getattr(target, "_qualified_op_name", None) if isinstance(target, torch._ops.OpOverloadPacket) else None


def _importing(modules: tuple[str, ...], rebuild: Callable[..., nn.Module], arguments: tuple[object, ...]
               ) -> nn.Module:
    """A traced stage rebuilt once the modules that register its custom operators are imported."""
    for module in modules:
        importlib.import_module(module)
    return rebuild(*arguments)


def _parametrized(cls: type[nn.Module], state: dict[str, object]) -> nn.Module:
    """A parametrized module made again from the class it had before its parametrizations and its state (which
    holds them, as parametrizations)."""
    module = cls.__new__(cls)
    module.__dict__.update(state)
    parametrize._inject_new_class(module)
    for name in module.parametrizations:
        parametrize._inject_property(module, name)
    return module


def dump_skeleton(module: nn.Module) -> bytes:
    """cloudpickle module with its parameters and buffers replaced by meta tensors of the same shape."""
    stripped = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
    file = io.BytesIO()
    _SkeletonPickler(file, stripped).dump(module)
    return file.getvalue()


def load_skeleton(data: bytes) -> nn.Module:
    return cloudpickle.loads(data)
