"""Measurements of this machine that the simulator needs to predict times here: memory copy speed."""

from __future__ import annotations

import functools
import time

import torch

from harmony.tasks.hardware import Hardware


@functools.cache
def this_machine() -> Hardware:
    """This machine as the simulator sees it: pilot-pass compute, and host copies at measured memcpy speed."""
    source = torch.empty(32 * 2**20, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    started = time.perf_counter()
    repeats = 4
    for _ in range(repeats):
        target.copy_(source)
    bandwidth = repeats * source.numel() / (time.perf_counter() - started)
    return Hardware("this machine", host_link=bandwidth)
