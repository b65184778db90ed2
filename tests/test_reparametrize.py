"""runtime.reparametrize: a module called with given tensors as torch.func.functional_call calls it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.func import functional_call

from harmony.runtime.reparametrize import bind, bound


class Tied(nn.Module):
    """An embedding whose weight the output projection shares, and a BatchNorm with running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)))


def given(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Fresh tensors for module's parameters and buffers (one name a tied weight), unlike its own."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(p.shape, generator=generator) for name, p in module.named_parameters()}
    tensors.update({name: b.clone() for name, b in module.named_buffers()})
    return tensors


def test_a_bound_call_computes_what_functional_call_computes_and_leaves_the_module_as_it_was() -> None:
    module = nn.Sequential(Tied())
    call = bind(module)
    own = {name: p for name, p in module.named_parameters(remove_duplicate=False)}
    x = torch.tensor([[1, 2, 3], [4, 5, 6]]).reshape(-1)
    for seed in range(3):  # the same module bound to one set of tensors after another
        mine, theirs = given(module, seed), given(module, seed)
        leaves = {name: t.requires_grad_() for name, t in mine.items()
                  if t.is_floating_point() and "running" not in name}
        expected_leaves = {name: theirs[name].requires_grad_() for name in leaves}
        y = call(mine, x)
        expected = functional_call(module, theirs, (x,))
        assert torch.equal(y, expected)
        y.square().sum().backward()
        expected.square().sum().backward()
        for name, leaf in leaves.items():  # the tied weight's gradient sums both of its uses
            assert torch.equal(leaf.grad, expected_leaves[name].grad), name
        for name in ("0.norm.running_mean", "0.norm.num_batches_tracked"):  # buffers updated in the given tensors
            assert torch.equal(mine[name], theirs[name]), name
        assert not torch.equal(mine["0.norm.running_mean"], torch.zeros(6))
    assert {name: p for name, p in module.named_parameters(remove_duplicate=False)} == own
    assert module[0].head.weight is module[0].embed.weight
    assert torch.equal(module[0].norm.running_mean, torch.zeros(6))


def test_a_bound_call_restores_the_module_when_its_forward_raises_and_rejects_unlike_tied_tensors() -> None:
    module = nn.Sequential(Tied())
    call = bind(module)
    weight = module[0].embed.weight
    with pytest.raises(IndexError):
        call(given(module, 0), torch.tensor([99]))  # out of the embedding's range
    assert module[0].embed.weight is weight and module[0].head.weight is weight
    tensors = given(module, 0)
    tensors["0.head.weight"] = torch.randn(11, 6)
    with pytest.raises(ValueError, match="tied"):
        call(tensors, torch.tensor([1]))
    assert module[0].head.weight is weight


def test_a_bound_call_given_a_name_the_module_does_not_hold_as_a_weight_calls_functional_call() -> None:
    """A plain tensor attribute is not a parameter or buffer: functional_call sets it for the call."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 3)
            self.scale = torch.ones(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) * self.scale

    module = nn.Sequential(Scaled())
    call = bind(module)
    tensors = {"0.linear.weight": torch.eye(3), "0.linear.bias": torch.zeros(3), "0.scale": torch.full((3,), 2.0)}
    x = torch.randn(4, 3)
    assert torch.equal(call(tensors, x), 2 * x)
    assert torch.equal(module[0].scale, torch.ones(3))


def test_a_bound_call_through_a_layer_used_twice_leaves_its_own_parameters_in_place() -> None:
    """A layer applied twice (the same module under two names) has its slot swapped twice in one call: undone in
    reverse, the module ends holding its own parameters, not the call's (torch.func.functional_call, undoing them
    in order, leaves the call's there)."""
    shared = nn.Linear(3, 3)
    module = nn.Sequential(shared, nn.Tanh(), shared)
    call = bind(module)
    own = shared.weight
    weight, bias = torch.randn(3, 3), torch.randn(3)
    x = torch.randn(2, 3)
    once = torch.nn.functional.linear(x, weight, bias)
    expected = torch.nn.functional.linear(torch.tanh(once), weight, bias)
    assert torch.equal(call({"0.weight": weight, "0.bias": bias}, x), expected)
    assert shared.weight is own and module[2].weight is own


def test_a_bound_module_is_freed_with_its_last_reference() -> None:
    """bind looks a module's names up once and keeps them while the module lives: a worker's packs of an ended run, a
    trial array's template, go when nothing else holds them."""
    module = nn.Sequential(nn.Linear(3, 3))
    call = bind(module)
    assert torch.equal(call({"0.weight": torch.eye(3), "0.bias": torch.zeros(3)}, torch.ones(1, 3)), torch.ones(1, 3))
    gone = weakref.ref(module)
    del module, call
    gc.collect()
    assert gone() is None


def test_bound_holds_the_tensors_in_place_for_a_block_and_calls_inside_it_swap_their_own() -> None:
    module = nn.Sequential(nn.Linear(3, 3))
    own = module[0].weight
    held = {"0.weight": torch.eye(3), "0.bias": torch.zeros(3)}
    with bound(module, held):
        assert module[0].weight is held["0.weight"]
        x = torch.ones(1, 3)
        assert torch.equal(module(x), x)
        assert torch.equal(bind(module)({"0.weight": 2 * torch.eye(3)}, x), 2 * x)
        assert module[0].weight is held["0.weight"]
    assert module[0].weight is own
