"""What a run tells its device workers: models, packs, layouts, user callables and the device of each worker."""

from __future__ import annotations

from dataclasses import dataclass

from harmony.runtime.devices import DeviceSpec
from harmony.tasks.layout import BufferLayout

LOSS_BLOCK = 4096


@dataclass(frozen=True)
class PackRuntime:
    """A pack as a worker runs it: its skeleton module, its weight and gradient layouts, its workspace."""

    skeleton: bytes
    weights: BufferLayout
    grads: BufferLayout
    buffers_offset: int
    workspace: int

    @property
    def has_buffers(self) -> bool:
        return self.buffers_offset < self.weights.nbytes


@dataclass(frozen=True)
class ModelRuntime:
    """A model (or a fused array of `members` models) as workers see it: its packs, loss and optimizer factory."""

    name: str
    packs: tuple[PackRuntime, ...]
    loss_fn: bytes
    optimizer: bytes
    seed: int
    groups: int = 1
    home: str | None = None
    members: int = 1


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs for one run; workers find their device by their Dask worker name."""

    run: str
    store_directory: str
    models: tuple[ModelRuntime, ...]
    devices: tuple[DeviceSpec, ...]
    prefetch: bool = True
    group: bool = True

    def device_index(self, worker_name: str) -> int:
        for index, device in enumerate(self.devices):
            if device.name == worker_name:
                return index
        raise KeyError(f"worker {worker_name!r} is not one of this run's devices")


def weights_name(model: int, pack: int) -> str:
    return f"m{model}-p{pack}-weights"


def grads_name(model: int, pack: int, group: int = 0) -> str:
    """A pack's gradients from one micro-batch group (the update reduces the groups into group 0's)."""
    return f"m{model}-p{pack}-grads" if group == 0 else f"m{model}-p{pack}-g{group}-grads"


def optimizer_name(model: int, pack: int, generation: int) -> str:
    return f"m{model}-p{pack}-optim{generation}"


def optimizer_meta_name(model: int, pack: int) -> str:
    return f"m{model}-p{pack}-optim-meta"


def versions_name(model: int) -> str:
    """Per pack, how many updates the host store's weights have had (the step they are ready for)."""
    return f"m{model}-versions"


SPAN_TIMING_BYTES = 16


def span_timing_name(model: int) -> str:
    """The seconds and the steps (float64) a resident model's multi-step tasks have timed so far, added up."""
    return f"m{model}-span-timing"


def counters_name(device: int) -> str:
    return f"device{device}-counters"


def losses_name(model: int, block: int, group: int = 0) -> str:
    """A block of LOSS_BLOCK steps of one micro-batch group's share of the mini-batch loss of each member."""
    return f"m{model}-losses{block}" if group == 0 else f"m{model}-g{group}-losses{block}"
