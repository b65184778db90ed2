"""The pilot pass: decompose a model into a chain of layers and measure bytes and times on one micro-batch.

A module is split into its children when it is an nn.Sequential, or when torch.fx shows that its
forward does nothing but call each child once, feeding each the previous one's output (a plain
``fc1 -> act -> fc2`` module is a chain). Any other module with children is traced and cut into stages at its
repeated blocks, and inside a block too large for one pack at the block's children (runtime.stages); a boundary
may carry several tensors. One that cannot be traced is kept whole, and the model's notes say why. A parameter
two layers share (tied weights) is held by the first and borrowed by the later ones (LayerProfile.borrowed);
layers that share a buffer, or are the same module, are merged into one layer. The pass runs on the CPU in the
driver before any worker starts; it leaves the model's buffers and the global RNG as it found them. Under a run's
autocast it measures and times each layer under autocast too, as the run computes it.
"""

from __future__ import annotations

import copy
import time
import types
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map

from harmony.runtime.array import configuration
from harmony.runtime.cache import tree_nbytes
from harmony.runtime.halving import casts
from harmony.runtime.hoststore import dtype_name
from harmony.runtime.stages import (
    CONTAINERS,
    ShapeError,
    Shapes,
    exported_graph,
    quiet_failures,
    trace_stages,
    weight_bytes,
)
from harmony.tasks.layout import TensorSpec
from harmony.tasks.profile import BACKWARD_RATIO, LayerProfile, ModelProfile

TIMING_BUDGET = 0.05  # seconds of calls per layer the pilot may spend timing it
BACKWARD_BYTES = 2**30  # activations the pilot may keep to time a backward through the chain
BACKWARD_SECONDS = 0.25  # the forward the pilot times a backward behind, at most (see _backward_ratio)


@dataclass
class Decomposition:
    """A model as a chain of layers, its profile, and the pilot micro-batch's output."""

    layers: list[nn.Module]
    profile: ModelProfile
    output: Any
    notes: list[str] = field(default_factory=list)


@contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Run code on model without it changing the model's buffers or the CPU RNG."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        torch.set_rng_state(rng)


class KeywordCall(nn.Module):
    """A model that takes a batch dict as its keyword arguments (a Hugging Face batch), as one layer that takes the
    dict: what the chain of layers starts with when batches are dicts."""

    harmony_prefix = "model."  # how the model's own module names start, seen from here

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Mapping[str, Any]) -> Any:
        return self.model(**batch)


