"""Fused sweeps through harmony.train: arrays of the chosen size equal plain PyTorch and the unfused run."""

from __future__ import annotations

import functools
import gc
import itertools
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import harmony
from harmony import fusing, planner, timings
from harmony.runtime.shipping import BatchFiles
from tests.conftest import (
    FlattenedTokens,
    GatedNet,
    TiedEnds,
    assert_same_weights,
    clones,
    deep_mlp,
    param_bytes,
    regression_batches,
    train_plain,
)

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

SWEEP: list[Factory] = [
    lambda p: torch.optim.SGD(p, lr=0.05),
    lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9, weight_decay=1e-3),
    lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.8, nesterov=True),
    lambda p: torch.optim.Adam(p, lr=1e-3),
    lambda p: torch.optim.Adam(p, lr=3e-3, betas=(0.8, 0.99), weight_decay=1e-2),
    lambda p: torch.optim.Adam(p, lr=2e-3, eps=1e-6),
    lambda p: torch.optim.AdamW(p, lr=1e-3),
    lambda p: torch.optim.AdamW(p, lr=4e-3, weight_decay=0.1),
    lambda p: torch.optim.AdamW(p, lr=2e-3, betas=(0.85, 0.995)),
]


def batchnorm_mlp(seed: int, width: int = 32, hidden: int = 48, depth: int = 1) -> nn.Sequential:
    """BatchNorm after the activation: right after a Linear it zeroes the bias gradient, which Adam would turn
    into updates of pure rounding noise (no two correct implementations agree on those)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(width, hidden), nn.ReLU(), nn.BatchNorm1d(hidden),
        *[module for _ in range(depth) for module in (nn.Linear(hidden, hidden), nn.GELU())],
        nn.Linear(hidden, 4),
    )


def flattened_sweep(count: int, width: int = 32) -> tuple[list[nn.Module], list[tuple[torch.Tensor, torch.Tensor]]]:
    """count FlattenedTokens in float64 (torch.fx cannot trace them: cut, they are exported), and three batches of 8
    sequences of 5 tokens."""
    torch.manual_seed(0)
    models = [FlattenedTokens(width=width, blocks=6, outputs=4).double() for _ in range(count)]
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 5, width, generator=generator, dtype=torch.float64),
                torch.randn(8, 5, 4, generator=generator, dtype=torch.float64)) for _ in range(3)]
    return models, batches


def small_cnn(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(6),
        nn.Conv2d(6, 6, 3, stride=2), nn.ReLU(),
        nn.Flatten(), nn.Linear(6 * 3 * 3, 5),
    )


def image_batches(steps: int, batch: int) -> list:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(steps * batch, 3, 8, 8, generator=generator)
    y = torch.randint(0, 5, (steps * batch,), generator=generator)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, steps * batch, batch)]


def check_against_plain(
    result: harmony.TrainResult,
    models: list[nn.Module],
    references: list[nn.Module],
    batches: list,
    loss_fns: list[Callable[..., torch.Tensor]],
    factories: list[Factory],
    epochs: int = 1,
) -> None:
    for index, (reference, loss_fn, factory) in enumerate(zip(references, loss_fns, factories)):
        losses = train_plain(reference, batches, loss_fn, factory, epochs=epochs)
        assert result.models[index] is models[index]
        assert_same_weights(models[index], reference, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(result.history[index]), torch.tensor(losses), rtol=1e-5, atol=1e-6)


def test_a_fused_sweep_matches_plain_pytorch_and_the_unfused_run(no_leaks: None) -> None:
    batches = regression_batches(samples=16 * 6, batch=16)
    runs = {}
    for fuse in (True, False):
        models = [batchnorm_mlp(seed) for seed in range(len(SWEEP))]
        references = clones(models)
        result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=SWEEP, fuse=fuse,
                               devices=["cpu"], device_memory="2MB", progress=False)
        check_against_plain(result, models, references, batches, [nn.functional.mse_loss] * len(SWEEP), SWEEP)
        runs[fuse] = (result, models)
    fused, unfused = runs[True][0], runs[False][0]
    assert [sorted(array) for array in fused.arrays if len(array) > 1] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert all(len(array) == 1 for array in unfused.arrays)
    assert [choice.size for choice in fused.fusion] == [3, 3, 3]
    for a, b in zip(runs[True][1], runs[False][1]):
        assert_same_weights(a, b, rtol=1e-5, atol=1e-6)
    assert fused.stats.tasks < unfused.stats.tasks


class ItemGate(nn.Module):
    """Scales by a Python number read off its weight (.item()): fine alone, impossible batched under vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale * (1.0 if self.scale.item() > 0 else -1.0)


class GatedWhole(nn.Module):
    """A model that is not a chain, an ItemGate inside: it fits whole, and vmap refuses it however it is cut."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.gate, self.out = nn.Linear(32, 16), ItemGate(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(torch.tanh(self.hidden(x))))


def test_a_whole_model_vmap_refuses_however_it_is_cut_trains_unfused_saying_why_and_printing_nothing(
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str], no_leaks: None) -> None:
    """A whole model whose array vmap refuses is cut apart for the array first (harmony.fusing._cut_apart: a model
    with gradient checkpointing fuses so); where its export fails too (.item() on a weight), fuse="auto" trains it
    unfused saying what vmap refused, fuse=True raises that, and the failed export's graph is not printed."""
    batches = regression_batches(samples=16 * 2, batch=16)
    factory = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    with caplog.at_level("WARNING", logger="harmony"):
        result = harmony.train([GatedWhole() for _ in range(2)], batches, loss_fn=nn.functional.mse_loss,
                               optimizer=factory, devices=["cpu"], progress=False)
    assert result.arrays == [[0], [1]]
    assert "trains them unfused, as their array raised RuntimeError: vmap: It looks like you're calling .item()" in \
        caplog.text
    with pytest.raises(harmony.ModelError, match=r"\.item\(\)"):
        harmony.train([GatedWhole() for _ in range(2)], batches, loss_fn=nn.functional.mse_loss, optimizer=factory,
                      devices=["cpu"], fuse=True, progress=False)
    assert "def forward(self" not in capfd.readouterr().err


