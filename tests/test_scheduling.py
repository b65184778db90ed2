"""Scheduling features end to end: prefetch over a simulated link, device-to-device traffic, utilization, and
which tasks wait at the scheduler."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import SchedulerPlugin
from torch import nn

import harmony
from harmony.tasks.graph import TaskId, parse_key
from tests.conftest import (
    assert_same_weights,
    clones,
    cross_device_reads,
    deep_mlp,
    param_bytes,
    regression_batches,
    train_plain,
)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_prefetch_over_a_slow_link_is_exact_and_within_budget(prefetch: bool, no_leaks: None) -> None:
    model = deep_mlp(depth=24)
    reference = clones([model])[0]
    budget = param_bytes(model) // 4
    batches = regression_batches(samples=48, batch=16)
    factory = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=4,
                           device_memory=budget, link_bandwidth="200MB/s", prefetch=prefetch, progress=False)
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert_same_weights(model, reference)
    stats = result.stats
    assert max(stats.peak_device_bytes.values()) <= budget
    assert stats.bytes_in["weights"] <= 3 * (2 * param_bytes(model))
    if prefetch:
        assert 0 < stats.bytes_prefetched <= stats.bytes_in["weights"]
        assert 0 < stats.bytes_ahead <= stats.bytes_in["activations"] + stats.bytes_in["inputs"]
    else:
        assert stats.bytes_prefetched == stats.bytes_ahead == stats.bytes_behind == 0


def test_two_devices_pass_activations_directly_and_report_utilization(no_leaks: None) -> None:
    models = [deep_mlp(seed=s) for s in range(2)]
    references = clones(models)
    batches = regression_batches(samples=64, batch=16)
    factory = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                           devices=["cpu", "cpu"], device_memory=30_000, mode="vpp", progress=False)
    assert result.mode == "vpp"
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference)
    stats = result.stats
    reads = cross_device_reads(stats.schedule)
    assert reads, "vpp puts a model's consecutive sections on different devices"
    assert stats.bytes_p2p == reads * 16 * 32 * 4, "every read of another device's result, 16 by 32 floats"
    assert stats.bytes_remote == 0, "no result crossed through Dask's comms"
    assert set(stats.busy_seconds) == set(stats.idle_seconds) == {"cpu-0", "cpu-1"}
    assert all(0 < u <= 1 for u in stats.utilization().values())
    ran = sorted(key for keys in stats.schedule.values() for key in keys)
    assert len(ran) == stats.tasks


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["1-device", "2-devices"])
def test_runtime_peaks_and_swaps_match_the_simulator_for_the_same_schedule(devices: list[str], no_leaks: None) -> None:
    from harmony.tasks.simulator import order_from_keys, replay_memory

    swapped = [deep_mlp(depth=16, seed=s) for s in range(2)]
    resident = deep_mlp(depth=1, seed=5)
    budget = param_bytes(swapped[0]) // 3 + 5 * param_bytes(resident)
    batches = regression_batches(samples=48, batch=16)
    result = harmony.train([*swapped, resident], batches, loss_fn=nn.functional.mse_loss,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), microbatches=4,
                           devices=devices, device_memory=budget, prefetch=False, progress=False, fuse=False,
                           mode="free", packs_per_task=1,  # sections' replays matched it in most runs, not all
                           stash=False)  # the replay's backward recomputes: it does not model stashes
    assert list(result.homes) == [2]
    assert all(len(packing.packs) > 1 for packing in result.packings[:2])
    order = order_from_keys(result.stats.schedule)
    predicted = replay_memory(order, result.packings, result.stats.budgets, result.homes, [1.0, 1.0, 1.0],
                              microbatch_samples=[[4, 4, 4, 4]] * 3)
    assert predicted.peak == result.stats.peak_device_bytes
    assert predicted.weights_in == result.stats.bytes_in["weights"]
    assert predicted.grads_out == result.stats.bytes_out["grads"]
    assert predicted.kept == result.stats.bytes_kept > 0
    homed_tasks = sum(key.startswith("bwd-m2-") for keys in result.stats.schedule.values() for key in keys)
    assert predicted.weights_out == result.stats.bytes_out["weights"] == homed_tasks * param_bytes(resident)


@pytest.mark.parametrize("mode", ["vpp", "vdp", "free"])
def test_every_mode_matches_plain_pytorch_on_two_devices(mode: str, no_leaks: None) -> None:
    models = [deep_mlp(seed=s) for s in range(2)]
    references = clones(models)
    batches = regression_batches(samples=48, batch=16)
    factories = [lambda p: torch.optim.Adam(p, lr=1e-3), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)]
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, microbatches=4,
                           devices=["cpu", "cpu"], device_memory=24_000, mode=mode, progress=False)
    for index, (model, reference) in enumerate(zip(models, references)):
        losses = train_plain(reference, batches, nn.functional.mse_loss, factories[index])
        assert_same_weights(model, reference)
        torch.testing.assert_close(torch.tensor(result.history[index]), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    assert max(result.stats.peak_device_bytes.values()) <= 24_000
    ran = {device: keys for device, keys in result.stats.schedule.items()}
    if mode == "vdp":
        assert any("-g1-" in key for key in ran["cpu-1"]) and not any("-g1-" in key for key in ran["cpu-0"])
    if mode == "vpp":
        for device, keys in ran.items():
            index = int(device.split("-")[1])
            for key in keys:
                task, _ = parse_key(key)
                if task.kind != "upd":
                    assert (task.model + task.pack) % 2 == index


class EdgeRecorder(SchedulerPlugin):
    """Records, for every task the scheduler is given, the keys it waits for and the worker it must run on."""

    def __init__(self) -> None:
        self.edges: dict[str, set[str]] = {}
        self.worker: dict[str, str] = {}

    def update_graph(self, scheduler: Any, *, keys: set[str], **kwargs: Any) -> None:
        for key in keys:
            task = scheduler.tasks.get(key)
            if task is not None and isinstance(key, str) and parse_key(key) is not None:
                self.edges[key] = {dep.key for dep in task.dependencies}
                self.worker[key] = next(iter(task.worker_restrictions or {""}))


def test_a_task_waits_at_the_scheduler_only_for_work_on_other_devices(no_leaks: None) -> None:
    models = [deep_mlp(seed=s) for s in range(2)]
    references = clones(models)
    batches = regression_batches(samples=48, batch=16)
    factory = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    recorder = EdgeRecorder()
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        cluster.scheduler.add_plugin(recorder)
        result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=4,
                               cluster=client, device_memory=24_000, mode="vdp", resident=False, progress=False,
                               packs_per_task=1)  # a task per pack: activations handed from task to task
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference)
    local_producers = 0
    for key, waits in recorder.edges.items():
        task, run = parse_key(key)  # type: ignore[misc]
        if task.kind == "upd":
            assert waits <= {TaskId("bwd", task.model, task.pack, task.span, g).key(run) for g in range(2)}
            continue
        same_worker = [dep for dep in waits if recorder.worker.get(dep) == recorder.worker[key]
                       and not dep.startswith("upd-")]  # an update runs beside the device: waited for through Dask
        assert not same_worker, f"{key} waits at the scheduler for {same_worker} on its own worker"
        if task.pack > 0:
            producer = TaskId("fwd", task.model, task.pack - 1, task.span, task.group).key(run)
            local_producers += recorder.worker[producer] == recorder.worker[key]
    assert local_producers > 0, "vDP runs a group's packs on one device: their activations never cross it"
    assert result.stats.tasks == len(recorder.edges)
