"""Harmony: train many PyTorch models at once on memory-budgeted devices through a Dask task graph."""

from harmony.api import train
from harmony.errors import HarmonyError, InputError, ModelError
from harmony.result import Stats, TrainResult

__all__ = ["HarmonyError", "InputError", "ModelError", "Stats", "TrainResult", "train"]
__version__ = "0.1.0"
