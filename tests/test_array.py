"""Array layers compute what their members compute, and array losses what each member's loss gives."""

from __future__ import annotations

import copy
import pickle
import types
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import fx, nn

from harmony.runtime.array import (
    FALLBACK_WARNING,
    ArrayLayer,
    array_loss,
    configuration,
    evaluating,
    layer_signature,
    narrowed,
    narrowed_bytes,
)


class Block(nn.Module):
    """Self-attention with a residual and a LayerNorm: one layer of a transformer, kept whole."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.attention(x, x, x, need_weights=False)[0])


def twice(layer: nn.Module) -> nn.Sequential:
    """layer applied twice, a Tanh between: one module held at two places."""
    return nn.Sequential(layer, nn.Tanh(), layer)


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
    "used-twice": (lambda: twice(nn.Linear(6, 6)), lambda: torch.randn(4, 6)),
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


EVALUATED = {**LAYERS, "dropout": (lambda: nn.Dropout(0.5), lambda: torch.randn(4, 6)),
             "linear-dropout": (lambda: nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5)), lambda: torch.randn(4, 6))}


@pytest.mark.parametrize("name", list(EVALUATED))
def test_an_array_in_evaluation_mode_computes_each_members_evaluation_and_back_in_training_mode_its_training(
    name: str
) -> None:
    """model.eval() reaches the array's template (not a submodule): its BatchNorms normalize by their running
    statistics, which stay as they are, and its Dropouts let everything through; model.train() undoes it."""
    make, data = EVALUATED[name]
    torch.manual_seed(0)
    members = [make().train() for _ in range(3)]
    with torch.no_grad():
        for member in members:  # running statistics of their own
            member(data())
    references = [copy.deepcopy(member) for member in members]
    array = nn.Sequential(ArrayLayer(members, shared_input=True))
    x = data()
    with torch.no_grad():
        out = array.eval()(x)
        for index, reference in enumerate(references):
            torch.testing.assert_close(out[index], reference.eval()(x), rtol=1e-5, atol=1e-6)
        torch.manual_seed(1)
        out = array.train()(x)
    torch.manual_seed(1)
    changed = [not torch.allclose(out[index], reference.eval()(x)) for index, reference in enumerate(references)]
    assert all(changed) == any(isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d))
                               or (isinstance(layer, nn.Dropout) and layer.p > 0) for layer in members[0].modules())


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("shared", [True, False], ids=["shared-input", "stacked-input"])
@pytest.mark.parametrize("live", [[0, 2], [1, 2]], ids=["copied", "viewed"])
def test_a_narrowed_array_computes_its_live_members_as_the_whole_array_does(name: str, shared: bool, live: list[int]
                                                                            ) -> None:
    """Narrowed to live, an array gives the live members' rows of the whole array's output, gradients and running
    statistics; the other members' gradients are zeros and their buffers stay; afterwards the layer is as it was."""
    make, data = LAYERS[name]
    torch.manual_seed(0)
    array = ArrayLayer([make() for _ in range(4)], shared_input=shared)
    whole = copy.deepcopy(array)
    x = data() if shared else torch.stack([data() for _ in range(4)])
    x.requires_grad_(x.is_floating_point())
    before = {key: value.clone() for key, value in array.state_dict().items()}
    parameters = dict(array.named_parameters())
    with narrowed(array, live):
        out = array(x if shared else x[live])
    expected = whole(x)[live]
    torch.testing.assert_close(out, expected)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    others = [member for member in range(4) if member not in live]
    for parameter, reference in zip(array.parameters(), whole.parameters()):
        torch.testing.assert_close(parameter.grad[live], reference.grad[live], rtol=1e-5, atol=1e-6)
        assert not parameter.grad[others].any()
    for key, buffer in array.named_buffers():
        torch.testing.assert_close(buffer[live], whole.get_buffer(key)[live])
        torch.testing.assert_close(buffer[others], before[key][others])
    assert dict(array.named_parameters()) == parameters and array.size == 4
    rows = sum(value[0].nbytes for value in before.values()) * len(live)
    assert narrowed_bytes(array, live) == (rows if live == [0, 2] else 0)


def test_an_array_of_a_layer_used_twice_leaves_its_template_as_it_was() -> None:
    """The template's slots are swapped for the members' batched rows during a call, twice for a module held at two
    places: afterwards it holds its own tensors again (the skeleton that ships it to workers pickles them)."""
    array = ArrayLayer([twice(nn.Linear(6, 6)) for _ in range(2)], shared_input=True)
    own = [tensor for _, tensor in array.template.named_parameters(remove_duplicate=False)]
    first = array(torch.randn(4, 6))
    after = [tensor for _, tensor in array.template.named_parameters(remove_duplicate=False)]
    assert len(after) == len(own) and all(a is b for a, b in zip(after, own))
    assert array.template[0] is array.template[2]
    pickle.dumps(array.template)
    assert array(torch.randn(4, 6)).shape == first.shape


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


