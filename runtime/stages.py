"""Stages: a module that is not a chain of its children, cut into a chain by tracing its forward.

torch.fx traces the forward down to torch's own layers (Linear, Conv2d, LayerNorm, MultiheadAttention ... stay
whole) and gives the operations in order, each with the stack of modules it ran in. Every operation belongs to a
unit: the repeated block it runs in (an entry of a ModuleList or Sequential: ``blocks.3``, ``layer2.1``,
``encoder.layers.encoder_layer_5``), or the model's child it runs in when it runs in no block (a stem, a head).
A unit whose weights exceed ``largest`` bytes is replaced by its children (an attention, an MLP, a convolution),
level by level. An operation outside every module (a flatten between children), and one that takes an item of a
layer's tuple output, joins the unit before it. The forward is cut wherever the unit changes, and also wherever a
single value flows (between the halves of a transformer block: such a cut costs one tensor). Each run of
operations between cuts becomes a stage, an ``fx.GraphModule`` that takes the values live at its start and returns
those live at its end: one tensor, or a tuple of them where several flow (a residual beside its branch inside a
block, a mask computed once for all blocks, a skip from an early layer). The stages are a chain, and packs are cut
from it like any chain of layers; the values at a boundary are what a pack keeps for its backward and what
moves between devices.

A parameter a stage reads by attribute is read from the user's module itself (the stage holds a reference), so
training the stages trains the user's model; a parameter two stages read (tied weights) is held by the first and
borrowed by the later ones (runtime.pilot). A forward that torch.fx cannot trace (control flow on tensor values, an
unsupported call) is exported with torch.export instead when the caller gives a sample input, and cut the same
way; one that neither can trace is not cut, and ``trace_stages`` says why.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import math
import operator
import re
import sys
import types
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sympy
import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP, free_unbacked_symbols
from torch.utils._pytree import TreeSpec, tree_leaves, tree_map, tree_unflatten

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


ASSERT_DTYPE = torch.ops.aten._assert_tensor_metadata.default  # export's check of a .to()'s input: under autocast
# the stage's inputs come in autocast's dtype (a model's logits.float() gets bfloat16 logits), as in the eager model


GUARDS = "harmony_guards"  # an exported graph's meta entry: torch.export's guards on its input's sizes, as code
Exporter = Callable[[nn.Module, Any], tuple[fx.GraphModule, TreeSpec]]  # module and sample -> graph, output's structure


def trace_stages(module: nn.Module, largest: int | None = None, sample: Any = None, exporter: Exporter | None = None
                 ) -> tuple[list[nn.Module], str]:
    """module as a chain of stages, and how it was cut (or why it was not: then the list holds module alone).

    largest: the most weight bytes a unit may hold before it is cut at its children (None: never). sample: an input
    to export the module with when torch.fx cannot trace it (None: do not try). exporter: how to export it
    (exported_graph where None; runtime.pilot.Exports keeps a planning's exports for the next cut)."""
    try:
        graph = fx.Tracer().trace(module)
    except Exception as error:  # torch.fx raises many kinds for what it cannot trace
        why = f"not traceable by torch.fx ({_first_line(error)})"
        if sample is None:
            return [module], why
        try:
            root, out_spec = (exporter or exported_graph)(module, sample)
        except Exception as export_error:  # so does torch.export
            return [module], f"{why} nor by torch.export ({_first_line(export_error)})"
        nodes = [node for node in root.graph.nodes if not (node.op == "call_module" and node.target == "_guards_fn")
                 and node.target is not ASSERT_DTYPE]
        stages, how = _cut(root, nodes, Units(module, largest), "exported by torch.export")
        if len(stages) < 2:
            return [module], how
        stages[0] = Entry(stages[0], Shapes(root))
        stages[-1] = Exit(stages[-1], out_spec)
        return stages, how
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    if len(placeholders) != 1:
        return [module], f"its forward takes {len(placeholders)} inputs"
    stages, how = _cut(module, list(graph.nodes), Units(module, largest), "traced by torch.fx")
    return (stages, how) if len(stages) > 1 else ([module], how)


FX_MESSAGE = "Call using an FX-traced Module"  # what torch.fx's message on an exception in a generated forward holds
PARTIAL_GRAPH = "def forward(self"  # how the partial graph torch.export prints when an export fails begins


class _WithoutFxMessages(io.TextIOBase):
    """A stream that writes to another all but torch.fx's messages on exceptions in a stage, and the partial graph
    torch.export prints when an export fails (and their newlines)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.dropped = False  # the last write was such a message: print's newline follows it

    def write(self, text: str) -> int:
        dropped, self.dropped = self.dropped, FX_MESSAGE in text or text.lstrip().startswith(PARTIAL_GRAPH)
        if self.dropped or (dropped and text == "\n"):
            return len(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def quiet_failures() -> Iterator[None]:
    """Within the block, a stage that raises leaves no message on stderr. A stage is an fx.GraphModule, and torch.fx
    prints a traceback and the generated lines to stderr for every exception inside one, caught or not (and
    torch.export the graph it had traced when it fails): a probe whose failure is an answer (a layer that cannot run
    on half its samples, models that cannot fuse) would fill a user's terminal with errors that are none. Everything
    else written to stderr meanwhile, from any thread, goes through."""
    with contextlib.redirect_stderr(_WithoutFxMessages(sys.stderr)):
        yield


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120] if str(error).strip() else ''}"


def exported_graph(module: nn.Module, sample: Any) -> tuple[fx.GraphModule, TreeSpec]:
    """module exported by torch.export for inputs shaped like sample, every dimension of its tensors free to vary (a
    shorter last batch, another sequence length) where the model allows it: the graph, which reads module's own
    parameters and buffers, and the structure of module's output."""
    dims = tree_map(lambda leaf: dict.fromkeys(range(leaf.dim()), torch.export.Dim.AUTO)
                    if isinstance(leaf, torch.Tensor) else None, sample)
    program = torch.export.export(module, (sample,), dynamic_shapes=(dims,), strict=False)
    root = program.module()
    root.meta[GUARDS] = tuple(getattr(program, "_guards_code", ()))  # what its _guards_fn checks, as text
    return root, program.call_spec.out_spec


def sized_by_shapes(layers: Sequence[nn.Module]) -> bool:
    """Whether every value the layers compute has a size their inputs' shapes fix: each layer is an exported stage
    (its graph records the sizes of its values) and none reads a size off a tensor's values (nonzero, a boolean
    mask, .item()). The bytes such a chain holds on one sample are then what it holds on any sample of those
    shapes."""
    stages = [layer.stage if isinstance(layer, _Wrapped) else layer for layer in layers]
    return all(isinstance(stage, fx.GraphModule)
               and any(node.meta.get("val") is not None for node in stage.graph.nodes)  # exported, not traced
               and not any(node.op == "call_module" or free_unbacked_symbols(node.meta.get("val"))
                           for node in stage.graph.nodes)
               for stage in stages)


def _cut(root: nn.Module, nodes: list[fx.Node], units: Units, traced: str) -> tuple[list[nn.Module], str]:
    """The operations of a traced forward (nodes, reading attributes of root) cut into stages (module docstring),
    and how (traced: by which tool)."""
    placeholders = [node for node in nodes if node.op == "placeholder"]
    position = {node: index for index, node in enumerate(nodes)}
    last_use: dict[fx.Node, int] = {}
    for index, node in enumerate(nodes):
        for used in node.all_input_nodes:
            last_use[used] = index
    single = _single_value_points(nodes, last_use)
    computed = [node for node in nodes if node.op not in ("placeholder", "get_attr", "output")]
    segments: list[list[fx.Node]] = []
    current: str | None = None
    for node in computed:
        unit = None if _takes_apart(node, segments) else units.of(node)
        if not segments or (unit is not None and unit != current and current is not None) or (
                unit is not None and segments[-1][-1] in single):
            segments.append([])
        if unit is not None:
            current = unit
        segments[-1].append(node)
    if len(segments) < 2:
        return [root], "its forward runs in one block"
    output = nodes[-1].args[0]
    stages: list[nn.Module] = []
    flowing = placeholders
    pending = list(placeholders)  # values read after the last cut: a size left behind there may cross a later one
    for segment in segments:
        end = position[segment[-1]]
        pending = [value for value in [*pending, *segment] if last_use.get(value, -1) > end]
        if segment is segments[-1]:
            result, live = output, []
        else:
            live = _needed_later(pending, last_use, end)
            result = live[0] if len(live) == 1 else tuple(live)
        stages.append(_stage(root, segment, flowing, result, units.model_name()))
        flowing = live
    widest = max(len(stage.harmony_inputs) for stage in stages[1:])
    crossing = "one value crosses each cut" if widest == 1 else f"up to {widest} values cross a cut"
    return stages, f"{traced} and cut into {len(stages)} stages at {units.blocks_cut()}; {crossing}"


def _needed_later(defined: list[fx.Node], last_use: dict[fx.Node, int], end: int) -> list[fx.Node]:
    """The values of defined that operations after position end read: what crosses a cut there. A size the export
    made symbolic (a batch or sequence length) does not cross when a crossing tensor has it: the next stage reads
    it off that tensor."""
    live = [value for value in defined if last_use.get(value, -1) > end]
    carried = {_symbol(size) for value in live for size in _shape(value)}
    return [value for value in live if _symbol(value.meta.get("val")) not in carried - {None}]


def _shape(value: fx.Node) -> tuple[Any, ...]:
    fake = value.meta.get("val")
    return tuple(fake.shape) if isinstance(fake, torch.Tensor) else ()


def _symbol(size: Any) -> str | None:
    """The symbol of a size torch.export left free (s0, s1, ...), None for a fixed one."""
    return str(size.node.expr) if isinstance(size, torch.SymInt) else None


class _Wrapped(nn.Module):
    """A stage inside a module that adapts its input or output; it keeps the stage's description."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self.harmony_description = stage.harmony_description
        self.harmony_inputs = stage.harmony_inputs


class Entry(_Wrapped):
    """An exported model's first stage, given the model's input as the model is: its tensors, flattened as the
    export flattened them, are the stage's inputs, checked against the shapes the graph holds for (Shapes) as
    torch's exported module checks them: a graph run on others would compute what the model does not."""

    def __init__(self, stage: nn.Module, shapes: Shapes) -> None:
        super().__init__(stage)
        self.shapes = shapes

    def forward(self, x: Any) -> Any:
        leaves = tree_leaves(((x,), {}))
        try:
            self.shapes.check(x)
        except ShapeError as error:
            raise ShapeError(f"{error}: torch.export's graph of the model holds only for inputs like those it was "
                             f"exported with; {REMEDY}") from None
        return self.stage(leaves[0] if len(leaves) == 1 else tuple(leaves))


class ShapeError(ValueError):
    """Inputs of shapes an exported graph does not hold for."""


REMEDY = ("give it batches of one size (a DataLoader's drop_last=True drops a short last batch; a batch size that "
          "microbatches divides keeps micro-batches one size), or a device_memory that fits it whole (a model not "
          "cut runs its own forward)")  # what a user does about a ShapeError


class Shapes:
    """The inputs an exported graph holds for, as the guard on the module torch.export makes checks them: each
    tensor input's sizes, read off its placeholders and ranges, each one the export fixed (the forward depends on
    it: a view to it, a branch on it being that size) or left free within a range (its default lower bound of 2
    unchecked: sizes 0 and 1 pass, as they do there), one free size in several places equal everywhere, one derived
    from others (2*s0) their function; a constant input its value; and the export's other guards on the input's
    sizes (a branch on a size not being 8, on x.shape[0] % 2), kept as the code torch checks them with
    (GUARDS). Plain data, so that it travels with its stage."""

    def __init__(self, root: fx.GraphModule) -> None:
        self.guards: tuple[str, ...] = root.meta.get(GUARDS, ())
        self.inputs: list[Any] = []  # per input: a tuple of sizes (an int, or a free size's name) or the constant
        for node in root.graph.find_nodes(op="placeholder"):
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                self.inputs.append(tuple(_size(size) for size in value.shape))
            else:
                self.inputs.append(_size(value) if isinstance(value, torch.SymInt) else value)
        self.ranges: dict[str, tuple[int, int | None]] = {}
        for symbol, bounds in (getattr(root, "range_constraints", None) or {}).items():
            if not symbol.is_Symbol:  # a size derived from free ones (2*s0): held to their values instead
                continue
            upper = bounds.upper  # torch's int_oo where it has none (which says is_finite)
            self.ranges[str(symbol)] = (int(bounds.lower), int(upper) if upper.is_Integer else None)

    def check(self, x: Any) -> None:
        """Raise ShapeError, saying which size, where x (the model's input) is not an input the graph holds for."""
        leaves = tree_leaves(((x,), {}))
        if len(leaves) != len(self.inputs):
            raise ShapeError(f"the input holds {len(leaves)} values, where the graph takes {len(self.inputs)}")
        bound: dict[str, tuple[int, str]] = {}
        derived: list[tuple[str, int, str]] = []
        for index, (leaf, wanted) in enumerate(zip(leaves, self.inputs, strict=True)):
            if not isinstance(wanted, tuple):
                sizes, places = [(leaf, wanted)], [f"input {index}"]
            elif not isinstance(leaf, torch.Tensor) or leaf.dim() != len(wanted):
                raise ShapeError(f"input {index} is {_shown(leaf)}, where the graph takes a tensor of "
                                 f"{len(wanted)} dimensions {_shown(wanted)}")
            else:
                sizes, places = list(zip(leaf.shape, wanted)), [f"input {index}'s size {dim}"
                                                                for dim in range(leaf.dim())]
            for (size, want), place in zip(sizes, places):
                if isinstance(want, str) and want in self.ranges:
                    self._bind(want, int(size), place, bound)
                elif isinstance(want, str):
                    derived.append((want, int(size), place))
                elif size != want:
                    raise ShapeError(f"{place} is {size}, and the export fixed it at {want} (the model's forward "
                                     "depends on it)")
        for expression, size, place in derived:
            value = sympy.sympify(expression).subs({sympy.Symbol(name): held for name, (held, _) in bound.items()})
            if value.is_number and int(value) != size:
                raise ShapeError(f"{place} is {size}, and the export holds it at {expression} = {int(value)}")
        names = {**SYMPY_INTERP, "math": math, "inf": math.inf, "L": defaultdict(lambda: x)} if self.guards else {}
        for guard in self.guards:  # torch's own guard code, in the names torch gives it
            if not eval(_compiled(guard), names):
                shapes, said = ", ".join(_shown(leaf) for leaf in leaves), re.sub(r"L\['([^']+)'\]", r"\1", guard)
                raise ShapeError(f"the input's shapes {shapes} fail the export's guard {said} (the model's forward "
                                 "depends on it)")

    def _bind(self, symbol: str, size: int, place: str, bound: dict[str, tuple[int, str]]) -> None:
        lower, upper = self.ranges[symbol]
        if symbol in bound and bound[symbol][0] != size:
            raise ShapeError(f"{place} is {size}, and the export holds it equal to {bound[symbol][1]} "
                             f"({bound[symbol][0]})")
        if (lower > 2 and size < lower) or (upper is not None and size > upper):
            raise ShapeError(f"{place} is {size}, and the export holds it within {lower} to "
                             f"{'any size' if upper is None else upper}")
        bound[symbol] = (size, place)


@functools.cache
def _compiled(guard: str) -> types.CodeType:
    """A guard's code, compiled once per process (L: the forward's argument under any name)."""
    return compile(guard, "<torch.export guard>", "eval")


def _size(size: Any) -> int | str:
    """A size of an exported graph's input: an int where the export fixed it, else its expression's text."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    return int(size.node.expr) if size.node.expr.is_number else str(size.node.expr)


def _shown(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else str(value)


class Exit(_Wrapped):
    """An exported model's last stage, returning what the model returns (a ModelOutput, a tuple), not the flat
    values of the exported graph."""

    def __init__(self, stage: nn.Module, spec: TreeSpec) -> None:
        super().__init__(stage)
        self.spec = spec

    def forward(self, x: Any) -> Any:
        return tree_unflatten(list(self.stage(x)), self.spec)


def weight_bytes(module: nn.Module) -> int:
    """The bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _module_path(node: fx.Node) -> str | None:
    """The module a traced operation ran in (the innermost of its stack; a module called twice is one path), None
    outside every module or in a hook torch.export names like a module (``_empty_nn_module_stack...``)."""
    paths = [value[0] for value in (node.meta.get("nn_module_stack") or {}).values()
             if value[0] and not value[0].startswith("_")]
    return re.sub(r"@\d+$", "", paths[-1]) if paths else None


class Units:
    """Which unit each traced operation belongs to (see the module docstring), and which units were cut finer."""

    def __init__(self, root: nn.Module, largest: int | None) -> None:
        self.root = root
        self.largest = largest
        self.seen: dict[str, None] = {}
        self.split: dict[str, None] = {}
        self._weights: dict[str, int] = {}

    def of(self, node: fx.Node) -> str | None:
        path = _module_path(node)
        if path is None:
            return None
        try:
            self.root.get_submodule(path)
        except AttributeError:  # a name torch.export records that is not one of the model's modules
            return None
        parts = path.split(".")
        depth = self._entry_depth(parts)
        if depth is None:  # in no block: the model's child, or its child's where that child holds the blocks
            depth = 1
            while depth < len(parts) and self._holds_blocks(parts[:depth]):
                depth += 1
        while depth < len(parts) and self._too_large(parts[:depth]):
            self.split[".".join(parts[:depth])] = None
            depth += 1
            while depth < len(parts) and isinstance(self.root.get_submodule(".".join(parts[:depth])), CONTAINERS):
                depth += 1
        unit = ".".join(parts[:depth])
        self.seen[unit] = None
        return unit

    def _entry_depth(self, parts: list[str]) -> int | None:
        """How many parts of a module path name the repeated block it is in (an entry of a container), if any."""
        return next((k for k in range(2, len(parts) + 1)
                     if isinstance(self.root.get_submodule(".".join(parts[: k - 1])), CONTAINERS)), None)

    def _holds_blocks(self, parts: list[str]) -> bool:
        return any(isinstance(sub, CONTAINERS) for sub in self.root.get_submodule(".".join(parts)).modules())

    def _too_large(self, parts: list[str]) -> bool:
        if self.largest is None:
            return False
        path = ".".join(parts)
        if path not in self._weights:
            self._weights[path] = weight_bytes(self.root.get_submodule(path))
        return self._weights[path] > self.largest

    def model_name(self) -> str:
        """The class name of the user's model (the one a batch-dict wrapper calls)."""
        model = self.root.model if hasattr(self.root, "harmony_prefix") else self.root
        return type(model).__name__

    def blocks_cut(self) -> str:
        """The units, briefly and in order: a run of repeated blocks as ``blocks.0-11``, then which units were
        cut at their children."""
        items: list[tuple[str, list[str]]] = []  # (container or unit, entries of the container)
        for unit in self.seen:
            parts = unit.split(".")
            depth = self._entry_depth(parts)
            if depth is None:
                items.append((unit, []))
                continue
            container, entry = ".".join(parts[: depth - 1]), parts[depth - 1]
            if items and items[-1][0] == container and items[-1][1]:
                if items[-1][1][-1] != entry:
                    items[-1][1].append(entry)
            else:
                items.append((container, [entry]))
        prefix = getattr(self.root, "harmony_prefix", "")
        items = [(name.removeprefix(prefix), entries) for name, entries in items if name != prefix.rstrip(".")]
        text = ", ".join(
            name if not entries else f"{name}.{entries[0]}" if len(entries) == 1
            else f"{name}.{entries[0]}-{entries[-1]}" if entries[0].isdigit() else f"{name}.{entries[0]}..{entries[-1]}"
            for name, entries in items
        )
        if self.split:
            inside = ", ".join(name.removeprefix(prefix) for name in self.split)
            text += f" (inside {inside}, too large for one pack, at their children)"
        return text


def _single_value_points(nodes: list[fx.Node], last_use: dict[fx.Node, int]) -> set[fx.Node]:
    """The operations after which their own value is the only one the rest of the forward needs: cutting there
    costs one tensor, inside a block as between blocks."""
    points = set()
    live: set[fx.Node] = set()
    for index, node in enumerate(nodes[:-1]):
        if node.op != "get_attr":
            live.add(node)
        live = {value for value in live if last_use.get(value, -1) > index}
        if live == {node} and node.op != "placeholder":
            points.add(node)
    return points


def _takes_apart(node: fx.Node, segments: list[list[fx.Node]]) -> bool:
    """Whether node takes an item of a value computed in the current segment (a layer's tuple output): it stays with
    that value, so that a cut carries the tensors, not the tuple."""
    return (node.op == "call_function" and node.target is operator.getitem and bool(segments)
            and isinstance(node.args[0], fx.Node) and node.args[0] in segments[-1])


class StageTracer(fx.Tracer):
    """How a worker rebuilds a stage it unpickles (torch.fx re-traces a GraphModule's code): a buffer it reads stays
    an attribute read, as a parameter does. By default fx would compute an operation on buffers alone (a position
    id slice) there and then, on the skeleton's meta buffers, and fold the result into the graph as a constant; and
    it would read the stage's mode (follow_mode's Mode, Counter) as the constant it is when pickled."""

    proxy_buffer_attributes = True

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, (Mode, Counter)) or super().is_leaf_module(module, qualified_name)


