"""Harmony: train many PyTorch models at once on memory-budgeted devices through a Dask task graph."""

from harmony.api import train
from harmony.errors import HarmonyError, InputError, ModelError
from harmony.plan import Plan, plan
from harmony.result import Stats, TrainResult
from harmony.tasks.simulator import Hardware

__all__ = ["Hardware", "HarmonyError", "InputError", "ModelError", "Plan", "Stats", "TrainResult", "plan", "train"]
__version__ = "0.1.0"
