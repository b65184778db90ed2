"""The run's plan: one frozen value, built once from validated arguments, that round-trips through msgpack."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from harmony.planner import build, pilot
from harmony.tasks.hardware import Hardware
from harmony.tasks.runplan import Job, Options, RunPlan
from harmony.validate import validate
from tests.conftest import deep_mlp, regression_batches


def small_sweep_plan(**options: object) -> RunPlan:
    models = [deep_mlp(depth=3, seed=s) for s in range(3)] + [deep_mlp(depth=6, seed=9)]
    args = validate(models, regression_batches(64, 16), nn.functional.mse_loss,
                    lambda p: torch.optim.Adam(p, lr=1e-3), Options(microbatches=2, **options),  # type: ignore[arg-type]
                    ["cpu", "cpu"], 150_000)
    budgets = {"cpu-0": 150_000, "cpu-1": 150_000}
    candidates = pilot(args, 150_000)
    plan, codes = build(args, candidates, budgets, Hardware(host_link=5e9))
    assert len(codes) == len(plan.jobs)
    return plan


def test_a_plan_round_trips_through_msgpack_exactly() -> None:
    plan = small_sweep_plan()
    assert sorted(model for job in plan.jobs for model in job.members) == [0, 1, 2, 3]
    assert plan.fusion, "the three same models were considered for fusion"
    again = RunPlan.from_msgpack(plan.to_msgpack())
    assert again == plan
    assert again.jobs[0].packing.packs[0].weights == plan.jobs[0].packing.packs[0].weights


def test_a_plan_is_frozen_and_its_decisions_are_new_values() -> None:
    plan = small_sweep_plan(fuse=False, steps_per_task=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mode = "vpp"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.jobs[0].home = None  # type: ignore[misc]
    homed = [job for job in plan.jobs if job.home is not None]
    assert homed and all(job.depth == 3 for job in homed if len(job.packing.packs) == 1)
    assert plan.homes == {index: job.home for index, job in enumerate(plan.jobs) if job.home is not None}
    assert plan.job_of(3) == 3 and plan.devices == {"cpu-0": 150_000, "cpu-1": 150_000}


def test_bytes_that_are_not_a_plan_are_refused() -> None:
    import msgpack

    with pytest.raises(ValueError, match="run's plan"):
        RunPlan.from_msgpack(msgpack.packb({"jobs": []}))


def test_a_bf16_model_is_cut_for_halved_copies_and_a_homed_job_holds_float32() -> None:
    def job_at(precision: str) -> Job:
        args = validate([deep_mlp(depth=6, seed=0)], regression_batches(64, 16), nn.functional.mse_loss,
                        lambda p: torch.optim.Adam(p, lr=1e-3), Options(microbatches=2, precision=precision),  # type: ignore[arg-type]
                        ["cpu"], 30_000)
        return pilot(args, 30_000)[0].job

    job, float32 = job_at("bf16"), job_at("fp32")
    assert job.packing.prefetch and float32.packing.prefetch and job.home is None
    assert 1 < len(job.packing.packs) < len(float32.packing.packs)
    assert job.device_packing == job.packing
    for index, pack in enumerate(job.packing.packs):
        halved = sum(spec.nbytes for spec in pack.weights if spec.name in job.halved(index))
        assert halved == pack.float_bytes == 2 * pack.cost.weights, "an MLP's weights are all linears'"
        assert pack.cost.total <= 30_000
    homed = dataclasses.replace(job, home="cpu-0")
    for pack, held in zip(job.packing.packs, homed.device_packing.packs, strict=True):
        assert held.cost.weights == pack.float_bytes and held.cost.grads == pack.cost.grads


def test_a_narrowed_job_shrinks_its_compute_and_the_rows_it_moves_but_not_a_device_updated_packs_stacks() -> None:
    job = next(job for job in small_sweep_plan(fuse=True).jobs if job.fused)
    job = dataclasses.replace(job, device_updates=(0,))
    half = job.narrowed(0.5)
    assert half.step_seconds == 0.5 * job.step_seconds and half.members == job.members
    for pack, whole in zip(half.packing.packs, job.packing.packs, strict=True):
        assert pack.forward_seconds_per_sample == 0.5 * whole.forward_seconds_per_sample
        assert pack.input_bytes_per_sample == 0.5 * whole.input_bytes_per_sample
        moved = (whole.cost.weights, whole.cost.grads) if pack.index == 0 else (
            round(whole.cost.weights / 2), round(whole.cost.grads / 2))
        assert (pack.cost.weights, pack.cost.grads) == moved
    assert job.narrowed(1.0) == job