class _ChildrenAsLeaves(fx.Tracer):
    """Traces one module's forward, treating each of its direct children as an opaque call."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return "." not in qualified_name


def chain_order(module: nn.Module) -> list[nn.Module] | None:
    """The children of module in the order its forward calls them, if that forward is exactly a chain.

    None when it is not: the forward must take one input, call every child exactly once, each on the
    previous call's output, and return the last output, with nothing else in between.
    """
    children = dict(module.named_children())
    if not children:
        return None
    if type(module).forward is nn.Sequential.forward:
        return list(module)  # every entry, as its forward calls them: named_children lists a module used twice once
    if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
        return None
    try:
        graph = _ChildrenAsLeaves().trace(module)
    except Exception:
        return None
    nodes = list(graph.nodes)
    if len(nodes) < 3 or nodes[0].op != "placeholder" or nodes[-1].op != "output":
        return None
    previous = nodes[0]
    order = []
    for node in nodes[1:-1]:
        if node.op != "call_module" or node.args != (previous,) or node.kwargs:
            return None
        order.append(str(node.target))
        previous = node
    if nodes[-1].args != (previous,) or sorted(order) != sorted(children):
        return None
    return [children[name] for name in order]


def _flatten(module: nn.Module, x: Any, layers: list[nn.Module], notes: list[str], largest: int | None,
             export: bool, exports: Exports | None, block: bool = False) -> Any:
    """Append module's layers to layers; notes says how a module that is not a chain of its children was cut, or
    why it was not (largest, and export: whether to try torch.export, through exports where given: see
    trace_stages). A block (an entry of a Sequential or ModuleList) is one layer unless its weights exceed largest.
    Only torch.export reads a module's input (x), so only with export is x run through the layers found (decompose
    runs them after, timing each)."""
    order = chain_order(module)
    if order is not None:
        for child in order:
            x = _flatten(child, x, layers, notes, largest, export, exports, isinstance(module, CONTAINERS))
        return x
    whole_block = block and (largest is None or weight_bytes(module) <= largest)
    if whole_block or not any(True for _ in module.children()):
        stages, how = [module], ""
    else:
        stages, how = trace_stages(module, largest, x if export else None, exports)
    if how:
        named = module.model if isinstance(module, KeywordCall) else module
        notes.append(f"{type(named).__name__}: {how}")
    for stage in stages:
        layers.append(stage)
        if export:
            x = stage(x)
    return x


def _merge_shared(layers: list[nn.Module]) -> list[nn.Module]:
    """Merge every run of layers that share a buffer or are the same module into one layer (a parameter two
    layers share is borrowed instead: see borrowings)."""
    while True:
        first_seen: dict[int, int] = {}
        span = None
        for index, layer in enumerate(layers):
            for tensor in [layer, *layer.buffers()]:
                owner = first_seen.setdefault(id(tensor), index)
                if owner != index:
                    span = (owner, index)
                    break
            if span:
                break
        if span is None:
            return layers
        first, last = span
        merged = nn.Sequential(*layers[first : last + 1])
        layers = [*layers[:first], merged, *layers[last + 1 :]]


def borrowings(layers: list[nn.Module]) -> list[dict[str, tuple[int, str]]]:
    """Per layer, the parameters an earlier layer holds (tied weights), by this layer's name for them: the lending
    layer and its name for it."""
    held: dict[int, tuple[int, str]] = {}
    borrowed: list[dict[str, tuple[int, str]]] = []
    for index, layer in enumerate(layers):
        mine = {}
        for name, param in layer.named_parameters():
            if id(param) in held:
                mine[name] = held[id(param)]
            else:
                held[id(param)] = (index, name)
        borrowed.append(mine)
    return borrowed


def _describe(layer: nn.Module) -> str:
    if hasattr(layer, "harmony_description"):
        return f"{type(layer).__name__.removesuffix('Stage')} stage {layer.harmony_description}"
    text = repr(layer).replace("\n", " ")
    return text if len(text) <= 80 else type(layer).__name__


def _specs(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in named)


def _fastest_call(layer: nn.Module, x: Any, repeats: int) -> tuple[Any, float]:
    """layer's output on x and its fastest time over repeats calls, or fewer once they have taken
    TIMING_BUDGET seconds (at least three): on a shared machine one call can be off by half, and which
    sub-array size wins can turn on ten percent. Every call but the last leaves the layer's buffers and the RNG
    as it found them; the last is the forward the chain goes on from, and only its output is held (a sub-array's
    outputs, a language model's logits, can be most of the pilot's memory)."""
    fastest = float("inf")
    spent = 0.0
    call = 0
    while True:
        last = call + 1 >= repeats or (call >= 2 and spent > TIMING_BUDGET)
        with nullcontext() if last else preserved_state(layer):
            started = time.perf_counter()
            y = layer(x)
            seconds = time.perf_counter() - started
        fastest = min(fastest, seconds)
        spent += seconds
        call += 1
        if last:
            return y, fastest
        del y


def rebound(layers: Sequence[nn.Module], source: nn.Module, target: nn.Module) -> list[nn.Module]:
    """layers, a chain cut from source, as the same chain of target, a model of source's architecture (the same
    names and shapes of parameters and buffers): copies that compute with target's parameters and buffers, trained
    in place as source's would be. Exporting a model takes a second or more; copying its stages, milliseconds."""
    return rebound_from(layers, _tensors(source), target)


