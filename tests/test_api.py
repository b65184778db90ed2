"""harmony.train end to end: errors by model, swap volumes, per-micro-batch swapping, tied weights, batch files."""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint

import harmony
from tests.conftest import (
    BatchBranch,
    assert_same_weights,
    clones,
    deep_mlp,
    harmony_files,
    param_bytes,
    regression_batches,
    train_plain,
)

SENTINEL = 1234.0


class Fragile(nn.Module):
    """Fails on the batch whose first value is SENTINEL, which the pilot pass never sees."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() and x.flatten()[0].item() == SENTINEL:
            raise ValueError("bad batch marker reached the model")
        return self.fc(x)


def test_an_exception_in_a_models_forward_stops_that_model_alone_with_its_last_complete_step(no_leaks: None) -> None:
    batches = regression_batches(samples=32, batch=8)
    poisoned = [(x.clone(), y) for x, y in batches]
    poisoned[2][0][0, 0] = SENTINEL
    models = [deep_mlp(depth=2), Fragile()]
    references = clones(models)
    factory = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    result = harmony.train(models, [batches, poisoned], loss_fn=nn.functional.mse_loss, optimizer=factory,
                           progress=False)
    assert list(result.failed) == [1] and result.failed[1]["step"] == 2
    assert "ValueError: bad batch marker reached the model" in str(result.failed[1]["reason"])
    train_plain(references[0], batches, nn.functional.mse_loss, factory)
    train_plain(references[1], poisoned[:2], nn.functional.mse_loss, factory)
    assert_same_weights(models[0], references[0])
    assert_same_weights(models[1], references[1])
    assert result.stats.steps == [4, 2] and len(result.history[1]) == 2


class Unsized:
    """A loader that does not say its batches' sizes ahead (neither a list nor a DataLoader)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator:
        return iter(self.batches)


def test_a_model_exported_for_its_batchs_size_trains_on_that_size_and_stops_alone_at_another(no_leaks: None
                                                                                             ) -> None:
    """BatchBranch does not fit whole: it is exported, its batch's size fixed at 8 (runtime.stages.Shapes). A
    DataLoader that drops its short last batch trains it as plain PyTorch does; a loader that does not say its
    sizes gives it a short batch at step 3: it stops there alone, with its weights of step 3 and the reason, while
    the model beside it trains on. Unchecked, the graph ran the short batch through the branch taken for 8."""
    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(28, 32, generator=generator).double(), torch.randn(28, 4, generator=generator).double()
    factory = functools.partial(torch.optim.SGD, lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, drop_last=True)
    model = BatchBranch().double()
    reference = copy.deepcopy(model)
    result = harmony.train(model, loader, loss_fn=nn.functional.mse_loss, optimizer=factory, device_memory=60_000,
                           devices=1, progress=False)
    assert len(result.packings[0].packs) > 1, "cut into packs: exported"
    train_plain(reference, list(loader), nn.functional.mse_loss, factory)
    assert_same_weights(model, reference, rtol=0, atol=1e-12)

    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 28, 8)]
    models = [BatchBranch().double(), deep_mlp(depth=2).double()]
    references = clones(models)
    result = harmony.train(models, [Unsized(batches), batches], loss_fn=nn.functional.mse_loss, optimizer=factory,
                           device_memory=60_000, devices=1, progress=False)
    assert list(result.failed) == [0] and result.failed[0]["step"] == 3
    assert "input 0's size 0 is 4, and the export fixed it at 8" in str(result.failed[0]["reason"])
    assert "drop_last=True" in str(result.failed[0]["reason"])
    train_plain(references[0], batches[:3], nn.functional.mse_loss, factory)
    train_plain(references[1], batches, nn.functional.mse_loss, factory)
    for trained, expected in zip(models, references):
        assert_same_weights(trained, expected, rtol=0, atol=1e-12)


