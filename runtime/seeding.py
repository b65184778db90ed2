"""Random streams: the seed a layer that draws random numbers (dropout) draws from in one micro-batch's forward.

A layer's stream is decided by the job's seed, the layer's place in the model's chain, the step and the
micro-batch's number in the step, and by nothing the plan chooses: how the chain is cut into packs, which tasks
run them, on which device, homed or swapped, in how many micro-batch groups. So a run draws the same masks
however its plan came out (the plan follows measured times, which differ from one run to the next), a task run
again draws what it drew, and a pack's recompute in backward draws what its forward drew.

How: the pilot marks the layers whose forward moved the CPU generator (LayerProfile.draws); on a worker, each such
layer of a pack's module gets a forward pre-hook that seeds the device's generator with its own stream (reseed),
from the micro-batch the running task set (begin). begin also seeds the stream of the pack's first layer, so that
a draw the pilot did not see (a layer that draws only sometimes) still repeats in a recompute. A plain loop that
calls begin before each micro-batch's forward on a module hooked by reseed draws the same masks (tested).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch import nn

_running = threading.local()  # the task thread's micro-batch: (device, base, step, microbatch)


def layer_seed(base: int, layer: int, step: int, microbatch: int) -> int:
    """The seed of layer's draws for one micro-batch of a step; base is the job's seed (its index in the plan)."""
    return (((base * 1_000_003 + step) * 1_009 + layer) * 65_537 + microbatch) % (2**63 - 1)


def microbatch_number(group: int, index: int, groups: int) -> int:
    """A micro-batch's number in its step: group g of groups takes micro-batches g, g + groups, ... (runtime.driver
    deals them out so), so its index-th is index * groups + g, whatever the number of groups."""
    return index * groups + group


def begin(device: torch.device, base: int, step: int, microbatch: int, layer: int = 0) -> None:
    """Set the micro-batch that the calling thread's forwards draw for, and seed the stream of layer, the first
    of the layers about to run."""
    _running.stream = (device, base, step, microbatch)
    _seed(device, layer_seed(base, layer, step, microbatch))


def reseed(module: nn.Module, first: int, drawing: Iterable[int]) -> nn.Module:
    """Hook the layers of module (a Sequential of the chain's layers from first on) that draw, by their index in
    the chain, to draw from their own streams. Returns module."""
    for layer in drawing:
        module.get_submodule(str(layer - first)).register_forward_pre_hook(_Reseed(layer))
    return module


def draw(layer: int) -> None:
    """Seed layer's stream for the calling thread's running micro-batch (none set: leave the generator alone)."""
    stream = getattr(_running, "stream", None)
    if stream is not None:
        device, base, step, microbatch = stream
        _seed(device, layer_seed(base, layer, step, microbatch))


class _Reseed:
    """A drawing layer's forward pre-hook (an eager forward's; a compiled one reseeds between its segments, see
    runtime.compiled)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def __call__(self, module: nn.Module, args: object) -> None:
        draw(self.layer)


def _seed(device: torch.device, seed: int) -> None:
    """Seed only the device's own generator: torch.manual_seed also queues seeding of every accelerator backend,
    which costs far more than a small pack's compute."""
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