def rebound_from(layers: Sequence[nn.Module], theirs: list[tuple[str, torch.Tensor]],
                 target: nn.Module) -> list[nn.Module]:
    """layers, which read the tensors theirs names (a model's parameters and buffers, _tensors), rebound to
    target's of the same names and shapes (rebound)."""
    owns = _tensors(target)
    if [(name, tensor.shape) for name, tensor in theirs] != [(name, tensor.shape) for name, tensor in owns]:
        raise ValueError(f"{type(target).__name__} is not of its source's architecture")
    memo: dict[int, Any] = {id(tensor): own for (_, tensor), (_, own) in zip(theirs, owns)}
    return [_rebound(layer, memo) for layer in layers]


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and then its buffers, by name, tied ones under each of their names."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _rebound(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A copy of module that reads the tensors memo maps its own to (by id). A traced stage (an fx.GraphModule)
    shares its class, graph and generated code with module (never changed once a stage is made; a deep copy would
    generate and compile the code again); a module that holds stages, and a bare nn.Module (the containers a
    stage reads its parameters through), is copied around them, its containers (hooks, meta) copied, methods bound
    to it bound to the copy, its other attributes shared; anything else is deep-copied."""
    if id(module) in memo:
        return memo[id(module)]
    if type(module) is not nn.Module and not any(isinstance(part, fx.GraphModule) for part in module.modules()):
        return copy.deepcopy(module, memo)
    copied = object.__new__(type(module))  # a GraphModule's class is its own, its forward installed on it
    memo[id(module)] = copied
    state = {}
    for name, value in vars(module).items():
        if name == "_modules":
            value = {key: None if child is None else _rebound(child, memo) for key, child in value.items()}
        elif name in ("_parameters", "_buffers"):
            value = {key: None if tensor is None else memo.get(id(tensor), tensor) for key, tensor in value.items()}
        elif isinstance(value, torch.Tensor):
            value = memo.get(id(value), value)
        elif isinstance(value, types.MethodType) and value.__self__ is module:  # torch.export's train and eval
            value = types.MethodType(value.__func__, copied)
        elif isinstance(value, (dict, set, list)):
            value = value.copy()
        state[name] = value
    copied.__dict__.update(state)
    return copied


Kept = tuple[list[tuple[str, torch.Tensor]], fx.GraphModule, TreeSpec]  # a kept export: stand-ins, graph, output


class Exports:
    """torch.export's graphs of one planning's modules, so that an architecture is exported once (an export takes a
    second or more): a module exported before (cut again, for another budget) takes its graph again, and one of the
    same architecture and configuration (runtime.array.configuration: what the graph bakes in), training modes and
    inputs of the same structure and dtypes takes that graph rebound to its own weights (rebound), on inputs of any
    shapes the graph's guards allow (runtime.stages.Shapes: the sizes the export left free; another batch size, an
    uneven micro-batch, another sequence length), and is exported again on others. It holds the modules it
    exported: keep it for one planning. kept, where given, is where the process keeps the exports of its plannings
    for later ones (harmony.timings.EXPORTS): clear moves each there, rebound to weightless stand-ins (meta
    tensors) for its module's parameters and buffers, so that no model's weights outlive its planning."""

    def __init__(self, kept: dict[Hashable, list[Kept]] | None = None) -> None:
        self.made: dict[Hashable, list[tuple[nn.Module, fx.GraphModule, TreeSpec, bool]]] = {}  # bool: exported here
        self.kept = kept

    def clear(self) -> None:
        """Drop every export (the planning is over), keeping each one it made weightless where the process keeps
        them."""
        if self.kept is not None:
            for key, made in self.made.items():
                for module, root, spec, exported in made:
                    if exported:
                        theirs = _tensors(module)
                        stand_ins = [(name, torch.empty_like(tensor, device="meta")) for name, tensor in theirs]
                        memo: dict[int, Any] = {id(tensor): meta for (_, tensor), (_, meta) in zip(theirs, stand_ins)}
                        weightless = _rebound(root, memo)
                        weightless.graph.owning_module = weightless  # the shared graph's owner held the weights
                        self.kept.setdefault(key, []).append((stand_ins, weightless, spec))
        self.made.clear()

    def __call__(self, module: nn.Module, sample: Any) -> tuple[fx.GraphModule, TreeSpec]:
        key = _export_key(module, sample)
        made = self.made.setdefault(key, [])
        for source, root, spec, _ in made:
            if _holds(root, sample):
                return (root if _own(source) is _own(module) else rebound([root], source, module)[0]), spec
        for stand_ins, weightless, spec in [] if self.kept is None else self.kept.get(key, []):
            if _holds(weightless, sample):
                root = rebound_from([weightless], stand_ins, module)[0]
                made.append((module, root, spec, False))
                return root, spec
        root, spec = exported_graph(module, sample)
        made.append((module, root, spec, True))
        return root, spec


def _holds(root: fx.GraphModule, sample: Any) -> bool:
    """Whether an exported graph holds for sample (its guards allow sample's shapes)."""
    try:
        Shapes(root).check(sample)
    except ShapeError:
        return False
    return True


def _own(module: nn.Module) -> nn.Module:
    """The user's module a layer is (a KeywordCall is made anew for each pilot of its model)."""
    return module.model if isinstance(module, KeywordCall) else module


def _export_key(module: nn.Module, sample: Any) -> Hashable:
    """What two modules and their samples must share for one's export to stand for the other's, where its guards
    allow the other's shapes (Exports): the architecture, the configuration the graph bakes in, the inputs'
    structure, ranks and dtypes, and the training modes."""
    return (architecture(_own(module)), configuration(_own(module)), input_structure(sample),
            tuple(part.training for part in module.modules()))


def architecture(module: nn.Module) -> Hashable:
    """What two modules must share, besides their inputs, for one's pilot timings to stand for the other's: class,
    parameters (names, shapes, dtypes, whether trained) and buffers (decompose still checks that their layers come
    out alike). An export or a cut must share their configuration too (runtime.array.configuration)."""
    return (type(module),
            tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in module.named_parameters()),
            tuple((name, tuple(b.shape), b.dtype) for name, b in module.named_buffers()))


