"""How a pack's forward is called: eagerly, or through torch.compile (the run's option compile=True).

Two things a reader must know before changing the compiled way:
- Random draws go through eager's generator (inductor's ``fallback_random``), so that a pack's recompute in bwd
  draws the dropout masks its fwd drew, and a model those plain PyTorch draws. Inductor's settings are kept per
  thread: one set in the module's config by one thread is not seen by a compile in another (a Dask task's), and
  the compiled kernels then draw from inductor's own generator. They are the compile's options instead.
- Every call gets its own code object. Dynamo keeps its compiled variants (grad mode, training mode, input shapes)
  per code object, up to a recompile limit, after which it runs that code eagerly without a word; all packs
  calling one function would share that limit.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

OPTIONS = {"fallback_random": True, "compile_threads": 1}

PackCall = Callable[[dict[str, torch.Tensor], Any], Any]


def pack_call(module: nn.Module, name: str, compile: bool) -> PackCall:
    """(tensors by name, input) -> module's output computed with those tensors as its parameters and buffers;
    compiled (name: what its code object is called, one per pack) or eager."""

    def call(tensors: dict[str, torch.Tensor], x: Any) -> Any:
        return functional_call(module, tensors, (x,))

    return _compiled(call, name) if compile else call


def module_call(module: nn.Module, name: str, compile: bool) -> Callable[[Any], Any]:
    """input -> module's output, compiled (name as in pack_call) or module itself."""

    def call(x: Any) -> Any:
        return module(x)

    return _compiled(call, name) if compile else module


def _compiled(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    code = function.__code__.replace(co_name=name, co_qualname=name)
    own = types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)
    return torch.compile(own, options=OPTIONS)
