"""Skeletons: a pack's modules travel to workers without their weights."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.reparametrize import bind
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


def test_a_parametrized_module_travels_as_its_class_and_state_and_computes_as_it_does() -> None:
    """torch refuses to pickle a module with a parametrization (weight_norm, spectral_norm): its skeleton is its
    class and state, parametrized again where it is loaded, and computes from the given originals."""
    torch.manual_seed(0)
    module = nn.Sequential(parametrizations.weight_norm(nn.Linear(6, 6)), nn.Tanh(),
                           parametrizations.spectral_norm(nn.Linear(6, 3))).eval()
    skeleton = load_skeleton(dump_skeleton(module))
    assert all(parametrize.is_parametrized(layer, "weight") for layer in (skeleton[0], skeleton[2]))
    assert type(skeleton[0]).__name__ == "ParametrizedLinear" and isinstance(skeleton[0], nn.Linear)
    assert skeleton[0].parametrizations.weight.original0.device.type == "meta"
    tensors = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    assert {name for name, _ in skeleton.named_parameters()} | {name for name, _ in skeleton.named_buffers()} \
        == set(tensors)
    x = torch.randn(4, 6)
    torch.testing.assert_close(bind(skeleton.eval())(tensors, x), module(x), rtol=0, atol=0)
    load_skeleton(dump_skeleton(skeleton))  # and again, from where it landed
