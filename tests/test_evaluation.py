"""Evaluation through harmony.train: validation losses and metrics equal a plain torch.no_grad() loop at the same
steps, for resident, swapped and fused models; best() and names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import harmony
from harmony.errors import InputError
from harmony.runtime import evaluation
from harmony.runtime.evaluation import chunked, metric_values, total
from tests.conftest import clones, deep_mlp, param_bytes, regression_batches, sum_batches

EVERY = 3
STEPS = 7


def sgd(parameters: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


def within(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A metric: the share of outputs within 1 of their target."""
    return ((output - target).abs() < 1).double().mean()


def plain_validation(
    model: nn.Module, batches: list, val: list, every: int, microbatches: int = 1
) -> tuple[list, list]:
    """Train model the plain way (gradients accumulated over micro-batches); after every `every` steps and at the
    end, its validation loss and metric as a plain no_grad loop in eval mode gives them (means over the validation
    samples)."""
    optimizer = sgd(model.parameters())
    losses, metrics = [], []
    samples = sum(len(x) for x, _ in val)
    for step, (x, y) in enumerate(batches, start=1):
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (nn.functional.mse_loss(model(xs), ys) * (len(xs) / len(x))).backward()
        optimizer.step()
        if step % every == 0 or step == len(batches):
            model.eval()
            with torch.no_grad():
                outputs = [(model(vx), vy, len(vx)) for vx, vy in val]
            model.train()
            losses.append((step, sum(nn.functional.mse_loss(o, t).item() * n for o, t, n in outputs) / samples))
            metrics.append((step, {"within": sum(within(o, t).item() * n for o, t, n in outputs) / samples}))
    return losses, metrics


def double(batches: list) -> list:
    return [(x.double(), y.double()) for x, y in batches]


def models_in_float64(count: int) -> list[nn.Module]:
    return [deep_mlp(seed=seed).double() for seed in range(count)]


def normalized(seed: int) -> nn.Module:
    """Batch norms between linears: a validation reads their running statistics of the step it is for."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 4)).double()


@pytest.mark.parametrize("case", ["resident", "swapped", "fused", "batchnorm"])
def test_validation_equals_a_plain_no_grad_loop(case: str, no_leaks: None) -> None:
    """In the batch-norm case, a step's forward on a device that still holds the weights of the step before (cached,
    or evaluated there next) must not leave its new running statistics in them: an evaluation of that step would
    read them."""
    models = models_in_float64(3) if case != "batchnorm" else [normalized(seed) for seed in range(2)]
    references = clones(models)
    batch = 32 if case == "batchnorm" else 8  # micro-batches of 16: batch norm over 4 samples magnifies rounding
    batches = double(regression_batches(samples=batch * STEPS, batch=batch))
    val = double(regression_batches(samples=20, batch=8, seed=7))  # batches of 8, 8 and 4: a weighted mean
    budget = {"swapped": param_bytes(models[0]) // 3, "batchnorm": 60_000}.get(case)
    result = harmony.train(models, batches, nn.functional.mse_loss, sgd, devices=2, device_memory=budget,
                           microbatches=2, fuse=case == "fused", val_loaders=val, eval_every=EVERY, metrics=within,
                           progress=False, **({"mode": "free", "packs_per_task": 1} if case == "batchnorm" else {}))
    if case in ("swapped", "batchnorm"):
        assert all(len(packing.packs) > 2 for packing in result.packings) and not result.homes
        assert all(peak <= budget for peak in result.stats.peak_device_bytes.values())
    if case == "fused":
        assert result.arrays == [[0, 1, 2]]
    for index, reference in enumerate(references):
        losses, metrics = plain_validation(reference, batches, val, EVERY, 2 if case == "batchnorm" else 1)
        assert [step for step, _ in result.val_history[index]] == [3, 6, 7]
        torch.testing.assert_close(torch.tensor(result.val_history[index], dtype=torch.float64),
                                   torch.tensor(losses, dtype=torch.float64), rtol=1e-9, atol=0)
        assert result.val_metrics[index] == [(step, pytest.approx(values)) for step, values in metrics]
    assert not result.failed


class Regularized(nn.Module):
    """torch.fx cannot trace it (a branch on a size): cut under a budget, it is exported. A dropout, a batch norm and
    a functional dropout, which eval mode turns off (the batch norm to its running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.5)
        self.norm = nn.BatchNorm1d(32)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_zeros(0, 4)
        h = self.norm(self.drop(torch.tanh(self.a(x))))
        return self.b(nn.functional.dropout(h, 0.25, training=self.training))


