"""The same exactness and budget checks on CUDA devices; skipped on machines without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import harmony
from tests.conftest import assert_same_weights, clones, deep_mlp, regression_batches, train_plain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_device_matches_plain_pytorch(no_leaks: None) -> None:
    models = [deep_mlp(seed=s) for s in range(2)]
    references = clones(models)
    batches = regression_batches(samples=64, batch=16)
    factory = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=4,
                           devices=["cuda:0"], device_memory=24_000, progress=False)
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, rtol=1e-4, atol=1e-6)
    assert max(result.stats.peak_device_bytes.values()) <= 24_000
