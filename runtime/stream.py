"""A device's copy engine: copies between host and device beside compute: a thread on CPU, streams on CUDA.

On a CPU device the engine is a thread and a copy is done when the call returns, made with memmove so that
the thread never starts an OpenMP team beside the compute thread's (serial_copy). On a CUDA device a copy
is enqueued on a dedicated non-blocking stream, one for each direction, so that it overlaps kernels on the
compute stream; the copy's event marks when its bytes are there, and the stream that reads them waits for that
event on the GPU (the host never blocks on it). A copy in records its device tensor on the copy's stream, so that
the caching allocator does not hand its memory to another tensor while the copy may still write it. A copy out does
not: its caller holds the source until the copy has ended or the compute stream waits for it (wait), so that the
source's memory goes back to the compute stream's pool in stream order, reused only by kernels queued after the copy
(recorded on the outward stream instead, the allocator would keep it from any reuse until the host saw the copy
end, and take new memory meanwhile).
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
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # into the device
        self.outward = torch.cuda.Stream(device) if device.type == "cuda" else None  # out of it
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

    def after(self, events: list[torch.cuda.Event | None]) -> None:
        """Make the copy stream's next copies wait, on the GPU, for events (an outward copy whose bytes they read)."""
        if self.stream is not None:
            for done in events:
                if done is not None:
                    self.stream.wait_event(done)

    def empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
        """Device memory for an inward copy to write. On CUDA it is taken on the copy stream, so that the copy never
        writes memory that kernels still queued on the compute stream read (freed there, and reused at once on
        that stream); wait(done, tensor) then records it on the stream that reads it."""
        if self.stream is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        with torch.cuda.stream(self.stream):
            return torch.empty(shape, dtype=dtype, device=self.device)

    def send(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A host copy of device bytes (source) and the event that ends it. On a CPU device it is made now (None).
        On CUDA it goes into page-locked memory on the outward stream, after what the calling thread's stream has
        enqueued so far (which makes source); the caller must hold source until the event has completed or its
        stream waits for it (wait)."""
        if self.outward is None:
            return source.clone(), None
        target = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.outward):
            self.outward.wait_event(made)
            target.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.outward)
        return target, done

    def wait(self, done: torch.cuda.Event | None, tensor: torch.Tensor | None = None) -> None:
        """Make the calling thread's current stream wait, on the GPU, until a copy's bytes are there; tensor (from
        empty) is then read on that stream, and its memory is not reused before those reads are done."""
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            if tensor is not None:
                tensor.record_stream(current)

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
        for stream in (self.stream, self.outward):
            if stream is not None:
                stream.synchronize()