def test_an_exported_model_is_evaluated_as_plain_pytorch_evaluates_the_weights_it_trained_to(no_leaks: None) -> None:
    """Regularized, cut under the budget (exported), evaluated every 2 steps: its last validation loss is plain
    PyTorch's eval-mode loss of the weights and running statistics it trained to, and evaluating changes none of
    them (a run that evaluates only at its end trains the same bit for bit). Before, the exported graph ran its
    dropouts and batch statistics in evaluation too, and counted its batches into the running statistics."""
    batches = double(regression_batches(samples=8 * 6, batch=8))
    val = double(regression_batches(samples=20, batch=8, seed=7))
    trained = {}
    for every in (2, None):
        model = Regularized().double()
        result = harmony.train(model, batches, nn.functional.mse_loss, sgd, devices=1, device_memory=40_000,
                               val_loaders=val, eval_every=every, threads=1, progress=False)
        assert len(result.packings[0].packs) > 1 and not result.homes
        trained[every] = (model, result)
    model, result = trained[2]
    assert [step for step, _ in result.val_history[0]] == [2, 4, 6]
    model.eval()
    with torch.no_grad():
        plain = sum(nn.functional.mse_loss(model(x), y).item() * len(x) for x, y in val) / 20
    assert result.val_history[0][-1][1] == pytest.approx(plain, rel=1e-12, abs=0)
    assert int(model.norm.num_batches_tracked) == 6
    for name, value in trained[None][0].state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_evaluating_leaves_each_layers_mode_as_the_user_set_it(no_leaks: None) -> None:
    """A batch norm the user froze (eval mode: its running statistics read, not updated) stays frozen through a
    swapped run that evaluates every 2 steps, as in plain PyTorch without evaluation; before, the first evaluation
    put every layer of the pack back in training mode."""
    model = normalized(0)
    model[1].eval()
    frozen = model[1].running_mean.clone()
    reference = clones([model])[0]
    batches = double(regression_batches(samples=32 * 4, batch=32))
    result = harmony.train(model, batches, nn.functional.mse_loss, sgd, devices=1, device_memory=60_000,
                           val_loaders=double(regression_batches(samples=16, batch=8, seed=7)), eval_every=2,
                           progress=False)
    assert len(result.packings[0].packs) > 2 and not result.homes
    assert torch.equal(model[1].running_mean, frozen) and not torch.equal(model[4].running_mean, frozen)
    optimizer = sgd(reference.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-12, msg=name)


def test_best_is_the_model_with_the_lowest_final_validation_loss_and_carries_its_name(no_leaks: None) -> None:
    models = [nn.Linear(4, 1) for _ in range(3)]
    batches = sum_batches()
    result = harmony.train(models, batches, nn.functional.mse_loss,
                           [lambda p, lr=lr: torch.optim.SGD(p, lr=lr) for lr in (1e-4, 0.1, 1e-3)],
                           epochs=5, val_loaders=[batches[:2]] * 3, names=["tiny", "right", "small"], progress=False)
    finals = [history[-1][1] for history in result.val_history]
    assert [step for step, _ in result.val_history[0]] == [20], "without eval_every: at the end alone"
    best = result.best()
    assert best.index == min(range(3), key=finals.__getitem__) == 1
    assert (best.name, best.val_loss, best.step) == ("right", finals[1], 20)
    assert best.loss == result.history[1][-1] and result.name(2) == "small"


def test_best_without_validation_says_what_it_needs(no_leaks: None) -> None:
    result = harmony.train(nn.Linear(4, 1), [(torch.randn(4, 4), torch.randn(4, 1))], nn.functional.mse_loss,
                           lambda p: torch.optim.SGD(p, lr=0.1), progress=False)
    with pytest.raises(ValueError, match="val_loaders"):
        result.best()


