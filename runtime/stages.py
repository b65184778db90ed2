"""Stages: a module that is not a chain of its children, cut by tracing its forward where a single value flows.

torch.fx traces the forward down to torch's own layers (Linear, Conv2d, LayerNorm, ... stay whole) and gives the
operations in order. Between two operations the forward may be cut when exactly one value computed before is
still needed after: the residual stream between two blocks of a ResNet or a ViT, the features before a
classifier's flatten. Each run of operations between cuts becomes a stage, an ``fx.GraphModule`` that takes that
one value and returns the next: the stages are a chain, and packs are cut from it like any chain of layers.
Where more than one value is live (inside a residual block: its input and its branch; across the blocks of a
model that computes an attention mask once for all of them) the forward is not cut, so such a span stays in one
stage. A parameter a stage reads by attribute is read from the user's module itself (the stage holds a
reference), so training the stages trains the user's model; a parameter read by two stages (tied weights) makes
the chain merge them (pilot's merge of shared layers). A forward that torch.fx cannot trace (control flow on
tensor values, an unsupported call) is not cut, and ``trace_stages`` says why.
"""

from __future__ import annotations

import itertools

from torch import fx, nn


def trace_stages(module: nn.Module) -> tuple[list[nn.Module], str]:
    """module as a chain of stages, and how it was cut (or why it was not: then the list holds module alone)."""
    try:
        graph = fx.Tracer().trace(module)
    except Exception as error:  # torch.fx raises many kinds for what it cannot trace
        return [module], f"not traceable by torch.fx ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    nodes = list(graph.nodes)
    placeholders = [node for node in nodes if node.op == "placeholder"]
    if len(placeholders) != 1:
        return [module], f"its forward takes {len(placeholders)} inputs"
    last_use: dict[fx.Node, int] = {}
    for index, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last_use[used] = index
    cuts = []
    live: set[fx.Node] = set()
    for index, node in enumerate(nodes[:-1]):
        if node.op != "get_attr":
            live.add(node)
        live = {value for value in live if last_use.get(value, -1) > index}
        if live == {node} and node.op != "placeholder":
            cuts.append(index)
    if not cuts:
        return [module], "no point of its forward carries a single value"
    bounds = [0, *[cut + 1 for cut in cuts], len(nodes) - 1]  # the output node ends the last stage
    stages: list[nn.Module] = []
    flowing = placeholders[0]
    for first, stop in itertools.pairwise(bounds):
        segment = [node for node in nodes[first:stop] if node.op not in ("placeholder", "get_attr")]
        if segment:
            result = segment[-1] if stop < len(nodes) - 1 else nodes[-1].args[0]
            stages.append(_stage(module, segment, flowing, result))
            flowing = segment[-1]
    if len(stages) < 2:
        return [module], "no point of its forward carries a single value"
    return stages, f"traced and cut into {len(stages)} stages where one value flows"


def _stage(module: nn.Module, segment: list[fx.Node], flowing: fx.Node, result: fx.node.Argument) -> fx.GraphModule:
    """The operations of segment as a module of their own: flowing in, result out; the attributes they read
    (parameters, buffers, submodules) are module's own, by reference."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {flowing: graph.placeholder("x")}

    def lookup(value: fx.Node) -> fx.Node:
        if value not in env and value.op == "get_attr":
            env[value] = graph.node_copy(value)
        return env[value]

    for node in segment:
        env[node] = graph.node_copy(node, lookup)
    graph.output(fx.map_arg(result, lookup))
    stage = fx.GraphModule(module, graph, class_name=f"{type(module).__name__}Stage")
    stage.harmony_description = _describe(segment)
    return stage


def _describe(segment: list[fx.Node]) -> str:
    """The modules a stage calls, first to last."""
    called = [str(node.target) for node in segment if node.op == "call_module"]
    if not called:
        return "operations"
    return called[0] if len(called) == 1 else f"{called[0]} .. {called[-1]}"
