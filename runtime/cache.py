"""A device's memory: resident pack weights and scratch reservations under a byte budget, exactly accounted.

Every byte that enters or leaves the device goes through copy_in / copy_out / weights, which count it.
What is on the device at any moment is the resident weight buffers plus the open reservations (gradient
buffers and each micro-batch's activation workspace as the plan sized it); the cache refuses to go over
budget, evicting least recently used weights that no running task holds, and raising BudgetExceeded
when that is not enough.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from harmony.runtime.counters import Counters


class BudgetExceeded(RuntimeError):
    """A device was asked to hold more bytes than its budget."""


@dataclass
class Resident:
    """A pack's weights on the device, at the host store version they were copied from."""

    buffer: torch.Tensor
    version: int
    pins: int = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def tree_nbytes(tree: Any) -> int:
    return sum(leaf.nbytes for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))


class DeviceCache:
    """Budgeted, accounted memory of one device."""

    def __init__(self, name: str, device: torch.device, budget: int, counters: Counters) -> None:
        self.name = name
        self.device = device
        self.budget = budget
        self.counters = counters
        self.used = 0
        self.residents: OrderedDict[Any, Resident] = OrderedDict()

    def _charge(self, nbytes: int, what: str) -> None:
        while self.used + nbytes > self.budget:
            victim = next((key for key, entry in self.residents.items() if entry.pins == 0), None)
            if victim is None:
                raise BudgetExceeded(
                    f"device {self.name}: {what} needs {nbytes:,} bytes but {self.used:,} of its "
                    f"{self.budget:,}-byte budget are held by running tasks"
                )
            self.drop(victim)
        self.used += nbytes
        self.counters.raise_to("peak", self.used)

    def drop(self, key: Any) -> None:
        entry = self.residents.pop(key, None)
        if entry is not None:
            self.used -= entry.nbytes

    def clear(self) -> None:
        for key in list(self.residents):
            self.drop(key)

    @contextmanager
    def scratch(self, nbytes: int, what: str) -> Iterator[None]:
        """Reserve nbytes for the duration of the block (activations, gradient buffers)."""
        self._charge(nbytes, what)
        try:
            yield
        finally:
            self.used -= nbytes

    @contextmanager
    def weights(self, key: Any, version: int, host: torch.Tensor) -> Iterator[torch.Tensor]:
        """The pack's weight bytes on the device at version, copied in from host unless already resident."""
        entry = self.residents.get(key)
        if entry is not None and entry.version != version and entry.pins == 0:
            self.drop(key)
            entry = None
        if entry is None:
            self._charge(host.numel(), f"weights of {key}")
            buffer = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            buffer.copy_(host)
            self.counters.add("in_weights", host.numel())
            entry = Resident(buffer, version)
            self.residents[key] = entry
        self.residents.move_to_end(key)
        entry.pins += 1
        try:
            yield entry.buffer
        finally:
            entry.pins -= 1

    def copy_in(self, tree: Any, kind: str) -> Any:
        """A device copy of every tensor in tree, counted as bytes_in[kind]."""
        self.counters.add(f"in_{kind}", tree_nbytes(tree))
        return tree_map(
            lambda leaf: leaf.to(self.device, copy=True) if isinstance(leaf, torch.Tensor) else leaf, tree
        )

    def copy_out(self, tree: Any, kind: str) -> Any:
        """A host copy of every tensor in tree, counted as bytes_out[kind]."""
        self.counters.add(f"out_{kind}", tree_nbytes(tree))
        return tree_map(
            lambda leaf: leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor) else leaf, tree
        )

    def write_back(self, device_bytes: torch.Tensor, host: torch.Tensor, kind: str) -> None:
        """Copy device bytes into a host store buffer, counted as bytes_out[kind]."""
        host.copy_(device_bytes)
        self.counters.add(f"out_{kind}", device_bytes.numel())
