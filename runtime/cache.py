"""A device's memory: resident pack weights and scratch reservations under a byte budget, exactly accounted.

Every byte that enters or leaves the device goes through copy_in / copy_out / weights / prefetch,
which count it. What is on the device at any moment is the resident weight buffers (prefetched ones
included), the boundary values kept for the next task (see keep), plus the open reservations (gradient
buffers and each micro-batch's activation workspace as the plan sized it); the cache refuses to go over
budget, evicting least recently used weights (and kept boundary values) that no running task holds, and
raising BudgetExceeded when that is not enough.

Copies between host and device can be held to a simulated link speed: each then takes at least
bytes / bandwidth of wall time on the thread doing it, so that on CPU devices one can see whether
swapping hides behind compute. Prefetches run on the device's copy engine (stream.py: a thread for CPU
devices, a copy stream and events on CUDA) while the compute thread works.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from harmony.runtime.counters import Counters
from harmony.runtime.stream import CopyEngine


class BudgetExceeded(RuntimeError):
    """A device was asked to hold more bytes than its budget."""


@dataclass
class Resident:
    """A pack's weights on the device, at the host store version they were copied from."""

    buffer: torch.Tensor
    version: int
    pins: int = 0
    arrived: threading.Event = field(default_factory=threading.Event)
    done: torch.cuda.Event | None = None
    failed: BaseException | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def _arrived() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class Boundary:
    """A pack's output (or its input's gradient) kept on the device for the task that reads it."""

    value: Any
    nbytes: int
    pins: int = 0
    arrived: threading.Event = field(default_factory=_arrived)


def boundary_key(consumer: Any, microbatch: int) -> tuple[str, Any, int]:
    """Where a boundary value for consumer's micro-batch is kept in the cache."""
    return ("boundary", consumer, microbatch)


def tree_nbytes(tree: Any) -> int:
    return sum(leaf.nbytes for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))


