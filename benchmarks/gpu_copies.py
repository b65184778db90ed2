"""Benchmark: a swapped pack's micro-batch loop on a GPU, activations in and out, with and without copy streams.

What one forward task of `gpu_swap` does with a pack (one 2048-wide linear and ReLU) over 16 micro-batches of 1024
samples: copy each input in from the host, compute, copy the output out to page-locked host memory. Rows: the
plain loop with every copy on the compute stream (as Harmony's DeviceCache.copy_in/copy_out enqueue them), the
plain loop with an inward and an outward copy stream (torchgpipe's way: the next input comes in and the last
output goes out while a micro-batch computes), each from page-locked and from pageable host inputs; Harmony's own
DeviceCache.copy_in/copy_out loop; and the compute alone (the floor). Each row: host seconds to enqueue the loop
(the host running ahead of the GPU when it is far below the total) and total seconds to the GPU's end, the
median of the runs after a warm-up.

    python -m benchmarks.gpu_copies
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.report import arguments, report
from harmony.runtime.cache import DeviceCache
from harmony.runtime.counters import BLOCK_BYTES, Counters
from harmony.runtime.hoststore import HostStore

WIDTH, SAMPLES, MICROBATCHES, RUNS = 2048, 1024, 16, 8


def single_stream(weight: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    device, outputs = weight.device, []
    for x in inputs:
        y = torch.relu(x.to(device, non_blocking=True) @ weight)
        host = torch.empty(y.shape, pin_memory=True)
        host.copy_(y, non_blocking=True)
        outputs.append(host)
    return outputs


def copy_streams(inward: torch.cuda.Stream, outward: torch.cuda.Stream) -> Callable:
    def loop(weight: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        device, compute, outputs = weight.device, torch.cuda.current_stream(), []
        for x in inputs:
            with torch.cuda.stream(inward):
                on_device = x.to(device, non_blocking=True)
            compute.wait_stream(inward)
            on_device.record_stream(compute)  # allocated on the inward stream, read on the compute stream
            y = torch.relu(on_device @ weight)
            outward.wait_stream(compute)
            host = torch.empty(y.shape, pin_memory=True)
            with torch.cuda.stream(outward):
                host.copy_(y, non_blocking=True)
            y.record_stream(outward)
            outputs.append(host)
        return outputs

    return loop


def cache_loop(cache: DeviceCache) -> Callable:
    def loop(weight: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [cache.copy_out(torch.relu(cache.copy_in(x, "activations") @ weight), "activations") for x in inputs]

    return loop


def timed(loop: Callable, weight: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[float, float]:
    """Median host seconds to enqueue the loop and median seconds until the GPU has run it."""
    hosts, totals = [], []
    for _ in range(RUNS):
        torch.cuda.synchronize()
        started = time.perf_counter()
        loop(weight, inputs)
        hosts.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        totals.append(time.perf_counter() - started)
    return statistics.median(hosts[1:]), statistics.median(totals[1:])


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_copies needs a CUDA GPU")
    device = torch.device("cuda:0")
    weight = torch.randn(WIDTH, WIDTH, device=device)
    pinned = [torch.randn(SAMPLES, WIDTH).pin_memory() for _ in range(MICROBATCHES)]
    pageable = [x.clone() for x in pinned]
    store = HostStore("gpucopies", pin=True)
    try:
        cache = DeviceCache("cuda-0", device, 1 << 34, Counters(store.create("counters", BLOCK_BYTES)))
        streams = copy_streams(torch.cuda.Stream(device), torch.cuda.Stream(device))
        rows = []
        for way, loop, inputs in (
            ("plain, copies on the compute stream, pinned inputs", single_stream, pinned),
            ("plain, copies on the compute stream, pageable inputs", single_stream, pageable),
            ("plain, inward and outward copy streams, pinned inputs", streams, pinned),
            ("plain, inward and outward copy streams, pageable inputs", streams, pageable),
            ("harmony DeviceCache.copy_in/copy_out, pinned inputs", cache_loop(cache), pinned),
        ):
            host, total = timed(loop, weight, inputs)
            rows.append({"way": way, "host s": host, "total s": total})
        on_device = [x.to(device) for x in pinned]
        compute = timed(lambda w, xs: [torch.relu(x @ w) for x in xs], weight, on_device)[1]
        rows.append({"way": "compute alone (inputs already on the GPU)", "host s": 0.0, "total s": compute})
        cache.clear()
    finally:
        store.close()
        store.unlink_all()
    for row in rows:
        row["/ compute"] = row["total s"] / compute
    report("gpu_copies", f"{MICROBATCHES} micro-batches of {SAMPLES} x {WIDTH} through a linear and ReLU on "
           f"{torch.cuda.get_device_name(device)}, activations in and out", rows, args.out,
           notes="host s: enqueueing the loop; total s: until the GPU has run it; medians of the runs after the first")


if __name__ == "__main__":
    main()
