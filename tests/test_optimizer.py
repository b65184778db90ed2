"""A pack's optimizer on the host store: its state lives there and survives a rebuild on another worker."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.files import grads_name, weights_name
from harmony.runtime.hoststore import HostStore, tensors_at
from harmony.runtime.optimizer import PackOptimizer
from harmony.runtime.skeleton import dump_skeleton
from harmony.runtime.spec import PackRuntime
from harmony.tasks.layout import TensorSpec, lay_out


def _pack_runtime(module: nn.Module) -> PackRuntime:
    weights = lay_out([TensorSpec(n, "float32", tuple(p.shape)) for n, p in module.named_parameters()])
    return PackRuntime(dump_skeleton(module), weights, weights, weights.nbytes, 0)


@pytest.mark.parametrize(
    "factory",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.Adam(p, lr=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
        lambda p: torch.optim.Adagrad(p, lr=0.1),
    ],
)
def test_pack_optimizer_state_lives_in_the_store_and_survives_a_rebuild(store: HostStore, factory) -> None:
    module = nn.Sequential(nn.Linear(3, 2))
    reference = copy.deepcopy(module)
    runtime = _pack_runtime(module)
    host_w = store.create(weights_name(0, 0), runtime.weights.nbytes)
    host_g = store.create(grads_name(0, 0), runtime.grads.nbytes)
    for name, view in tensors_at(host_w, runtime.weights).items():
        view.copy_(dict(module.named_parameters())[name].detach())
    ref_opt = factory(reference.parameters())
    torch.manual_seed(0)
    for step in range(4):
        grads = [torch.randn_like(p) for p in reference.parameters()]
        for p, g in zip(reference.parameters(), grads):
            p.grad = g.clone()
        ref_opt.step()
        for view, g in zip(tensors_at(host_g, runtime.grads).values(), grads):
            view.copy_(g)
        optimizer = PackOptimizer(factory, store, 0, 0, runtime)
        assert optimizer.last_step == step - 1
        optimizer.step(step)
    for (name, p) in reference.named_parameters():
        torch.testing.assert_close(tensors_at(host_w, runtime.weights)[name], p.detach(), rtol=1e-6, atol=1e-7)
