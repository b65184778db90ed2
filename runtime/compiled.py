"""How a pack's forward is called: eagerly, or through torch.compile (the run's option compile=True).

Two things a reader must know before changing the compiled way:
- Random draws go through eager's generator (inductor's ``fallback_random``), so that a pack's recompute in bwd
  draws the dropout masks its fwd drew, and a model those plain PyTorch draws. Inductor's settings are kept per
  thread: one set in the module's config by one thread is not seen by a compile in another (a Dask task's), and
  the compiled kernels then draw from inductor's own generator. They are the compile's options instead.
- A layer that draws random numbers (runtime.seeding) is reseeded eagerly: the pack is compiled in segments that
  each start at such a layer.
- Every call gets its own code object. Dynamo keeps its compiled variants (grad mode, training mode, input shapes)
  per code object, up to a recompile limit, after which it runs that code eagerly without a word; all packs
  calling one function would share that limit.
"""

from __future__ import annotations

import itertools
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from harmony.runtime.reparametrize import bind
from harmony.runtime.seeding import draw, reseed

OPTIONS = {"fallback_random": True, "compile_threads": 1}

PackCall = Callable[[dict[str, torch.Tensor], Any], Any]


def pack_call(module: nn.Module, name: str, compile: bool, first: int = 0, drawing: tuple[int, ...] = ()) -> PackCall:
    """(tensors by name, input) -> module's output computed with those tensors as its parameters and buffers;
    compiled (name: what its code object is called, one per pack) or eager. module is a Sequential of the chain's
    layers from first on; drawing, those of them that draw from their own streams (runtime.seeding)."""
    if not compile:
        reseed(module, first, drawing)
        return bind(module)

    def part(segment: nn.Module, start: int) -> PackCall:
        names = [n for n, _ in (*segment.named_parameters(remove_duplicate=False), *segment.named_buffers())]
        twice = _held_twice(segment)

        def call(tensors: dict[str, torch.Tensor], x: Any) -> Any:
            return functional_call(segment, tensors, (x,))

        compiled = _compiled(call, f"{name}_layer_{start}")

        def run(tensors: dict[str, torch.Tensor], x: Any) -> Any:
            try:  # a module held twice gets its tensors under one name (the others are its aliases)
                return compiled({n: tensors[n] for n in names if n in tensors}, x)
            finally:  # functional_call leaves the call's tensor in such a module's slot (runtime.reparametrize)
                for table, attribute, original in twice:
                    table[attribute] = original

        return run

    return _segmented(module, first, drawing, part)


def _held_twice(module: nn.Module) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """The parameter and buffer slots of the submodules module holds at more than one place, with what they hold."""
    seen: set[int] = set()
    twice = set()
    for _, held in module.named_modules(remove_duplicate=False):
        if id(held) in seen:
            twice.add(id(held))
        seen.add(id(held))
    return [(table, attribute, tensor) for _, held in module.named_modules() if id(held) in twice
            for table in (held._parameters, held._buffers) for attribute, tensor in table.items() if tensor is not None]


def module_call(module: nn.Module, name: str, compile: bool, first: int = 0, drawing: tuple[int, ...] = ()
                ) -> Callable[[Any], Any]:
    """input -> module's output, compiled (name as in pack_call) or module itself; module, first and drawing as in
    pack_call."""
    if not compile:
        return reseed(module, first, drawing)

    def part(segment: nn.Module, start: int) -> Callable[[Any], Any]:
        def call(x: Any) -> Any:
            return segment(x)

        return _compiled(call, f"{name}_layer_{start}")

    return _segmented(module, first, drawing, part)


def _segmented(module: nn.Module, first: int, drawing: tuple[int, ...],
               part: Callable[[nn.Module, int], Callable[..., Any]]) -> Callable[..., Any]:
    """module run segment by segment (_segments), each by part(segment, its first layer's chain index), each
    drawing layer's stream begun before its segment. The call's last argument is the input; any before it go to
    every part."""
    parts = [(start if start in drawing else None, part(segment, start))
             for start, segment in _segments(module, first, drawing)]

    def segmented(*args: Any) -> Any:
        *given, x = args
        for layer, run in parts:
            if layer is not None:
                draw(layer)
            x = run(*given, x)
        return x

    return segmented


def _segments(module: nn.Module, first: int, drawing: tuple[int, ...]) -> list[tuple[int, nn.Module]]:
    """module's layers cut before each drawing layer: (the chain index of its first layer, a Sequential of its
    layers under their names in module). A layer's reseeding between segments stays out of the compiled graphs:
    traced, the micro-batch it reads would compile every call anew, and a graph break inside functional_call's
    reparametrization runs the whole pack eagerly."""
    if not drawing:
        return [(first, module)]
    layers = list(module.named_children())
    cuts = sorted({0, *(layer - first for layer in drawing)} | {len(layers)})
    return [(first + a, nn.Sequential(OrderedDict(layers[a:b]))) for a, b in itertools.pairwise(cuts)]


def _compiled(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    code = function.__code__.replace(co_name=name, co_qualname=name)
    own = types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)
    return torch.compile(own, options=OPTIONS)
