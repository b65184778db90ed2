"""Tensors through Dask's serialization, bf16 included."""

from __future__ import annotations

import pytest
import torch
from distributed.protocol import deserialize, serialize

from harmony.runtime import handoff, serialization  # noqa: F401


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_tensors_round_trip_through_dask_serialization(dtype: torch.dtype) -> None:
    tensor = (torch.arange(12).reshape(3, 4) * 3).to(dtype)
    header, frames = serialize(tensor)
    back = deserialize(header, frames)
    assert back.dtype == dtype and torch.equal(back, tensor)
    sliced = tensor[1:]
    assert torch.equal(deserialize(*serialize(sliced)), sliced)