def test_fuse_true_says_which_models_it_never_fuses_and_why(caplog: pytest.LogCaptureFixture, no_leaks: None
                                                            ) -> None:
    """Models trained in fp16 are never fused (fusing.UNFUSED: each skips its steps by its own loss scale): with
    fuse=True the plan says so for each."""
    models = [nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)) for _ in range(2)]
    x, y = torch.randn(16, 64), torch.randn(16, 4)
    with caplog.at_level("WARNING", logger="harmony"):
        plan = harmony.plan(models, [(x, y)], loss_fn=nn.functional.mse_loss, devices=["cpu"], precision="fp16",
                            fuse=True)
    assert [job.members for job in plan.plan.jobs] == [(0,), (1,)]
    for index in (0, 1):
        assert f"model {index} (Sequential): fuse=True trains it unfused: precision='fp16' skips" in caplog.text


def test_models_whose_layers_cannot_run_as_an_array_train_unfused_under_auto_and_fuse_true_says_why(
    caplog: pytest.LogCaptureFixture, no_leaks: None
) -> None:
    batches = regression_batches(samples=16 * 4, batch=16)

    def gated(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(32, 16), nn.Tanh(), ItemGate(), nn.Linear(16, 4)).double()

    double = [(x.double(), y.double()) for x, y in batches]
    models = [gated(seed) for seed in range(3)]
    references = clones(models)
    factory = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    with caplog.at_level("WARNING", logger="harmony"):
        result = harmony.train(models, double, loss_fn=nn.functional.mse_loss, optimizer=factory, devices=["cpu"],
                               progress=False)
    assert all(len(array) == 1 for array in result.arrays)
    assert "fuse='auto' trains them unfused" in caplog.text
    for model, reference in zip(models, references):
        train_plain(reference, double, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, rtol=1e-12, atol=1e-12)
    with pytest.raises(harmony.ModelError, match="pass fuse=False to train these models unfused"):
        harmony.train([gated(seed) for seed in range(3)], double, loss_fn=nn.functional.mse_loss, optimizer=factory,
                      devices=["cpu"], fuse=True, progress=False)


def test_an_array_that_does_not_fit_is_cut_into_sub_arrays_and_packs_within_budget(no_leaks: None) -> None:
    factories = [(lambda lr: (lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9)))(0.01 * (i + 1)) for i in range(4)]
    models = [deep_mlp(seed=seed) for seed in range(4)]
    references = clones(models)
    budget = 60_000  # an array of two needs 39,000 bytes for its largest layer, an array of four twice that
    batches = regression_batches(samples=16 * 5, batch=16)
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, fuse=True,
                           microbatches=2, devices=["cpu"], device_memory=budget, resident=False, progress=False)
    check_against_plain(result, models, references, batches, [nn.functional.mse_loss] * 4, factories)
    (choice,) = result.fusion
    assert choice.predicted[4] is None, "an array of all four models must not fit this budget"
    assert choice.size == 2
    assert sorted(map(len, result.arrays)) == [2, 2]
    assert any(len(packing.packs) > 1 for packing in result.packings), "the arrays must be swapped pack by pack"
    assert 0 < result.stats.peak_device_bytes["cpu-0"] <= budget


def test_cnns_with_different_losses_fuse_while_other_models_run_beside_them(no_leaks: None) -> None:
    batches = image_batches(steps=5, batch=8)
    cnns = [small_cnn(seed) for seed in range(3)]
    other_architecture = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 5))
    own_loader_cnn = small_cnn(7)
    models = [*cnns, other_architecture, own_loader_cnn]
    references = clones(models)
    loss_fns = [nn.CrossEntropyLoss(), nn.CrossEntropyLoss(label_smoothing=0.1), nn.functional.cross_entropy,
                nn.CrossEntropyLoss(), nn.CrossEntropyLoss()]
    factories: list[Factory] = [(lambda lr: (lambda p: torch.optim.Adam(p, lr=lr)))(1e-3 * (i + 1)) for i in range(5)]
    other_batches = image_batches(steps=5, batch=8)[::-1]
    result = harmony.train(models, [batches, batches, batches, batches, other_batches], loss_fn=loss_fns,
                           optimizer=factories, fuse=True, devices=["cpu", "cpu"], progress=False)
    assert sorted(map(sorted, result.arrays)) == [[0, 1, 2], [3], [4]]
    check_against_plain(result, models[:4], references[:4], batches, loss_fns[:4], factories[:4])
    losses = train_plain(references[4], other_batches, loss_fns[4], factories[4])
    assert_same_weights(models[4], references[4], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(result.history[4]), torch.tensor(losses), rtol=1e-5, atol=1e-6)


def test_fused_dropout_draws_its_own_masks_for_every_member(no_leaks: None) -> None:
    def dropout_mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 4))

    models = [dropout_mlp() for _ in range(3)]
    batches = regression_batches(samples=16 * 4, batch=16)
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.05), devices=["cpu"], fuse=True,
                           progress=False)  # fused whatever the timings say ("auto" chose by timing: flaky here)
    assert result.arrays == [[0, 1, 2]]
    assert len({round(history[0], 6) for history in result.history}) == 3
    assert not torch.equal(models[0][0].weight, models[1][0].weight)


