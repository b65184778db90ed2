"""The host optimizer's bandwidth: a swapped pack's update on the host store against the machine's memory bandwidth.

A swapped pack's update (runtime/optimizer.update) reads the pack's weights at version s from one slot of the host
store, copies the trainable bytes and the optimizer state into the other slot, steps a torch optimizer (built by the
user's factory) over that slot with the pack's gradients, and publishes version s + 1. This runs it as the workers
do, on packs of several sizes, with Adam as torch builds it by default (per tensor on the CPU), with
``foreach=True`` (multi-tensor) and ``fused=True`` (torch's fused CPU kernel), one thread (a device worker's share
on this box) and all of them. The figure is the pack's parameter bytes updated per second; beside it, the machine's
copy bandwidth (a large tensor copied, bytes read + written per second) and what the update moves per parameter
byte (weights copied, state copied, the step's reads and writes), which bounds it. Issue 28: the update should
come near that bound (ZeRO-Offload's CPU Adam).

    python -m benchmarks.host_update
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from benchmarks.report import arguments, report
from harmony.runtime.files import Versions, grads_name, slot_bytes, versions_name, weights_name, weights_slot
from harmony.runtime.hoststore import HostStore, tensors_at
from harmony.runtime.optimizer import PackOptimizer, update
from harmony.runtime.optimstate import OptimizerState
from harmony.runtime.skeleton import dump_skeleton
from harmony.runtime.spec import PackRuntime
from harmony.tasks.layout import TensorSpec, lay_out

WAYS = {
    "per tensor (default)": lambda p: torch.optim.Adam(p, lr=1e-3),
    "foreach": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
}
# bytes moved per parameter byte by one Adam update: weights copied to the other slot (read + write), two state
# tensors copied (2 x read + write), the step reading weights, gradient and both states and writing weights and
# both states
MOVED_PER_BYTE = 2 + 4 + 7


def copy_bandwidth(nbytes: int, rounds: int = 5) -> float:
    """Bytes read and written per second by copying a large tensor (the machine's memory bandwidth, as torch sees
    it with its current threads)."""
    source = torch.ones(nbytes // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return 2 * nbytes / min(times)


def pack(width: int, layers: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def update_seconds(store: HostStore, module: nn.Module, factory: object, steps: int, tag: int) -> float:
    """Median seconds of one pack's update on the host store, as a worker applies it (after one warm-up step)."""
    weights = lay_out([TensorSpec(n, "float32", tuple(p.shape)) for n, p in module.named_parameters()])
    runtime = PackRuntime(dump_skeleton(module), weights, weights, weights.nbytes, 0)
    mapped = store.create(weights_name(tag, 0), 2 * slot_bytes(weights.nbytes))
    grads = store.create(grads_name(tag, 0), weights.nbytes)
    versions = Versions(store.create(versions_name(tag), 8))
    for slot in (0, 1):
        for name, view in tensors_at(weights_slot(mapped, slot, weights.nbytes), weights).items():
            view.copy_(dict(module.named_parameters())[name].detach())
    grads.view(torch.float32).normal_()
    optimizers: dict[int, PackOptimizer] = {}

    def optimizer(slot: int) -> PackOptimizer:
        if slot not in optimizers:
            optimizers[slot] = PackOptimizer(factory, weights_slot(mapped, slot, weights.nbytes), grads, runtime,  # type: ignore[arg-type]
                                             OptimizerState(store, tag, 0))
        return optimizers[slot]

    times = []
    for step in range(steps + 1):
        started = time.perf_counter()
        update(runtime, versions, 0, step, lambda slot: weights_slot(mapped, slot, weights.nbytes), optimizer, [])
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    shapes = [(1024, 2)] if args.quick else [(256, 8), (1024, 4), (2048, 4)]
    steps = 3 if args.quick else 9
    rows = []
    store = HostStore("benchmark-host-update")
    tag = 0
    try:
        for threads in sorted({1, torch.get_num_threads()}):
            torch.set_num_threads(threads)
            bandwidth = copy_bandwidth(256 * 2**20)
            for width, layers in shapes:
                module = pack(width, layers)
                nbytes = sum(p.numel() for p in module.parameters()) * 4
                row: dict[str, object] = {"threads": threads, "pack MiB": nbytes / 2**20,
                                          "copy GB/s": bandwidth / 1e9}
                for way, factory in WAYS.items():
                    seconds = update_seconds(store, module, factory, steps, tag)
                    tag += 1
                    row[f"{way} GB/s"] = nbytes / seconds / 1e9
                    row[f"{way} of bound"] = nbytes * MOVED_PER_BYTE / seconds / bandwidth
                rows.append(row)
    finally:
        store.unlink_all()
    report("host_update", "A swapped pack's Adam update on the host store: parameter bytes updated per second",
           rows, args.out,
           notes=f"GB/s = the pack's parameter bytes / the update's time (median of {steps} steps, as a worker "
                 "applies it: slot copy, state copy, step, publish); of bound = bytes the update moves "
                 f"({MOVED_PER_BYTE} per parameter byte) / time / the copy bandwidth beside it")


if __name__ == "__main__":
    main()
