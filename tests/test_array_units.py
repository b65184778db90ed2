"""Fused arrays in isolation: array layers compute what their members compute, array optimizers step like theirs."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from harmony.runtime.array import ArrayLayer, array_loss, layer_signature
from harmony.runtime.array_optimizer import ArrayOptimizer, StackedOptimizer, optimizer_params, step_optimizer
from harmony.tasks.fusion import candidate_sizes, choose_size, fusion_groups, split


class Block(nn.Module):
    """Self-attention with a residual and a LayerNorm: one layer of a transformer, kept whole."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.attention(x, x, x, need_weights=False)[0])


LAYERS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "linear": (lambda: nn.Linear(6, 5), lambda: torch.randn(4, 6)),
    "linear-3d": (lambda: nn.Linear(6, 5, bias=False), lambda: torch.randn(4, 3, 6)),
    "conv-batchnorm": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()),
                       lambda: torch.randn(4, 3, 7, 7)),
    "batchnorm1d": (lambda: nn.BatchNorm1d(6), lambda: torch.randn(4, 6)),
    "batchnorm2d-no-affine": (lambda: nn.BatchNorm2d(3, affine=False, momentum=0.3), lambda: torch.randn(4, 3, 5, 5)),
    "batchnorm1d-eval": (lambda: nn.BatchNorm1d(6).eval(), lambda: torch.randn(4, 6, 2)),
    "embedding-layernorm": (lambda: nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8)),
                            lambda: torch.randint(0, 10, (4, 5))),
    "attention-block": (Block, lambda: torch.randn(4, 5, 8)),
    "transformer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                    lambda: torch.randn(4, 5, 8)),
    "gelu": (nn.GELU, lambda: torch.randn(4, 6)),
    "flatten": (nn.Flatten, lambda: torch.randn(4, 2, 3)),
}


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("shared", [True, False], ids=["shared-input", "stacked-input"])
def test_an_array_layer_computes_each_members_forward_and_backward(name: str, shared: bool) -> None:
    make, data = LAYERS[name]
    torch.manual_seed(0)
    members = [make() for _ in range(3)]
    references = [copy.deepcopy(member) for member in members]
    array = ArrayLayer(members, shared_input=shared)
    inputs = [data() for _ in range(3)]
    x = inputs[0].clone() if shared else torch.stack(inputs)
    x.requires_grad_(x.is_floating_point())
    for value in inputs:
        value.requires_grad_(value.is_floating_point())
    out = array(x)
    out.pow(2).sum().backward()
    for index, reference in enumerate(references):
        expected = reference(inputs[0] if shared else inputs[index])
        expected.pow(2).sum().backward()
        torch.testing.assert_close(out[index], expected, rtol=1e-5, atol=1e-6)
        for param_name, param in reference.named_parameters():
            torch.testing.assert_close(array.stacked(param_name, grad=True)[index], param.grad, rtol=1e-4, atol=1e-4)
        for buffer_name, buffer in reference.named_buffers():
            torch.testing.assert_close(array.stacked(buffer_name)[index], buffer)
    array.unstack_into(members)
    for member, reference in zip(members, references):
        for (_, got), (_, want) in zip(member.state_dict().items(), reference.state_dict().items()):
            torch.testing.assert_close(got, want)


def test_linear_layers_run_as_one_batched_matmul_and_dropout_draws_per_member() -> None:
    assert ArrayLayer([nn.Linear(3, 3) for _ in range(2)], shared_input=True).kind == "linear"
    assert ArrayLayer([nn.BatchNorm2d(3) for _ in range(2)], shared_input=False).kind == "batchnorm"
    assert ArrayLayer([nn.BatchNorm2d(3, momentum=None) for _ in range(2)], shared_input=False).kind == "vmap"
    dropout = ArrayLayer([nn.Dropout(0.5) for _ in range(4)], shared_input=False)
    masks = dropout(torch.ones(4, 1000)) == 0
    assert all(not torch.equal(masks[0], masks[index]) for index in range(1, 4))
    assert 0.4 < masks.float().mean() < 0.6


def test_layer_signatures_tell_configurations_apart() -> None:
    assert layer_signature(nn.Linear(4, 3)) == layer_signature(nn.Linear(4, 3))
    assert layer_signature(nn.Linear(4, 3)) != layer_signature(nn.Linear(4, 2))
    assert layer_signature(nn.Dropout(0.1)) != layer_signature(nn.Dropout(0.5))
    assert layer_signature(nn.LeakyReLU(0.1)) != layer_signature(nn.LeakyReLU(0.2))
    assert layer_signature(nn.Linear(4, 3)) != layer_signature(nn.Linear(4, 3).double())
    assert layer_signature(nn.BatchNorm1d(3)) != layer_signature(nn.BatchNorm1d(3).eval())


def test_array_losses_are_per_member_and_vectorized_only_when_the_losses_agree() -> None:
    output, target = torch.randn(3, 4, 5), torch.randint(0, 5, (4,))
    same = array_loss([nn.CrossEntropyLoss()] * 3, output, target)
    mixed = array_loss([nn.CrossEntropyLoss(), nn.CrossEntropyLoss(label_smoothing=0.1), nn.CrossEntropyLoss()],
                       output, target)
    assert same.mode == "cross_entropy" and mixed.mode == "loop"
    regression, goal = torch.randn(3, 4, 2), torch.randn(4, 2)
    for losses, mode in (([nn.functional.mse_loss] * 3, "mse"), ([nn.SmoothL1Loss()] * 3, "vmap")):
        chosen = array_loss(losses, regression, goal)
        assert chosen.mode == mode
        torch.testing.assert_close(chosen(regression, goal),
                                   torch.stack([losses[0](regression[i], goal) for i in range(3)]))
    expected = torch.stack([nn.functional.cross_entropy(output[i], target) for i in range(3)])
    torch.testing.assert_close(same(output, target), expected)
    assert mixed(output, target)[1] != expected[1]
    torch.testing.assert_close(mixed(output, target)[::2], expected[::2])


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
    "rmsprop-merged": [
        lambda p: torch.optim.RMSprop(p, lr=1e-3),
        lambda p: torch.optim.RMSprop(p, lr=5e-3, momentum=0.5),
    ],
}


@pytest.mark.parametrize("name", list(HYPERPARAMETERS))
def test_an_array_optimizer_steps_every_member_as_its_own_optimizer_would(name: str) -> None:
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
            step_optimizer(array)  # the runtime's
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


def test_fusion_groups_sizes_and_splits() -> None:
    assert fusion_groups(["a", "b", "a", None, "b", "c", None]) == [[0, 2], [1, 4]]
    assert candidate_sizes(1) == [1]
    assert candidate_sizes(6) == [1, 2, 4, 6]
    assert candidate_sizes(16) == [1, 2, 4, 8, 16]
    assert split(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert split(list(range(4)), 4) == [[0, 1, 2, 3]]
    assert choose_size(range(4), {1: 4.0, 2: 2.0, 4: 2.0}).size == 4
    assert choose_size(range(4), {1: 4.0, 2: 1.0, 4: 2.0}).size == 2
    assert choose_size(range(4), {1: 4.0, 2: None, 4: None}).size == 1
    assert choose_size(range(4), {2: None, 4: None}).size == 1
    assert "does not fit" in choose_size(range(4), {1: 4.0, 2: None}).explain("MLP")

