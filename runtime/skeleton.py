"""Ship a pack's modules to workers without their weights: parameters and buffers travel as meta tensors.

Workers run the skeleton with every parameter and buffer supplied from the device copy of the pack's weights
(runtime.reparametrize), so the bytes that travel are only the module structure. A parametrized module
(torch.nn.utils.parametrize: weight_norm, spectral_norm, orthogonal) refuses to be pickled, its class being made
when its parametrization was registered: it travels as its own class and state, and the class is made again where
it lands. A traced stage that calls a custom operator (torch.library.custom_op: transformers' grouped matrix product
in a mixture of experts) names the module that registers it, which is imported where the stage lands, before the
stage's code is rebuilt: a worker that never imported it would not know the operator. A custom operator that no
worker can import (defined in the user's script, whose module is __main__, or in a module cloudpickle ships by
value) travels with every skeleton instead, its functions by value, and is registered where it lands before
anything that calls it is rebuilt (its kernels, fake, autograd, vmap, dispatch and autocast rules as they were
registered; an operator of the same name that a module there registered is kept, and one shipped before is
registered again where its definition changed).
"""

from __future__ import annotations

import hashlib
import importlib
import io
import logging
import marshal
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
from torch import fx, nn
from torch._library.custom_ops import OPDEFS, CustomOpDef
from torch.nn.utils import parametrize

logger = logging.getLogger("harmony")


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
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType and sys.modules.get(
                obj.__name__) is obj:  # torch.ops (a module subclass cloudpickle does not know) that code reads
            return importlib.import_module, (obj.__name__,)
        if isinstance(obj, CustomOpDef) and shipped(obj):  # its registrations after it: they may call it
            rules = (dict(obj._backend_fns), obj._abstract_fn, obj._setup_context_fn, obj._backward_fn, obj._vmap_fn,
                     dict(obj._torch_dispatch_fns), dict(obj._autocast_dtype))
            return (_operator, (obj._namespace, obj._name, obj._schema, obj._init_fn, tuple(obj._tags),
                                fingerprint(obj._init_fn, rules)), rules, None, None, _registered)
        return super().reducer_override(obj)


def shipped(operator: CustomOpDef) -> bool:
    """Whether a custom operator travels with the skeletons: its module is one a worker cannot import (the user's
    script, __main__) or one cloudpickle ships by value."""
    module = getattr(operator._init_fn, "__module__", None)
    return module == "__main__" or module in cloudpickle.list_registry_pickle_by_value()


SHIPPED: dict[str, str] = {}  # the operators this process registered from skeletons: their definitions' fingerprints


def fingerprint(function: Callable[..., object], rules: tuple[object, ...]) -> str:
    """What tells two definitions of an operator apart: the code of its function and of its rules' functions."""
    digest = hashlib.sha256()
    for part in (function, *rules):
        for item in part.items() if isinstance(part, dict) else [part]:
            code = getattr(item[-1] if isinstance(item, tuple) else item, "__code__", None)
            digest.update(marshal.dumps(code) if code is not None else repr(item).encode())
    return digest.hexdigest()


def _operator(namespace: str, name: str, schema: str, function: Callable[..., object], tags: tuple[object, ...],
              definition: str) -> CustomOpDef:
    """A shipped custom operator, registered in this process unless one of its name already is: one a module of
    this process registered is kept, one shipped before is registered again where its definition changed (a user
    who edits the operator and trains again on a long-lived cluster)."""
    qualified = f"{namespace}::{name}"
    existing = OPDEFS.get(qualified)
    if existing is not None and SHIPPED.get(qualified, definition) == definition:
        return existing
    operator = CustomOpDef(namespace, name, schema, function, list(tags))
    if hasattr(operator._opoverload, "_enable_pyobj_dispatch"):  # as torch.library.custom_op does (torch 2.14)
        operator._opoverload._enable_pyobj_dispatch(True)
    SHIPPED[qualified] = definition
    return operator


def _registered(operator: CustomOpDef, rules: tuple[object, ...]) -> None:
    """A shipped operator's rules, each registered where it lands has none of its own."""
    kernels, fake, setup, backward, vmap, dispatch, autocast = rules
    for device_type, kernel in kernels.items():
        if device_type not in operator._backend_fns:
            operator.register_kernel(device_type, kernel)
    if fake is not None and operator._abstract_fn is None:
        operator.register_fake(fake)
    if backward is not None and operator._backward_fn is None:
        operator.register_autograd(backward, setup_context=setup)
    if vmap is not None and operator._vmap_fn is None:
        operator.register_vmap(vmap)
    for mode, rule in dispatch.items():
        if mode not in operator._torch_dispatch_fns:
            operator.register_torch_dispatch(mode, rule)
    for device_type, dtype in autocast.items():
        if dtype is not None and operator._autocast_dtype.get(device_type) is None:
            operator.register_autocast(device_type, dtype)


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
    return dump_code(module, {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()})


def dump_code(code: object, stripped: set[int] | None = None) -> bytes:
    """cloudpickle code (a skeleton, a loss function, an optimizer factory) with the custom operators a worker
    cannot import, which it may call; the tensors whose ids are in stripped as meta tensors."""
    file = io.BytesIO()
    operators = tuple(operator for operator in OPDEFS.values() if shipped(operator) and _picklable(operator))
    _SkeletonPickler(file, stripped or set()).dump((operators, code))  # the operators registered first where it lands
    return file.getvalue()


PICKLABLE: weakref.WeakKeyDictionary[CustomOpDef, bool] = weakref.WeakKeyDictionary()  # checked once per definition


def _picklable(operator: CustomOpDef) -> bool:
    """Whether a shipped operator pickles (its functions may hold what does not: a lock, an open file); one that does
    not stays behind with a warning, so that a run whose code never calls it is not refused for it. Checked once per
    definition (every pack's skeleton carries the operators), again for one defined anew under the same name."""
    if operator not in PICKLABLE:
        try:
            _SkeletonPickler(io.BytesIO(), set()).dump(operator)
            PICKLABLE[operator] = True
        except Exception as error:
            PICKLABLE[operator] = False
            logger.warning("harmony: custom operator %s, defined in your script, cannot be sent to the workers (%s): "
                           "a pack or loss that calls it will fail there", operator._qualname, error)
    return PICKLABLE[operator]


def load_code(data: bytes) -> Any:
    """What dump_code pickled, its custom operators registered first."""
    _, code = cloudpickle.loads(data)
    return code


def load_skeleton(data: bytes) -> nn.Module:
    return load_code(data)
