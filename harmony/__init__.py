"""Harmony: train many PyTorch models at once on memory-budgeted devices through a Dask task graph."""

from harmony.api import shutdown, train
from harmony.errors import BudgetTooSmall, HarmonyError, InputError, ModelError
from harmony.plan import Forecast, plan
from harmony.result import Stats, TrainResult
from harmony.tasks.hardware import Hardware
from harmony.tasks.pruning import Standing

__all__ = ["BudgetTooSmall", "Forecast", "Hardware", "HarmonyError", "InputError", "ModelError", "Standing", "Stats",
           "TrainResult", "plan", "shutdown", "train"]
__version__ = "0.1.0"
