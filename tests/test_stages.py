"""Stages: a module that is not a chain, cut by tracing its forward at its blocks, inside a block too large at its
children, with boundaries that carry one value or several."""

from __future__ import annotations

import re
import sys

import cloudpickle
import pytest
import torch
from torch import fx, nn

from harmony.runtime.stages import FX_MESSAGE, quiet_failures, sized_by_shapes, trace_stages
from tests.conftest import BatchBranch, FlattenedTokens, GatedNet, MaskedSquares, ResidualBlock, ResidualNet


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else self.b(x)


def run_chain(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


def test_a_residual_net_is_cut_between_its_blocks_and_computes_what_it_computed() -> None:
    torch.manual_seed(0)
    net = ResidualNet(width=16, blocks=4, inputs=8, outputs=3)
    stages, how = trace_stages(net)
    assert how == ("traced by torch.fx and cut into 6 stages at stem, blocks.0-3, head; one value crosses each cut")
    descriptions = [stage.harmony_description for stage in stages]
    assert descriptions == ["stem", *[f"blocks.{i}.norm .. blocks.{i}.b" for i in range(4)], "head"]
    x = torch.randn(5, 8)
    torch.testing.assert_close(run_chain(stages, x), net(x), rtol=0, atol=0)
    assert stages[0].stem.weight is net.stem.weight, "stages train the user's own parameters"
    assert sum(p.numel() for stage in stages for p in stage.parameters()) == sum(p.numel() for p in net.parameters())


def test_a_block_too_large_is_cut_at_its_children_with_the_residual_crossing_beside_the_branch() -> None:
    torch.manual_seed(0)
    net = ResidualNet(width=16, blocks=4, inputs=8, outputs=3)
    block_bytes = sum(p.numel() * p.element_size() for p in net.blocks[0].parameters())
    stages, how = trace_stages(net, largest=block_bytes - 1)
    assert "inside blocks.0, blocks.1, blocks.2, blocks.3, too large for one pack, at their children" in how
    assert "up to 2 values cross a cut" in how
    descriptions = [stage.harmony_description for stage in stages]
    assert descriptions[1:5] == ["blocks.0.norm", "blocks.0.a", "blocks.0", "blocks.0.b"]  # blocks.0: its relu
    assert [len(stage.harmony_inputs) for stage in stages[1:6]] == [1, 2, 2, 2, 2], "the block's input rides along"
    x = torch.randn(5, 8)
    torch.testing.assert_close(run_chain(stages, x), net(x), rtol=0, atol=0)
    middle = stages[2](stages[1](stages[0](x)))
    assert isinstance(middle, tuple) and len(middle) == 2
    unsplit, _ = trace_stages(net, largest=block_bytes)
    assert len(unsplit) == 6, "a block within the limit stays whole"


def test_a_value_computed_once_for_every_block_flows_through_each_cut() -> None:
    torch.manual_seed(0)
    net = GatedNet()
    stages, how = trace_stages(net)
    assert "at gate, blocks.0-2, head" in how and "up to 2 values cross a cut" in how
    assert [len(stage.harmony_inputs) for stage in stages] == [1, 2, 2, 2, 1]
    x = torch.randn(4, 16)
    torch.testing.assert_close(run_chain(stages, x), net(x), rtol=0, atol=0)
    gradients = [torch.autograd.grad(out.sum(), list(net.parameters())) for out in (run_chain(stages, x), net(x))]
    for ours, theirs in zip(*gradients):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_torchvisions_resnet_is_cut_at_its_bottlenecks_and_inside_the_largest() -> None:
    models = pytest.importorskip("torchvision.models")
    net = models.resnet50(width_per_group=8, num_classes=3).eval()
    def size(block: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in [*block.parameters(), *block.buffers()])

    largest = max(size(block) for block in net.layer3)
    too_large = [f"layer4.{i}" for i, block in enumerate(net.layer4) if size(block) > largest]
    assert too_large, "the test needs a bottleneck larger than every block before it"
    stages, how = trace_stages(net, largest=largest)
    assert "layer1.0-2, layer2.0-3, layer3.0-5, layer4.0-2" in how
    assert f"(inside {', '.join(too_large)}, too large for one pack, at their children)" in how
    assert any(stage.harmony_description.startswith("layer4.0.conv2") for stage in stages)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(run_chain(stages, x), net(x), rtol=0, atol=0)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = ResidualBlock(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2 + x


def test_a_module_of_children_is_cut_at_them_one_of_one_child_is_not_and_an_untraceable_one_says_why() -> None:
    block = ResidualBlock(8)
    stages, how = trace_stages(block)
    assert "3 stages at norm, a, b" in how and [len(stage.harmony_inputs) for stage in stages] == [1, 2, 2]
    x = torch.randn(3, 8)
    torch.testing.assert_close(run_chain(stages, x), block(x), rtol=0, atol=0)
    scaled = Scaled()
    stages, how = trace_stages(scaled)
    assert stages == [scaled] and how == "its forward runs in one block"
    untraceable = DataDependent()
    stages, how = trace_stages(untraceable)
    assert stages == [untraceable] and "not traceable by torch.fx" in how


def test_a_stage_travels_to_workers_as_a_pickle() -> None:
    stages, _ = trace_stages(ResidualNet(width=16, blocks=4, inputs=8, outputs=3))
    copy = cloudpickle.loads(cloudpickle.dumps(stages[2]))
    x = torch.randn(3, 16)
    torch.testing.assert_close(copy(x), stages[2](x))


def test_a_model_torch_fx_cannot_trace_is_exported_cut_at_its_layers_and_runs_other_shapes_on_workers() -> None:
    """A Hugging Face model (its forward branches on its inputs) is exported and cut at its decoder layers; the
    stages, rebuilt from skeletons as a worker rebuilds them, compute the model's own output for another batch
    size and sequence length than the export saw."""
    transformers = pytest.importorskip("transformers")
    from harmony.runtime.pilot import KeywordCall
    from harmony.runtime.skeleton import dump_skeleton, load_skeleton

    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=16, intermediate_size=32,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=50,
                                      bos_token_id=0, eos_token_id=0, use_cache=False)
    model = transformers.LlamaForCausalLM(config).double().eval()
    ids = torch.randint(0, 50, (4, 12))
    stages, how = trace_stages(KeywordCall(model))
    assert stages[0].model is model and how.startswith("not traceable by torch.fx")
    stages, how = trace_stages(KeywordCall(model), sample={"input_ids": ids, "labels": ids})
    assert how.startswith("exported by torch.export and cut into 10 stages at model.embed_tokens")
    assert "model.layers.0-2" in how and "up to 5 values cross a cut" in how
    rebuilt = []
    for stage in stages:
        skeleton = load_skeleton(dump_skeleton(stage))
        rebuilt.append((skeleton, {**dict(stage.named_parameters()), **dict(stage.named_buffers())}))
    other = ids[:3, :7]
    x: object = {"input_ids": other, "labels": other}
    with torch.no_grad():
        for skeleton, tensors in rebuilt:
            x = torch.func.functional_call(skeleton, tensors, (x,))
        expected = model(input_ids=other, labels=other)
    assert type(x) is type(expected)
    torch.testing.assert_close(x.logits, expected.logits, rtol=0, atol=0)
    torch.testing.assert_close(x.loss, expected.loss, rtol=0, atol=0)


def test_exported_stages_whose_sizes_their_inputs_fix_are_told_from_ones_whose_values_set_a_size() -> None:
    """sized_by_shapes: a Llama's exported stages compute only values whose sizes the input's shapes fix; a model
    that masks a tensor by its values keeps one whose size they set; stages torch.fx traced record no sizes."""
    transformers = pytest.importorskip("transformers")
    from harmony.runtime.pilot import KeywordCall

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=50,
                                      bos_token_id=0, eos_token_id=0, use_cache=False)
    ids = torch.randint(0, 50, (4, 12))
    llama, how = trace_stages(KeywordCall(transformers.LlamaForCausalLM(config)), sample={"input_ids": ids})
    assert how.startswith("exported by torch.export") and sized_by_shapes(llama)
    masked, how = trace_stages(MaskedSquares(), sample=torch.randn(6, 8))
    assert how.startswith("exported by torch.export") and not sized_by_shapes(masked)
    traced, how = trace_stages(ResidualNet(width=16, blocks=2, inputs=8, outputs=3))
    assert how.startswith("traced by torch.fx") and not sized_by_shapes(traced)


