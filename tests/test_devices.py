"""Device specs: names, budgets and each worker's share of the CPU threads."""

from __future__ import annotations

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.devices import build_specs, cpu_count, threads_per_device


def test_every_device_worker_gets_an_even_share_of_the_cpu_threads() -> None:
    """GPU workers too: they step optimizers on the host store, which one thread made the bottleneck."""
    specs = build_specs(["cpu", "cuda:0"], budget=1_000_000)
    assert [spec.threads for spec in specs] == [threads_per_device(cpu_count(), 2)] * 2
    assert threads_per_device(16, 1) == 16 and threads_per_device(16, 3) == 5 and threads_per_device(2, 4) == 1
