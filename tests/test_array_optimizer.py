"""An array's optimizer steps every member as the member's own optimizer would."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from harmony.runtime.array_optimizer import (
    ArrayOptimizer,
    StackedOptimizer,
    optimizer_params,
    step_optimizer,
)

HYPERPARAMETERS: dict[str, list[Callable[[list[nn.Parameter]], torch.optim.Optimizer]]] = {
    "sgd": [
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.8, dampening=0.1),
        lambda p: torch.optim.SGD(p, lr=0.03, momentum=0.7, nesterov=True),
    ],
    "adam": [
        lambda p: torch.optim.Adam(p, lr=1e-3),
        lambda p: torch.optim.Adam(p, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
        lambda p: torch.optim.Adam(p, lr=2e-2, betas=(0.5, 0.9)),
    ],
    "adamw": [
        lambda p: torch.optim.AdamW(p, lr=1e-3),
        lambda p: torch.optim.AdamW(p, lr=5e-3, weight_decay=0.1, betas=(0.85, 0.995)),
    ],
    "maximized": [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, maximize=True),
        lambda p: torch.optim.SGD(p, lr=0.02, weight_decay=0.01, maximize=True),
    ],
    "adam-maximized": [
        lambda p: torch.optim.Adam(p, lr=1e-3, maximize=True),
        lambda p: torch.optim.Adam(p, lr=3e-3, weight_decay=0.01, maximize=True),
    ],
    "rmsprop-merged": [
        lambda p: torch.optim.RMSprop(p, lr=1e-3),
        lambda p: torch.optim.RMSprop(p, lr=5e-3, momentum=0.5),
    ],
}


@pytest.mark.parametrize("columns", [True, False], ids=["small", "large"])
@pytest.mark.parametrize("name", list(HYPERPARAMETERS))
def test_an_array_optimizer_steps_every_member_as_its_own_optimizer_would(
        name: str, columns: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small members' SGD goes stack by stack with per-member columns, large members' (and Adam's) member by
    member through torch's fused kernels: either is each member's own optimizer."""
    from harmony.runtime import array_optimizer

    monkeypatch.setattr(array_optimizer, "COLUMNS_ELEMENTS", array_optimizer.COLUMNS_ELEMENTS if columns else 0)
    factories = HYPERPARAMETERS[name]
    torch.manual_seed(0)
    shapes = [(5, 4), (5,), (3, 5)]
    members = [[nn.Parameter(torch.randn(shape)) for shape in shapes] for _ in factories]
    stacked = [nn.Parameter(torch.stack([m[k].detach() for m in members])) for k in range(len(shapes))]
    for param in stacked:
        param.grad = torch.zeros_like(param)
    optimizers = [factory(params) for factory, params in zip(factories, members)]
    array = ArrayOptimizer(factories)(stacked)
    assert isinstance(array, StackedOptimizer) == (name != "rmsprop-merged")
    assert len(optimizer_params(array)) == (len(shapes) if name != "rmsprop-merged" else len(shapes) * len(factories))
    for step in range(4):
        if step == 2:  # a schedule halves every learning rate: the array's columns follow from the next step
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= 0.5
            for group in array.param_groups:
                group["lr"] = [lr * 0.5 for lr in group["lr"]] if isinstance(group["lr"], list) else group["lr"] * 0.5
        grads = [torch.randn(len(factories), *shape) for shape in shapes]
        for param, grad in zip(stacked, grads):
            param.grad.copy_(grad)
        for index, params in enumerate(members):
            for param, grad in zip(params, grads):
                param.grad = grad[index].clone()
        if step % 2:
            array.step()  # torch's entry point
        else:
            step_optimizer(array, step)  # the runtime's
        for optimizer in optimizers:
            optimizer.step()
        for index, params in enumerate(members):
            for param, stack in zip(params, stacked):
                torch.testing.assert_close(stack.detach()[index], param.detach(), rtol=1e-6, atol=1e-7)


