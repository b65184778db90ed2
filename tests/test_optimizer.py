"""A swapped pack's update on the host store: applied once, by version, into the other slot, its state kept there."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.files import Versions, grads_name, slot_bytes, versions_name, weights_name, weights_slot
from harmony.runtime.hoststore import HostStore, tensors_at
from harmony.runtime.optimizer import PackOptimizer, update
from harmony.runtime.optimstate import OptimizerState
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
def test_a_packs_updates_alternate_slots_keep_their_state_in_the_store_and_apply_once(
    store: HostStore, factory
) -> None:
    """Each step as another worker would take it up (a fresh optimizer), each update written into the other slot
    and published by version; an update run again (its worker died after it) changes nothing."""
    module = nn.Sequential(nn.Linear(3, 2))
    reference = copy.deepcopy(module)
    runtime = _pack_runtime(module)
    mapped = store.create(weights_name(0, 0), 2 * slot_bytes(runtime.weights.nbytes))
    host_g = store.create(grads_name(0, 0), runtime.grads.nbytes)
    versions = Versions(store.create(versions_name(0), 8))
    for slot in (0, 1):
        for name, view in tensors_at(weights_slot(mapped, slot, runtime.weights.nbytes), runtime.weights).items():
            view.copy_(dict(module.named_parameters())[name].detach())
    ref_opt = factory(reference.parameters())
    torch.manual_seed(0)

    def weights(slot: int) -> torch.Tensor:
        return weights_slot(mapped, slot, runtime.weights.nbytes)

    def optimizer(slot: int) -> PackOptimizer:
        return PackOptimizer(factory, weights(slot), host_g, runtime, OptimizerState(store, 0, 0))

    for step in range(4):
        grads = [torch.randn_like(p) for p in reference.parameters()]
        for p, g in zip(reference.parameters(), grads):
            p.grad = g.clone()
        ref_opt.step()
        for view, g in zip(tensors_at(host_g, runtime.grads).values(), grads):
            view.copy_(g)
        assert update(runtime, versions, 0, step, weights, optimizer, [])
        assert not update(runtime, versions, 0, step, weights, optimizer, []), "applied twice"
        assert versions.current(0) == (step + 1, (step + 1) % 2)
    _, slot = versions.current(0)
    for (name, p) in reference.named_parameters():
        torch.testing.assert_close(tensors_at(weights(slot), runtime.weights)[name], p.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="came before"):
        update(runtime, versions, 0, 6, weights, optimizer, [])


def test_host_updates_use_the_fused_cpu_kernel_unless_the_factory_chose_an_implementation() -> None:
    from harmony.runtime.optimizer import fused_on_host

    def built(factory: object) -> torch.optim.Optimizer:
        optimizer = factory([nn.Parameter(torch.randn(3))])  # type: ignore[operator]
        fused_on_host(optimizer)
        return optimizer

    assert built(lambda p: torch.optim.Adam(p, lr=0.1)).param_groups[0]["fused"] is True
    assert built(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)).param_groups[0]["fused"] is True
    assert built(lambda p: torch.optim.Adam(p, lr=0.1, foreach=False)).param_groups[0]["fused"] is None
    assert built(lambda p: torch.optim.Adam(p, lr=0.1, fused=False)).param_groups[0]["fused"] is False
    assert "fused" not in built(lambda p: torch.optim.RMSprop(p, lr=0.1)).param_groups[0]
