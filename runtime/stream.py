"""A device's copy engine: host-to-device copies off the compute thread, on CUDA on their own stream.

On a CPU device the engine is a thread and a copy is done when the call returns, made with memmove so that
the thread never starts an OpenMP team beside the compute thread's (serial_copy). On a CUDA device a copy
is enqueued on a dedicated non-blocking stream, so that it overlaps kernels on the compute stream; the
copy's event marks when its bytes are there, and the stream that reads them waits for that event on the
GPU (the host never blocks on it). The target is recorded on the copy stream, so that the caching
allocator does not hand its memory to another tensor while the copy may still be writing it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from harmony.runtime.serial_copy import copy_serially


class CopyEngine:
    """Copies into one device's memory: synchronous on CPU, ordered by events on CUDA."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread: ThreadPoolExecutor | None = None

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> torch.cuda.Event | None:
        """Copy source into target; on CUDA, enqueue it on the copy stream and return the event that ends it."""
        if self.stream is None:
            copy_serially(target, source)  # on the engine's thread too: no OpenMP team of its own (serial_copy)
            return None
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            target.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, done: torch.cuda.Event | None) -> None:
        """Make the calling thread's current stream wait, on the GPU, until a copy's bytes are there."""
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def submit(self, work: Callable[..., Any], *args: Any) -> None:
        """Run work on the engine's thread (one at a time, in order)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"copy-{self.name}")
        self._thread.submit(work, *args)

    def shutdown(self) -> None:
        """Wait for every submitted copy, and on CUDA for the copy stream to drain."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self.stream is not None:
            self.stream.synchronize()
