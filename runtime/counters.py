"""Per-device counters in the host store: bytes moved by kind, peak accounted bytes, busy time, tasks run."""

from __future__ import annotations

import threading

import torch

IN_KINDS = ("weights", "activations", "inputs", "grads", "state")
OUT_KINDS = ("grads", "activations", "buffers", "weights", "state")
NAMES = (
    *(f"in_{kind}" for kind in IN_KINDS),
    *(f"out_{kind}" for kind in OUT_KINDS),
    "remote",
    "p2p",
    "prefetched",
    "halved",
    "ahead",
    "behind",
    "kept",
    "stashed",
    "recomputed",
    "inputs_recomputed",
    "computed",
    "peak",
    "reserved",
    "used",
    "busy_ns",
    "wait_ns",
    "room_ns",
    "gc_ns",
    "update_ns",
    "updates",
    "device_update_ns",
    "device_updates",
    "threads_chosen",
    "one_thread",
    "tasks",
    "executing",
)
BLOCK_BYTES = 8 * len(NAMES)


def block_bytes(jobs: int) -> int:
    """A device's counters block for a run of that many jobs: the named counters, then per job its host updates
    running on the device's worker."""
    return BLOCK_BYTES + 8 * jobs


class Counters:
    """Named int64 counters kept as Python ints by one device worker and published to a shared block.

    The worker counts in plain ints (a tensor update per copy would cost more than a small copy), from
    its compute thread and its copy engine, and publishes all of them with one write at the end of
    every task; the driver reads the block. What the worker is doing (the job its task thread executes, the
    jobs whose host updates run beside it) is written at once, for a driver that outlives the worker.
    """

    def __init__(self, block: torch.Tensor) -> None:
        self.shared = block.view(torch.int64)
        self.values = dict(zip(NAMES, self.shared.tolist()))
        self._lock = threading.Lock()

    def add(self, name: str, amount: int) -> None:
        with self._lock:
            self.values[name] += int(amount)

    def raise_to(self, name: str, value: int) -> None:
        with self._lock:
            if value > self.values[name]:
                self.values[name] = int(value)

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self.values[name] = int(value)

    def mark(self, name: str, value: int) -> None:
        """Set one counter and publish it at once (what the worker is doing, for a driver that outlives it)."""
        with self._lock:
            self.values[name] = int(value)
            self.shared[NAMES.index(name)] = int(value)

    def updating(self, job: int, running: bool) -> None:
        """A host update of job starts (running) or ends on this worker, published at once. Several of one job
        may run at a time (its sections'), so each job's slot counts them."""
        with self._lock:
            self.shared[len(NAMES) + job] += 1 if running else -1

    def publish(self) -> None:
        with self._lock:
            snapshot = [self.values[name] for name in NAMES]
        self.shared[: len(NAMES)].copy_(torch.tensor(snapshot, dtype=torch.int64))

    def read(self) -> dict[str, int]:
        """What was last published (by any process)."""
        return dict(zip(NAMES, self.shared.tolist()))

    def busy_jobs(self) -> set[int]:
        """The jobs the worker was last marked busy with: its task thread's, and those whose host updates run."""
        marks = self.shared.tolist()
        executing = marks[NAMES.index("executing")]
        return {job for job, count in enumerate(marks[len(NAMES):]) if count > 0} | (
            {executing - 1} if executing > 0 else set())
