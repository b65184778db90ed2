"""Exceptions that cross from device workers to the driver."""

from __future__ import annotations


class ModelFailure(RuntimeError):
    """User code (a model's forward, its loss, its optimizer) raised inside a task on a worker.

    Carries the model index, where it happened and the original traceback as text, so the driver can
    tell the user which model failed and show the frames of their own code.
    """

    def __init__(self, model: int, where: str, error: str, traceback_text: str) -> None:
        super().__init__(model, where, error, traceback_text)
        self.model = model
        self.where = where
        self.error = error
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        return f"model {self.model}: {self.error} in {self.where}"