PYTHON_CALLS = {  # operators an exported graph calls that a fused array needs called as Python calls (a stage
    # computes the same either way): vmap has no batching rule for a size read, and a fallback's warning from an
    # operator called as torch.ops.aten.* goes to stderr past Python's warnings filters
    torch.ops.aten.sym_size.int: ("call_method", "size"),
    torch.ops.aten.sym_numel.default: ("call_method", "numel"),
    torch.ops.aten.scaled_dot_product_attention.default: ("call_function", nn.functional.scaled_dot_product_attention),
}


def _stage(module: nn.Module, segment: list[fx.Node], flowing: list[fx.Node], result: fx.node.Argument,
           name: str) -> nn.Module:
    """The operations of segment as a module of their own: the flowing values in (one, or a tuple), result out; the
    attributes they read (parameters, buffers, submodules) are module's own, by reference."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    env: dict[fx.Node, fx.Node] = {}
    if len(flowing) == 1:
        env[flowing[0]] = x
    else:
        for index, value in enumerate(flowing):
            env[value] = graph.call_function(operator.getitem, (x, index))

    sizes = {}  # symbolic size: (a flowing tensor that has it, its dimension)
    for value in flowing:
        for dim, size in enumerate(_shape(value)):
            if _symbol(size) is not None:
                sizes.setdefault(_symbol(size), (env[value], dim))

    def lookup(value: fx.Node) -> fx.Node:
        if value not in env and value.op == "get_attr":
            env[value] = graph.node_copy(value)
        elif value not in env and _symbol(value.meta.get("val")) in sizes:  # a size read off a flowing tensor
            tensor, dim = sizes[_symbol(value.meta["val"])]
            env[value] = graph.call_method("size", (tensor, dim))
        return env[value]

    tensors = [env[value] for value in flowing if isinstance(value.meta.get("val"), torch.Tensor)]
    device = graph.call_function(getattr, (tensors[0], "device")) if tensors else None
    for node in segment:
        if node.op == "call_function" and node.target in PYTHON_CALLS:
            kind, target = PYTHON_CALLS[node.target]
            copied = graph.create_node(kind, target, fx.map_arg(node.args, lookup), fx.map_arg(node.kwargs, lookup))
            copied.meta = dict(node.meta)
        else:
            copied = graph.node_copy(node, lookup)
        if device is not None:  # an exported graph names the device it was exported on: compute where its input is
            copied.args, copied.kwargs = tree_map(lambda arg: device if isinstance(arg, torch.device) else arg,
                                                  (copied.args, copied.kwargs))
        env[node] = copied
    graph.output(fx.map_arg(result, lookup))
    graph._tracer_cls = StageTracer
    stage = fx.GraphModule(module, graph, class_name=f"{name}Stage")
    follow_mode(stage)
    stage.harmony_description = _describe(segment)
    stage.harmony_inputs = tuple(value.name for value in flowing)
    return stage


FLAGS = ("train", "training")  # an operator's argument that says whether it runs as in training
ATTENTION = {torch.ops.aten.scaled_dot_product_attention.default, nn.functional.scaled_dot_product_attention}
DROPOUT_P = 4  # attention's dropout_p, by position: a module's rate in training, else 0


class Mode(nn.Module):
    """A stage's training mode as a value its graph reads (follow_mode). A leaf to StageTracer, so that a worker's
    re-trace keeps the read rather than the mode the stage had when pickled."""

    def forward(self) -> bool:
        return self.training


class Counter(nn.Module):
    """A batch norm's count of batches, one more in training only (follow_mode), a leaf to StageTracer as Mode is."""

    def forward(self, count: torch.Tensor) -> torch.Tensor:
        return count.add_(1) if self.training else count