def test_an_exception_in_forward_with_fail_fast_reaches_the_user_with_model_and_traceback(no_leaks: None) -> None:
    batches = regression_batches(samples=32, batch=8)
    poisoned = [(x.clone(), y) for x, y in batches]
    poisoned[2][0][0, 0] = SENTINEL
    with pytest.raises(harmony.ModelError) as raised:
        harmony.train(
            [deep_mlp(depth=2), Fragile()],
            [batches, poisoned],
            loss_fn=nn.functional.mse_loss,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            progress=False,
            fail_fast=True,
        )
    error = raised.value
    assert error.model == 1
    assert "model 1 (Fragile) raised ValueError: bad batch marker reached the model" in str(error)
    assert "step 2" in str(error)
    assert 'raise ValueError("bad batch marker reached the model")' in error.traceback_text
    assert "Original traceback" in str(error)


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "swapped"])
def test_swap_volume_is_measured_for_a_model_that_fits(resident: bool, no_leaks: None) -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    weight_bytes = param_bytes(model)
    steps = 3
    batches = regression_batches(samples=8 * steps, batch=8, width=16)
    factory = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=4,
                           resident=resident, progress=False)
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert_same_weights(model, reference)
    assert [len(packing.packs) for packing in result.packings] == [1]
    stats = result.stats
    if resident:
        # The model stays on its device: weights cross once, gradients never leave; its weights (and optimizer
        # state) are written back after each of its tasks (one step each in so short a run), the version a lost
        # device's model is taken up from.
        assert stats.bytes_in["weights"] == weight_bytes == 1360
        assert stats.bytes_out["grads"] == 0
        assert result.stats.steps_per_task == [1]
        assert stats.bytes_out["weights"] == steps * weight_bytes
        assert stats.bytes_out["state"] == steps * weight_bytes, "SGD's momentum: one float per weight"
    else:
        # Swapped: the update on the host store makes the device copy stale, so each step's backward
        # swaps the weights in once and sends the gradients out once, whatever the number of micro-batches.
        assert stats.bytes_in["weights"] == steps * weight_bytes
        assert stats.bytes_out["grads"] == steps * weight_bytes
        assert stats.bytes_out["weights"] == stats.bytes_out["state"] == 0
    assert stats.bytes_in["inputs"] == steps * 8 * (16 + 4) * 4
    assert stats.bytes_in["activations"] == stats.bytes_out["activations"] == 0


@pytest.mark.parametrize("batch", [16, 32, 64], ids=["small-activations", "activations-quarter-a-layer",
                                                    "single-layer-packs"])
def test_swap_volume_for_a_model_four_times_the_budget(batch: int, no_leaks: None) -> None:
    """With prefetch on (the default), as activations grow: a prefetched pack must not be pushed out by
    boundary values kept for later micro-batches (batch 32 copied packs in up to three times a step), and
    packs of a lone activation layer (batch 64) have nothing for their optimizer to step."""
    model = deep_mlp(width=32, depth=24)
    weights = param_bytes(model)
    budget = weights // 4
    steps, microbatches = 4, 4
    batches = regression_batches(samples=batch * steps, batch=batch)
    reference = copy.deepcopy(model)
    result = harmony.train(
        model, batches, loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        microbatches=microbatches, device_memory=budget, progress=False,
        stash=False,  # the volumes of recomputing: a stash skips its input's read and may push weights out
        packs_per_task=1,  # the volumes of one pack a task: in a section, a value for a later pack stays on the device
    )
    train_plain(reference, batches, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.05))
    assert_same_weights(model, reference)
    plan = result.packings[0]
    assert len(plan.packs) >= 4
    last = plan.packs[-1].weight_bytes
    stats = result.stats
    # Every gradient byte leaves the device exactly once per step.
    assert stats.bytes_out["grads"] == steps * weights
    # Weights cross at least once (updates make copies stale) and at most twice per step, whatever M is.
    assert steps * weights <= stats.bytes_in["weights"] <= steps * (2 * weights - last)
    # Activations between packs: forward sends each boundary out, backward sends its gradient out;
    # boundaries are read for forward, for the recompute, and as upstream gradients, except that the
    # last pack has no separate forward (it runs forward, loss and backward in one task). A value read
    # by the task that runs next on its device stays there (kept) instead of coming back in: on one
    # device, every forward input and upstream gradient where it fits; recompute inputs always come in.
    one_boundary = batch * 32 * 4
    boundaries = one_boundary * (len(plan.packs) - 1)
    assert stats.bytes_out["activations"] == steps * 2 * boundaries
    assert stats.bytes_in["activations"] + stats.bytes_kept == steps * (3 * boundaries - one_boundary)
    assert stats.bytes_in["activations"] >= steps * (boundaries - one_boundary)
    assert stats.bytes_kept > steps * boundaries, "forward inputs and upstream gradients were not kept on the device"
    assert max(stats.peak_device_bytes.values()) <= budget


def test_per_microbatch_swapping_pays_m_times_the_weights_for_the_same_result(no_leaks: None) -> None:
    steps, batch, microbatches = 2, 16, 4
    batches = regression_batches(samples=batch * steps, batch=batch)
    trained = {}
    for group in (True, False):
        model = deep_mlp(depth=24)
        weights = param_bytes(model)
        result = harmony.train(
            model, batches, loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
            microbatches=microbatches, device_memory=weights // 4, group=group, progress=False,
        )
        trained[group] = (model, result)
    assert_same_weights(trained[False][0], trained[True][0], rtol=0, atol=0)
    grouped, ungrouped = trained[True][1].stats, trained[False][1].stats
    last = trained[True][1].packings[0].packs[-1].weight_bytes
    reloads = steps * (microbatches - 1) * (2 * weights - last)
    assert grouped.bytes_in["weights"] <= steps * (2 * weights - last)
    assert ungrouped.bytes_in["weights"] >= reloads + steps * weights
    assert ungrouped.bytes_out["grads"] == grouped.bytes_out["grads"] == steps * weights


