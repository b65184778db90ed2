"""A task's predicted compute from the pilot's per-sample times: a forward, a backward with its recompute, an update."""

from __future__ import annotations

import pytest

from harmony.tasks.graph import TaskId
from harmony.tasks.hardware import Hardware
from harmony.tasks.packing import Pack, PackCost, Packing
from harmony.tasks.runplan import Job
from harmony.tasks.work import optimizer_seconds, task_seconds, update_passes, update_seconds


def packing(*forwards: float) -> Packing:
    """Packs of these forward seconds per sample, a backward twice its forward, 1,000 weight bytes each."""
    packs = tuple(Pack(index, index, index + 1, (), (), (), PackCost(1000, 1000, 0, 0), seconds, backward_ratio=2.0)
                  for index, seconds in enumerate(forwards))
    return Packing("m", packs, 10**12, 1)


def test_a_forward_a_backward_and_a_sections_backward_at_the_devices_speed() -> None:
    cut = packing(1e-3, 2e-3, 3e-3)
    fast = Hardware(compute_scale=2.0)
    assert task_seconds(TaskId("fwd", 0, 1, 0), cut, 10, fast) == pytest.approx(10 * 2e-3 / 2)
    assert task_seconds(TaskId("bwd", 0, 1, 0), cut, 10, fast) == pytest.approx(3 * 10 * 2e-3 / 2), (
        "its recompute and a backward twice as long")
    assert task_seconds(TaskId("fwd", 0, 0, 0), cut, 10, fast, range(0, 3)) == pytest.approx(10 * 6e-3 / 2)
    assert task_seconds(TaskId("bwd", 0, 0, 0), cut, 10, fast, range(0, 3)) == pytest.approx(
        10 * (3 * 6e-3 + 1e-3 + 2e-3) / 2), "every pack's inputs but the first's recomputed first"


def test_an_update_is_a_few_passes_over_the_packs_weights_at_the_host_stores_rate() -> None:
    cut = packing(1e-3, 2e-3, 3e-3)
    host = Hardware(optimizer_bytes_per_second=1e6)
    assert update_seconds(cut, range(0, 2), host) == pytest.approx(4 * 2000 / 1e6)
    assert task_seconds(TaskId("upd", 0, 1, 0), cut, 10, host) == update_seconds(cut, range(1, 2), host)


def test_a_host_update_adds_the_runtimes_work_for_each_pack_to_the_optimizers_passes() -> None:
    cut = packing(1e-3, 2e-3, 3e-3)
    host = Hardware(optimizer_bytes_per_second=1e6, update_call_seconds=5e-4)
    assert optimizer_seconds(cut, range(0, 2), host) == pytest.approx(4 * 2000 / 1e6)
    assert update_seconds(cut, range(0, 2), host) == pytest.approx(4 * 2000 / 1e6 + 2 * 5e-4)
    assert task_seconds(TaskId("upd", 0, 0, 0), cut, 10, host, range(0, 3)) == pytest.approx(
        4 * 3000 / 1e6 + 3 * 5e-4), "an upd task of a section: each of its packs' updates"


def test_a_packs_update_passes_run_at_the_devices_speed_where_it_updates_there() -> None:
    job = Job(members=(0,), label="m", feed=0, seed=0, packing=packing(1e-3, 2e-3), steps=1, step_seconds=0.0,
              batch_bytes=0, device_updates=(1,))
    fast = Hardware(optimizer_bytes_per_second=1e6, compute_scale=4.0, update_call_seconds=5e-4)
    assert update_passes(job, 0, fast) == pytest.approx(4 * 1000 / 1e6), "on the host store"
    assert update_passes(job, 1, fast) == pytest.approx(4 * 1000 / 1e6 / 4), "on its device"
