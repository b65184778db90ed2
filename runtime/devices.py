"""Device specs: which devices a run uses, their byte budgets and the CPU threads each one gets."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch


class DeviceSpecError(ValueError):
    """A devices argument Harmony cannot turn into devices."""


@dataclass(frozen=True)
class DeviceSpec:
    """One device worker: its name (also the Dask worker name), torch device, budget and threads, and the machine
    it is on (runtime.hoststore.identity; "" for the driver's)."""

    name: str
    torch_device: str
    budget: int
    threads: int
    link_bandwidth: float | None = None
    machine: str = ""

    @property
    def kind(self) -> str:
        return self.torch_device.split(":")[0]


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_device(cpus: int, devices: int) -> int:
    """An even share of a machine's CPU threads for each of its device workers, at least one."""
    return max(1, cpus // max(devices, 1))


def shared_threads(specs: Sequence[DeviceSpec], idle: frozenset[str]) -> dict[str, int]:
    """Each CPU device's threads once the idle devices (those with nothing left to compute in the run) give theirs
    to the CPU devices of their machine that still compute, in even shares (the first ones one more where they do not
    divide): the last model of a pruned sweep, homed alone, computes with the cores its neighbours freed, as a
    plain loop's one process would."""
    threads = {spec.name: spec.threads for spec in specs if spec.kind == "cpu"}
    for machine in {spec.machine for spec in specs}:
        cpus = [spec for spec in specs if spec.machine == machine and spec.kind == "cpu"]
        busy = [spec.name for spec in cpus if spec.name not in idle]
        spare = sum(spec.threads for spec in cpus if spec.name in idle)
        for index, name in enumerate(busy):
            threads[name] += spare // len(busy) + (index < spare % len(busy))
    return threads


@contextmanager
def device_threads(specs: Sequence[DeviceSpec]) -> Iterator[None]:
    """Within the block this process computes with the threads of a CPU device worker of specs (the fewest), so
    that the pilot pass times layers as those devices will run them: a fused array's batched multiply gains more
    from a second thread than one model's small one does, so timed with all of the machine's threads an array looks
    faster against its members than it is on a device of one. Unchanged where the devices are GPUs."""
    cpus = [spec.threads for spec in specs if spec.kind == "cpu"]
    before = torch.get_num_threads()
    if cpus and min(cpus) != before:
        torch.set_num_threads(min(cpus))
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def parse_devices(devices: int | str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Normalize the user's devices argument to torch device strings, one per device worker.

    None: every CUDA GPU, else one CPU device. An int n: n devices of that kind. A list: those devices;
    "cpu" may repeat (each is one CPU device worker), "cuda" without an index takes the next free GPU.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices is None:
        return [f"cuda:{i}" for i in range(gpus)] or ["cpu"]
    if isinstance(devices, bool) or not isinstance(devices, (int, str, list, tuple)):
        raise DeviceSpecError(
            f"devices={devices!r} is not understood; pass None, a count such as 2, or a list such as "
            "['cpu', 'cpu'] or ['cuda:0', 'cuda:1']"
        )
    if isinstance(devices, int):
        if devices < 1:
            raise DeviceSpecError(f"devices={devices} must be at least 1")
        if gpus:
            if devices > gpus:
                raise DeviceSpecError(f"devices={devices} asks for more GPUs than the {gpus} this machine has")
            return [f"cuda:{i}" for i in range(devices)]
        return ["cpu"] * devices
    names = [devices] if isinstance(devices, str) else list(devices)
    if not names:
        raise DeviceSpecError("devices=[] names no device; pass None to use every GPU (or the CPU)")
    out: list[str] = []
    next_gpu = 0
    for position, name in enumerate(names):
        match = _DEVICE.match(name.strip().lower()) if isinstance(name, str) else None
        if match is None:
            raise DeviceSpecError(
                f"devices[{position}] = {name!r} is not a device Harmony knows; use 'cpu', 'cuda' or 'cuda:N'"
            )
        kind, index = match.group(1), match.group(2)
        if kind == "cpu":
            out.append("cpu")
            continue
        gpu = int(index) if index is not None else next_gpu
        if gpu >= gpus:
            raise DeviceSpecError(
                f"devices[{position}] = {name!r}: this machine has {gpus} CUDA GPU{'s' if gpus != 1 else ''}"
                + ("" if gpus else "; use 'cpu' devices instead")
            )
        next_gpu = gpu + 1
        out.append(f"cuda:{gpu}")
    duplicates = {d for d in out if d != "cpu" and out.count(d) > 1}
    if duplicates:
        raise DeviceSpecError(f"devices lists {sorted(duplicates)} more than once; each GPU is one device")
    return out


def capacity(torch_device: str, cpu_devices: int) -> int:
    """Bytes a device has: its GPU memory, or an equal share of the host's memory for CPU devices."""
    if torch_device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(torch_device)).total_memory
    return psutil.virtual_memory().total // max(cpu_devices, 1)


def build_specs(
    torch_devices: list[str], budget: int | dict[str, int] | None, link_bandwidths: list[float | None] | None = None,
    threads: int | None = None,
) -> list[DeviceSpec]:
    """Device specs with names cpu-0, cpu-1, cuda-0 ... and the machine's CPU threads split evenly among them
    (threads: that many each instead).

    A CPU device computes with its threads; a GPU device's worker needs them too, for the optimizer steps
    it runs on the host store (docs/performance.md, "Host optimizers need the machine's threads").
    link_bandwidths, one per device, hold its host<->device copies to that many bytes per second
    (a simulated link for CPU devices); None leaves copies at the machine's own speed. budget is every device's
    bytes, or per device name (a device not named gets its own capacity).
    """
    links = link_bandwidths or [None] * len(torch_devices)
    cpu_devices = sum(1 for d in torch_devices if d == "cpu")
    threads = threads or threads_per_device(cpu_count(), len(torch_devices))
    specs = []
    cpu_index = 0
    for device, link in zip(torch_devices, links):
        if device == "cpu":
            name = f"cpu-{cpu_index}"
            cpu_index += 1
        else:
            name = device.replace(":", "-")
        given = budget.get(name) if isinstance(budget, dict) else budget
        limit = capacity(device, cpu_devices) if given is None else given
        specs.append(DeviceSpec(name, device, limit, threads, link))
    return specs
