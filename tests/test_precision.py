"""Mixed precision: precision="bf16" trains as a plain loop under torch.autocast(bfloat16) does, for swapped,
homed and fused models; weights and optimizer state stay float32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import harmony
from harmony.errors import InputError
from tests.conftest import deep_mlp, regression_batches

MICROBATCHES = 2


def adam(parameters: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(parameters, lr=1e-3)  # type: ignore[arg-type]


def plain(model: nn.Module, batches: list, microbatches: int, autocast: bool) -> nn.Module:
    """The plain loop: gradients accumulated over micro-batches, forward and loss under autocast when asked."""
    optimizer = adam(model.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = nn.functional.mse_loss(model(xs), ys) * (len(xs) / len(x))
            loss.backward()
        optimizer.step()
    return model


def distance(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("case", ["swapped", "homed", "fused"])
def test_bf16_trains_as_a_plain_loop_under_autocast(case: str, no_leaks: None) -> None:
    models = [deep_mlp(seed=seed) for seed in range(3 if case == "fused" else 1)]
    batches = regression_batches(samples=16 * 6, batch=16)
    references = [copy.deepcopy(model) for model in models]
    budget = 24_000 if case == "swapped" else None  # under half the model
    result = harmony.train(models, batches, nn.functional.mse_loss, adam, microbatches=MICROBATCHES, devices=2,
                           device_memory=budget, fuse=case == "fused", precision="bf16", progress=False)
    if case == "swapped":
        assert len(result.packings[0].packs) > 1 and not result.homes
    if case == "homed":
        assert result.homes
    if case == "fused":
        assert result.arrays == [[0, 1, 2]]
    for model, reference in zip(models, references):
        assert all(p.dtype == torch.float32 for p in model.parameters()), "master weights stay float32"
        micro = plain(copy.deepcopy(reference), batches, MICROBATCHES, autocast=True)
        whole = plain(copy.deepcopy(reference), batches, 1, autocast=True)
        full = plain(copy.deepcopy(reference), batches, MICROBATCHES, autocast=False)
        noise = distance(micro, whole)  # plain PyTorch's own micro-batching difference under the same autocast
        assert noise > 0
        assert distance(model, micro) <= noise, (distance(model, micro), noise)
        assert distance(model, full) > 10 * distance(model, micro), "it computed in bfloat16, not float32"


def test_fp16_and_unknown_precisions_are_refused_before_work_starts() -> None:
    for precision, message in (("fp16", "gradient scaler"), ("int8", "is not a precision")):
        with pytest.raises(InputError, match=message):
            harmony.train(nn.Linear(4, 1), [(torch.randn(4, 4), torch.randn(4, 1))], nn.functional.mse_loss, adam,
                          precision=precision, progress=False)