def test_per_microbatch_swapping_of_a_model_that_fits_swaps_it_and_trains_as_plain_pytorch(no_leaks: None) -> None:
    """group=False is per-micro-batch swapping: a model that fits is swapped too, not kept resident (reloading its
    weights from the host store between micro-batches would undo a resident model's updates)."""
    model = deep_mlp(depth=3)
    reference = copy.deepcopy(model)
    batches = regression_batches(samples=48, batch=12)
    factory = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=3,
                           group=False, progress=False)
    losses = train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert result.homes == {}, "nothing stays resident under per-micro-batch swapping"
    assert_same_weights(model, reference)
    assert result.history[0] == pytest.approx(losses, rel=1e-5)


def test_auto_microbatches_train_as_plain_pytorch_on_the_whole_batch(no_leaks: None) -> None:
    """microbatches="auto" splits each batch into the fewest micro-batches whose activations fit beside a layer;
    the loss stays the mean over the batch, so the weights are plain PyTorch's whole-batch ones (float64)."""
    model = deep_mlp(depth=3).double()
    reference = copy.deepcopy(model)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=512, batch=256)]
    factory = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, devices=["cpu"],
                           device_memory=40_000, microbatches="auto", progress=False)
    losses = train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert result.plan.options.microbatches > 1 and result.homes == {}, "a swapped model in micro-batches"
    assert_same_weights(model, reference, rtol=0, atol=1e-12)
    assert result.history[0] == pytest.approx(losses, rel=1e-12)


class TiedClassifier(nn.Module):
    """Token embeddings shared with the output projection (tied weights), and a BatchNorm with running stats."""

    def __init__(self, vocabulary: int = 20, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.norm = nn.BatchNorm1d(width)
        self.project = nn.Linear(width, vocabulary, bias=False)
        self.project.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.project(self.norm(self.embed(tokens).mean(1)))


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "swapped"])
def test_tied_weights_train_as_in_plain_pytorch(resident: bool, no_leaks: None) -> None:
    torch.manual_seed(0)
    model = TiedClassifier()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 20, (8, 5), generator=generator), torch.randint(0, 20, (8,), generator=generator))
               for _ in range(6)]
    factory = lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9)  # noqa: E731
    result = harmony.train(model, batches, loss_fn=nn.functional.cross_entropy, optimizer=factory,
                           resident=resident, steps_per_task=3, progress=False)
    losses = train_plain(reference, batches, nn.functional.cross_entropy, factory)
    assert model.project.weight is model.embed.weight
    assert_same_weights(model, reference)
    assert result.history[0] == pytest.approx(losses, rel=1e-5)
    assert bool(result.homes) == resident


def float64_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four batches of 16 samples, 8 features to 2 targets, in float64 (where Harmony equals plain PyTorch to
    reassociation)."""
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 8, generator=generator, dtype=torch.float64),
             torch.randn(16, 2, generator=generator, dtype=torch.float64)) for _ in range(4)]


def applied_twice(seed: int) -> nn.Sequential:
    """A float64 MLP whose Sequential holds one Linear twice (model[2] is model[4])."""
    torch.manual_seed(seed)
    shared = nn.Linear(8, 8)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), shared, nn.Tanh(), shared, nn.Linear(8, 2)).double()


@pytest.mark.parametrize("budget", [None, 5000], ids=["resident", "swapped"])
def test_a_layer_applied_twice_trains_as_in_plain_pytorch(budget: int | None, no_leaks: None) -> None:
    """A Sequential that holds one Linear twice applies it twice, homed or cut into packs, in float64."""
    model = applied_twice(seed=0)
    reference = copy.deepcopy(model)
    batches = float64_batches()
    factory = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                           devices=["cpu"], device_memory=budget, progress=False)
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert (len(result.plan.jobs[0].packing.packs) > 1) == (budget is not None)
    assert model[2] is model[4]
    assert_same_weights(model, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("budget", [None, 12000], ids=["resident", "swapped"])
def test_fused_models_that_apply_a_layer_twice_train_as_in_plain_pytorch(budget: int | None, no_leaks: None) -> None:
    """An array of such models runs the layer twice per member, homed or cut into packs, in float64."""
    models = [applied_twice(seed) for seed in range(3)]
    references = [copy.deepcopy(model) for model in models]
    batches = float64_batches()
    factory = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                           devices=["cpu"], device_memory=budget, fuse=True, progress=False)
    assert max(len(job.members) for job in result.plan.jobs) > 1
    assert any(len(job.packing.packs) > 1 for job in result.plan.jobs) == (budget is not None)
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert model[2] is model[4]
        assert_same_weights(model, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("budget", [None, 8000], ids=["resident", "swapped"])
def test_parametrized_layers_train_as_in_plain_pytorch(budget: int | None, no_leaks: None) -> None:
    """weight_norm and spectral_norm (torch.nn.utils.parametrizations: modules torch will not pickle, and a power
    iteration's buffers updated by every training forward), homed or in packs, in float64."""
    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 8)), nn.Tanh(),
                          parametrizations.spectral_norm(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 2)).double()
    reference = copy.deepcopy(model)
    batches = float64_batches()
    factory = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, devices=["cpu"],
                           device_memory=budget, progress=False)
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert (len(result.plan.jobs[0].packing.packs) > 1) == (budget is not None)
    assert_same_weights(model, reference, rtol=1e-12, atol=1e-12)


