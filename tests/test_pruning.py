"""Pruning a sweep (prune=): the built-in pruners' choices, and through harmony.train the weights, histories and
validation figures of the models stopped and of those left, against plain PyTorch loops that stop the same models
at the same steps, for homed, swapped and fused models; a user's pruner; bad arguments."""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import harmony
from harmony.errors import InputError, ModelError
from harmony.tasks.pruning import Pruner, Standing, computed_share, halving, live_members, median
from tests.conftest import assert_same_weights, clones, deep_mlp, param_bytes, regression_batches, sum_batches

EVERY = 2
STEPS = 7
RATES = (0.002, 0.05, 0.0005, 0.02)  # four learning rates: their validation losses part early


def standings(*losses: float) -> list[Standing]:
    return [Standing(index, f"model {index}", loss) for index, loss in enumerate(losses)]


def test_halving_stops_the_worse_half_and_never_the_last_model() -> None:
    assert sorted(halving(2, standings(0.5, 0.1, 0.9, 0.3))) == [0, 2]
    assert sorted(halving(2, standings(0.5, 0.1, 0.9))) == [2], "three: one stops, two go on"
    assert halving(2, standings(0.5)) == []
    assert sorted(halving(2, standings(math.nan, 0.1, 0.2, math.inf))) == [0, 3], "a loss not finite ranks last"
    assert halving(2, standings(0.5, 0.5)) == [1], "equal losses: the later model stops"


def test_the_median_rule_stops_the_models_worse_than_the_median() -> None:
    assert sorted(median(2, standings(0.5, 0.1, 0.9, 0.3))) == [0, 2]
    assert median(2, standings(0.5, 0.1, 0.9)) == [2], "the median model itself goes on"
    assert median(2, standings(0.2, math.nan, 0.4)) == [1, 2]
    assert median(2, standings(0.5, 0.5)) == []


@pytest.mark.parametrize("pruner", [halving, median])
@pytest.mark.parametrize("sizes", [[1] * 6, [3, 3], [2, 2, 2], [4, 2], [6]])
def test_the_share_fusion_expects_to_compute_is_the_average_over_every_order_the_models_could_finish_in(
    pruner: Pruner, sizes: list[int],
) -> None:
    """Every ranking of six models equally likely, each pruning step run by the real pruner: the mean share of the
    arrays' steps computed is what computed_share predicts, for arrays that compute while any member trains and for
    narrowed ones, whose step costs what their members still training cost (in proportion to them, or not)."""
    steps, every = 11, 2
    arrays = [set(range(a, b)) for a, b in itertools.pairwise(itertools.accumulate([0, *sizes]))]
    def concave(live: int, size: int) -> float:
        return (live / size) ** 0.5

    computed = narrowed = bent = 0.0
    orders = list(itertools.permutations(range(6)))
    for order in orders:
        training = set(range(6))
        for step in range(1, steps + 1):
            computed += sum(bool(training & array) for array in arrays)
            narrowed += sum(len(training & array) / len(array) for array in arrays)
            bent += sum(concave(len(training & array), len(array)) for array in arrays)
            if step % every == 0 and step < steps:
                losses = {model: float(order.index(model)) for model in training}
                training -= set(pruner(step, [Standing(m, f"model {m}", loss) for m, loss in losses.items()]))
    expected = computed / (len(orders) * steps * len(sizes))
    assert computed_share(sizes, 6, steps, every) == pytest.approx(expected, rel=1e-12)
    expected = narrowed / (len(orders) * steps * len(sizes))
    assert computed_share(sizes, 6, steps, every, live_members) == pytest.approx(expected, rel=1e-12)
    expected = bent / (len(orders) * steps * len(sizes))
    assert computed_share(sizes, 6, steps, every, concave) == pytest.approx(expected, rel=1e-12)
    assert computed_share([1] * 8, 8, 48, 8) == 136 / 384, "benchmarks/pruning.py's grid"


def sgd(lr: float) -> Callable[..., torch.optim.Optimizer]:
    return lambda parameters: torch.optim.SGD(parameters, lr=lr, momentum=0.9)


