"""runtime.compiled: a pack call computes what its module computes with the given tensors, and leaves it as it was."""

from __future__ import annotations

import gc

import torch
from torch import nn

from harmony.runtime.compiled import pack_call


def test_a_compiled_pack_of_a_layer_used_twice_computes_it_twice_and_leaves_its_own_tensors_in_place() -> None:
    """The pack's tensors name the layer once (its second place is an alias); functional_call, which the compiled
    code traces, leaves the call's tensor at the second place, and the call puts the module's own back."""
    shared = nn.Linear(4, 4)
    module = nn.Sequential(shared, nn.Tanh(), shared)
    own = [tensor for _, tensor in module.named_parameters(remove_duplicate=False)]
    call = pack_call(module, "twice", compile=True)
    weight, bias = torch.randn(4, 4), torch.randn(4)
    for _ in range(2):
        x = torch.randn(3, 4)
        expected = nn.functional.linear(torch.tanh(nn.functional.linear(x, weight, bias)), weight, bias)
        torch.testing.assert_close(call({"0.weight": weight, "0.bias": bias}, x), expected)
        after = [tensor for _, tensor in module.named_parameters(remove_duplicate=False)]
        assert len(after) == len(own) and all(a is b for a, b in zip(after, own))


def test_an_eager_pack_call_keeps_the_module_it_was_made_for() -> None:
    """The caller may hold the module only through its call."""
    call = pack_call(nn.Sequential(nn.Linear(3, 3)), "pack", compile=False)
    gc.collect()
    assert torch.equal(call({"0.weight": torch.eye(3), "0.bias": torch.zeros(3)}, torch.ones(1, 3)), torch.ones(1, 3))
