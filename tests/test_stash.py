"""A pack's activations kept on the device from its forward to its backward: the stash holds no weight bytes, gives
the gradients a recompute gives, and in a run equals recomputing and plain PyTorch within the budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import harmony
from harmony.runtime.stash import RETRY, Stash, worth_stashing
from tests.conftest import clones, deep_mlp, regression_batches, stashing_and_recomputing, train_plain

LAYER = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3))


def laid_out(module: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """module's parameters as views of one flat buffer, as a device's cached weights are."""
    named = dict(module.named_parameters())
    buffer = torch.cat([param.detach().reshape(-1) for param in named.values()]).double()
    views, offset = {}, 0
    for name, param in named.items():
        views[name] = buffer[offset : offset + param.numel()].view(param.shape)
        offset += param.numel()
    return buffer, views


def call(tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return functional_call(LAYER, tensors, (x,))


def test_a_stash_holds_no_weight_bytes_and_backpropagates_through_another_copy_of_them() -> None:
    torch.manual_seed(0)
    LAYER.double()
    buffer, tensors = laid_out(LAYER)
    held = buffer.untyped_storage()._weak_ref()
    x = torch.randn(4, 6, dtype=torch.float64)
    stash = Stash(tensors, tensors.keys())
    y = stash.forward(call, x, torch.autocast("cpu", enabled=False), lambda v: v.requires_grad_())
    assert not stash.pinned
    # the input, the norm's input, mean and inverse deviation, the tanh's output (the last linear's input), the output
    assert stash.nbytes == 8 * (4 * 6 + 4 * 5 + 4 + 4 + 4 * 5 + 4 * 3), "every activation once, no weight bytes"
    copy = buffer.clone()  # the weights swapped out and in again: another buffer, the same version
    del buffer, tensors, y
    assert torch.UntypedStorage._expired(held), "the stash keeps the weights' buffer alive"
    _, again = laid_out(LAYER)
    again = {name: copy[view.storage_offset() : view.storage_offset() + view.numel()].view(view.shape)
             for name, view in again.items()}
    grads = {name: torch.zeros_like(view) for name, view in again.items()}
    upstream = torch.randn(4, 3, dtype=torch.float64)
    stashed_x = stash.backward(again, grads, set(), upstream, lambda out, up: out.backward(up))

    reference = LAYER
    reference.zero_grad()
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).backward(upstream)
    for name, param in reference.named_parameters():
        assert torch.equal(grads[name], param.grad), name
    assert torch.equal(stashed_x.grad, x_ref.grad)
    assert stash.y is None and stash.leaves == {}, "spent"


def test_a_saved_view_of_the_weights_in_another_dtype_pins_the_stash() -> None:
    buffer = torch.randn(8, dtype=torch.float32)
    tensors = {"w": buffer[:4]}

    def reinterpreting(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x * weights["w"].view(torch.int32)  # mul saves its other operand: an int32 view of the buffer

    stash = Stash(tensors, [])
    stash.forward(reinterpreting, torch.randn(4), torch.autocast("cpu", enabled=False), lambda v: v.requires_grad_())
    assert stash.pinned


def test_a_pack_whose_stash_was_lost_runs_without_gradients_for_longer_after_each_loss() -> None:
    assert worth_stashing(None, 0) and worth_stashing(None, 7)
    assert worth_stashing((3, 1), 3), "the step it was lost in: its other micro-batches still try"
    assert not any(worth_stashing((3, 1), step) for step in range(4, 3 + RETRY))
    assert worth_stashing((3, 1), 3 + RETRY)
    assert not worth_stashing((11, 2), 11 + RETRY) and worth_stashing((11, 2), 11 + 2 * RETRY)
    assert not worth_stashing((50, 9), 50 + 63 * RETRY) and worth_stashing((50, 9), 50 + 64 * RETRY), "at most 64x"


def test_stashed_runs_equal_recomputing_runs_and_plain_pytorch_within_the_budget(
    steady_pilot: None, no_leaks: None
) -> None:
    """Float64 Adam over a swapped chain in two micro-batches. With room to spare the plan stashes every pack and
    every backward reads its stash; with less, the plan stashes the packs whose stash it predicts lasting (the
    last fwd's) and the rest recompute; with stash=False none is stashed. Either way the weights are a recomputing
    run's bit for bit and plain PyTorch's, and nothing exceeds the budget."""
    models = [deep_mlp(depth=8, seed=3).double()]
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    reference = clones(models)[0]
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    counts = {}
    for budget in (150_000, 60_000):
        runs = stashing_and_recomputing(models[0], batches, factory, reference, 1, budget)
        for stash, (_, result) in runs.items():
            counts[budget, stash] = result.stats.stashed, result.stats.recomputed
            predicted = result.plan.jobs[0].stashes
            assert result.stats.stashed <= len(predicted) * 2 * 4, "only the packs the plan stashes"
            assert bool(predicted) == stash and len(predicted) < len(result.plan.jobs[0].packing.packs)
        read = {stash: result.stats.bytes_in["activations"] + result.stats.bytes_in["inputs"] + result.stats.bytes_kept
                for stash, (_, result) in runs.items()}
        boundary = 8 * 32 * 8  # a micro-batch's input to any pack (the batch's to the first): 8 samples of 32 float64
        assert read[False] - read[True] == runs[True][1].stats.stashed * boundary, "a stashed pass reads no input"
    passes = sum(counts[150_000, True])
    assert counts[150_000, True] == (passes, 0), counts
    assert counts[150_000, False] == (0, passes), counts
    forecast = harmony.plan(models, batches, nn.functional.mse_loss, factory, microbatches=2, devices=1,
                            device_memory=150_000, resident=False, fuse=False, packs_per_task=1)
    assert "stashes the activations of 2 of its packs" in str(forecast)
    stashed, recomputed = counts[60_000, True]
    assert stashed > 0 and recomputed > 0, counts


def test_a_section_whose_later_packs_are_stashed_recomputes_none_of_their_inputs(
    steady_pilot: None, no_leaks: None
) -> None:
    """The bwd task of a section of several packs (not a pass's last) first recomputes its later packs' inputs;
    where those packs' stashes are all on the device it takes them at once and recomputes none. Float64 Adam, three
    packs in two sections ([0, 1], [2]), the plan stashing pack 1: the weights are a recomputing run's bit for bit
    and plain PyTorch's within 1e-9."""
    model = deep_mlp(seed=0).double()
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    reference = clones([model])[0]
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    runs = stashing_and_recomputing(model, batches, factory, reference, 1, 200_000, packs_per_task=2)
    job = runs[True][1].plan.jobs[0]
    assert (len(job.packing.packs), job.sections, job.stashes) == (3, (0, 2), (1,))
    stashed, recomputing = runs[True][1].stats, runs[False][1].stats
    assert recomputing.inputs_recomputed == 4 * 2, "4 steps, 2 micro-batches, pack 1's input"
    assert stashed.inputs_recomputed == 0
    assert (stashed.stashed, stashed.recomputed) == (4 * 2, 4 * 2), "pack 1 stashed, pack 0 recomputed"


@pytest.mark.parametrize("packs_per_task", [1, 2], ids=["one-pack-tasks", "two-pack-sections"])
def test_stashes_of_dropout_bf16_and_fused_arrays_equal_recomputing(
    packs_per_task: int, steady_pilot: None, no_leaks: None
) -> None:
    """Dropout masks (drawn once, in the forward, and kept), autocast's bf16 with weights copied in halved, and a
    fused array's vmapped packs: the stash gives the weights recomputing gives, bit for bit. In sections of two
    packs (three packs, the plan stashing pack 1), the first section's bwd takes pack 1's stash and recomputes no
    input."""
    def dropout_mlp(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.2)) for _ in range(6)],
                             nn.Linear(32, 4))

    batches = regression_batches(samples=64, batch=16)
    factory = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    for precision, models, budget in (("fp32", [dropout_mlp(0)], 60_000), ("bf16", [deep_mlp(seed=1)], 60_000),
                                      ("fp32", [deep_mlp(seed=s) for s in range(2)],
                                       150_000 if packs_per_task == 1 else 200_000)):
        trained = {}
        for stash in (True, False):
            run = clones(models)
            result = harmony.train(run, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                                   devices=1, device_memory=budget, resident=False, fuse=len(models) > 1,
                                   packs_per_task=packs_per_task, precision=precision, stash=stash, progress=False)
            assert len(result.plan.jobs[0].packing.packs) > 2
            assert (result.stats.stashed > 0) == stash, (precision, result.stats.stashed)
            if packs_per_task == 2:
                assert result.stats.inputs_recomputed == (0 if stash else 4 * 2), precision
            trained[stash] = run
        for stashed, recomputed in zip(trained[True], trained[False]):
            for name, value in stashed.state_dict().items():
                assert torch.equal(value, recomputed.state_dict()[name]), (precision, name)