def validation_loss(model: nn.Module, val: list) -> float:
    model.eval()
    with torch.no_grad():
        total = sum(nn.functional.mse_loss(model(x), y).item() * len(x) for x, y in val)
    model.train()
    return total / sum(len(x) for x, _ in val)


def plain_sweep(models: list[nn.Module], batches: list, val: list, pruner: Pruner, rates: tuple[float, ...] = RATES
                ) -> tuple[dict, list, list]:
    """The sweep as plain loops in lockstep: every model steps, every EVERY steps each model still training is
    evaluated and pruner says which stop there (their weights stay). Returns the pruned {model: step}, the loss
    histories and the validation histories."""
    optimizers = [sgd(lr)(model.parameters()) for model, lr in zip(models, rates)]
    training = list(range(len(models)))
    pruned: dict[int, int] = {}
    history: list[list[float]] = [[] for _ in models]
    val_history: list[list[tuple[int, float]]] = [[] for _ in models]
    for step, (x, y) in enumerate(batches, start=1):
        for index in training:
            optimizers[index].zero_grad()
            loss = nn.functional.mse_loss(models[index](x), y)
            loss.backward()
            optimizers[index].step()
            history[index].append(loss.item())
        if step % EVERY == 0 or step == len(batches):
            for index in training:
                val_history[index].append((step, validation_loss(models[index], val)))
        if step % EVERY == 0 and step < len(batches):
            ranked = [Standing(index, f"model {index}", val_history[index][-1][1]) for index in training]
            for index in pruner(step, ranked):
                pruned[index] = step
            training = [index for index in training if index not in pruned]
    return pruned, history, val_history


CASES = {
    "homed": {"fuse": False},
    "swapped": {"fuse": False, "device_memory": "budget"},
    "fused": {"fuse": True},
    "fused-swapped": {"fuse": True, "device_memory": "budget"},
    "fused-pairs": {"fuse": 2},
    "fused-merged": {"fuse": True, "merged": True},  # members' optimizers merged, not stacked: whole gradients
}


class MergedSGD(torch.optim.SGD):
    """torch's SGD under another class, which an array does not step as stacks (runtime.array_optimizer)."""


@pytest.mark.parametrize("case", list(CASES))
def test_a_halving_sweep_stops_the_models_a_plain_sweep_stops_with_their_weights_of_that_step(
    case: str, no_leaks: None
) -> None:
    models = [deep_mlp(seed=seed).double() for seed in range(len(RATES))]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=8 * STEPS, batch=8)]
    val = [(x.double(), y.double()) for x, y in regression_batches(samples=16, batch=8, seed=7)]
    options = dict(CASES[case])
    if options.get("device_memory") == "budget":
        options["device_memory"] = param_bytes(models[0]) * (4 if options["fuse"] else 1) // 2
    optimizers = [sgd(lr) for lr in RATES]
    if options.pop("merged", False):
        optimizers = [functools.partial(MergedSGD, lr=lr, momentum=0.9) for lr in RATES]
    result = harmony.train(models, batches, nn.functional.mse_loss, optimizers, devices=2,
                           val_loaders=val, eval_every=EVERY, prune="halving", progress=False, **options)
    expected, history, val_history = plain_sweep(references, batches, val, halving)
    assert len(expected) == 3 and len(set(expected.values())) == 2, "the plain sweep halves twice: 4 -> 2 -> 1"
    if case == "fused-pairs":  # dealt out in turn: the neighbours 0 and 1, which survive step 2, train apart
        assert result.arrays == [[0, 2], [1, 3]]
    elif case.startswith("fused"):
        assert result.arrays == [[0, 1, 2, 3]]
    if "swapped" in case:
        assert not result.homes and all(len(packing.packs) > 1 for packing in result.packings)
    else:
        assert result.homes
    assert result.pruned == expected and not result.failed
    assert result.stats.computed == sum(result.stats.steps), "an array computes its members still training alone"
    for index, (model, reference) in enumerate(zip(result.models, references)):
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
        assert result.history[index] == pytest.approx(history[index], rel=1e-9)
        assert result.stats.steps[index] == expected.get(index, STEPS)
        assert [step for step, _ in result.val_history[index]] == [step for step, _ in val_history[index]]
        assert [loss for _, loss in result.val_history[index]] == pytest.approx(
            [loss for _, loss in val_history[index]], rel=1e-9)


