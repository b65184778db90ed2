"""Attention of fused members folded into one call: the values and gradients of vmap's loop over the members, with
no loop (vmap's fallback warning is the loop's sign)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.func import vmap

from harmony.runtime import attention
from harmony.runtime.array import ArrayLayer
from harmony.runtime.attention import FoldedAttention
from harmony.runtime.attention import folded as fold

MEMBERS, BATCH, HEADS, TOKENS, FEATURES = 3, 2, 4, 5, 8


def loop_and_folded(call: Callable[..., torch.Tensor], inputs: list[torch.Tensor], dims: tuple[int | None, ...]
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """call on each member's inputs (dims: each input's member dimension, None where shared) and under vmap with
    FoldedAttention: each one's output and gradients, and how many calls the mode folded. The loop reads a shared
    input through one expanded view, so that its gradient sums the members' in the order folding does."""
    upstream = None
    results = []
    for folded in (False, True):
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        if folded:
            with FoldedAttention() as mode:
                out = vmap(call, in_dims=dims, randomness="different")(*leaves)
            assert mode.calls == 1
        else:
            own = [t.expand(MEMBERS, *t.shape) if d is None else t.movedim(d, 0) for t, d in zip(leaves, dims)]
            out = torch.stack([call(*[t[i] for t in own]) for i in range(MEMBERS)])
        upstream = torch.randn_like(out) if upstream is None else upstream
        (out * upstream).sum().backward()
        results.append([out.detach(), *[t.grad for t in leaves if t.requires_grad]])
    return results[0], results[1], mode.folds


def qkv(heads: int = HEADS) -> list[torch.Tensor]:
    return [torch.randn(MEMBERS, BATCH, h, TOKENS, FEATURES, dtype=torch.float64) for h in (HEADS, heads, heads)]


@pytest.mark.parametrize("case", ["plain", "causal", "scaled", "grouped", "a member a call"])
def test_folded_attention_gives_the_loops_values_and_gradients_bit_for_bit(case: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The last case folds the members one call each, as where members x batch exceed what one call of CUDA's
    kernels takes (their rows here)."""
    torch.manual_seed(0)
    if case == "a member a call":
        monkeypatch.setattr(attention, "ROWS", BATCH)
        assert attention._per_call(torch.empty(BATCH, HEADS, TOKENS, FEATURES)) == 1
    kwargs = {"causal": {"is_causal": True}, "scaled": {"scale": 0.3}, "grouped": {"enable_gqa": True}}.get(case, {})

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)

    loop, folded, folds = loop_and_folded(call, qkv(2 if case == "grouped" else HEADS), (0, 0, 0))
    assert folds == 1
    for expected, got in zip(loop, folded):
        assert torch.equal(expected, got)


@pytest.mark.parametrize("mask", ["per member", "shared per row", "shared", "shared square", "per member boolean"])
def test_a_mask_of_members_or_shared_by_them_is_folded_with_them(mask: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    shapes = {"per member": (MEMBERS, BATCH, 1, TOKENS, TOKENS), "shared per row": (BATCH, 1, TOKENS, TOKENS),
              "shared": (1, 1, TOKENS, TOKENS), "shared square": (TOKENS, TOKENS),
              "per member boolean": (MEMBERS, BATCH, HEADS, TOKENS, TOKENS)}
    values = torch.randn(shapes[mask], dtype=torch.float64)
    masks = values > -0.5 if "boolean" in mask else values

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *own: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=own[0] if own else masks)

    per_member = "per member" in mask  # a mask of the members' own, with a gradient; a shared one is a constant
    inputs = [*qkv(), *[masks] * per_member]
    state = torch.get_rng_state()
    loop, folded, folds = loop_and_folded(call, inputs, (0, 0, 0, *[0] * per_member))
    assert folds == 1
    monkeypatch.setattr(attention, "ROWS", BATCH)  # a member a call: each its own rows of the mask
    torch.set_rng_state(state)  # the same upstream gradient
    _, by_member, folds = loop_and_folded(call, inputs, (0, 0, 0, *[0] * per_member))
    assert folds == 1 and all(torch.equal(a, b) for a, b in zip(by_member, loop))
    for expected, got in zip(loop, folded):
        assert torch.equal(expected, got)


def test_shared_keys_and_values_are_folded_too() -> None:
    torch.manual_seed(2)
    q, k, v = qkv()

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v)

    loop, folded, folds = loop_and_folded(call, [q, k[0], v[0]], (0, None, None))
    assert folds == 1
    for expected, got in zip(loop, folded):
        assert torch.equal(expected, got)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap's loop, which then raises
def test_a_learned_mask_broadcast_over_the_batch_is_differentiated_as_plain_pytorch_does_expanded() -> None:
    """A bias learned per member, broadcast over the batch: vmap's loop cannot differentiate it (fails when torch
    can, and the case is then checked against it); folded, its gradient is summed over the batch as plain PyTorch
    sums it where each member's mask is expanded to the batch, bit for bit, and the rest is the loop's."""
    torch.manual_seed(5)
    bias = torch.randn(MEMBERS, 1, HEADS, TOKENS, TOKENS, dtype=torch.float64)
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'attn_mask'"):
        vmap(nn.functional.scaled_dot_product_attention)(q, k, v, bias.clone().requires_grad_())

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)

    def expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return call(q, k, v, m.expand(BATCH, -1, -1, -1))

    torch.manual_seed(6)  # the same upstream gradient for both
    loop, folded, folds = loop_and_folded(call, [q, k, v, bias], (0, 0, 0, 0))
    torch.manual_seed(6)
    explicit, _, _ = loop_and_folded(expanded, [q, k, v, bias], (0, 0, 0, 0))
    assert folds == 1
    for expected, got in zip(loop[:4], folded[:4]):
        assert torch.equal(expected, got)
    assert torch.equal(explicit[4], folded[4])


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_attention_with_dropout_draws_for_members_by_batch_at_once(randomness: str) -> None:
    """Folded below the vmap, a dropout draws its masks for members x batch in one call (each member its own, as
    randomness="different" asks): the values of one call over the folded batch from the same generator state, and
    its gradients. Under randomness="same" (members drawing alike) the call keeps vmap's loop."""
    torch.manual_seed(3)
    q = torch.randn(1, BATCH, HEADS, TOKENS, FEATURES).expand(MEMBERS, -1, -1, -1, -1).clone().requires_grad_()
    expected_q = q.detach().clone().requires_grad_()
    torch.manual_seed(4)
    with FoldedAttention() as mode:
        out = vmap(lambda t: nn.functional.scaled_dot_product_attention(t, t, t, dropout_p=0.5),
                   randomness=randomness)(q)
    out.sum().backward()
    if randomness == "same":
        assert (mode.calls, mode.folds) == (1, 0) and torch.equal(out[0], out[1])
        return
    assert (mode.calls, mode.folds) == (1, 1) and not torch.equal(out[0], out[1])
    torch.manual_seed(4)
    flat = expected_q.flatten(0, 1)
    expected = nn.functional.scaled_dot_product_attention(flat, flat, flat, dropout_p=0.5).unflatten(0, (MEMBERS, -1))
    expected.sum().backward()
    assert torch.equal(out, expected) and torch.equal(q.grad, expected_q.grad)


