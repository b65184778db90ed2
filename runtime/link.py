"""A simulated host<->device link: copies held to a bandwidth, one at a time in each direction.

A CPU device has no link of its own; with ``link_bandwidth`` its copies take the time a real one would give them,
so that what swapping costs, and what hides behind compute, shows on CPU. Like PCIe, the link is full duplex:
a copy in and a copy out run at once, each at the full bandwidth, while two copies the same way (a prefetch of
weights and a micro-batch's input) share it, the later one starting when the earlier one is done.
"""

from __future__ import annotations

import threading
import time

IN, OUT = "in", "out"


class Link:
    """The two directions of one device's link, each free again at a time on perf_counter's clock."""

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = bandwidth
        self._free = {IN: 0.0, OUT: 0.0}
        self._lock = threading.Lock()

    def schedule(self, nbytes: int, direction: str, started: float) -> float:
        """When the link will have carried a copy of nbytes begun at started (perf_counter): nbytes / bandwidth
        seconds after both the copy began and the direction's previous copy ended."""
        with self._lock:
            begin = max(started, self._free[direction])
            end = self._free[direction] = begin + nbytes / self.bandwidth
        return end

    def carry(self, nbytes: int, direction: str, started: float) -> None:
        """Hold the calling thread until the link has carried a copy of nbytes begun at started."""
        until(self.schedule(nbytes, direction, started))


def until(moment: float) -> None:
    """Sleep until perf_counter reaches moment."""
    remaining = moment - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
