"""Embedding lookups with a padding row in fused arrays: torch's vmap gives every member but the first a gradient in
its padding row where the indices are batched; runtime.padding computes the lookup so that none gets one."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from harmony.runtime.array import ArrayLayer
from harmony.runtime.padding import PaddedLookups, lookup, pads

INDICES = torch.tensor([[1, 2, 1, 0], [3, 1, 4, 1]])


def member_grads(members: list[nn.Module], indices: torch.Tensor) -> list[torch.Tensor]:
    grads = []
    for member, own in zip(members, indices):
        weight = member.weight.detach().clone().requires_grad_()
        (torch.func.functional_call(member, {"weight": weight}, (own,)) * torch.arange(3.0)).sum().backward()
        grads.append(weight.grad)
    return grads


def test_vmap_gives_the_padding_row_of_every_member_but_the_first_a_gradient_where_indices_are_batched() -> None:
    """What runtime.padding works around: if torch fixes it, this fails and the workaround can go."""
    weights = torch.randn(2, 5, 3, requires_grad=True)
    indices = INDICES.unsqueeze(0).expand(2, -1, -1)
    torch.func.vmap(lambda w, i: nn.functional.embedding(i, w, padding_idx=1))(weights, indices).sum().backward()
    assert weights.grad[0, 1].abs().sum() == 0 and weights.grad[1, 1].abs().sum() > 0


@pytest.mark.parametrize("padding", [1, -4])
def test_a_lookup_computes_an_embeddings_values_and_gradient_bit_for_bit(padding: int) -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(5, 3, padding_idx=padding)
    weight = embedding.weight.detach().clone().requires_grad_()
    upstream = torch.randn(2, 4, 3)
    (embedding(INDICES) * upstream).sum().backward()
    out = lookup(weight, INDICES, padding % 5)
    (out * upstream).sum().backward()
    assert torch.equal(out, embedding(INDICES))
    assert torch.equal(weight.grad, embedding.weight.grad) and weight.grad[1].abs().sum() == 0


def test_an_array_of_embeddings_with_a_padding_row_on_batched_indices_gives_each_member_its_own_gradient() -> None:
    """Each member looks up its own indices (an array layer after the first): every member's padding row gets no
    gradient and the rest are the member's own, bit for bit (member 1's padding row got one before)."""
    torch.manual_seed(0)
    members = [nn.Embedding(5, 3, padding_idx=1) for _ in range(3)]
    indices = torch.stack([INDICES, INDICES.flip(1), INDICES.roll(1)])
    array = ArrayLayer(members, shared_input=False)
    assert array.pads
    out = array(indices)
    (out * torch.arange(3.0)).sum().backward()
    for index, (member, grad) in enumerate(zip(members, member_grads(members, indices))):
        assert torch.equal(out[index], member(indices[index]))
        assert torch.equal(array.stacked("weight", grad=True)[index], grad), index


def test_an_exported_graphs_lookup_with_a_padding_row_runs_as_one_without_it_within_the_mode() -> None:
    """An exported graph calls the operator with its padding row as a number: the mode computes it as lookup does;
    a lookup with frequency scaling is left as it is."""
    weight = torch.randn(5, 3)
    with PaddedLookups():
        assert torch.equal(torch.ops.aten.embedding.default(weight, INDICES, 1), weight[INDICES])
        assert torch.equal(nn.functional.embedding(INDICES, weight, padding_idx=1, scale_grad_by_freq=True),
                           weight[INDICES])


def test_pads_finds_embeddings_with_a_padding_row_and_traced_graphs_that_look_rows_up() -> None:
    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(5, 3))

        def forward(self, indices: torch.Tensor) -> torch.Tensor:
            return nn.functional.embedding(indices, self.weight, padding_idx=0)

    assert pads(nn.Sequential(nn.Embedding(5, 3, padding_idx=0), nn.ReLU()))
    assert not pads(nn.Sequential(nn.Embedding(5, 3), nn.ReLU()))
    assert pads(fx.symbolic_trace(Lookup()))
    assert not pads(fx.symbolic_trace(nn.Linear(3, 3)))