class DeviceCache:
    """Budgeted, accounted memory of one device, with a copy engine for prefetches."""

    def __init__(
        self, name: str, device: torch.device, budget: int, counters: Counters, link_bandwidth: float | None = None
    ) -> None:
        self.name = name
        self.device = device
        self.budget = budget
        self.counters = counters
        self.link_bandwidth = link_bandwidth
        self.used = 0
        self.residents: OrderedDict[Any, Resident | Boundary] = OrderedDict()
        self._lock = threading.RLock()
        self.engine = CopyEngine(name, device)
        self._unsettled = False

    def _evictable(self) -> Any:
        return next(
            (key for key, entry in self.residents.items() if entry.pins == 0 and entry.arrived.is_set()), None
        )

    def _charge(self, nbytes: int, what: str) -> None:
        with self._lock:
            while self.used + nbytes > self.budget:
                victim = self._evictable()
                if victim is None:
                    raise BudgetExceeded(
                        f"device {self.name}: {what} needs {nbytes:,} bytes but {self.used:,} of its "
                        f"{self.budget:,}-byte budget are held by running tasks"
                    )
                self.drop(victim)
            self.used += nbytes
            self.counters.raise_to("peak", self.used)

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes

    def drop(self, key: Any) -> None:
        with self._lock:
            entry = self.residents.pop(key, None)
            if entry is not None:
                self.used -= entry.nbytes

    def clear(self) -> None:
        self.engine.shutdown()
        with self._lock:
            for key in list(self.residents):
                self.drop(key)

    def _over_link(self, nbytes: int, started: float) -> None:
        """Hold a copy to the simulated link speed: it takes at least nbytes / bandwidth seconds."""
        if self.link_bandwidth:
            remaining = nbytes / self.link_bandwidth - (time.perf_counter() - started)
            if remaining > 0:
                time.sleep(remaining)

    def _copy_weights(self, entry: Resident, host: torch.Tensor, prefetched: bool = False) -> None:
        """Copy host weight bytes into entry over the link, count them, and mark them arrived.

        On CUDA the copy is only enqueued: entry.done marks its end for the stream that reads the weights.
        A copy that fails marks the entry arrived with its error, so that a task waiting for it raises.
        """
        started = time.perf_counter()
        try:
            entry.done = self.engine.copy(entry.buffer, host)
            self._over_link(host.numel(), started)
            self.counters.add("in_weights", host.numel())
            if prefetched:
                self.counters.add("prefetched", host.numel())
        except BaseException as error:
            entry.failed = error
            raise
        finally:
            entry.arrived.set()

    def _wait_arrived(self, key: Any, entry: Resident) -> None:
        """Block until entry's copy was issued, and order the current stream after it."""
        entry.arrived.wait()
        if entry.failed is not None:
            with self._lock:
                if self.residents.get(key) is entry:
                    self.drop(key)
            raise RuntimeError(f"device {self.name}: copying the weights of {key} in failed") from entry.failed
        self.engine.wait(entry.done)

    def hold(self, key: Any) -> None:
        """Pin a resident entry for the rest of the run: a resident model's master copy of its weights."""
        with self._lock:
            self.residents[key].pins += 1

    def allocate(self, nbytes: int, what: str) -> torch.Tensor:
        """Device bytes charged to the budget for the rest of the run (a resident model's gradients)."""
        self._charge(nbytes, what)
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def charge(self, nbytes: int, what: str) -> None:
        """Account nbytes held for the rest of the run (a resident model's optimizer state)."""
        self._charge(nbytes, what)

    def set_version(self, key: Any, version: int) -> None:
        """The resident weights now hold version: they were updated on the device."""
        with self._lock:
            self.residents[key].version = version

    def reload(self, key: Any, host: torch.Tensor) -> None:
        """Copy a resident pack's weights in again: what swapping per micro-batch costs (a baseline)."""
        with self._lock:
            entry = self.residents[key]
        self._copy_weights(entry, host)
        self._wait_arrived(key, entry)

    @contextmanager
    def scratch(self, nbytes: int, what: str) -> Iterator[None]:
        """Reserve nbytes for the duration of the block (activations, gradient buffers)."""
        self._charge(nbytes, what)
        try:
            yield
        finally:
            self._release(nbytes)

    @contextmanager
    def weights(self, key: Any, version: int, host: torch.Tensor) -> Iterator[torch.Tensor]:
        """The pack's weight bytes on the device at version, copied in from host unless already there.

        A prefetch of the same weights still in flight is waited for rather than repeated.
        """
        with self._lock:
            entry = self.residents.get(key)
            if entry is not None and entry.version != version:
                if entry.pins or not entry.arrived.is_set():
                    raise RuntimeError(
                        f"device {self.name}: weights of {key} at version {entry.version} are in use or in "
                        f"flight while version {version} is asked for"
                    )
                self.drop(key)
                entry = None
            load = entry is None
            if load:
                self._charge(host.numel(), f"weights of {key}")
                entry = Resident(torch.empty(host.numel(), dtype=torch.uint8, device=self.device), version)
                self.residents[key] = entry
            assert entry is not None
            self.residents.move_to_end(key)
            entry.pins += 1
        try:
            if load:
                self._copy_weights(entry, host)
            self._wait_arrived(key, entry)
            yield entry.buffer
        finally:
            with self._lock:
                entry.pins -= 1

    def prefetch(self, key: Any, version: int, host: torch.Tensor, keep_free: int) -> bool:
        """Start copying a pack's weights in on the copy engine, if they fit beside keep_free bytes.

        keep_free is what the running task will still reserve; a prefetch never takes that room and
        never evicts weights a task holds. Returns whether a copy was started.
        """
        nbytes = host.numel()
        with self._lock:
            if key in self.residents:
                return False
            while self.used + nbytes + keep_free > self.budget:
                victim = self._evictable()
                if victim is None:
                    return False
                self.drop(victim)
            self._charge(nbytes, f"prefetch of {key}")
            entry = Resident(torch.empty(nbytes, dtype=torch.uint8, device=self.device), version)
            self.residents[key] = entry
        self.engine.submit(self._copy_weights, entry, host, True)
        return True

    def keep(self, consumer: Any, microbatch: int, value: Any, keep_free: int = 0) -> bool:
        """Keep a boundary value on the device for consumer, if it fits beside keep_free bytes without evicting.

        keep_free is what the running task will still reserve (the next micro-batch's workspace): a value
        kept in that room would push out what the cache holds when the reservation comes, weights
        prefetched for the next task first, and they would be copied in again. It stays evictable (its
        host copy exists), least recently used first like weights, and any task other than consumer drops
        it when it starts (drop_boundaries). Returns whether it was kept.
        """
        nbytes = tree_nbytes(value)
        with self._lock:
            if self.used + nbytes + keep_free > self.budget:
                return False
            self.used += nbytes
            self.counters.raise_to("peak", self.used)
            self.residents[boundary_key(consumer, microbatch)] = Boundary(value, nbytes)
        return True

    def claim(self, consumer: Any, microbatch: int) -> Any | None:
        """The boundary value kept for consumer's micro-batch (now the task's own), or None if it is not here."""
        with self._lock:
            entry = self.residents.get(boundary_key(consumer, microbatch))
            if not isinstance(entry, Boundary):
                return None
            self.drop(boundary_key(consumer, microbatch))
            self.counters.add("kept", entry.nbytes)
        return entry.value

    def drop_boundaries(self, running: Any) -> None:
        """Drop every kept boundary value that is not for the task now starting."""
        with self._lock:
            for key in [k for k, e in self.residents.items() if isinstance(e, Boundary) and k[1] != running]:
                self.drop(key)

    def copy_in(self, tree: Any, kind: str) -> Any:
        """A device copy of every tensor in tree, counted as bytes_in[kind].

        On CUDA the copy is enqueued on the compute stream (asynchronous from page-locked host memory, which
        copy_out gives and a pinned store's batch files are), so the kernels that read it are ordered after it
        without the host waiting; settle() waits for it before the task ends and its source may be rewritten.
        """
        started = time.perf_counter()
        asynchronous = self.device.type == "cuda"

        def copy(leaf: torch.Tensor) -> torch.Tensor:
            return leaf.to(self.device, copy=True, non_blocking=True) if asynchronous else leaf.clone()

        if isinstance(tree, torch.Tensor):  # the common case, without pytree's walk (a step copies two)
            nbytes, copied = tree.nbytes, copy(tree)
        else:
            nbytes = tree_nbytes(tree)
            copied = tree_map(lambda leaf: copy(leaf) if isinstance(leaf, torch.Tensor) else leaf, tree)
        self._over_link(nbytes, started)
        self.counters.add(f"in_{kind}", nbytes)
        self._unsettled = self._unsettled or asynchronous
        return copied

    def copy_out(self, tree: Any, kind: str) -> Any:
        """A host copy of every tensor in tree, counted as bytes_out[kind].

        On CUDA the copy goes into page-locked memory from PyTorch's caching host allocator and is only
        enqueued: the host bytes are valid once settle() has run, which the task does before it returns them.
        """
        started = time.perf_counter()
        nbytes = tree_nbytes(tree)
        copied = tree_map(lambda leaf: self._host_copy(leaf) if isinstance(leaf, torch.Tensor) else leaf, tree)
        self._over_link(nbytes, started)
        self.counters.add(f"out_{kind}", nbytes)
        return copied

    def _host_copy(self, leaf: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return leaf.detach().to("cpu", copy=True)
        host = torch.empty(leaf.shape, dtype=leaf.dtype, pin_memory=True)
        host.copy_(leaf.detach(), non_blocking=True)
        self._unsettled = True
        return host

    def settle(self) -> None:
        """Wait until the copies enqueued on the compute stream (copy_out's to the host, copy_in's from it) have
        completed (CUDA only)."""
        if self._unsettled:
            self._unsettled = False
            torch.cuda.current_stream(self.device).synchronize()

    def write_back(self, device_bytes: torch.Tensor, host: torch.Tensor, kind: str) -> None:
        """Copy device bytes into a host store buffer, counted as bytes_out[kind]."""
        started = time.perf_counter()
        host.copy_(device_bytes)
        self._over_link(device_bytes.numel(), started)
        self.counters.add(f"out_{kind}", device_bytes.numel())
