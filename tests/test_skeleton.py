"""Skeletons: a pack's modules travel to workers without their weights."""

from __future__ import annotations

import torch
from torch import nn

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.skeleton import dump_skeleton, load_skeleton


def test_skeleton_carries_structure_without_weights() -> None:
    module = nn.Sequential(nn.Linear(1000, 1000), nn.BatchNorm1d(1000))
    data = dump_skeleton(module)
    assert len(data) < 20_000
    skeleton = load_skeleton(data)
    assert skeleton[0].weight.device.type == "meta"
    params = {k: v.detach() for k, v in module.state_dict().items()}
    x = torch.randn(4, 1000)
    out = torch.func.functional_call(skeleton, params, (x,))
    torch.testing.assert_close(out, module(x))
