"""The pilot's timings kept for a process's later calls: a re-run plans without timing again."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import harmony
from harmony import fusing, planner, timings
from harmony.runtime import pilot
from tests.conftest import deep_mlp, regression_batches

pytestmark = pytest.mark.usefixtures("no_cluster_may_start")


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch, timed_calls: list[int]) -> dict[str, list[Any]]:
    """What a plan measures: each layer's call by the pilot (the repeats asked: one where it only sizes the
    output), each backward ratio and update rate timed, and each array built (its members)."""
    seen: dict[str, list[Any]] = {"layers": timed_calls, "backward": [], "update": [], "built": []}
    ratio, rate, build = pilot._backward_ratio, planner.update_rate, fusing.build_array

    def backward(*args: Any) -> float:
        seen["backward"].append(1)
        return ratio(*args)

    def update(*args: Any) -> float | None:
        seen["update"].append(1)
        return rate(*args)

    def built(members: list[int], *args: Any) -> Any:
        seen["built"].append(list(members))
        return build(members, *args)

    monkeypatch.setattr(pilot, "_backward_ratio", backward)
    monkeypatch.setattr(planner, "update_rate", update)
    monkeypatch.setattr(fusing, "update_rate", update)
    monkeypatch.setattr(fusing, "build_array", built)
    return seen


def sweep(batch: int = 16, seed: int = 0) -> harmony.Forecast:
    models = [deep_mlp(width=64, depth=4, seed=seed + index) for index in range(4)]
    return harmony.plan(models, regression_batches(samples=batch * 4, batch=batch, width=64),
                        loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                        devices=["cpu"], fuse=2)


def test_a_re_run_plans_from_the_kept_timings_and_predicts_the_same(measured: dict[str, list[Any]]) -> None:
    """The first call times the first model's layers, backward and update, and the trial array of 2; a re-run with
    other models of that architecture times nothing: it builds only the arrays it trains, with the trial's
    timings, and predicts exactly what the first call predicted."""
    first = sweep()
    assert first.arrays == [[0, 1], [2, 3]]
    assert max(measured["layers"]) > 1 and measured["backward"] and measured["update"]
    assert measured["built"] == [[0, 1], [2, 3]], "the trial array [0, 1], trained, and [2, 3] from its timings"
    for kind in measured.values():
        kind.clear()
    again = sweep(seed=10)
    assert again.arrays == first.arrays
    assert set(measured["layers"]) == {1}, "every layer called once, for its output's size, none timed"
    assert measured == {**measured, "backward": [], "update": [], "built": [[0, 1], [2, 3]]}
    assert [choice.predicted for choice in again.fusion] == [choice.predicted for choice in first.fusion]
    assert again.step_seconds == first.step_seconds


def test_batches_of_another_shape_or_other_threads_are_timed_again(measured: dict[str, list[Any]]) -> None:
    sweep()
    measured["layers"].clear()
    sweep(batch=32)
    assert max(measured["layers"]) > 1, "another micro-batch size: its layers timed"
    sample = torch.zeros(16, 64)
    assert timings.context(sample, "fp32") == timings.context(torch.ones(16, 64), "fp32")
    assert timings.context(sample, "fp32") != timings.context(torch.zeros(32, 64), "fp32")
    assert timings.context(sample, "fp32") != timings.context(sample, "bf16")
    assert timings.context(sample, "fp32") != timings.context(sample.double(), "fp32")
    assert timings.context({"x": sample}, "fp32") != timings.context((sample,), "fp32")
    before, threads = timings.context(sample, "fp32"), torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert timings.context(sample, "fp32") != before, "timed with as many threads as a device worker has"
    finally:
        torch.set_num_threads(threads)


def test_shutdown_forgets_the_kept_timings(measured: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("harmony.api.close_warm", lambda: None)  # the suite's warm cluster stays up
    sweep()
    assert timings.KEPT and timings.RATES
    harmony.shutdown()
    assert not timings.KEPT and not timings.RATES
    measured["layers"].clear()
    sweep()
    assert max(measured["layers"]) > 1