def test_choosing_a_sub_array_size_holds_one_built_array_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every candidate size's array holds a stacked copy of its members' weights: for 8 models, arrays of 2, 4 and
    8 built side by side held 14 model copies; only the best predicted one so far may live on beside the next."""
    alive: list[weakref.ref] = []
    most = []
    build = fusing.build_array

    def counted(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        most.append(sum(ref() is not None for ref in alive))
        array = build(*args, **kwargs)
        alive.append(weakref.ref(array))
        return array

    monkeypatch.setattr(fusing, "build_array", counted)
    models = [batchnorm_mlp(seed) for seed in range(8)]
    plan = harmony.plan(models, regression_batches(samples=16 * 3, batch=16), loss_fn=nn.functional.mse_loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), devices=["cpu"], device_memory="4MB")
    assert sorted(model for array in plan.arrays for model in array) == list(range(8))
    assert len(most) >= 3 and max(most) <= 1, most


def test_a_sub_array_size_whose_trial_array_would_not_fit_the_host_is_not_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trial array stacks a copy of its members' weights beside theirs (docs/performance.md, "Planning a sweep of
    large models"): a size whose trial needs more than the host has free is skipped, and the plan says so."""
    one_model: list[int] = []
    built: list[int] = []
    estimate, build = fusing.trial_bytes, fusing.build_array

    def spied(profile: Any, size: int, samples: int) -> int:
        one_model.append(estimate(profile, 1, samples))
        return estimate(profile, size, samples)

    def counted(members: list[int], *args: Any, **kwargs: Any) -> Any:
        built.append(len(members))
        return build(members, *args, **kwargs)

    monkeypatch.setattr(fusing, "trial_bytes", spied)
    monkeypatch.setattr(fusing, "build_array", counted)
    monkeypatch.setattr(fusing.psutil, "virtual_memory", lambda: SimpleNamespace(available=3 * one_model[-1]))
    models = [batchnorm_mlp(seed) for seed in range(4)]
    plan = harmony.plan(models, regression_batches(samples=16 * 3, batch=16), loss_fn=nn.functional.mse_loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), devices=["cpu"], device_memory="4MB")
    (choice,) = plan.fusion
    assert choice.unbuilt == {4: 4 * one_model[-1]} and choice.predicted[4] is None
    assert choice.predicted[2] is not None and choice.size in (1, 2)
    assert 4 not in built and 2 in built
    assert "4: not tried, its trial array needs" in str(plan)


def test_plan_shows_the_arrays_and_the_sizes_it_compared() -> None:
    models = [batchnorm_mlp(seed) for seed in range(4)]
    batches = regression_batches(samples=16 * 3, batch=16)
    plan = harmony.plan(models, batches, loss_fn=nn.functional.mse_loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), devices=["cpu"], device_memory="4MB")
    text = str(plan)
    assert sorted(model for array in plan.arrays for model in array) == [0, 1, 2, 3]
    assert "4 x Sequential fused as" in text and "sub-array size" in text
    assert "model-steps/s" in text
    unfused = harmony.plan(models, batches, loss_fn=nn.functional.mse_loss,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1), devices=["cpu"], fuse=False)
    assert unfused.arrays == [[0], [1], [2], [3]] and "fused" not in str(unfused)


def test_groups_that_train_beside_each_other_are_each_sized_on_their_share_of_the_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two groups (SGD and Adam) of three alike models on two devices: each group's sizes are predicted on one device,
    its share of the run's compute (as arrays they would each train on their own device); a group alone, on both."""
    devices: list[int] = []
    monkeypatch.setattr(fusing, "_predict", lambda arrays, sizing: devices.append(len(sizing.budgets)) or 0.1)
    models = [batchnorm_mlp(seed) for seed in range(6)]
    optimizers: list[Factory] = [*SWEEP[:3], *SWEEP[3:6]]
    batches = regression_batches(samples=16 * 3, batch=16)
    plan = harmony.plan(models, batches, loss_fn=nn.functional.mse_loss, optimizer=optimizers, devices=2,
                        device_memory="4MB")
    assert [(choice.members, choice.devices, choice.total) for choice in plan.fusion] == [
        ((0, 1, 2), 1, 2), ((3, 4, 5), 1, 2)]
    assert set(devices) == {1} and "on 1 of the 2 devices, its share of the run's compute" in str(plan)
    devices.clear()
    alone = harmony.plan(models[:3], batches, loss_fn=nn.functional.mse_loss, optimizer=optimizers[:3], devices=2,
                         device_memory="4MB")
    assert [(choice.devices, choice.total) for choice in alone.fusion] == [(0, 0)] and set(devices) == {2}
    assert "devices, its share" not in str(alone)
    devices.clear()
    pruned = harmony.plan(models, batches, loss_fn=nn.functional.mse_loss, optimizer=optimizers, devices=2,
                          device_memory="4MB", prune="halving", eval_every=1)
    assert [(choice.devices, choice.total) for choice in pruned.fusion] == [(0, 0), (0, 0)] and set(devices) == {2}, (
        "pruned: the models that stop free their devices for those left, in either group")


def test_a_swapped_arrays_size_is_predicted_with_a_whole_pass_a_task_where_that_is_faster() -> None:
    """Dask's cost per task of 20 ms: an array of two swapped in packs is predicted at a whole pass a task (the plan
    may cut it so, planner.with_tasks), far faster than at a pack a task, which packs_per_task=1 holds it to."""
    hardware = harmony.Hardware("slow tasks", task_overhead=20e-3, shared_cores=True)
    models = [deep_mlp(seed=seed) for seed in range(2)]
    predicted = {}
    for per_task in ("auto", 1):
        plan = harmony.plan(models, regression_batches(samples=16 * 3, batch=16), loss_fn=nn.functional.mse_loss,
                            optimizer=SWEEP[0], devices=1, device_memory=param_bytes(models[0]),
                            hardware=hardware, fuse=2, packs_per_task=per_task)
        assert plan.arrays == [[0, 1]] and len(plan.packings[0].packs) > 3 and plan.plan.jobs[0].home is None
        predicted[per_task] = plan.fusion[0].predicted[2]
    assert predicted["auto"] < predicted[1] / 2, predicted