def follow_mode(stage: fx.GraphModule) -> None:
    """Make the operations of stage that its trace ran as in training (a dropout, a batch norm's batch statistics
    and its count of batches, an attention's dropout) follow the stage's own mode, so that eval() turns them off as
    it turns off the modules they came from. A trace records the mode as a constant (True in an operator's train or
    training argument, an attention's dropout_p, torch.export's add_ to num_batches_tracked): an evaluation ran them
    as in training. In training mode the stage computes what it did."""
    graph = stage.graph
    mode: fx.Node | None = None

    def training() -> fx.Node:
        nonlocal mode
        if mode is None:
            stage.add_submodule("harmony_mode", Mode())
            with graph.inserting_after(next(iter(graph.nodes))):
                mode = graph.call_module("harmony_mode")
        return mode

    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if _counts_batches(node):
            if not hasattr(stage, "harmony_counter"):
                stage.add_submodule("harmony_counter", Counter())
            with graph.inserting_before(node):
                node.replace_all_uses_with(graph.call_module("harmony_counter", (node.args[0],)))
            graph.erase_node(node)
            changed = True
        elif node.target in ATTENTION:
            rate = node.args[DROPOUT_P] if len(node.args) > DROPOUT_P else node.kwargs.get("dropout_p", 0.0)
            if isinstance(rate, float) and rate > 0:
                with graph.inserting_before(node):
                    trained = graph.call_function(operator.mul, (rate, training()))  # rate or 0.0
                if len(node.args) > DROPOUT_P:
                    node.update_arg(DROPOUT_P, trained)
                else:
                    node.update_kwarg("dropout_p", trained)
                changed = True
        else:
            for position, name in enumerate(_parameters(node.target)):
                if name in FLAGS and len(node.args) > position and node.args[position] is True:
                    node.update_arg(position, training())
                    changed = True
                elif name in FLAGS and node.kwargs.get(name) is True:
                    node.update_kwarg(name, training())
                    changed = True
    if changed:
        stage.recompile()


def _parameters(target: Any) -> list[str]:
    """The names of an operator's or a Python function's parameters, in order (none where they cannot be read)."""
    if isinstance(target, torch._ops.OpOverload):
        return [argument.name for argument in target._schema.arguments]
    try:
        return list(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return []


def _counts_batches(node: fx.Node) -> bool:
    """Whether node is torch.export's count of a batch norm's batches in training (add_ 1 to num_batches_tracked)."""
    counter = node.args[0] if node.args else None
    return (node.target is torch.ops.aten.add_.Tensor and isinstance(counter, fx.Node) and counter.op == "get_attr"
            and str(counter.target).endswith("num_batches_tracked"))


def _describe(segment: list[fx.Node]) -> str:
    """The modules a stage calls, first to last (for an exported graph, the modules its operations ran in)."""
    called = [str(node.target) for node in segment if node.op == "call_module"]
    if not called:
        called = [path for path in map(_module_path, segment) if path is not None]
    if not called:
        return "operations"
    return called[0] if len(called) == 1 or called[0] == called[-1] else f"{called[0]} .. {called[-1]}"
