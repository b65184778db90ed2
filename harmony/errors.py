"""Errors Harmony raises to its users."""

from __future__ import annotations

from typing import Any


class HarmonyError(Exception):
    """Base of every error Harmony raises on purpose."""


class InputError(HarmonyError, ValueError):
    """An argument of harmony.train is wrong; raised before any worker starts, naming model and argument."""


class BudgetTooSmall(InputError):
    """device_memory cannot hold a model's largest layer: minimum is the smallest budget it trains in, prefetching
    the smallest where the next pack's weights come in beside it (what a caller that sizes the budget itself
    reads, rather than the message); need, where given, is that layer's bytes by kind (tasks.packing.PackCost) at
    the micro-batch it was piloted on, per_sample the part of its activations' bytes that each sample of the
    micro-batch adds (microbatches="auto" scales them from there)."""

    def __init__(self, message: str, minimum: int, prefetching: int, need: Any = None, per_sample: float = 0.0
                 ) -> None:
        super().__init__(message)
        self.minimum = minimum
        self.prefetching = prefetching
        self.need = need
        self.per_sample = per_sample


class ModelError(HarmonyError, RuntimeError):
    """A model's own code (forward, loss or optimizer) raised while training; carries the original traceback."""

    def __init__(self, model: int, message: str, traceback_text: str = "") -> None:
        self.model = model
        self.traceback_text = traceback_text
        text = message if not traceback_text else f"{message}\n\nOriginal traceback:\n{traceback_text}"
        super().__init__(text)