class SelfAttention(nn.Module):
    """Attention over its input's tokens, as a Hugging Face attention layer calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(FEATURES, 3 * FEATURES, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)


class MultiHead(nn.Module):
    """Self-attention through nn.MultiheadAttention (torchvision's ViT, nn.TransformerEncoderLayer)."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(FEATURES, 2, batch_first=True, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("kind", [SelfAttention, MultiHead], ids=["attention", "nn.MultiheadAttention"])
def test_an_array_layer_folds_its_members_attention_and_knows_after_its_first_call_whether_it_attends(
        kind: type[nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer that never calls attention runs without the mode after its first call; one that does keeps it, and
    gives vmap's loop's output and gradients bit for bit: a layer that calls attention itself, and
    nn.MultiheadAttention, which calls it from within its functional form."""
    convs = ArrayLayer([nn.Conv1d(2, 2, 3) for _ in range(2)], shared_input=False)
    assert convs.attends is None
    convs(torch.randn(2, 4, 2, 6))
    assert convs.attends is False
    torch.manual_seed(6)
    members = [kind() for _ in range(MEMBERS)]
    x = torch.randn(MEMBERS, BATCH, TOKENS, FEATURES, dtype=torch.float64)
    upstream = torch.randn(MEMBERS, BATCH, TOKENS, FEATURES, dtype=torch.float64)
    folds = []
    monkeypatch.setattr(attention, "folded", lambda *args, **kwargs: folds.append(fold(*args, **kwargs)) or folds[-1])
    results = []
    for folding in (False, True):
        array = ArrayLayer(members, shared_input=False)
        array.attends = None if folding else False
        for _ in range(2):
            out = array(x)
            assert array.attends is folding
        assert len(folds) == 2 * folding and all(out is not None for out in folds)
        (out * upstream).sum().backward()
        results.append([out.detach(), *[array.stacked(name, grad=True) for name, _ in members[0].named_parameters()]])
    for loop, folded in zip(*results):
        assert torch.equal(loop, folded)