@pytest.mark.parametrize("room", [True, False], ids=["room", "tight"])
def test_a_homed_array_computes_its_live_members_alone_where_the_copy_of_their_rows_fits(
    room: bool, tmp_path: Path, no_leaks: None
) -> None:
    """Halving keeps members 0 and 3 of the array at step 2 (not consecutive: their rows are copied to compute them)
    and member 0 at step 4 (a view of its rows). With room, every step computes the members still training; under a
    budget of the array's own planned peak the copy does not fit (batches of 4: little room for activations), so
    steps 2 and 3 compute all four. The weights and validation losses are a plain sweep's either way, and each
    evaluation computes the members not pruned: a metric called once per member and validation batch is called
    2 x (4 + 2 + 1 + 1) times over the evaluations at steps 2, 4, 6 and 7."""
    calls = tmp_path / "calls"

    def counted(output: torch.Tensor, target: torch.Tensor) -> float:
        with open(calls, "a") as file:
            file.write("called\n")
        return 0.0

    rates = (0.002, 0.05, 0.0005, 0.02)
    models = [deep_mlp(seed=seed).double() for seed in range(len(rates))]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=4 * STEPS, batch=4)]
    val = [(x.double(), y.double()) for x, y in regression_batches(samples=16, batch=8, seed=7)]
    expected, _, val_history = plain_sweep(references, batches, val, halving, rates)
    assert expected == {1: 2, 2: 2, 3: 4}
    options: dict[str, Any] = dict(devices=2, fuse=True, eval_every=EVERY, prune="halving")
    if not room:
        planned = harmony.plan(models, batches, nn.functional.mse_loss, [sgd(lr) for lr in rates], **options)
        options["device_memory"] = max(planned.peak_device_bytes.values())
    result = harmony.train(models, batches, nn.functional.mse_loss, [sgd(lr) for lr in rates], val_loaders=val,
                           metrics={"counted": counted}, progress=False, **options)
    assert result.arrays == [[0, 1, 2, 3]] and result.homes
    assert result.pruned == expected and not result.failed
    assert result.stats.computed == 4 * 2 + (2 if room else 4) * 2 + 1 * (STEPS - 4)
    assert len(calls.read_text().splitlines()) == 2 * (4 + 2 + 1 + 1)
    for index, (model, reference) in enumerate(zip(result.models, references)):
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
        assert [step for step, _ in result.val_history[index]] == [step for step, _ in val_history[index]]
        assert [loss for _, loss in result.val_history[index]] == pytest.approx(
            [loss for _, loss in val_history[index]], rel=1e-9)


