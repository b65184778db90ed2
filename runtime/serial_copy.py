"""Copies between CPU tensors made on the calling thread alone, never through torch's OpenMP thread pool.

A torch copy of more than a few thousand elements runs as an OpenMP parallel region, and the first region a
thread runs gives that thread its own team of pool threads for as long as the thread lives. GNU OpenMP
(torch's CPU pool on Linux) lets idle pool threads spin for their next region only while it manages no more
threads than the machine has CPUs: one extra team anywhere in a device worker's process (its copy engine's
thread, or its event loop's through ``client.run``) puts every team's threads to sleep between regions, and
each operator of the compute thread then waits for its helpers to wake (docs/performance.md, "One OpenMP
team per device worker"). In an otherwise idle driver the spinning threads would instead take cores from
the workers. Threads other than a device's compute thread
therefore move CPU bytes with memmove.
"""

from __future__ import annotations

import ctypes

import torch


def is_plain(tensor: torch.Tensor) -> bool:
    """Whether tensor's bytes are its values, contiguous in host memory (what memmove can copy)."""
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def copy_to_address(address: int, source: torch.Tensor) -> None:
    """Copy a plain CPU tensor's bytes to address, on this thread."""
    ctypes.memmove(address, source.data_ptr(), source.numel() * source.element_size())


SMALL_BYTES = 1 << 20


def copy_small(target: torch.Tensor, source: torch.Tensor) -> None:
    """target.copy_(source) on the compute thread: with memmove below SMALL_BYTES, where waking the pool's threads
    costs more than they save; with torch's parallel copy above."""
    if source.numel() * source.element_size() < SMALL_BYTES:
        copy_serially(target, source)
    else:
        target.copy_(source)


def copy_serially(target: torch.Tensor, source: torch.Tensor) -> None:
    """target.copy_(source) for CPU tensors, with memmove on this thread where both are plain and alike (same
    dtype and shape); other copies go through torch (whose pool a large one wakes)."""
    alike = target.dtype == source.dtype and target.shape == source.shape
    if alike and is_plain(target) and is_plain(source):
        copy_to_address(target.data_ptr(), source)
    else:
        target.copy_(source)