@pytest.mark.parametrize("budget", ["4MB", "200kB"], ids=["homed", "swapped"])
@pytest.mark.parametrize("prune", [None, "halving", "median", lambda step, standings: []])
def test_a_pruned_sweep_is_fused_by_what_each_size_is_expected_to_compute(
    prune: Any, budget: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Arrays of 4 predicted 2.5x as fast as models alone win unpruned. Halving every step of 12 leaves models alone
    computing a third of their steps (16 of 48 model-steps). An array of 4, homed or swapped, computes its members
    still training alone, each step costing what an array of that many is predicted to (on one device: 1 of 4 a
    model's 0.25 s of the array's 0.4, 2 of 4 an array of two's 0.35): (1 + 0.875 + 10 x 0.625) / 12 of its steps'
    cost, so arrays of 4 still win. A user's pruner stops an unknown number: the sizes are ranked as unpruned. Under
    a built-in pruner the plan also simulates the pruned run: a homed array computing its expected share of its
    steps, here a third of the time; a swapped one paying its tasks' fixed costs every step any member trains (all
    12: its members are every contender), its compute and its rows copied a third of the whole."""
    seconds = {4: 1.0, 2: 0.7, 1: 0.4}  # the group's step by the number of arrays it runs as
    monkeypatch.setattr(fusing, "_predict", lambda arrays, sizing: seconds[len(arrays)])
    models = [batchnorm_mlp(seed) for seed in range(4)]
    plan = harmony.plan(models, regression_batches(samples=16 * 12, batch=16), loss_fn=nn.functional.mse_loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), devices=["cpu"], device_memory=budget,
                        prune=prune, eval_every=1)
    (choice,) = plan.fusion
    if prune not in ("halving", "median"):
        assert choice.size == 4 and plan.arrays == [[0, 1, 2, 3]] and not choice.shares
        assert plan.computed is None and "computed under" not in str(plan)
        assert plan.pruned_seconds is None and "stopping models" not in str(plan)
        return
    if budget == "4MB":  # every model computes a third of its steps, each of them as long as any other
        assert plan.pruned_seconds == pytest.approx(plan.total_seconds / 3, rel=0.01)
    else:  # 12 steps of task costs as before, a third of the compute and of the bytes moved
        assert plan.total_seconds / 2 < plan.pruned_seconds < plan.total_seconds
    assert f"s with prune={prune!r} stopping models" in str(plan)
    assert choice.size == 4 and plan.arrays == [[0, 1, 2, 3]] and bool(plan.plan.homes) == (budget == "4MB")
    assert choice.shares[1] == 16 / 48 and choice.shares[4] == pytest.approx((1 + 0.875 + 10 * 0.625) / 12)
    assert "computing 68% of its steps" in str(plan)
    assert plan.computed == 16 / 48 and f"about 33% of them computed under prune={prune!r}" in str(plan)


def test_resident_arrays_run_several_steps_per_task_and_still_match_plain_pytorch(no_leaks: None) -> None:
    factories: list[Factory] = [(lambda lr: (lambda p: torch.optim.Adam(p, lr=lr)))(1e-3 * (i + 1)) for i in range(4)]
    batches = regression_batches(samples=16 * 30, batch=16)
    for steps_per_task, spans in ((8, 4), ("auto", None)):
        models = [deep_mlp(depth=2, seed=seed) for seed in range(4)]
        references = clones(models)
        result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories,
                               steps_per_task=steps_per_task, devices=["cpu"], fuse=True, progress=False)
        assert result.arrays == [[0, 1, 2, 3]] and result.homes == dict.fromkeys(range(4), "cpu-0")
        assert result.stats.steps == [30] * 4
        if spans is not None:
            assert result.stats.tasks == spans, "8 + 8 + 8 + 6 steps: one bwd task per span, the updates in it"
            assert result.stats.steps_per_task == [8] * 4
            assert sorted(result.stats.schedule["cpu-0"])[0].startswith("bwd-m0-p0-s0-")
            times = result.stats.step_seconds[2]
            assert len(times) == 30 and times == sorted(times) and times[-1] == result.stats.finish_seconds[2]
            assert [len(set(times[i : i + 8])) for i in range(0, 30, 8)] == [1, 1, 1, 1] and len(set(times)) == 4
            assert result.stats.steady_seconds_per_step(2) == pytest.approx((times[-1] - times[7]) / 22)
        else:
            depth = result.stats.steps_per_task[0]
            assert 0 < result.stats.task_seconds < 1.0, "the task cost is measured on the cluster"
            assert result.stats.steps_per_task == [depth] * 4 and depth > 1, "tiny resident steps are grouped"
            assert result.stats.tasks == -(-30 // depth), "one bwd task per span of depth steps"
        check_against_plain(result, models, references, batches, [nn.functional.mse_loss] * 4, factories)


def test_auto_steps_per_task_re_cuts_the_later_spans_from_the_measured_step_time(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The predicted step time gave 2 steps per task (standing in for a prediction far off); the first spans'
    measured tiny steps give the cap, a quarter of the run, to every span opened after the first finished."""
    monkeypatch.setattr(planner, "steps_per_task", lambda *args: 2)
    factories: list[Factory] = [functools.partial(torch.optim.SGD, lr=0.05 * (i + 1), momentum=0.9) for i in range(3)]
    batches = regression_batches(samples=16 * 30, batch=16)
    models = [deep_mlp(depth=2, seed=seed) for seed in range(3)]
    references = clones(models)
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, devices=["cpu"],
                           progress=False)
    assert result.arrays == [[0, 1, 2]] and result.stats.steps == [30] * 3
    times = result.stats.step_seconds[0]
    spans = [len(list(group)) for _, group in itertools.groupby(times)]
    assert spans == [2, 2, 7, 7, 7, 5], "two spans opened before any finished, then 30 // 4 steps per task"
    assert result.stats.steps_per_task == [7] * 3 and result.stats.tasks == 6
    check_against_plain(result, models, references, batches, [nn.functional.mse_loss] * 3, factories)