def test_an_array_optimizer_gives_each_factory_its_members_own_shapes_for_transposed_and_row_stacks() -> None:
    """An array stores linear weights transposed (members x in x out) and biases as rows (members x 1 x out); a
    factory that groups parameters by shape still sees each member's (out x in) weight and (out,) bias, and the
    update lands in the right elements."""
    torch.manual_seed(0)
    weights = [nn.Parameter(torch.randn(3, 5)) for _ in range(2)]
    biases = [nn.Parameter(torch.randn(3)) for _ in range(2)]

    def factory(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
        def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            assert [tuple(p.shape) for p in params] == [(3, 5), (3,)]
            return torch.optim.SGD([{"params": [p for p in params if p.dim() == 2], "weight_decay": 0.1},
                                    {"params": [p for p in params if p.dim() == 1]}], lr=lr, momentum=0.9)
        return build

    factories = [factory(0.1), factory(0.3)]
    members = [factory_(list(params)) for factory_, params in zip(factories, zip(weights, biases))]
    stacked_weight = nn.Parameter(torch.stack([w.detach().t() for w in weights]).contiguous())
    stacked_bias = nn.Parameter(torch.stack([b.detach() for b in biases]).unsqueeze(1))
    stacked_weight.grad, stacked_bias.grad = torch.zeros_like(stacked_weight), torch.zeros_like(stacked_bias)
    array = ArrayOptimizer(factories).build([stacked_weight, stacked_bias], ["0.weight^T", "0.bias^row"])
    for _ in range(3):
        for index in range(2):
            weights[index].grad, biases[index].grad = torch.randn(3, 5), torch.randn(3)
            stacked_weight.grad[index].copy_(weights[index].grad.t())
            stacked_bias.grad[index, 0].copy_(biases[index].grad)
        array.step()
        for member in members:
            member.step()
    for index in range(2):
        torch.testing.assert_close(stacked_weight.detach()[index].t(), weights[index].detach())
        torch.testing.assert_close(stacked_bias.detach()[index, 0], biases[index].detach())


@pytest.mark.parametrize("told", ["live", "stopped"])
@pytest.mark.parametrize("first", [0, 1], ids=["from-the-first-step", "later"])
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_a_stacked_optimizer_with_live_members_steps_their_rows_alone(name: str, first: int, told: str) -> None:
    """Members drop out (live: every member but the second from step `first`, then the first alone, a view of its
    rows): each live member's rows move as its own optimizer steps it, the others' stay where they stopped, also
    where the step makes the state (the rows of members that do not step zeros). Told as a homed array tells it
    (live) or as a host store's update does (the stopped members, for that step alone)."""
    factories = HYPERPARAMETERS[name]
    torch.manual_seed(1)
    shapes = [(5, 4), (5,)]
    members = [[nn.Parameter(torch.randn(shape)) for shape in shapes] for _ in factories]
    stacked = [nn.Parameter(torch.stack([m[k].detach() for m in members])) for k in range(len(shapes))]
    optimizers = [factory(params) for factory, params in zip(factories, members)]
    array = ArrayOptimizer(factories)(stacked)
    assert isinstance(array, StackedOptimizer)
    everyone = list(range(len(factories)))
    for step in range(5):
        live = None if step < first else [m for m in everyone if m != 1] if step < 3 else [0]
        grads = [torch.randn(len(factories), *shape) for shape in shapes]
        for param, grad in zip(stacked, grads):
            param.grad = grad.clone()
        if told == "live":
            array.live = live
            step_optimizer(array, step)
        else:
            step_optimizer(array, step, [] if live is None else [m for m in everyone if m not in live])
            assert array.live is None
        for index, (optimizer, params) in enumerate(zip(optimizers, members)):
            if live is None or index in live:
                for param, grad in zip(params, grads):
                    param.grad = grad[index].clone()
                optimizer.step()
        for index, params in enumerate(members):
            for param, stack in zip(params, stacked):
                torch.testing.assert_close(stack.detach()[index], param.detach(), rtol=1e-6, atol=1e-7)


def test_an_adam_state_with_one_count_for_every_member_is_refused_by_name() -> None:
    """A state saved before Adam's counts were per member (a checkpoint of an earlier Harmony) is not stepped as if
    it were one."""
    stacked = [nn.Parameter(torch.zeros(2, 3))]
    stacked[0].grad = torch.ones(2, 3)
    array = ArrayOptimizer([lambda p: torch.optim.Adam(p, lr=0.1)] * 2)(stacked)
    array.state[stacked[0]].update(step=torch.tensor(4.0), exp_avg=torch.zeros(2, 3), exp_avg_sq=torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="one step count for all its members"):
        step_optimizer(array, 4)