def test_a_models_configuration_tells_apart_what_its_graph_would_bake_in() -> None:
    """Models of one architecture (the same parameters and buffers) take one another's export or cut only where their
    configurations agree: a rate, an activation function kept as a function, a settings object's values."""

    class Configured(nn.Module):
        def __init__(self, rate: float, activation: Callable[..., torch.Tensor], scale: float) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.drop = nn.Dropout(rate)
            self.activation = activation
            self.config = types.SimpleNamespace(scale=scale)

    base = configuration(Configured(0.1, nn.functional.gelu, 2.0))
    assert configuration(Configured(0.1, nn.functional.gelu, 2.0)) == base, "other weights, the same configuration"
    assert configuration(Configured(0.2, nn.functional.gelu, 2.0)) != base
    assert configuration(Configured(0.1, nn.functional.relu, 2.0)) != base
    assert configuration(Configured(0.1, nn.functional.gelu, 3.0)) != base
    gelu = nn.TransformerEncoderLayer(8, 2, 16, activation="gelu")
    assert configuration(gelu) != configuration(nn.TransformerEncoderLayer(8, 2, 16, activation="relu"))

    def defined() -> nn.Module:  # a class of one name defined each time (a notebook's cell run again)
        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = nn.Linear(4, 4)

        return Block()

    assert configuration(nn.Sequential(defined())) != configuration(nn.Sequential(defined()))
    assert layer_signature(Configured(0.1, nn.functional.gelu, 2.0)) != layer_signature(
        Configured(0.1, nn.functional.relu, 2.0)), "an array runs its first member's activation for all"
    assert layer_signature(Configured(0.1, nn.functional.gelu, 2.0)) == layer_signature(
        Configured(0.1, nn.functional.gelu, 2.0))


def test_traced_stages_whose_code_differs_have_different_signatures() -> None:
    """A traced forward holds the constants its configuration put there (an epsilon, a rate read off a config
    object, which no attribute shows): stages of models configured apart are not fused."""

    class Scaled(nn.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.config = types.SimpleNamespace(scale=scale)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x) * self.config.scale

    def stage(scale: float) -> fx.GraphModule:
        return fx.symbolic_trace(Scaled(scale))

    assert layer_signature(stage(2.0)) == layer_signature(stage(2.0))
    assert layer_signature(stage(2.0)) != layer_signature(stage(3.0))


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


class Attention(nn.Module):
    """Causal self-attention through scaled_dot_product_attention, which vmap has no batching rule for on a CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


def test_an_array_of_an_op_vmap_loops_over_computes_each_member_and_warns_nothing() -> None:
    """vmap warns that it loops over the members for an op without a batching rule (attention on a CPU): fusion times
    an array as it runs, so the warning says nothing a user can act on, and the array keeps it to itself."""
    torch.manual_seed(0)
    members = [Attention() for _ in range(2)]
    x = torch.randn(2, 3, 5, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ArrayLayer(members, shared_input=False)(x)
        expected = [member(x[index]) for index, member in enumerate(members)]
    assert not [warning for warning in caught if FALLBACK_WARNING in str(warning.message)], caught
    for index, want in enumerate(expected):
        torch.testing.assert_close(out[index], want)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.func.vmap(members[0])(x)
    assert [warning for warning in caught if FALLBACK_WARNING in str(warning.message)], "torch's vmap still warns"


class Shifted(nn.Module):
    """Shifts its input right by one place, the first place filled with a token id from its configuration (as a
    sequence-to-sequence model makes its decoder's inputs), then a linear layer: exported, the token id is a tensor
    constant lifted into a buffer."""

    def __init__(self, token: float) -> None:
        super().__init__()
        self.token = token
        self.linear = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = x.new_zeros(x.shape)
        shifted[:, 1:] = x[:, :-1]
        shifted[:, 0] = torch.tensor(self.token)
        return self.linear(shifted)


def exported(module: nn.Module, sample: torch.Tensor) -> fx.GraphModule:
    """module exported and made a stage of its graph as runtime.stages makes one (the stage copies what its graph
    reads: a tensor constant becomes a buffer)."""
    program = torch.export.export(module, (sample,), strict=False).module()
    return fx.GraphModule(program, program.graph)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-input", "stacked-input"])
def test_an_exported_constant_every_member_has_alike_is_read_unstacked_and_one_that_differs_is_stacked(
        shared: bool) -> None:
    """A constant an exported forward made fills a fresh tensor: stacked per member, vmap refuses to fill a tensor
    that is not batched with one that is (exported BART could not be fused); the same in every member, every member
    reads it as it is. Constants that differ between members stay each member's own."""
    torch.manual_seed(0)
    x = torch.randn(4, 5)
    alike = [exported(Shifted(2.0), x) for _ in range(2)]
    layer = ArrayLayer(alike, shared_input=shared)
    assert list(layer.constants) and not [name for name in layer.buffer_names if name in layer.constants]
    inputs = x if shared else torch.stack([x, 2 * x])
    out = layer(inputs)
    for index, member in enumerate(alike):
        torch.testing.assert_close(out[index], member(x if shared else inputs[index]))
    (out ** 2).sum().backward()
    assert layer.stacked("linear.weight", grad=True).abs().sum() > 0

    differing = [exported(Shifted(token), x) for token in (2.0, 3.0)]
    layer = ArrayLayer(differing, shared_input=True)
    assert layer.constants == {} and len(layer.buffer_names) == 1, "each member's own, stacked"
    with pytest.raises(RuntimeError):  # vmap refuses the stacked constant in place (fusion then trains them unfused)
        layer(x)


def test_evaluating_puts_every_part_back_in_the_mode_it_had() -> None:
    """An evaluation's eval mode, then each part's own mode again: a batch norm a member's user froze stays frozen,
    in an array's template too (not a submodule: its train() sets it). Before, an evaluation ended with train(),
    which unfroze it and, in an array, ran every member's batch norm on the batch's statistics from then on."""
    members = []
    for _ in range(2):
        member = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
        member[1].eval()
        members.append(member)
    module = nn.Sequential(ArrayLayer(members, shared_input=True), nn.Linear(4, 4))
    array = module[0]
    before = [part.training for part in (*module.modules(), *array.template.modules())]
    assert not array.template[1].training and array.template[2].training
    with evaluating(module):
        assert not any(part.training for part in (*module.modules(), *array.template.modules()))
    assert [part.training for part in (*module.modules(), *array.template.modules())] == before
