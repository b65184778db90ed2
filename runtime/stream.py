"""A device's copy engine: host-to-device copies off the compute thread, on CUDA on their own streams.

On a CPU device the engine is a thread and a copy is done when the call returns, made with memmove so that
the thread never starts an OpenMP team beside the compute thread's (serial_copy). On a CUDA device a weight
copy is enqueued on a dedicated non-blocking stream, so that it overlaps kernels on the compute stream; the
copy's event marks when its bytes are there, and the stream that reads them waits for that event on the
GPU (the host never blocks on it). The target is recorded on the copy stream, so that the caching
allocator does not hand its memory to another tensor while the copy may still be writing it.

Activations and gradients crossing between host and GPU (copy_in, copy_out) go on two more streams, one each
way, as torchgpipe's copy streams do: the host enqueues a task's micro-batches ahead of the GPU, so the next
micro-batch's input comes in and the last one's output goes out while this one computes. Each stream waits
for what it needs on the GPU (an output for the kernels that made it, an input for the copy that is still
filling its host source in the same task), and each tensor is recorded on the stream that reads it. Host
copies made by copy_out are valid once settle() has run.
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
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.inward = torch.cuda.Stream(device) if cuda else None
        self.outward = torch.cuda.Stream(device) if cuda else None
        self._filling: dict[int, torch.cuda.Event] = {}  # host storage copy_out is filling -> its copy's end
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

    def copy_in(self, source: torch.Tensor) -> torch.Tensor:
        """A device copy of host tensor source, made on the inward stream; the current stream waits for it on the
        GPU. A source that copy_out is still filling in this task is waited for first."""
        current = torch.cuda.current_stream(self.device)
        if source.device.type != "cpu" or source.numel() == 0:
            return source.to(self.device, copy=True)
        filling = self._filling.get(source.untyped_storage().data_ptr())
        if filling is not None:
            self.inward.wait_event(filling)
        with torch.cuda.stream(self.inward):
            copied = source.to(self.device, copy=True, non_blocking=True)
        current.wait_stream(self.inward)
        copied.record_stream(current)
        return copied

    def copy_out(self, leaf: torch.Tensor) -> torch.Tensor:
        """A page-locked host copy of device tensor leaf, made on the outward stream once the current stream has
        computed it; its bytes are valid on the host after settle()."""
        host = torch.empty(leaf.shape, dtype=leaf.dtype, pin_memory=True)
        if leaf.numel() == 0:
            return host
        self.outward.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.outward):
            host.copy_(leaf.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.outward)
        leaf.record_stream(self.outward)
        self._filling[host.untyped_storage().data_ptr()] = done
        return host

    def settle(self) -> None:
        """Wait until the current stream's kernels and every activation copy enqueued so far have completed."""
        torch.cuda.current_stream(self.device).synchronize()
        self.inward.synchronize()
        self.outward.synchronize()
        self._filling.clear()

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
            self.settle()