def normed_mlp(seed: int) -> nn.Sequential:
    """deep_mlp with a BatchNorm after each hidden Linear: running statistics a step updates in place."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 4))


def check_pruned_array(homed: bool, norm: bool, devices: Any, tmp_path: Path) -> None:
    """A user's pruner stops member 2 at step 2 and member 1 at step 4 of a swapped array of four. Members 0, 1 and 3
    do not follow one another, and copying three quarters of some pack's rows takes more than the quarter of its
    workspace member 2 frees: steps 2 and 3 compute members 0 to 3, member 2's gradients zeroed. Members 0 and 3
    are copied (their rows take no more than the half of the workspace the others free): steps 4 to 6 compute
    two, their rows alone crossing the link. Weights (running statistics too: a stopped member's stay as they were,
    computed or not), loss histories
    and validation losses are a plain sweep's. Homed at the budget of its planned peak, the array computes the
    same members (its copy of three members' rows does not fit, two members' does). Evaluations measure the members
    not pruned before their step: a metric called once per member and validation batch is called 2 x (4 + 3 + 2 + 2)
    times over the evaluations at steps 2, 4, 6 and 7."""
    stops = {2: [2], 4: [1]}
    calls = tmp_path / "calls"

    def counted(output: torch.Tensor, target: torch.Tensor) -> float:
        with open(calls, "a") as file:
            file.write("called\n")
        return 0.0

    def stopping(step: int, standings: list[Standing]) -> list[int]:
        return stops.get(step, [])

    make = normed_mlp if norm else functools.partial(deep_mlp, depth=6)
    models = [make(seed=seed).double() for seed in range(len(RATES))]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=8 * STEPS, batch=8)]
    val = [(x.double(), y.double()) for x, y in regression_batches(samples=16, batch=8, seed=7)]
    expected, history, val_history = plain_sweep(references, batches, val, stopping)
    assert expected == {2: 2, 1: 4}
    options: dict[str, Any] = dict(devices=devices, fuse=True, eval_every=EVERY, prune=stopping)
    if homed:
        planned = harmony.plan(models, batches, nn.functional.mse_loss, [sgd(lr) for lr in RATES], **options)
        budget = max(planned.peak_device_bytes.values())
    else:
        budget = param_bytes(models[0]) * 4  # an array of the four fits a layer, not a quarter of its weights
    result = harmony.train(models, batches, nn.functional.mse_loss, [sgd(lr) for lr in RATES], device_memory=budget,
                           val_loaders=val, metrics={"counted": counted}, progress=False, **options)
    assert result.arrays == [[0, 1, 2, 3]] and bool(result.homes) == homed
    packs = result.packings[0].packs
    if not homed:
        assert len(packs) > 1
        assert not all(3 * pack.cost.weights <= pack.cost.workspace for pack in packs), "3/4 of the rows: not in 1/4"
        assert all(pack.cost.weights <= pack.cost.workspace for pack in packs), "half of them fit half of it"
    assert result.pruned == expected and not result.failed
    assert result.stats.computed == 4 * 4 + 2 * (STEPS - 4)
    if not homed:  # steps 4 to 6 write the gradients' rows of members 0 and 3 back alone (runtime.rows)
        assert result.stats.bytes_out["grads"] == param_bytes(models[0]) * (4 * 4 + 2 * (STEPS - 4))
    assert len(calls.read_text().splitlines()) == 2 * (4 + 3 + 2 + 2)
    for index, (model, reference) in enumerate(zip(result.models, references)):
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
        assert result.history[index] == pytest.approx(history[index], rel=1e-9)
        assert [loss for _, loss in result.val_history[index]] == pytest.approx(
            [loss for _, loss in val_history[index]], rel=1e-9)


@pytest.mark.parametrize(("homed", "norm"), [(False, False), (False, True), (True, True)],
                         ids=["swapped-mlp", "swapped-batchnorm", "homed-batchnorm"])
def test_a_swapped_array_computes_its_members_still_training_alone(
    homed: bool, norm: bool, tmp_path: Path, no_leaks: None
) -> None:
    check_pruned_array(homed, norm, 2, tmp_path)


def test_a_users_pruner_sees_the_models_still_training_and_a_bad_answer_ends_the_run(no_leaks: None) -> None:
    models = [nn.Linear(4, 1) for _ in range(3)]
    batches = sum_batches()
    seen: list[tuple[int, list[str]]] = []

    def by_name(step: int, standings: list[Standing]) -> list[int]:
        seen.append((step, [standing.name for standing in standings]))
        assert all("within" in standing.metrics for standing in standings)
        return [standing.index for standing in standings if standing.name == "b"]

    def within(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((output - target).abs() < 1).double().mean()

    arguments = dict(loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.01), epochs=2,
                     val_loaders=batches[:1], eval_every=3, metrics=within, names=["a", "b", "c"], fuse=False,
                     progress=False)
    result = harmony.train(models, batches, prune=by_name, **arguments)
    assert seen == [(3, ["a", "b", "c"]), (6, ["a", "c"])]
    assert result.pruned == {1: 3} and result.stats.steps == [8, 3, 8] and len(result.history[1]) == 3
    with pytest.raises(InputError, match=r"prune returned \[7\] at step 3; it may stop only models still training"):
        harmony.train(models, batches, prune=lambda step, standings: [7], **arguments)


@pytest.mark.parametrize("arguments, message", [
    ({"prune": "halving", "eval_every": 2}, "eval_every needs val_loaders"),
    ({"prune": "halving", "val_loaders": "val"}, "pass eval_every"),
    ({"prune": "hyperband", "val_loaders": "val", "eval_every": 2}, "prune='hyperband' is not a pruner"),
    ({"prune": 0.5, "val_loaders": "val", "eval_every": 2}, "prune=0.5; prune must be one of"),
])
def test_bad_pruning_arguments_are_refused_before_work_starts(arguments: dict, message: str) -> None:
    batch = (torch.randn(4, 4), torch.randn(4, 1))
    if arguments.get("val_loaders") == "val":
        arguments = {**arguments, "val_loaders": [batch]}
    with pytest.raises(InputError, match=message):
        harmony.train(nn.Linear(4, 1), [batch], nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.1),
                      progress=False, **arguments)


class FailingOnce:
    """mse_loss that raises on the batch whose first target is marker while the file flag exists (a crash that a
    resumed run, with the flag gone, does not meet)."""

    def __init__(self, flag: Path, marker: float) -> None:
        self.flag = str(flag)
        self.marker = marker

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if os.path.exists(self.flag) and target.reshape(-1)[0].item() == self.marker:
            raise RuntimeError("a crash")
        return nn.functional.mse_loss(output, target)


@pytest.mark.parametrize("fuse", [False, True], ids=["alone", "fused"])
def test_a_pruned_sweep_that_crashed_resumes_to_the_models_and_stops_of_the_uninterrupted_one(
    fuse: bool, tmp_path: Path, no_leaks: None
) -> None:
    """The run ends at step 5 of the model that wins (fail_fast): two models were pruned at step 2 and one at 4 (a
    fused array's members in its checkpoint, the others checkpointed whole there); the resumed run keeps them
    stopped and trains the winner to the end, as a plain sweep does."""
    models = [deep_mlp(seed=seed).double() for seed in range(len(RATES))]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=8 * STEPS, batch=8)]
    val = [(x.double(), y.double()) for x, y in regression_batches(samples=16, batch=8, seed=7)]
    expected, _, _ = plain_sweep(references, batches, val, halving)
    [winner] = set(range(len(RATES))) - set(expected)
    flag = tmp_path / "crash"
    flag.touch()
    marker = batches[5][1].reshape(-1)[0].item()
    losses = [FailingOnce(flag if index == winner else tmp_path / "never", marker) for index in range(len(RATES))]
    arguments = dict(devices=2, val_loaders=val, eval_every=EVERY, prune="halving", progress=False, fuse=fuse,
                     checkpoint_dir=tmp_path / "checkpoints", checkpoint_every=1, fail_fast=True)
    with pytest.raises(ModelError, match="a crash"):
        harmony.train(models, batches, losses, [sgd(lr) for lr in RATES], **arguments)
    flag.unlink()
    result = harmony.train(models, batches, losses, [sgd(lr) for lr in RATES], resume=True, **arguments)
    assert result.pruned == expected and not result.failed
    for model, reference in zip(result.models, references):
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
    assert result.stats.steps == [expected.get(index, STEPS) for index in range(len(RATES))]


def test_a_fused_member_that_diverged_is_not_ranked_and_stays_failed_not_pruned(no_leaks: None) -> None:
    """In an array of four, the member whose loss stops being finite before the first pruning step (step 4) is left
    out of the ranking there; halving ranks the three others and stops one."""
    models = [deep_mlp(seed=seed) for seed in range(4)]
    batches = regression_batches(samples=8 * 8, batch=8)
    seen: list[tuple[int, list[int]]] = []

    def halving_seen(step: int, standings: list[Standing]) -> list[int]:
        seen.append((step, sorted(standing.index for standing in standings)))
        return halving(step, standings)

    optimizers = [sgd(lr) for lr in (0.002, 1e8, 0.0005, 0.02)]  # model 1 blows up at its third or fourth step
    result = harmony.train(models, batches, nn.functional.mse_loss, optimizers, fuse=True, val_loaders=batches[:2],
                           eval_every=4, prune=halving_seen, progress=False)
    assert result.arrays == [[0, 1, 2, 3]]
    assert list(result.failed) == [1] and result.failed[1]["step"] < 4
    assert seen == [(4, [0, 2, 3])]
    assert len(result.pruned) == 1 and set(result.pruned.values()) == {4} and 1 not in result.pruned
