"""Python's garbage collector during a run: its time, summed per process and counted per device around its tasks,
and the objects a run starts with frozen out of its collections until it ends."""

from __future__ import annotations

import gc

import torch
from distributed import get_worker
from torch import nn

import harmony
from harmony.runtime import cluster, collector
from tests.conftest import regression_batches


def test_frozen_keeps_the_objects_alive_at_its_start_out_of_collections_and_leaves_another_freeze_alone() -> None:
    assert gc.get_freeze_count() == 0
    with collector.frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0, "unfrozen after"
    gc.freeze()  # frozen objects still go when their last reference does: the count may only fall
    try:
        with collector.frozen():
            pass
        assert gc.get_freeze_count() > 0, "a freeze made before it is not undone"
    finally:
        gc.unfreeze()


def test_install_sums_collections_once() -> None:
    collector.install()
    collector.install()
    assert gc.callbacks.count(collector._timed) == 1, "installed once"
    before = collector.collected_ns()
    gc.collect()
    assert collector.collected_ns() > before


class Collecting(nn.Module):
    """A layer whose forward runs a young-generation collection (as an allocation can at any time). It has no
    child: the pilot would take a module whose traced forward only calls its child for that child (runtime.pilot's
    chain_order), and the call to gc, which tracing does not record, would never run on the worker."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gc.collect(0)
        try:
            get_worker()
        except ValueError:  # the pilot, in the driver
            pass
        else:
            assert gc.get_freeze_count() > 0, "a worker's objects are frozen while it trains"
        return x @ self.weight


def test_a_device_counts_the_collections_during_its_tasks() -> None:
    model = nn.Sequential(Collecting(), nn.ReLU(), nn.Linear(8, 8))
    result = harmony.train(model, regression_batches(32, 16, width=8, out=8), loss_fn=nn.functional.mse_loss,
                           optimizer=lambda parameters: torch.optim.SGD(parameters, lr=0.01), devices=["cpu"],
                           progress=False)
    (device,) = result.stats.busy_seconds
    assert 0 < result.stats.gc_seconds[device] < result.stats.busy_seconds[device]
    assert gc.get_freeze_count() == 0, "the driver's objects are not frozen after the run"
    warm = cluster.WARM
    assert warm is not None and set(warm[1].client.run(gc.get_freeze_count).values()) == {0}, "nor the workers'"
    assert result.stats.room_seconds == {device: 0.0}, "a homed model waits for no room"
