"""What harmony.train returns: the trained models, per-step losses and measured statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from harmony.tasks.packing import PackPlan


@dataclass
class Stats:
    """Measured, not estimated: bytes are sums of what was actually copied, peaks what devices accounted.

    bytes_in kinds (host to device): "weights", "activations", "inputs".
    bytes_out kinds (device to host): "grads", "activations", "buffers" (running statistics written back).
    """

    peak_device_bytes: dict[str, int]
    bytes_in: dict[str, int]
    bytes_out: dict[str, int]
    steps: list[int]
    tasks: int
    wall_seconds: float
    busy_seconds: dict[str, float] = field(default_factory=dict)
    budgets: dict[str, int] = field(default_factory=dict)


@dataclass
class TrainResult:
    """The outcome of harmony.train."""

    models: list[nn.Module]
    history: list[list[float]]
    stats: Stats
    dashboard_link: str | None
    plans: list[PackPlan]