def test_a_span_holding_an_epochs_short_last_batch_still_matches_plain_pytorch(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spans of equal batches ship stacked; the span with the short last batch of each epoch ships step by step."""
    shipped: list[int] = []
    ship_steps = BatchFiles.ship_steps

    def recording(files: BatchFiles, steps: list[Any]) -> Any:
        value = ship_steps(files, steps)
        shipped.append(value.stacked_steps)
        return value

    monkeypatch.setattr(BatchFiles, "ship_steps", recording)
    factories: list[Factory] = [functools.partial(torch.optim.SGD, lr=0.05 * (i + 1), momentum=0.9) for i in range(3)]
    batches = regression_batches(samples=16 * 9 + 5, batch=16)
    models = [deep_mlp(depth=2, seed=seed) for seed in range(3)]
    references = clones(models)
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, epochs=2,
                           steps_per_task=4, devices=["cpu"], progress=False)
    assert result.arrays == [[0, 1, 2]] and result.stats.steps == [20] * 3
    assert result.stats.tasks == 5, "spans of steps 0-3, 4-7, 8-11 (the short batch 9), 12-15, 16-19 (19)"
    assert shipped == [4, 4, 4, 4, 0, 0, 4, 4, 0, 0], "inputs and targets per span; spans with batch 9 or 19 not"
    check_against_plain(result, models, references, batches, [nn.functional.mse_loss] * 3, factories, epochs=2)


class TokenClassifier(nn.Module):
    """Embedding, a transformer encoder layer (attention, LayerNorm, GELU, dropout off) and a linear head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(20, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation="gelu", batch_first=True)
        self.pool = nn.Flatten()
        self.head = nn.Linear(16 * 6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.block(self.embed(tokens))))


def test_fused_transformers_match_plain_pytorch(no_leaks: None) -> None:
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 20, (8 * 4, 6), generator=generator)
    labels = torch.randint(0, 3, (8 * 4,), generator=generator)
    batches = [(tokens[i : i + 8], labels[i : i + 8]) for i in range(0, len(tokens), 8)]
    models = [TokenClassifier(seed) for seed in range(3)]
    references = clones(models)
    # SGD: attention's key bias has an exactly-zero gradient, whose rounding noise Adam would scale up to full steps
    factories: list[Factory] = [functools.partial(torch.optim.SGD, lr=0.05 * (i + 1), momentum=0.9) for i in range(3)]
    result = harmony.train(models, batches, loss_fn=nn.functional.cross_entropy, optimizer=factories, fuse=True,
                           devices=["cpu"], progress=False)
    assert result.arrays == [[0, 1, 2]]
    check_against_plain(result, models, references, batches, [nn.functional.cross_entropy] * 3, factories)


@pytest.mark.parametrize("mode", ["vdp", "vpp"])
def test_swapped_arrays_in_both_harmony_modes_match_plain_pytorch(mode: str, no_leaks: None) -> None:
    models = [deep_mlp(depth=4, seed=seed) for seed in range(4)]
    references = clones(models)
    factories: list[Factory] = [functools.partial(torch.optim.Adam, lr=1e-3 * (i + 1)) for i in range(4)]
    batches = regression_batches(samples=16 * 5, batch=16)
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, microbatches=4,
                           devices=["cpu", "cpu"], device_memory=60_000, fuse=True, mode=mode, progress=False)
    assert result.mode == mode and sorted(map(len, result.arrays)) == [2, 2]
    assert all(len(packing.packs) > 1 for packing in result.packings)
    assert max(result.stats.peak_device_bytes.values()) <= 60_000
    check_against_plain(result, models, references, batches, [nn.functional.mse_loss] * 4, factories)


def test_a_resident_array_of_members_with_a_merged_optimizer_matches_plain_pytorch(no_leaks: None) -> None:
    """RMSprop has no stacked form: the members' optimizers are merged into one over views of the stacks, and
    the array keeps a gradient buffer for those views, over multi-step tasks and micro-batches."""
    factories: list[Factory] = [
        lambda p: torch.optim.RMSprop(p, lr=1e-3),
        lambda p: torch.optim.RMSprop(p, lr=3e-3, momentum=0.5),
        lambda p: torch.optim.RMSprop(p, lr=2e-3, alpha=0.9, weight_decay=0.01),
    ]
    batches = regression_batches(samples=16 * 8, batch=16)
    models = [deep_mlp(depth=2, seed=seed) for seed in range(3)]
    references = clones(models)
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, fuse=True,
                           microbatches=2, steps_per_task=3, devices=["cpu"], progress=False)
    assert result.arrays == [[0, 1, 2]] and set(result.homes) == {0, 1, 2}
    check_against_plain(result, models, references, batches, [nn.functional.mse_loss] * 3, factories)


def test_swapped_arrays_of_traced_models_carry_several_tensors_across_their_cuts(no_leaks: None) -> None:
    """Every block of a GatedNet reads a gate computed once from the input, so two values cross each cut between
    blocks: fused into an array, in packs on two devices of the array's weights' bytes each (beside its gradients,
    Adam's state and each residual block's LayerNorm, ReLU and product, kept for their backward), in float64, the
    members equal plain PyTorch within 1e-9."""
    torch.manual_seed(0)
    models = [GatedNet(width=64, blocks=6).double() for _ in range(2)]
    references = clones(models)
    factories: list[Factory] = [functools.partial(torch.optim.Adam, lr=1e-3 * (i + 1)) for i in range(2)]
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * 4, batch=16, width=64, out=2)]
    budget = 2 * param_bytes(models[0])
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, fuse=2,
                           devices=["cpu", "cpu"], device_memory=budget, progress=False)
    assert result.arrays == [[0, 1]] and len(result.packings[0].packs) >= 3
    assert max(result.stats.peak_device_bytes.values()) <= budget
    for model, reference, factory in zip(models, references, factories):
        losses = train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, rtol=0, atol=1e-9)
    assert result.history[1] == pytest.approx(losses, abs=1e-9)


