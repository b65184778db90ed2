"""A module called with given tensors in place of its parameters and buffers, as torch.func.functional_call does.

functional_call walks the module's names and tied weights on every call: once per micro-batch and pack, that costs
as much as a small layer's forward. bind looks each name's place up once. It also undoes its swaps in reverse: a
module held twice (a layer a Sequential applies twice) has its slot swapped twice in one call, and undone in order
(as functional_call does in torch 2.14) the module would keep the call's tensor afterwards, a device's weights or,
under vmap, a batched tensor that no longer pickles. bound holds the tensors in place for a whole block: a backward
that runs the module's forward again (torch.utils.checkpoint inside it) reads them there.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

Call = Callable[[dict[str, torch.Tensor], Any], Any]
Slot = tuple[dict[str, Any], str, list[str]]  # a table of a submodule (its parameters or buffers), a name, aliases
_SLOTS: weakref.WeakKeyDictionary[nn.Module, tuple[list[Slot], set[str]]] = weakref.WeakKeyDictionary()


def _slots(module: nn.Module) -> tuple[list[Slot], set[str]]:
    """Where each of module's parameters and buffers lives (a tied weight's slots share one list of its names), and
    every name; looked up once per module, kept while it lives (the tables hold no reference to it)."""
    if module not in _SLOTS:
        aliases: dict[int, list[str]] = {}
        slots: list[Slot] = []
        for name, tensor in (*module.named_parameters(remove_duplicate=False),
                             *module.named_buffers(remove_duplicate=False)):
            path, _, attribute = name.rpartition(".")
            owner = module.get_submodule(path)
            table = owner._parameters if attribute in owner._parameters else owner._buffers
            names = aliases.setdefault(id(tensor), [])
            names.append(name)
            slots.append((table, attribute, names))
        _SLOTS[module] = (slots, {name for names in aliases.values() for name in names})
    return _SLOTS[module]


@contextmanager
def _swapped(slots: list[Slot], tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    swapped = []
    try:
        for table, attribute, names in slots:
            value = tensors.get(names[0])
            if len(names) > 1:
                given = [tensors[name] for name in names if name in tensors]
                if any(other is not given[0] for other in given[1:]):
                    raise ValueError(f"tied weights {', '.join(names)} were given different tensors")
                value = given[0] if given else None
            if value is not None:
                swapped.append((table, attribute, table[attribute]))
                table[attribute] = value
        yield
    finally:
        for table, attribute, original in reversed(swapped):
            table[attribute] = original


def bind(module: nn.Module) -> Call:
    """(tensors by name, x) -> module(x) with tensors in place of the parameters and buffers they name for the call
    (strict=False: the others stay; a tied weight's every name set from any one of them, and tied names given
    different tensors refused). A name that is not one of the module's parameters or buffers (a plain tensor
    attribute) goes through functional_call."""
    slots, known = _slots(module)

    def call(tensors: dict[str, torch.Tensor], x: Any) -> Any:
        if not tensors.keys() <= known:
            return functional_call(module, tensors, (x,))
        with _swapped(slots, tensors):
            return module(x)

    return call


@contextmanager
def bound(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, module holds tensors in place of the parameters and buffers they name (as a bound call holds
    them for one call; calls inside the block swap their own in and back). Unlike bind's call, a name that is not
    one of the module's parameters or buffers is left out, not passed to functional_call: the block has no call."""
    slots, _ = _slots(module)
    with _swapped(slots, tensors):
        yield
