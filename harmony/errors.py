"""Errors Harmony raises to its users."""

from __future__ import annotations


class HarmonyError(Exception):
    """Base of every error Harmony raises on purpose."""


class InputError(HarmonyError, ValueError):
    """An argument of harmony.train is wrong; raised before any worker starts, naming model and argument."""


class BudgetTooSmall(InputError):
    """device_memory cannot hold a model's largest layer: minimum is the smallest budget it trains in, prefetching
    the smallest where the next pack's weights come in beside it (what a caller that sizes the budget itself
    reads, rather than the message); largest_microbatch is the most samples a micro-batch may have for it to fit
    (None where micro-batches of one sample do not either), one_sample the least budget it trains in with such
    micro-batches (what microbatches="auto" reports as minimum when no count fits)."""

    def __init__(self, message: str, minimum: int, prefetching: int, largest_microbatch: int | None = None,
                 one_sample: int = 0) -> None:
        super().__init__(message)
        self.minimum = minimum
        self.prefetching = prefetching
        self.largest_microbatch = largest_microbatch
        self.one_sample = one_sample


class ModelError(HarmonyError, RuntimeError):
    """A model's own code (forward, loss or optimizer) raised while training; carries the original traceback."""

    def __init__(self, model: int, message: str, traceback_text: str = "") -> None:
        self.model = model
        self.traceback_text = traceback_text
        text = message if not traceback_text else f"{message}\n\nOriginal traceback:\n{traceback_text}"
        super().__init__(text)