class Heads(nn.Module):
    """A pre-norm attention block that takes its sizes from its input, as a GPT's does, and an MLP: cut into its
    children, the sizes (Python ints) cross the cuts beside the activations."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, 4, width // 4).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(torch.relu(self.up(x)))


def test_arrays_of_traced_models_carry_sizes_across_their_cuts(no_leaks: None) -> None:
    """Attention blocks cut into their children (a block's weights do not fit the budget) pass their sizes (ints)
    from stage to stage: fused into an array of two (vmap gives the ints to every member, and they pass out beside
    the stacked tensors), swapped in packs, in float64, the members equal plain PyTorch within 1e-9 (an array of them
    raised in its pilot before)."""
    torch.manual_seed(0)
    models = [nn.Sequential(*(Heads(64) for _ in range(2)), nn.Flatten(), nn.Linear(64 * 4, 2)).double()
              for _ in range(2)]
    references = clones(models)
    factories: list[Factory] = [functools.partial(torch.optim.Adam, lr=1e-3 * (i + 1)) for i in range(2)]
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 4, 64, generator=generator, dtype=torch.float64),
                torch.randn(2, 2, generator=generator, dtype=torch.float64)) for _ in range(4)]
    block = param_bytes(models[0][0])
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, fuse=2,
                           devices=["cpu"], device_memory=3 * block, progress=False)
    assert result.arrays == [[0, 1]] and len(result.packings[0].packs) >= 3
    for model, reference, factory in zip(models, references, factories):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, rtol=0, atol=1e-9)


def test_members_too_coarse_for_their_array_are_cut_again_for_their_share_of_the_budget(no_leaks: None) -> None:
    """Two FlattenedTokens (torch.fx cannot trace them) under six times one's weight bytes: each fits whole, one
    layer, and an array of two such layers does not fit. Cut again for half the budget (exported, at their blocks),
    they fuse into an array swapped in packs within the budget; in float64 with Adam at two rates, the members equal
    plain PyTorch within 1e-9 (they trained unfused before)."""
    models, batches = flattened_sweep(2)
    references = clones(models)
    factories: list[Factory] = [functools.partial(torch.optim.Adam, lr=1e-3 * (i + 1)) for i in range(2)]
    budget = 6 * param_bytes(models[0])
    alone = harmony.plan(models[0], batches, loss_fn=nn.functional.mse_loss, devices=["cpu"], device_memory=budget,
                         resident=False)
    assert len(alone.plan.jobs[0].packing.packs) == 1, "one model fits whole"
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, fuse=True,
                           devices=["cpu"], device_memory=budget, resident=False, progress=False)
    assert result.arrays == [[0, 1]] and len(result.packings[0].packs) >= 2
    assert max(result.stats.peak_device_bytes.values()) <= budget
    for model, reference, factory in zip(models, references, factories):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, rtol=0, atol=1e-9)


def test_a_member_is_cut_again_once_a_budget_and_never_under_a_budget_it_could_not_be_cut_for(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each cut pilots the model again: sizing eight FlattenedTokens under four
    times one's weights, fuse="auto" cuts members for arrays of two, four and eight, each member once a budget, and
    once the first member could not be cut for an array's share, no larger array is tried on it."""
    calls: list[tuple[int, int, str]] = []
    piloted = planner._piloted

    def spy(args: Any, index: int, budget: int, made: Any = None, finer: bool = False) -> Any:
        try:
            result = piloted(args, index, budget, made, finer)
        except harmony.BudgetTooSmall:
            calls.append((index, budget, "too small"))
            raise
        if finer:
            calls.append((index, budget, "cut"))
        return result

    monkeypatch.setattr(planner, "_piloted", spy)
    models, batches = flattened_sweep(8)
    budget = 4 * param_bytes(models[0])
    forecast = harmony.plan(models, batches, loss_fn=nn.functional.mse_loss, devices=["cpu"], device_memory=budget,
                            resident=False)
    assert len(calls) == len(set(calls)), calls
    failed = [(index, share) for index, share, outcome in calls if outcome == "too small"]
    assert failed, "an array's share too small to cut a member for (else the test shows nothing)"
    assert not [call for call in calls for index, share in failed if call[0] == index and call[1] < share]
    assert forecast.fusion[0].predicted[2] is not None, "arrays of two, of members cut again, were predicted"


def test_an_array_whose_stacked_weights_alone_outgrow_the_budget_is_not_piloted_and_the_plan_is_the_same(
    monkeypatch: pytest.MonkeyPatch, steady_pilot: None
) -> None:
    """Two FlattenedTokens each fit four times one's weights whole, and an array of two whole ones holds more in its
    stacked parameters and their gradients alone: fuse=2 cuts the members again for their share of the budget
    without piloting that array first (fusing._outgrows), and plans what piloting it first plans."""
    stacked: list[tuple[tuple[int, ...], int]] = []
    build = fusing._stacked

    def recorded(members: list[int], parts: list[Any], *args: Any) -> Any:
        stacked.append((tuple(members), len(parts[0].code.layers)))
        return build(members, parts, *args)

    monkeypatch.setattr(fusing, "_stacked", recorded)
    models, batches = flattened_sweep(2, width=64)
    alone = harmony.plan(models[0], batches, loss_fn=nn.functional.mse_loss, devices=["cpu"],
                         device_memory=4 * param_bytes(models[0]), resident=False)
    assert len(alone.plan.jobs[0].packing.packs[0].weights) == len(list(models[0].parameters())), "fits whole"
    plans = []
    for outgrows in (fusing._outgrows, lambda parts, budget: False):
        monkeypatch.setattr(fusing, "_outgrows", outgrows)
        timings.forget()
        stacked.clear()
        forecast = harmony.plan(models, batches, loss_fn=nn.functional.mse_loss, devices=["cpu"], fuse=2,
                                device_memory=4 * param_bytes(models[0]), resident=False)
        cuts = [[(pack.first, pack.stop, pack.weights) for pack in job.packing.packs] for job in forecast.plan.jobs]
        plans.append((forecast.arrays, cuts, sorted(set(stacked))))
    assert plans[0][0] == [[0, 1]] and plans[0][:2] == plans[1][:2]
    assert all(layers > 1 for _, layers in plans[0][2]), "no array of whole models piloted"
    assert ((0, 1), 1) in plans[1][2], "piloted first where it was not told apart"


def test_arrays_of_exported_members_cut_alike_take_the_first_arrays_profile_and_plan_as_measured(
    monkeypatch: pytest.MonkeyPatch, steady_pilot: None
) -> None:
    """Six FlattenedTokens under three times one's weights are exported and cut; in arrays of two, the first array
    is piloted and the other two take its profile (their stages' sizes fixed by their inputs' shapes), measuring
    nothing: their packs, bytes and costs are what measuring each plans. The planning keeps the first array's profile,
    not its stacked copies of its members' weights."""
    from harmony.runtime.array import ArrayLayer
    from harmony.runtime.stages import sized_by_shapes
    from harmony.validate import Arguments

    given: list[bool] = []
    piloted, planned = fusing.decompose, Arguments.planned
    kept: list[nn.Module] = []  # what the first planning's cuts held when it was over
    monkeypatch.setattr(fusing, "decompose", lambda *args, **kwargs: given.append(kwargs.get("alike") is not None)
                        or piloted(*args, **kwargs))

    def over(self: Arguments) -> None:
        if not kept:
            kept.extend(layer for cut in self.cuts.values() for layer in cut.layers)
        planned(self)

    monkeypatch.setattr(Arguments, "planned", over)
    models, batches = flattened_sweep(6)
    plans = []
    for sized in (sized_by_shapes, lambda layers: False):
        monkeypatch.setattr(fusing, "sized_by_shapes", sized)
        timings.forget()
        given.clear()
        forecast = harmony.plan(models, batches, loss_fn=nn.functional.mse_loss, devices=["cpu"], fuse=2,
                                device_memory=3 * param_bytes(models[0]), resident=False)
        packs = [[(pack.first, pack.stop, pack.weights, pack.cost, pack.transient, pack.input_bytes_per_sample)
                  for pack in job.packing.packs] for job in forecast.plan.jobs]
        plans.append((forecast.arrays, packs, list(given)))
    assert plans[0][0] == [[0, 1], [2, 3], [4, 5]] and len(plans[0][1][0]) > 1
    assert plans[0][2] == [False, True, True] and plans[1][2] == [False, False, False]
    assert plans[0][:2] == plans[1][:2]
    assert kept and not any(isinstance(layer, ArrayLayer) for layer in kept), "no array's stacks kept for the next"


@pytest.mark.parametrize("budget", [2.5, 4.5], ids=["does not fit", "fits without prefetching"])
def test_a_warm_plan_does_not_build_again_a_trial_array_that_had_no_room_at_its_budget(
    budget: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two chains of Linears (no finer cut) whose array of two does not fit the budget (2.5x one's weights), or fits
    it only without room to prefetch where each alone prefetches (4.5x): the first plan builds the trial array (and
    tries its members cut again); the next plan at that budget, from the kept timings, builds nothing and plans the
    same, unfused (it built the array, and piloted the members again, every call before)."""
    builds: list[list[int]] = []
    build = fusing.build_array

    def recorded(members: list[int], *args: Any, **kwargs: Any) -> Any:
        builds.append(list(members))
        return build(members, *args, **kwargs)

    monkeypatch.setattr(fusing, "build_array", recorded)
    models = []
    for seed in range(2):
        torch.manual_seed(seed)
        models.append(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                    nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 4)))
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 64, generator=generator), torch.randn(16, 4, generator=generator)) for _ in range(3)]
    plans = []
    for _ in range(2):
        builds.clear()
        forecast = harmony.plan(models, batches, loss_fn=nn.functional.mse_loss, devices=["cpu"],
                                device_memory=int(budget * param_bytes(models[0])), resident=False)
        plans.append((forecast.arrays, [job.packing for job in forecast.plan.jobs], list(builds)))
    assert plans[0][2] == [[0, 1]] and plans[1][2] == [], "built the first time only"
    assert plans[0][:2] == plans[1][:2] and plans[0][0] == [[0], [1]]


@pytest.mark.parametrize("budget", [None, 2.5], ids=["homed", "swapped"])
def test_models_with_tied_weights_fuse_and_keep_their_ties(budget: float | None, no_leaks: None) -> None:
    """TiedEnds' last linear layer reads its first one's weight: fused into an array of two, the first layer's stack is
    the last's (one stack, stepped once with both uses' gradients), homed, or swapped in packs that the tie spans (the
    first's pack holds it, the last's borrows it); in float64 the members equal plain PyTorch within 1e-9 and keep
    their ties. Tied models were never fused before."""
    models = [TiedEnds().double() for _ in range(2)]
    with torch.no_grad():
        for parameter in models[1].parameters():
            parameter.add_(0.01)
    references = clones(models)
    factories: list[Factory] = [functools.partial(torch.optim.Adam, lr=1e-3 * (i + 1)) for i in range(2)]
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * 4, batch=16)]
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, fuse=2,
                           devices=["cpu"], device_memory=budget and int(budget * param_bytes(models[0])),
                           progress=False)
    assert result.arrays == [[0, 1]] and (result.plan.jobs[0].home is None) == (budget is not None)
    assert budget is None or len(result.packings[0].packs) > 2
    for model, reference, factory in zip(models, references, factories):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert model.first.weight is model.last.weight
        assert_same_weights(model, reference, rtol=0, atol=1e-9)


def test_a_pruned_swapped_array_of_tied_models_computes_its_live_members_rows_of_the_shared_stack(
        no_leaks: None) -> None:
    """Four TiedEnds (SGD at four rates) in two arrays of two, swapped in packs the tie spans, halved every two steps:
    the packs that borrow the tied stack compute the live members' rows of it as the holder does (runtime.rows), and
    each member equals plain PyTorch over the steps it trained within 1e-9."""
    models = [TiedEnds().double() for _ in range(4)]
    with torch.no_grad():
        for index, model in enumerate(models):
            for parameter in model.parameters():
                parameter.add_(0.01 * index)
    references = clones(models)
    factories: list[Factory] = [functools.partial(torch.optim.SGD, lr=1e-2 * (i + 1)) for i in range(4)]
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * 8, batch=16)]
    validation = [(x.double(), y.double()) for x, y in regression_batches(samples=32, batch=16, seed=5)]
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, fuse=4,
                           devices=["cpu"], device_memory=4 * param_bytes(models[0]), val_loaders=validation,
                           eval_every=2, prune="halving", progress=False)
    assert len(result.arrays) == 2 and all(len(packing.packs) > 2 for packing in result.packings)
    assert sorted(result.stats.steps) == [2, 2, 4, 8]
    for model, reference, factory, steps in zip(models, references, factories, result.stats.steps):
        train_plain(reference, batches[:steps], nn.functional.mse_loss, factory)
        assert model.first.weight is model.last.weight
        assert_same_weights(model, reference, rtol=0, atol=1e-9)


def test_an_embedding_and_the_head_tied_to_it_fuse_through_one_stack_run_by_vmap() -> None:
    """An embedding's stack is laid out as its members' weights, a linear layer's transposed: tied, both run through
    vmap and read one stack, whose gradient takes both uses' (each member's its own)."""
    torch.manual_seed(0)

    def chain() -> tuple[nn.Module, ...]:
        embedding, head = nn.Embedding(10, 6), nn.Linear(6, 10, bias=False)
        head.weight = embedding.weight
        return embedding, nn.Tanh(), head

    members = [chain() for _ in range(2)]
    layers = fusing._array_layers(members)
    assert [layer.kind for layer in layers] == ["vmap", "elementwise", "vmap"], "the head not run as linear"
    [stack] = list(layers[0].parameters())
    assert list(layers[2].parameters()) == [stack], "one stack"
    ids = torch.randint(0, 10, (4, 3))
    out = nn.Sequential(*layers)(ids)
    out.pow(2).sum().backward()
    assert stack.grad is not None
    for index, (embedding, tanh, head) in enumerate(members):
        expected = head(tanh(embedding(ids)))
        expected.pow(2).sum().backward()
        torch.testing.assert_close(out[index], expected)
        torch.testing.assert_close(stack.grad[index], embedding.weight.grad)


def test_a_fused_pair_of_hugging_face_gpt2s_keeps_the_head_tied_to_the_embedding(no_leaks: None) -> None:
    """GPT-2 ties its head to its token embedding inside its traced stages: two of them (AdamW at two rates) fused into
    an array of two on one device, in float64, equal plain PyTorch micro-batched the same way within 1e-9 and keep
    the tie."""
    transformers = pytest.importorskip("transformers")

    class LanguageModel(nn.Module):
        def __init__(self, seed: int) -> None:
            super().__init__()
            torch.manual_seed(seed)
            config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16,
                                             attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, bos_token_id=0,
                                             eos_token_id=0)
            self.gpt = transformers.GPT2LMHeadModel(config)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.gpt(input_ids=ids).logits

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))

    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (4, 16), generator=generator), torch.randint(0, 64, (4, 16), generator=generator))
               for _ in range(3)]
    models = [LanguageModel(seed).double() for seed in range(2)]
    references = clones(models)
    factories: list[Factory] = [functools.partial(torch.optim.AdamW, lr=1e-3 * (i + 1)) for i in range(2)]
    result = harmony.train(models, batches, loss_fn=loss, optimizer=factories, fuse=2, devices=["cpu"],
                           microbatches=2, progress=False)
    assert result.arrays == [[0, 1]]
    for model, reference, factory in zip(models, references, factories):
        optimizer = factory(reference.parameters())
        for x, y in batches:
            optimizer.zero_grad()
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                (loss(reference(xs), ys) / 2).backward()
            optimizer.step()
        assert model.gpt.lm_head.weight is model.gpt.transformer.wte.weight
        assert_same_weights(model, reference, rtol=0, atol=1e-9)


def test_arrays_dealt_out_in_turn_take_the_timings_of_the_trial_array_of_their_size(
    monkeypatch: pytest.MonkeyPatch, timed_calls: list[int],
) -> None:
    """Pruned, the arrays [0, 2] and [1, 3] are not the trial array [0, 1] that chose their size: they are built
    with its timings, not piloted again. The trial array itself is timed through its chain alone, its layers
    taking their member's shares: only the first model's layers are timed one by one."""
    calls: list[tuple[list[int], bool]] = []
    build = fusing.build_array

    def recorded(members: list[int], *args: Any) -> Any:
        calls.append((list(members), len(args) > 3 and args[3] is not None))
        return build(members, *args)

    monkeypatch.setattr(fusing, "build_array", recorded)
    models = [batchnorm_mlp(seed) for seed in range(4)]
    plan = harmony.plan(models, regression_batches(samples=16 * 12, batch=16), loss_fn=nn.functional.mse_loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), devices=["cpu"], fuse=2, prune="halving",
                        eval_every=4)
    assert plan.arrays == [[0, 2], [1, 3]]
    assert calls == [([0, 1], False), ([0, 2], True), ([1, 3], True)]
    layers = timed_calls.count(7)
    assert layers > 1 and timed_calls == [7] * layers + [1] * (len(timed_calls) - layers), timed_calls
    updates = {sum(pack.update_seconds for pack in job.packing.packs) for job in plan.plan.jobs}
    assert len(updates) == 1 and updates.pop() > 0, "their update timed on the trial array's stacked optimizer"
