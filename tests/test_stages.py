"""Stages: a module that is not a chain, cut by tracing its forward where a single value flows."""

from __future__ import annotations

import cloudpickle
import torch
from torch import nn

from harmony.runtime.stages import trace_stages
from tests.conftest import ResidualBlock, ResidualNet


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else self.b(x)


def test_a_residual_net_is_cut_between_its_blocks_and_computes_what_it_computed() -> None:
    torch.manual_seed(0)
    net = ResidualNet(width=16, blocks=4, inputs=8, outputs=3)
    stages, how = trace_stages(net)
    assert "stages where one value flows" in how
    descriptions = [stage.harmony_description for stage in stages]
    assert "blocks.0.norm .. blocks.0.b" in descriptions and descriptions[-1] == "head"
    assert not any("blocks.0" in d and "blocks.1" in d for d in descriptions), "a residual block is never split"
    x = torch.randn(5, 8)
    y = x
    for stage in stages:
        y = stage(y)
    torch.testing.assert_close(y, net(x), rtol=0, atol=0)
    assert stages[0].stem.weight is net.stem.weight, "stages train the user's own parameters"
    assert sum(p.numel() for stage in stages for p in stage.parameters()) == sum(p.numel() for p in net.parameters())


def test_a_block_whose_residual_is_live_throughout_is_not_cut_and_an_untraceable_one_says_why() -> None:
    block = ResidualBlock(8)
    stages, how = trace_stages(block)
    assert stages == [block] and "no point" in how
    untraceable = DataDependent()
    stages, how = trace_stages(untraceable)
    assert stages == [untraceable] and "not traceable by torch.fx" in how


def test_a_stage_travels_to_workers_as_a_pickle() -> None:
    stages, _ = trace_stages(ResidualNet(width=16, blocks=4, inputs=8, outputs=3))
    copy = cloudpickle.loads(cloudpickle.dumps(stages[2]))
    x = torch.randn(3, 16)
    torch.testing.assert_close(copy(x), stages[2](x))
