"""Per-device counters in the host store: bytes moved by kind, peak accounted bytes, busy time, tasks run."""

from __future__ import annotations

import torch

IN_KINDS = ("weights", "activations", "inputs")
OUT_KINDS = ("grads", "activations", "buffers")
NAMES = (
    *(f"in_{kind}" for kind in IN_KINDS),
    *(f"out_{kind}" for kind in OUT_KINDS),
    "peak",
    "busy_ns",
    "tasks",
)
BLOCK_BYTES = 8 * len(NAMES)


class Counters:
    """Named int64 counters living in a shared buffer, written by one device worker, read by the driver."""

    def __init__(self, block: torch.Tensor) -> None:
        self.values = block.view(torch.int64)

    def add(self, name: str, amount: int) -> None:
        self.values[NAMES.index(name)] += int(amount)

    def raise_to(self, name: str, value: int) -> None:
        index = NAMES.index(name)
        if value > self.values[index]:
            self.values[index] = int(value)

    def read(self) -> dict[str, int]:
        return {name: int(value) for name, value in zip(NAMES, self.values.tolist())}
