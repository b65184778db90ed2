"""Which weights a device may hold in autocast's dtype: those whose every use is an op autocast casts them for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harmony.runtime.halving import casts, unhalved


def halved(layer: nn.Module, x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> set[str]:
    return set(casts(layer, x, dtype, {name for name, _ in layer.named_parameters()}).only)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_and_convolution_weights_are_halved_and_norms_and_embeddings_are_not(dtype: torch.dtype) -> None:
    mlp = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    assert halved(mlp, torch.randn(2, 4), dtype) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    convolution = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    assert halved(convolution, torch.randn(2, 3, 8, 8), dtype) == {"0.weight", "0.bias"}
    embedding = nn.Embedding(10, 4)
    assert halved(embedding, torch.tensor([[1, 2]]), dtype) == set()


def test_unhalved_halves_nothing_and_keeps_what_is_read_in_the_low_dtype() -> None:
    mlp = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    names = {name for name, _ in mlp.named_parameters()}
    x = torch.randn(2, 4)
    found, none = casts(mlp, x, torch.bfloat16, names), unhalved(mlp, x, torch.bfloat16, names)
    assert found.only and none.only == frozenset()
    assert none.some == found.some


class Reads(nn.Module):
    """A weight read through an op autocast casts, and others read otherwise as well."""

    def __init__(self) -> None:
        super().__init__()
        self.matmul = nn.Parameter(torch.randn(4, 4))
        self.also_scaled = nn.Parameter(torch.randn(4, 4))
        self.viewed = nn.Parameter(torch.randn(4, 4))
        self.unscaled = nn.Parameter(torch.randn(4, 4))
        self.tied = nn.Embedding(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.matmul) + x.size(-1)
        y = torch.matmul(y, self.also_scaled) * self.also_scaled.sum()  # an elementwise use: stays float32
        y = y @ self.viewed.T  # a view first: its gradient would be summed in the low dtype
        with torch.autocast("cpu", enabled=False):
            y = torch.matmul(y.float(), self.unscaled)  # autocast is off here: it computes in float32
        return y + nn.functional.linear(y, self.tied.weight).sum() + self.tied(torch.tensor([0]))


def test_a_weight_with_any_other_use_stays_float32() -> None:
    assert halved(Reads(), torch.randn(2, 4)) == {"matmul"}


def test_every_weight_an_op_casts_is_copied_by_autocast_through_a_view_too() -> None:
    """What a float32 device copy costs in each forward (LayerProfile.copied): all but the one autocast is off for."""
    layer = Reads()
    copied = casts(layer, torch.randn(2, 4), torch.bfloat16, {name for name, _ in layer.named_parameters()}).some
    assert copied == {"matmul", "also_scaled", "viewed", "tied.weight"}


def test_a_conv1d_of_gpt2_is_halved() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    block = transformers.GPT2Model(config).h[0]
    names = halved(block, torch.randn(2, 8, 16))
    assert names == {f"{part}.{kind}" for part in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
                     for kind in ("weight", "bias")}


def test_a_layer_that_fails_under_autocast_or_holds_other_dtypes_halves_nothing() -> None:
    class Fails(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled("cpu"):
                raise RuntimeError("no autocast here")
            return super().forward(x)

    assert halved(Fails(4, 4), torch.randn(2, 4)) == set()
    assert halved(nn.Linear(4, 4).double(), torch.randn(2, 4, dtype=torch.float64)) == set()