@pytest.mark.parametrize("arguments, message", [
    ({"eval_every": 2}, "eval_every needs val_loaders"),
    ({"metrics": within}, "metrics needs val_loaders"),
    ({"val_loaders": [(torch.randn(2, 4), torch.randn(2, 1))], "metrics": 3}, "metrics=3 must be"),
    ({"val_loaders": [(torch.randn(2, 4), torch.randn(2, 1))], "names": ["a", "b"]}, "one name per model"),
    ({"val_loaders": [(torch.randn(2, 4), torch.randn(2, 1))], "eval_every": 0}, "eval_every=0"),
])
def test_bad_validation_arguments_are_refused_before_work_starts(arguments: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        harmony.train(nn.Linear(4, 1), [(torch.randn(4, 4), torch.randn(4, 1))], nn.functional.mse_loss,
                      lambda p: torch.optim.SGD(p, lr=0.1), progress=False, **arguments)


def test_metric_values_and_totals_are_means_over_samples() -> None:
    assert metric_values(within, torch.zeros(2), torch.tensor([0.5, 3.0])) == {"within": 0.5}
    assert metric_values({"a": lambda o, t: 1, "b": lambda o, t: 2.0}, None, None) == {"a": 1.0, "b": 2.0}
    assert metric_values(lambda o, t: {"x": torch.tensor(3.0)}, None, None) == {"x": 3.0}
    parts = [{"sums": {"loss": torch.tensor([8.0, 4.0], dtype=torch.float64)}, "samples": 8},
             {"sums": {"loss": torch.tensor([2.0, 0.0], dtype=torch.float64)}, "samples": 2}]
    assert total(parts) == {"loss": [1.0, 0.4]}


def test_chunks_hold_consecutive_batches_up_to_the_limit() -> None:
    assert chunked([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
    assert chunked([3, 9, 1], 6) == [[0], [1], [2]], "a batch over the limit is a chunk alone"
    assert chunked([0, 0, 0], 6) == [[0, 1, 2]]


@pytest.mark.parametrize("chunk_bytes", [None, 1], ids=["one-chunk", "a-batch-a-chunk"])
def test_a_swapped_models_evaluation_swaps_each_pack_in_once_per_chunk_of_validation_batches(
    chunk_bytes: int | None, monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    """One evl task per pack runs a chunk of validation batches with the pack's weights swapped in once (the last
    pack's task of a lone chunk gives the figures: a val task); chunks each run their packs, and a val task sums
    them. The figures are a plain no_grad loop's either way."""
    if chunk_bytes is not None:
        monkeypatch.setattr(evaluation, "CHUNK_BYTES", chunk_bytes)
    models = models_in_float64(2)
    references = clones(models)
    batches = double(regression_batches(samples=8 * 4, batch=8))
    val = double(regression_batches(samples=20, batch=8, seed=7))  # three batches
    result = harmony.train(models, batches, nn.functional.mse_loss, sgd, devices=2,
                           device_memory=param_bytes(models[0]) // 3, fuse=False, val_loaders=val, eval_every=2,
                           metrics=within, progress=False)
    packs = len(result.packings[0].packs)
    assert packs > 2 and not result.homes
    keys = [key for tasks in result.stats.timeline.values() for *_, key in tasks]
    evaluations = sum(len(history) for history in result.val_history)
    chunks = 1 if chunk_bytes is None else len(val)
    assert sum(key.startswith("evl-") for key in keys) == evaluations * (packs * chunks - (chunks == 1))
    assert sum(key.startswith("val-") for key in keys) == evaluations * (chunks == 1), "a sum task is no body"
    for index, reference in enumerate(references):
        losses, metrics = plain_validation(reference, batches, val, 2)
        torch.testing.assert_close(torch.tensor(result.val_history[index], dtype=torch.float64),
                                   torch.tensor(losses, dtype=torch.float64), rtol=1e-9, atol=0)
        assert result.val_metrics[index] == [(step, pytest.approx(values)) for step, values in metrics]