def input_structure(sample: Any) -> Hashable:
    """A sample's structure and its leaves' ranks, dtypes and devices: input_shapes without the sizes."""
    return _described(sample, lambda leaf: leaf.dim())


def input_shapes(sample: Any) -> Hashable:
    """A sample's structure and its leaves' shapes, dtypes and devices (a leaf that is not a tensor: its type, and
    its value where it is a number, string or bool)."""
    return _described(sample, lambda leaf: tuple(leaf.shape))


def _described(sample: Any, sizes: Callable[[torch.Tensor], Hashable]) -> Hashable:
    """A sample's structure and its leaves, a tensor by sizes (its shape or rank), dtype and device."""
    leaves, spec = tree_flatten(sample)
    return str(spec), tuple((sizes(leaf), str(leaf.dtype), leaf.device.type) if isinstance(leaf, torch.Tensor)
                            else (type(leaf).__qualname__, leaf if isinstance(leaf, (int, float, str, bool)) else None)
                            for leaf in leaves)


def decompose(model: nn.Module, sample: Any, name: str, repeats: int = 7, largest: int | None = None,
              export: bool = False, autocast: str | None = None, timed: ModelProfile | None = None,
              shares: ModelProfile | None = None, cut: tuple[list[nn.Module], list[str]] | None = None,
              alike: ModelProfile | None = None, exports: Exports | None = None) -> Decomposition:
    """Decompose model into a chain and profile it on sample (one micro-batch of inputs); a traced block holding more
    than largest bytes of weights is cut at its children; with export, a module torch.fx cannot trace is exported
    with torch.export and cut the same way; with autocast (a dtype's name), each layer's parameters that autocast
    only casts to it are found (LayerProfile.halved; never a tied one, which another layer may read otherwise), and
    those it casts at all (LayerProfile.copied).

    timed is the profile of a model piloted before that may share this one's architecture (a sweep's models): if
    its layers are these (the same descriptions, parameters and buffers, on as many samples), each layer is called
    once, for its output and sizes, and takes its time from timed instead of being timed again. Everything else
    (bytes, which parameters are halved) is this model's own. shares is the profile of a chain of as many layers
    that do alike in their proportions (a sub-array's member, for the sub-array): each layer is called once and
    only the whole chain is timed, its time split among the layers as shares' times split. cut: model's chain
    and the notes on how it was cut, already made (rebound from a model of its architecture, or an array's layers):
    profiled as it is, or with alike, as a chain like it was (another model's it was rebound from, an array of as
    many members of one architecture cut alike) on a sample of these shapes, where the caller knows every size the
    chain computes is fixed by its inputs' shapes (stages.sized_by_shapes): its bytes are then alike's, and so are
    its times (the same code on the same shapes), and only its output is computed. exports: the planning's
    exports, which a module to export is taken from where it can be (Exports)."""
    samples = max(1, _batch_size(sample))
    if cut is not None and alike is not None and len(alike.layers) == len(cut[0]):
        with preserved_state(model), torch.no_grad():
            output = sample
            for layer in cut[0]:
                output = layer(output)
        return Decomposition(list(cut[0]), replace(alike, name=name), output, list(cut[1]))
    if cut is not None:
        layers, notes = list(cut[0]), list(cut[1])
    else:
        with preserved_state(model), torch.no_grad():
            layers, notes = [], []
            _flatten(model, sample, layers, notes, largest, export, exports)
            layers = _merge_shared(layers)
    profiles = []
    ties = borrowings(layers)
    lent = {lender for borrowed in ties for lender in borrowed.values()}
    known = _timings(timed, layers, ties, samples)
    shared = ([layer.forward_seconds_per_sample for layer in shares.layers]
              if shares is not None and len(shares.layers) == len(layers) and not known else None)
    given = known or shared  # the layers' times, not timed one by one
    device = next((leaf.device for leaf in tree_leaves(sample) if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
    dtype = getattr(torch, autocast) if autocast else None

    def computing() -> AbstractContextManager[object]:
        """Where layers run as the run's forward does: under autocast in its dtype, where it has one."""
        return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    with preserved_state(model), torch.no_grad():
        x = low = sample  # low: the values as the run computes them (under autocast); x: in float32, for output
        for index, (layer, borrowed) in enumerate(zip(layers, ties)):
            kept = _kept(layer, low, index > 0, computing, dtype)  # before the timed calls: one output at a time
            named = list(layer.named_parameters())
            saved, transient = _split(layer, low, index > 0, computing, dtype, samples, kept, named)
            generator = torch.get_rng_state()
            versions = _versions(low)
            with computing():
                y, seconds = _fastest_call(layer, low, 1 if given else repeats)
            draws = not torch.equal(generator, torch.get_rng_state())  # only the last call leaves the RNG moved
            writes = _versions(low) != versions  # its input written in place: see LayerProfile.cut_before
            halved: frozenset[str] = frozenset()
            copied: frozenset[str] = frozenset()
            if dtype is not None:
                with preserved_state(layer):
                    cast = casts(layer, low, dtype, {n for n, _ in named})
                own = {n for n, _ in named if n not in borrowed and (index, n) not in lent}
                halved, copied = cast.only & own, cast.some
            profiles.append(
                LayerProfile(
                    description=_describe(layer),
                    params=_specs((n, p) for n, p in named if n not in borrowed),
                    buffers=_specs(layer.named_buffers()),
                    frozen=frozenset(n for n, p in named if not p.requires_grad),
                    input_bytes_per_sample=tree_nbytes(low) / samples,
                    output_bytes_per_sample=_new_bytes(y, low) / samples,
                    saved_bytes_per_sample=saved.per_sample,
                    saved_bytes=saved.fixed,
                    transient_bytes_per_sample=transient.per_sample,
                    transient_bytes=transient.fixed,
                    forward_seconds_per_sample=given[index] if given else seconds / samples,
                    cut_before=is_boundary(low) and not writes,
                    borrowed=_specs((n, p) for n, p in named if n in borrowed),
                    lenders=tuple(borrowed[n] for n, _ in named if n in borrowed),
                    halved=halved,
                    copied=copied,
                    draws=draws,
                )
            )
            if dtype is not None:  # the output a loss is checked on, as the model computes it without autocast
                with preserved_state(layer):
                    x = layer(x)
            else:
                x = y
            low = y
        output = x
        if shared or (not known and len(layers) > 1):  # a chain of one layer is the layer the calls above timed
            profiles = _as_chained(profiles, layers, sample, samples, computing)
        ratio = (timed.backward_ratio if known and timed else
                 _backward_ratio(layers, sample, samples, profiles, computing))
    profile = ModelProfile(name=name, layers=tuple(profiles), pilot_samples=samples, backward_ratio=ratio)
    return Decomposition(layers=layers, profile=profile, output=output, notes=notes)


def _as_chained(profiles: list[LayerProfile], layers: list[nn.Module], sample: Any, samples: int,
                computing: Callable[[], AbstractContextManager[object]] = nullcontext) -> list[LayerProfile]:
    """profiles with their layers' times scaled to the fastest of two forwards through the whole chain. A layer
    called again and again alone finds its weights and input in the caches, where the chain finds them evicted by
    the layers before: the sum of the layers' fastest times can be well under a forward of the model, and under
    what a run's tasks take. The layers keep their shares of the time (what the cut and the stashes weigh). The
    caller restores the buffers and the RNG."""
    alone = sum(profile.forward_seconds_per_sample for profile in profiles) * samples
    if alone <= 0:
        return profiles
    chained = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        x = _through(layers, sample, computing)
        chained = min(chained, time.perf_counter() - started)
        del x
        if chained > TIMING_BUDGET:
            break
    scale = chained / alone
    return [replace(profile, forward_seconds_per_sample=profile.forward_seconds_per_sample * scale)
            for profile in profiles]


def _through(layers: list[nn.Module], x: Any, computing: Callable[[], AbstractContextManager[object]]) -> Any:
    """x through the chain of layers, computing as the run does."""
    with computing():
        for layer in layers:
            x = layer(x)
    return x


def _backward_ratio(layers: list[nn.Module], sample: Any, samples: int, profiles: list[LayerProfile],
                    computing: Callable[[], AbstractContextManager[object]] = nullcontext) -> float:
    """A backward's seconds per forward's through the chain (sample: samples of them), the forward with autograd
    recording (as a bwd task runs it), the fastest of each over up to three rounds while they take under
    TIMING_BUDGET, after one round on two samples that takes each op's first backward in the process (slow enough
    to skew the ratio: docs/performance.md, "Predictions on CPU devices"). The rounds take as many samples as the
    profiles' forward puts under BACKWARD_SECONDS, which bounds what the timing adds to a large model's pilot.
    Where they take the pilot's own micro-batch, the ratio also counts what recording the graph adds to the forward
    (the profiles time it under no_grad, a backward's recompute records: dearer for small layers, docs/performance.md,
    "The pilot's forwards are timed without autograd recording"), so that a forward times one plus the ratio is the
    recompute and the backward; on fewer samples the forward's own time is the unit.
    BACKWARD_RATIO where nothing is trained, where two samples' forward passes BACKWARD_SECONDS, or where the
    activations kept for it would be more than BACKWARD_BYTES. The parameters' gradients are left as they were;
    the caller restores the buffers and the RNG."""
    per_sample = sum(profile.forward_seconds_per_sample for profile in profiles)
    count = samples if per_sample * samples <= BACKWARD_SECONDS else int(BACKWARD_SECONDS // per_sample)
    kept = sum(profile.output_bytes_per_sample for profile in profiles) * count
    parameters = [parameter for layer in layers for parameter in layer.parameters()]
    if (count < min(samples, 2) or kept > BACKWARD_BYTES
            or not any(parameter.requires_grad for parameter in parameters)):
        return BACKWARD_RATIO
    grads = [(parameter, parameter.grad) for parameter in parameters]
    warm, timed = (_first(sample, samples, size) for size in (min(count, 2), count))
    forward = backward = float("inf")
    try:
        with torch.enable_grad():
            for turn in range(4):
                started = time.perf_counter()
                try:
                    x = _through(layers, warm if turn == 0 else timed, computing)
                except ShapeError:  # an export that fixed the micro-batch's size (runtime.stages.Shapes)
                    if turn > 0 or count != samples:
                        return BACKWARD_RATIO
                    warm = timed  # the warm-up round on all of them
                    x = _through(layers, warm, computing)
                middle = time.perf_counter()
                outputs = [leaf for leaf in tree_leaves(x) if isinstance(leaf, torch.Tensor) and leaf.grad_fn]
                if not outputs:
                    return BACKWARD_RATIO
                torch.autograd.backward(outputs, [torch.ones_like(output) for output in outputs])
                ended = time.perf_counter()
                del x, outputs
                for parameter in parameters:
                    parameter.grad = None
                if turn > 0:
                    forward, backward = min(forward, middle - started), min(backward, ended - middle)
                    if ended - started > TIMING_BUDGET:
                        break
    finally:
        for parameter, grad in grads:
            parameter.grad = grad
    if forward <= 0:
        return BACKWARD_RATIO
    unrecorded = per_sample * count  # the profiles' chained forward, timed under no_grad
    if count != samples or unrecorded <= 0:
        return backward / forward
    return (max(forward - unrecorded, 0.0) + backward) / unrecorded  # the recompute records the graph: it is dearer


def _first(sample: Any, samples: int, count: int) -> Any:
    """The first count of sample's samples (its tensors batched along their first dimension)."""
    if count == samples:
        return sample
    return tree_map(lambda leaf: leaf[:count] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
                    and leaf.shape[0] == samples else leaf, sample)


def _timings(timed: ModelProfile | None, layers: list[nn.Module], borrowings: list[dict[str, tuple[int, str]]],
             samples: int) -> list[float] | None:
    """Each layer's forward seconds per sample from timed, where timed's layers are these on as many samples;
    else None."""
    if timed is None or timed.pilot_samples != samples or len(timed.layers) != len(layers):
        return None
    for known, layer, borrowed in zip(timed.layers, layers, borrowings):
        own = [(n, p) for n, p in layer.named_parameters() if n not in borrowed]
        if (known.description, known.params, known.buffers) != (
                _describe(layer), _specs(own), _specs(layer.named_buffers())):
            return None
    return [known.forward_seconds_per_sample for known in timed.layers]


@dataclass
class _Kept:
    """What one forward and backward of a layer hold (_kept)."""

    saved: int  # what the forward saves for the backward beyond the layer's input, output and weights
    backward: int  # the most the backward allocates at once
    output: Any  # the forward's output, detached; what it passes on of its input is the input's own


def _kept(layer: nn.Module, x: Any, tracked: bool, computing: Callable[[], AbstractContextManager[object]],
          dtype: torch.dtype | None) -> _Kept:
    """What layer's forward on x saves for its backward beyond its input, its output and its weights (a block's
    internals), and the most its backward then allocates at once (a block that recomputes its internals there,
    under gradient checkpointing, holds them then), as a bwd task's recompute and backward run it: under its
    weights' own requires_grad, and where tracked (every layer but the model's first) from an input that requires
    gradients, the backward from gradients of ones into gradient buffers of zeros (as a run's accumulate). That input
    is a copy (a leaf would refuse a layer that changes its input in place); the random generator and the weights'
    gradients are left as they were. The forward runs in computing (the run's autocast, in dtype where it has one),
    and what it saves of its weights' copies in dtype is not counted (LayerProfile.copied counts those apart)."""
    own = {tensor.untyped_storage().data_ptr() for tensor in (*layer.parameters(), *layer.buffers())}
    with torch.enable_grad():
        inputs = tree_map(lambda leaf: leaf.detach().requires_grad_().clone()
                          if tracked and isinstance(leaf, torch.Tensor) and leaf.is_floating_point() else leaf, x)
    weights = [parameter.detach() for parameter in layer.parameters() if parameter.dtype == torch.float32]
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in saved:
            saved[storage.data_ptr()] = 0 if _cast_weight(storage, dtype, weights) else storage.nbytes()
        return tensor

    generator = torch.get_rng_state()
    trained = [parameter for parameter in layer.parameters() if parameter.requires_grad]
    grads = [parameter.grad for parameter in trained]
    allocated = Allocated()
    try:
        with torch.enable_grad(), computing(), torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            y = layer(inputs)
        outputs = [leaf for leaf in tree_leaves(y) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if outputs:
            ones = [torch.ones_like(output) for output in outputs]
            for parameter in trained:
                parameter.grad = torch.zeros_like(parameter)
            with allocated:
                torch.autograd.backward(outputs, ones)
            del ones
    finally:
        torch.set_rng_state(generator)
        for parameter, grad in zip(trained, grads):
            parameter.grad = grad
    passed = {leaf.untyped_storage().data_ptr() for leaf in tree_leaves((x, inputs, y))
              if isinstance(leaf, torch.Tensor)}
    originals = {id(copy): leaf for copy, leaf in zip(tree_leaves(inputs), tree_leaves(x))}
    made = tree_map(lambda leaf: originals.get(id(leaf), leaf.detach() if isinstance(leaf, torch.Tensor) else leaf), y)
    return _Kept(sum(nbytes for pointer, nbytes in saved.items() if pointer not in own | passed), allocated.peak, made)


class Allocated(TorchDispatchMode):
    """The most bytes the tensors that ops make inside it hold at once: each op's outputs counted by their storage
    until it is freed (a weak reference, looked at before every op), but for an output in an argument's storage (a
    view, an op in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for pointer, (reference, nbytes) in list(self.storages.items()):
            if reference.expired():
                del self.storages[pointer]
                self.live -= nbytes
        out = func(*args, **(kwargs or {}))
        given = {leaf.untyped_storage().data_ptr() for leaf in tree_leaves((args, kwargs))
                 if isinstance(leaf, torch.Tensor)}
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr() not in self.storages.keys() | given:
                storage = leaf.untyped_storage()
                if storage.data_ptr():
                    self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
        return out


class _Part(NamedTuple):
    """A count of bytes as a part that does not grow with the micro-batch and a part per sample."""

    fixed: int
    per_sample: float


def _split(layer: nn.Module, x: Any, tracked: bool, computing: Callable[[], AbstractContextManager[object]],
           dtype: torch.dtype | None, samples: int, kept: _Kept, named: list[tuple[str, nn.Parameter]]
           ) -> tuple[_Part, _Part]:
    """What the layer keeps (kept, on x's samples) and what its backward allocates beyond its reserve, each split
    into a part that does not grow with the micro-batch (a parametrized weight, a mask or a table made for the
    sequence, fresh weight gradients) and a part per sample, from a second measure on half the samples. All of it
    per sample where x has fewer than four samples, where it keeps nothing, or where the layer fails on the half."""
    whole = (kept.saved, _beyond(kept, named, x))
    every = (_Part(0, whole[0] / samples), _Part(0, whole[1] / samples))
    if samples < 4 or not any(whole):
        return every
    fewer = samples // 2
    half = _first(x, samples, fewer)
    try:
        with quiet_failures():
            less = _kept(layer, half, tracked, computing, dtype)
    except Exception:
        return every
    parts = []
    for many, few in zip(whole, (less.saved, _beyond(less, named, half))):
        per = max(many - few, 0) / (samples - fewer)
        parts.append(_Part(max(round(many - per * samples), 0), per))
    return parts[0], parts[1]


def _beyond(kept: _Kept, named: list[tuple[str, nn.Parameter]], x: Any) -> int:
    """What the layer's backward allocates at once beyond what a pack's workspace reserves for it: its input's, its
    output's and its kept internals' gradients, and its largest weight's fresh gradient (tasks.packing)."""
    reserved = tree_nbytes(x) + _new_bytes(kept.output, x) + kept.saved + max(
        (parameter.nbytes for _, parameter in named), default=0)
    return max(kept.backward - reserved, 0)


def _cast_weight(storage: torch.UntypedStorage, dtype: torch.dtype | None, weights: list[torch.Tensor]) -> bool:
    """Whether storage holds one of weights cast to dtype, as autocast casts a weight for an op."""
    if dtype is None:
        return False
    size = torch.empty((), dtype=dtype).element_size()
    for weight in weights:
        if storage.nbytes() == weight.numel() * size and weight.numel():
            values = torch.empty(0, dtype=dtype, device=weight.device).set_(storage, 0, (weight.numel(),), (1,))
            if torch.equal(values, weight.reshape(-1).to(dtype)):
                return True
    return False


def _new_bytes(y: Any, x: Any) -> int:
    """The bytes of y's tensors that are not x's own: a value a stage passes on to a later one (the residual beside
    a branch) is memory its input already holds."""
    passed = {id(leaf) for leaf in tree_leaves(x) if isinstance(leaf, torch.Tensor)}
    return sum(leaf.nbytes for leaf in tree_leaves(y) if isinstance(leaf, torch.Tensor) and id(leaf) not in passed)


def _versions(x: Any) -> list[int]:
    """The version counters of x's tensors: a layer that writes its input in place moves them."""
    return [leaf._version for leaf in tree_leaves(x) if isinstance(leaf, torch.Tensor)]


def is_boundary(x: Any) -> bool:
    """Whether packs may be cut where x flows: a tensor, or a tuple of tensors and integers (a traced stage boundary,
    where an exported model's sizes that no crossing tensor has cross as integers)."""
    return isinstance(x, torch.Tensor) or (
        isinstance(x, tuple) and any(isinstance(value, torch.Tensor) for value in x)
        and all(isinstance(value, (torch.Tensor, int)) for value in x))


def _batch_size(tree: Any) -> int:
    leaves = [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    return leaves[0].shape[0] if leaves else 1