def test_an_exported_models_stages_run_as_an_array_of_members_each_computing_its_own_output(
    capfd: pytest.CaptureFixture[str]
) -> None:
    """The stages of two exported Llamas, stacked stage by stage into array layers, compute each model's output: an
    export reads sizes with an operator vmap cannot batch and calls attention as an operator whose fallback warns
    on stderr; the stages call both as Python calls, which compute the same unfused."""
    transformers = pytest.importorskip("transformers")
    from harmony.runtime.array import ArrayLayer
    from harmony.runtime.pilot import KeywordCall

    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=50,
                                      bos_token_id=0, eos_token_id=0, use_cache=False)
    models = []
    for seed in range(2):
        torch.manual_seed(seed)
        models.append(transformers.LlamaForCausalLM(config).double().eval())
    ids = torch.randint(0, 50, (4, 12))
    batch = {"input_ids": ids, "labels": ids}
    chains = [trace_stages(KeywordCall(model), sample=batch)[0] for model in models]
    graphs = [module.graph for stage in chains[0] for module in stage.modules() if isinstance(module, fx.GraphModule)]
    calls = {node.target for graph in graphs for node in graph.nodes if node.op == "call_function"}
    assert not calls & {torch.ops.aten.sym_size.int, torch.ops.aten.scaled_dot_product_attention.default}
    assert nn.functional.scaled_dot_product_attention in calls
    x: object = batch
    with torch.no_grad():
        for position in range(len(chains[0])):
            x = ArrayLayer([chain[position] for chain in chains], shared_input=position == 0)(x)
        for index, model in enumerate(models):
            torch.testing.assert_close(x.logits[index], model(**batch).logits, rtol=0, atol=1e-12)
    assert "performance drop" not in capfd.readouterr().err


