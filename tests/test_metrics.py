"""The metrics log: one JSON-lines file per run, one record per model per step, evaluations and device samples; and
TensorBoard event files beside it."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch
from torch import nn

import harmony
from harmony.metrics import initial_lr
from tests.conftest import deep_mlp, regression_batches


def test_every_model_and_step_has_one_record_with_its_loss_and_evaluations_carry_the_validation_loss(
    tmp_path: Path, no_leaks: None
) -> None:
    models = [deep_mlp(depth=2, seed=seed) for seed in range(3)]
    batches = regression_batches(samples=8 * 10, batch=8)
    factories = [lambda p, lr=lr: torch.optim.SGD(p, lr=lr) for lr in (0.01, 0.02, 0.03)]
    result = harmony.train(models, batches, nn.functional.mse_loss, factories, devices=2, fuse=False,
                           val_loaders=batches[:2], eval_every=4, names=["x", "y", "z"], log_dir=tmp_path / "logs",
                           progress=False)
    [path] = (tmp_path / "logs").glob("harmony-*.jsonl")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, "the metrics are the user's alone"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [record for record in records if record["kind"] == "step"]
    assert sorted((r["model"], r["step"]) for r in steps) == [(m, s) for m in range(3) for s in range(1, 11)]
    for record in steps:
        model, step = record["model"], record["step"]
        assert record["loss"] == result.history[model][step - 1] and record["name"] == "xyz"[model]
        assert record["lr"] == (0.01, 0.02, 0.03)[model]
        assert record["samples_per_s"] is None or record["samples_per_s"] > 0
        assert ("val_loss" in record) == (step in (4, 8, 10))
        if "val_loss" in record:
            assert record["val_loss"] == dict(result.val_history[model])[step]
    evaluations = [(r["model"], r["step"], r["val_loss"]) for r in records if r["kind"] == "val"]
    assert sorted(evaluations) == sorted((m, s, v) for m in range(3) for s, v in result.val_history[m])
    devices = [record for record in records if record["kind"] == "device"]
    assert {record["device"] for record in devices} == {"cpu-0", "cpu-1"}
    assert all(0 <= record["cached"] <= record["budget"] and 0 <= record["busy"] <= 1 for record in devices)
    assert max(record["bytes_in"] for record in devices) > 0
    pytest.importorskip("tensorboard")
    assert list((tmp_path / "logs" / path.stem).glob("events.out.tfevents.*")), "TensorBoard event files"


def test_the_learning_rate_comes_from_the_optimizer_factory() -> None:
    assert initial_lr(lambda p: torch.optim.Adam(p, lr=3e-4)) == 3e-4
    assert initial_lr(lambda p: 1 / 0) is None


def test_a_clipped_models_records_carry_its_gradient_norm(tmp_path: Path, no_leaks: None) -> None:
    """Each step of a clipped model (swapped, and homed) has the total gradient norm before clipping in its record, as
    in result.grad_norms; a model that is not clipped has none."""
    torch.manual_seed(2)
    models = [deep_mlp(seed=0), deep_mlp(seed=1), nn.Sequential(nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 4))]
    batches = regression_batches(samples=16 * 5, batch=16)
    result = harmony.train(models, batches, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.05),
                           devices=1, device_memory=60_000, fuse=False, clip_grad_norm=[0.05, None, 0.05],
                           log_dir=tmp_path / "logs", progress=False)
    assert result.plan.jobs[0].home is None and result.plan.jobs[2].home is not None
    [path] = (tmp_path / "logs").glob("harmony-*.jsonl")
    steps = [json.loads(line) for line in path.read_text().splitlines() if '"kind": "step"' in line]
    for model in (0, 2):
        logged = [r["grad_norm"] for r in sorted(steps, key=lambda r: r["step"]) if r["model"] == model]
        assert logged == result.grad_norms[model] and len(logged) == 5 and min(logged) > 0.05
    assert result.grad_norms[1] == [] and all("grad_norm" not in r for r in steps if r["model"] == 1)


def test_a_pruned_member_of_an_array_has_no_records_past_its_step_and_one_that_says_it_was_pruned(
    tmp_path: Path, no_leaks: None
) -> None:
    models = [deep_mlp(depth=2, seed=seed) for seed in range(3)]
    batches = regression_batches(samples=8 * 6, batch=8)
    result = harmony.train(models, batches, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.01), fuse=True,
                           val_loaders=batches[:2], eval_every=2, prune=lambda step, standings: [1] * (step == 2),
                           log_dir=tmp_path / "logs", progress=False)
    assert result.arrays == [[0, 1, 2]] and result.pruned == {1: 2}
    [path] = (tmp_path / "logs").glob("harmony-*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["model"], r["step"]) for r in records if r["kind"] == "pruned"] == [(1, 2)]
    for kind, steps in (("step", [1, 2]), ("val", [2])):
        assert sorted(r["step"] for r in records if r["kind"] == kind and r["model"] == 1) == steps
        assert len([r for r in records if r["kind"] == kind and r["model"] == 0]) == (6 if kind == "step" else 3)
