"""The copy engine: CPU copies never start an OpenMP team beside the compute thread's."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.stream import CopyEngine
from tests.conftest import native_threads, torch_threads


def test_the_cpu_copy_engine_never_starts_an_openmp_team_beside_the_compute_threads() -> None:
    """A large torch copy on a thread leaves that thread a team of OpenMP pool threads for its life, which
    makes the compute thread's pool sleep between operators (serial_copy); the engine's copies make none."""
    source = torch.arange(1 << 22, dtype=torch.int32).view(torch.uint8)
    by_torch, by_engine = torch.empty_like(source), torch.empty_like(source)
    with torch_threads(2), ThreadPoolExecutor(max_workers=1) as pool:
        before = native_threads()
        pool.submit(by_torch.copy_, source).result()
        assert native_threads() - before, "control: a thread's large torch copy starts pool threads"
    engine = CopyEngine("cpu-t", torch.device("cpu"))
    copied = threading.Event()
    with torch_threads(2):
        before = native_threads()
        engine.submit(engine.copy, by_engine, source)
        engine.submit(copied.set)
        assert copied.wait(30)
        assert not native_threads() - before, "the copy engine's thread started OpenMP pool threads"
    engine.shutdown()
    assert torch.equal(by_engine, source) and torch.equal(by_torch, source)