def test_a_size_left_behind_at_one_cut_crosses_a_later_one_where_no_tensor_has_it() -> None:
    """The first cut carries a tensor shaped (batch, length, 8): the sizes stay behind, read off it. Later cuts carry
    only (batch * length, 8), a product, and the head needs batch and length: they cross as values of their own
    (once they were lost, and cutting raised a KeyError). The stages compute the model's output for other sizes."""
    torch.manual_seed(0)
    model = FlattenedTokens().double()
    stages, how = trace_stages(model, sample=torch.randn(4, 5, 8, dtype=torch.float64))
    assert how.startswith("exported by torch.export") and len(stages) >= 4, how
    x = torch.randn(3, 7, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(run_chain(stages, x), model(x), rtol=0, atol=0)


def test_a_stage_that_raises_under_quiet_failures_leaves_no_message_on_stderr(capsys: pytest.CaptureFixture[str]
                                                                             ) -> None:
    """torch.fx prints its generated lines to stderr for an exception inside a stage, even one the caller catches; a
    probe whose failure is an answer runs under quiet_failures, which drops that message and nothing else."""

    class Sized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x).view(x.shape[0], 3)

    stage = fx.symbolic_trace(Sized())
    wrong = torch.randn(3, 4)  # 12 values: not 3 rows of 3
    with pytest.raises(RuntimeError):
        stage(wrong)
    assert FX_MESSAGE in capsys.readouterr().err, "torch.fx prints it (else quiet_failures has nothing to do)"
    with quiet_failures(), pytest.raises(RuntimeError):
        print("a warning of the user's", file=sys.stderr)
        stage(wrong)
    assert capsys.readouterr().err == "a warning of the user's\n"