class Checkpointed(nn.Module):
    """A residual block whose inner layers torch.utils.checkpoint runs again in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("budget", [None, 12_500], ids=["one-pack", "packs"])
def test_a_model_that_checkpoints_inside_its_forward_trains_swapped_as_in_plain_pytorch(
    budget: int | None, no_leaks: None
) -> None:
    """The checkpoint's second forward runs in the pack's backward, recomputed or from a stash: the pack's module
    still holds its weights there, in float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Checkpointed(), nn.Tanh(), Checkpointed(), nn.Tanh(), Checkpointed(),
                          nn.Linear(8, 2)).double()
    reference = copy.deepcopy(model)
    batches = float64_batches()
    factory = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                           devices=["cpu"], device_memory=budget, resident=False, progress=False)
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    if budget is not None:  # backward passes both from stashes and recomputing
        assert len(result.plan.jobs[0].packing.packs) > 1 and result.stats.stashed and result.stats.recomputed
    assert_same_weights(model, reference, rtol=1e-12, atol=1e-12)


class CountingBatchFiles:
    """A loader that, each time the driver takes a batch, counts the host-store files holding shipped batches."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches
        self.counts: list[int] = []

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.batches:
            self.counts.append(sum("-batch-" in name for name in harmony_files()))
            yield batch


def test_batches_reach_the_workers_through_files_removed_once_read(no_leaks: None) -> None:
    """Mini-batches travel as host-store files (a task carries only the name), and the driver removes each
    step's files when their last task has finished: the number of files stays bounded however long the run."""
    model = deep_mlp(width=32, depth=24)
    reference = copy.deepcopy(model)
    batches = regression_batches(samples=16 * 24, batch=16)
    loader = CountingBatchFiles(batches)
    budget = param_bytes(model) // 4
    factory = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    harmony.train(model, loader, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                  device_memory=budget, progress=False)
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert_same_weights(model, reference)
    assert len(loader.counts) >= len(batches), "the driver read the whole loader"
    assert max(loader.counts) > 0, "batches were shipped as files"
    assert max(loader.counts) <= 4, f"batch files piled up (an input and a target file per step): {loader.counts}"


def test_a_budget_with_no_room_to_prefetch_trains_without_prefetching(no_leaks: None) -> None:
    """The error for a budget too small names the smallest budget with and without prefetching; the smaller one
    trains (no byte prefetched, none over budget) and equals plain PyTorch."""

    model = deep_mlp(depth=6)
    reference = copy.deepcopy(model)
    batches = regression_batches(samples=32, batch=8)
    sgd = functools.partial(torch.optim.SGD, lr=0.05)
    with pytest.raises(harmony.InputError) as raised:
        harmony.train(model, batches, nn.functional.mse_loss, sgd, device_memory=1_000, progress=False)
    alone, beside = (int(n.replace(",", "")) for n in
                     re.search(r"at least ([\d,]+) bytes \(([\d,]+) to prefetch\)", str(raised.value)).groups())
    assert alone < beside
    result = harmony.train(model, batches, nn.functional.mse_loss, sgd, device_memory=alone, devices=["cpu"],
                           progress=False)
    train_plain(reference, batches, nn.functional.mse_loss, sgd)
    assert_same_weights(model, reference)
    assert not result.packings[0].prefetch and len(result.packings[0].packs) > 1
    assert result.stats.bytes_prefetched == 0
    assert max(result.stats.peak_device_bytes.values()) <= alone
