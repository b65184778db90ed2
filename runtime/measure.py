"""Measurements of this machine that the simulator needs to predict times here: memory copy speed, the host
optimizer's rate, a job's own optimizer step, and a GPU's speed against this machine's CPU and its link from pinned
memory."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from harmony.runtime.array_optimizer import build_optimizer, step_optimizer
from harmony.tasks.hardware import Hardware

PROBE_BYTES = 64 * 2**20  # the most parameter bytes update_rate builds probes of
EVICTING_BYTES = 64 * 2**20  # at most, written before each timed step: a run's update finds its state out of the caches


@functools.cache
def this_machine() -> Hardware:
    """This machine as the simulator sees it: pilot-pass compute, host copies at measured memcpy speed, the host
    store's optimizer at its measured rate."""
    source = torch.empty(32 * 2**20, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    started = time.perf_counter()
    repeats = 4
    for _ in range(repeats):
        target.copy_(source)
    bandwidth = repeats * source.numel() / (time.perf_counter() - started)
    return Hardware("this machine", host_link=bandwidth, optimizer_bytes_per_second=optimizer_rate())


def optimizer_rate(elements: int = 1 << 22, repeats: int = 3) -> float:
    """The host store's update rate in tasks.work.optimizer_seconds' measure (4 bytes per parameter byte a
    second): torch's fused CPU Adam over a float32 parameter, after the copies an update makes into the other slot
    (the weights and both moments, runtime.optimizer)."""
    param = nn.Parameter(torch.zeros(elements))
    param.grad = torch.full_like(param, 1e-3)
    optimizer = torch.optim.Adam([param], lr=1e-3, fused=True)
    optimizer.step()  # its state exists from here
    sources = [param.detach(), *(value for value in optimizer.state[param].values() if value.dim())]
    targets = [torch.empty_like(source) for source in sources]
    started = time.perf_counter()
    for _ in range(repeats):
        for target, source in zip(targets, sources):
            target.copy_(source)
        optimizer.step()
    return 4 * param.nbytes * repeats / (time.perf_counter() - started)


def update_rate(factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer], layers: Sequence[nn.Module]
                ) -> float | None:
    """Seconds per trainable parameter byte of one step of factory's optimizer (an array's ArrayOptimizer too) over
    layers' trainable parameters, on zero probes of their shapes named as a pack of these layers names them: the
    fastest of three steps after the one that makes its state, each after four times the probes' bytes written
    elsewhere, at most EVICTING_BYTES: an update streams its state, which a run's step, touching as much again,
    finds out of the caches (docs/performance.md, "Predictions on CPU devices"), and a model small enough to stay
    in the caches pays little for the writes. What a homed job's update takes on a device that computes like this
    thread (the caller sets a CPU device's threads). Of a larger model, the parameters in order that fit
    PROBE_BYTES stand for the rest (an update's cost goes by bytes). None where none fits, or the optimizer fails
    on probes."""
    named = []
    nbytes = 0
    for name, param in nn.Sequential(*layers).named_parameters():
        if param.requires_grad and nbytes + param.nbytes <= PROBE_BYTES:
            named.append((name, param))
            nbytes += param.nbytes
    if not named:
        return None
    probes = []
    for _, param in named:
        probe = nn.Parameter(torch.zeros_like(param, device="cpu"))
        probe.grad = torch.full_like(probe, 1e-3)
        probes.append(probe)
    try:
        optimizer = build_optimizer(factory, probes, [name for name, _ in named])
        step_optimizer(optimizer, 0)  # its state exists from here
        fastest = float("inf")
        evicting = torch.empty(min(EVICTING_BYTES, 4 * nbytes), dtype=torch.uint8)
        for step in range(1, 4):
            evicting.fill_(step)
            started = time.perf_counter()
            step_optimizer(optimizer, step)
            fastest = min(fastest, time.perf_counter() - started)
    except Exception:  # a user's optimizer that cannot step zero probes: the prediction goes without it
        return None
    return fastest / nbytes


def matmul_seconds(device: torch.device, size: int = 1024, repeats: int = 8) -> float:
    """Seconds for one float32 matmul of two size x size matrices on device (the kernels' time on a GPU)."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    torch.mm(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / repeats


def pinned_link(device: torch.device, nbytes: int = 64 * 2**20, repeats: int = 4) -> float:
    """Bytes per second from page-locked host memory to a CUDA device (what a pinned host store's copies get)."""
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(source, non_blocking=True)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source, non_blocking=True)
    torch.cuda.synchronize(device)
    return nbytes * repeats / (time.perf_counter() - started)


def accelerator_speed() -> tuple[float, float] | None:
    """(compute_scale, host_link) of this process's first CUDA device: a matmul's time on this machine's CPU over
    its time there (the pilot pass times layers on the CPU), and its link from pinned memory; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", torch.cuda.current_device())
    return matmul_seconds(torch.device("cpu")) / matmul_seconds(device), pinned_link(device)


def with_accelerator(hardware: Hardware, speed: tuple[float, float] | None) -> Hardware:
    """hardware with a GPU's measured compute scale and link (accelerator_speed), where one was measured."""
    if speed is None:
        return hardware
    scale, link = speed
    return dataclasses.replace(hardware, name=f"{hardware.name}, its GPUs", compute_scale=scale, host_link=link)