class Halves(nn.Module):
    """Its second input holds two of the first's rows for each: torch.export derives its size from the first's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rows, pairs = x
        if rows.shape[0] == 0:
            return rows
        return self.b(torch.tanh(self.a(rows) + self.a(pairs[: rows.shape[0]]) + self.a(pairs[rows.shape[0]:])))


def test_an_exported_models_first_stage_refuses_inputs_its_graph_does_not_hold_for_and_takes_the_others() -> None:
    """As torch's exported module checks its inputs: a size the export fixed (a branch on its being 8) must be that
    size, a free one may be any other its guards allow (a branch on its not being 8: sizes 1 and 5, not 8), one
    derived from another follows it. The check travels with the stage as a worker rebuilds it; without it the
    graph ran a batch of 4 through the branch taken for 8."""
    from harmony.runtime.skeleton import dump_skeleton, load_skeleton
    from harmony.runtime.stages import ShapeError

    torch.manual_seed(0)
    model = BatchBranch(width=4)
    fixed, how = trace_stages(model, sample=torch.randn(8, 4))
    assert how.startswith("exported by torch.export")
    entry = load_skeleton(dump_skeleton(fixed[0]))
    params = {**dict(fixed[0].named_parameters()), **dict(fixed[0].named_buffers())}
    x = torch.randn(8, 4)
    torch.testing.assert_close(torch.func.functional_call(entry, params, (x,)), fixed[0](x))
    for wrong, said in [(torch.randn(4, 4), "input 0's size 0 is 4, and the export fixed it at 8"),
                        (torch.randn(8, 5), "input 0's size 1 is 5, and the export fixed it at 4"),
                        (torch.randn(8), "input 0 is (8,), where the graph takes a tensor of 2 dimensions")]:
        with pytest.raises(ShapeError, match=re.escape(said)) as raised:
            torch.func.functional_call(entry, params, (wrong,))
        assert "drop_last=True" in str(raised.value)

    free, _ = trace_stages(model, sample=torch.randn(3, 4))
    for size in (1, 5):
        x = torch.randn(size, 4)
        torch.testing.assert_close(run_chain(free, x), model(x))
    with pytest.raises(ShapeError, match=re.escape("fail the export's guard x.size()[0] != 8")):
        run_chain(free, torch.randn(8, 4))

    halves = Halves()
    stages, _ = trace_stages(halves, sample=(torch.randn(6, 4), torch.randn(12, 4)))
    for rows in (3, 2):
        pair = (torch.randn(rows, 4), torch.randn(2 * rows, 4))
        torch.testing.assert_close(run_chain(stages, pair), halves(pair))
    for rows, pairs in ((3, 5), (3, 3)):
        with pytest.raises(ShapeError, match=re.escape(f"input 1's size 0 is {pairs}, and the export holds it at "
                                                       "2*s")):
            stages[0]((torch.randn(rows, 4), torch.randn(pairs, 4)))


class Attending(nn.Module):
    """A dropout and an attention's dropout written as Hugging Face writes them (the functional call at the module's
    mode, dropout_p at its rate in training only), and a batch norm: a trace records them as they ran in training.
    exported: a branch on a size keeps torch.fx from tracing it."""

    def __init__(self, exported: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.exported = exported
        self.a = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(5)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exported and x.shape[0] == 0:
            return x
        h = nn.functional.dropout(self.norm(self.a(x)), 0.5, training=self.training)
        q = h.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        h = nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5 if self.training else 0.0)
        return self.b(h.transpose(1, 2).reshape(x.shape))


@pytest.mark.parametrize("exported", [False, True], ids=["traced", "exported"])
def test_stages_follow_their_mode_where_the_trace_recorded_training_as_a_constant(exported: bool) -> None:
    """Rebuilt as a worker rebuilds them, in eval mode the stages compute the model's eval-mode output (no dropout,
    the batch norm's running statistics, none updated nor batches counted); in training mode the model's own
    output, its dropouts drawing the same masks. Before, a trace's stages ran as in training in eval mode too."""
    from harmony.runtime.skeleton import dump_skeleton, load_skeleton

    model = Attending(exported)
    x = torch.randn(4, 5, 8)
    stages, how = trace_stages(model, 10**9, x if exported else None)
    assert how.startswith("exported by torch.export" if exported else "traced by torch.fx") and len(stages) > 1
    chain = nn.Sequential(*stages)
    rebuilt = load_skeleton(dump_skeleton(chain))
    tensors = {**dict(chain.named_parameters()), **dict(chain.named_buffers())}
    before = {name: value.clone() for name, value in model.state_dict().items()}
    for training in (False, True):
        model.train(training)
        rebuilt.train(training)
        torch.manual_seed(1)
        with torch.no_grad():
            got = torch.func.functional_call(rebuilt, tensors, (x,))
        torch.manual_seed(1)
        with torch.no_grad():
            expected = model(x)
        torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, expected, rtol=0, atol=0)
        if not training:
            assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert int(model.norm.num_batches_tracked) == 2, "one count each, in training: the stages' and the model's"
