"""runtime.compiled: a compiled pack call computes the eager one and leaves its module as it was."""

from __future__ import annotations

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
