"""The runtime's host cost per pack call, fitted to a run's steps and taken by the process's later plans."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import harmony
from harmony import calls
from harmony.tasks.hardware import Hardware
from tests.conftest import deep_mlp, regression_batches


def sgd(parameters: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.01)


def weight_bytes(model: nn.Module) -> int:
    return sum(parameter.nbytes for parameter in model.parameters())


def train(budget: int, steps: int = 10) -> harmony.TrainResult:
    return harmony.train(deep_mlp(), regression_batches(16 * steps, 16), loss_fn=nn.functional.mse_loss,
                         optimizer=sgd, devices=["cpu"], device_memory=budget, microbatches=4, progress=False)


def assert_predicts(result: harmony.TrainResult, fitted: float) -> None:
    """fitted is the least call cost (to the fit's hundredth) at which the run's plan predicts its steady step."""
    measured = result.stats.steady_seconds_per_step()
    plan = dataclasses.replace(result.plan, hardware=dataclasses.replace(result.plan.hardware, call_seconds=0.0))
    if fitted > 0:
        assert calls.steady_step(plan, [16], fitted) >= measured
        assert calls.steady_step(plan, [16], 0.98 * fitted) < measured
    else:
        assert calls.steady_step(plan, [16], 0.0) >= measured


def test_a_swapped_run_fits_the_call_cost_that_predicts_its_steady_step_and_later_plans_take_it() -> None:
    budget = weight_bytes(deep_mlp()) // 3
    result = train(budget)
    assert result.plan.jobs[0].home is None and len(result.plan.jobs[0].packing.packs) > 2, "a swapped model"
    assert result.plan.hardware.call_seconds == 0.0, "the first run planned without a call cost"
    fitted = result.call_seconds
    assert fitted is not None and {"cpu": [fitted]} == calls.FITS and calls.learned("cpu") == fitted
    assert_predicts(result, fitted)

    slow = dataclasses.replace(result, stats=dataclasses.replace(
        result.stats, step_seconds=[[100.0 * step for step in range(10)]]))
    assert calls.learn(slow, [16], "cpu") is None, "100 s steps: no call cost explains them"
    assert {"cpu": [fitted]} == calls.FITS, "nothing kept of it"
    evaluated = dataclasses.replace(result, val_history=[[(5, 0.5)]])
    assert calls.learn(evaluated, [16], "cpu") is None, "the simulator predicts no evaluation"
    checkpointed = dataclasses.replace(result, plan=dataclasses.replace(
        result.plan, options=dataclasses.replace(result.plan.options, checkpoint_every=4)))
    assert calls.learn(checkpointed, [16], "cpu") is None, "nor checkpoints"
    assert {"cpu": [fitted]} == calls.FITS
    stopped = dataclasses.replace(result, stats=dataclasses.replace(
        result.stats, step_seconds=[result.stats.step_seconds[0], [0.5]]))
    assert calls.learn(stopped, [16], "cpu") == fitted, "a model stopped after one step leaves the others' steps"
    calls.FITS["cpu"].pop()

    forecast = harmony.plan(deep_mlp(), regression_batches(160, 16), devices=["cpu"], device_memory=budget,
                            microbatches=4)
    assert forecast.hardware.call_seconds == fitted
    assert (f"with {fitted * 1e6:,.0f} µs of the runtime's host work per pack call" in str(forecast)) == (fitted > 0)
    again = train(budget)
    assert again.plan.hardware.call_seconds == fitted, "the next run on such devices plans with it"
    assert again.call_seconds is not None
    assert_predicts(again, again.call_seconds)
    assert calls.learned("cpu") == pytest.approx((fitted + again.call_seconds) / 2), "the median of the fits"
    for _ in range(calls.KEPT):
        calls.learn(again, [16], "cpu")
    assert {"cpu": [again.call_seconds] * calls.KEPT} == calls.FITS, "the last few fits"

    harmony.shutdown()
    assert calls.FITS == {} and calls.learned("cpu") is None


def test_a_homed_run_says_nothing_of_the_call_cost() -> None:
    result = train(10 * weight_bytes(deep_mlp()))
    assert all(job.home is not None for job in result.plan.jobs)
    assert calls.FITS == {} and result.call_seconds is None
    assert calls.learn(result, [16], "cpu") is None
    assert calls.learn(result, [16], None) is None


def test_a_run_too_short_for_a_steady_step_keeps_nothing() -> None:
    result = train(weight_bytes(deep_mlp()) // 3, steps=1)
    assert result.plan.jobs[0].home is None
    assert calls.FITS == {} and result.call_seconds is None


def test_later_plans_take_the_median_of_the_fits_for_their_kind_of_device() -> None:
    calls.FITS["cuda"] = [1e-3, 2e-3, 0.04]
    assert calls.fitted(Hardware(), "cuda").call_seconds == 2e-3, "one run's outlier moves nothing"
    assert calls.fitted(Hardware(), "cpu") == Hardware(), "none fitted for CPU devices"
    assert calls.fitted(Hardware(), None) == Hardware(), "devices of several kinds"
