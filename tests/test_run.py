"""A run's lifecycle on its workers: homed weights flushed on the task thread, no OpenMP team left behind."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import harmony
from tests.conftest import (
    assert_same_weights,
    deep_mlp,
    native_threads,
    regression_batches,
    train_plain,
)


def test_a_run_leaves_no_openmp_team_on_its_workers_beside_the_compute_threads(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    """Every torch copy of a run is made by the worker's task thread (or with memmove): a large one on its
    event loop, as a ``client.run`` would make it, leaves that thread OpenMP pool threads for the process's
    life, and the compute thread's pool then sleeps between operators in every later run (serial_copy).
    The device's thread count holds in every thread of its worker, also where the driver's environment says
    one thread, as distributed's nanny leaves it after starting a worker."""
    from harmony.runtime.cluster import start_embedded
    from harmony.runtime.devices import DeviceSpec
    from harmony.runtime.worker import wait_for_warmup

    def large_copy() -> None:
        torch.empty(1 << 22).copy_(torch.ones(1 << 22))

    model = deep_mlp(width=128, depth=2, seed=3)  # weights well over torch's grain for a parallel copy
    reference = copy.deepcopy(model)
    batches = regression_batches(samples=64, batch=16, width=128)
    factory = functools.partial(torch.optim.SGD, lr=0.05)
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.setenv(variable, "1")
    handle = start_embedded([DeviceSpec("cpu-0", "cpu", 2**26, 2)], dashboard_address=":0")
    try:
        assert list(handle.client.run(torch.get_num_threads).values()) == [2], "the device's threads, not the driver's"
        handle.client.run(wait_for_warmup)  # threads its background imports may start are there before we look
        worker = list(handle.workers.values())
        handle.client.submit(large_copy, workers=worker, pure=False).result()  # the compute thread's own team
        [before] = handle.client.run(native_threads).values()
        result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory,
                               cluster=handle.client, progress=False)
        [after_run] = handle.client.run(native_threads).values()
        handle.client.run(large_copy)
        [after_control] = handle.client.run(native_threads).values()
    finally:
        handle.close()
    assert result.homes, "the model trained resident, so its weights were flushed from the worker at the end"
    assert not after_run - before, "the run left pool threads of a second OpenMP team on the worker"
    assert after_control - after_run, "control: a large copy on the worker's event loop starts pool threads"
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert_same_weights(model, reference)
