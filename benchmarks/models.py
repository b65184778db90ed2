"""Models and data the benchmarks share."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn


def mlp(width: int, depth: int, inputs: int | None = None, outputs: int = 8, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(inputs or width, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, outputs))


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def regression(steps: int, batch: int, width: int, outputs: int = 8, seed: int = 1) -> list:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * batch, width, generator=generator)
    y = torch.randn(steps * batch, outputs, generator=generator)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, steps * batch, batch)]


def train_sequentially(models: list[nn.Module], rates: list[float], data: list, loss_fn: Callable[..., Any]) -> float:
    """The plain way: each model trained in turn (SGD at its rate, one step per batch); returns the seconds."""
    started = time.perf_counter()
    for model, rate in zip(models, rates):
        optimizer = torch.optim.SGD(model.parameters(), lr=rate)
        for x, y in data:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    return time.perf_counter() - started


def plain_step_seconds(forward: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer, data: list,
                       autocast: torch.dtype | None = None, microbatches: int = 2) -> list[float]:
    """The seconds of each step of a plain regression loop: each batch in micro-batches through forward (under CPU
    autocast in that dtype where given), MSE divided by their count per micro-batch, one optimizer step."""
    seconds = []
    for x, y in data:
        started = time.perf_counter()
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast("cpu", dtype=autocast) if autocast else nullcontext():
                loss = nn.functional.mse_loss(forward(xs), ys) / microbatches
            loss.backward()
        optimizer.step()
        seconds.append(time.perf_counter() - started)
    return seconds
