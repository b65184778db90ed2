"""Hugging Face conventions a model keeps while it trains: no key/value cache is built or returned.

A causal LM's forward builds a key/value cache by default (``config.use_cache``), which a training step never
reads and which is no tensor (a ``DynamicCache``): fused arrays cannot return it and every task would carry it.
While Harmony trains a model its config says ``use_cache=False`` (what Hugging Face's Trainer arranges with
gradient checkpointing); the user's setting is back when train returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def training_conventions(models: list[nn.Module]) -> Iterator[None]:
    """The models' configs with the key/value cache off for the block, each restored after."""
    changed = []
    for model in models:
        for module in model.modules():
            config = getattr(module, "config", None)
            if getattr(config, "use_cache", False) is True:
                config.use_cache = False
                changed.append(config)
    try:
        yield
    finally:
        for config in changed:
            config.use_cache = True
