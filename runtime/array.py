"""Fused arrays: one layer of N same-architecture models run as one computation, and their losses.

An ArrayLayer holds every member's parameters and buffers stacked along a new leading dimension (member
i's weight is ``stacked[i]``) and runs them at once: an nn.Linear as one batched matrix multiply
(``baddbmm``), a BatchNorm as one over members x channels, an elementwise activation or dropout
directly on the stacked activations, and any other
layer (Conv2d, BatchNorm with its running statistics per member, LayerNorm, Embedding, attention) through
``torch.func.vmap`` over a functional call (runtime.reparametrize), with random draws different per member and the
members' attention calls folded into one (runtime.attention); a tensor constant an exported stage made, alike in
every member, is read by all of them as it is (lifted_constants: vmap cannot fill an unbatched tensor from a
stacked one). Activations
between array layers carry the member dimension first; the first layer's input is the members' shared
mini-batch.
"""

from __future__ import annotations

import copy
import types
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import fx, nn
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from harmony.runtime.attention import FoldedAttention
from harmony.runtime.padding import PaddedLookups, pads
from harmony.runtime.reparametrize import bind

ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.Tanh,
    nn.Sigmoid,
    nn.SiLU,
    nn.LeakyReLU,
    nn.ELU,
    nn.Softplus,
    nn.Mish,
    nn.Hardtanh,
    nn.Identity,
    nn.Dropout,
)


TRANSPOSED = "^T"
ROW = "^row"
FALLBACK_WARNING = "There is a performance drop because we have not yet implemented the batching rule"  # vmap's
TENSOR = object()  # in a vmapped member's output, a tensor's place (ArrayLayer.forward keeps the other leaves)
LINEAR_TYPES = (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear)


LIFT = torch.ops.aten.lift_fresh_copy.default  # how an exported graph reads a tensor its forward made


def lifted_constants(module: nn.Module) -> set[str]:
    """module's buffers that torch.export lifted from tensors its forward made (``torch.tensor(2)``, a config's
    token id): a graph reads them only through lift_fresh_copy, so nothing writes them."""
    names = set()
    for path, graph in module.named_modules():
        if isinstance(graph, fx.GraphModule):
            for node in graph.graph.nodes:
                if node.op == "get_attr" and node.users and all(user.target is LIFT for user in node.users):
                    names.add(f"{path}.{node.target}" if path else str(node.target))
    return names & {name for name, _ in module.named_buffers()}


def stacked_name(name: str) -> str:
    """The attribute name of a member tensor's stack (module attribute names may not contain dots)."""
    return name.replace(".", ":")


def member_layout(name: str, stack: torch.Tensor) -> torch.Tensor:
    """A stack (members first, stored as the array stores the tensor called name in any module) viewed so that
    stack[i] has member i's own shape: a transposed stack transposed back, a row stack without its row dimension."""
    if name.endswith(TRANSPOSED):
        return stack.transpose(1, 2)
    if name.endswith(ROW):
        return stack.squeeze(1)
    return stack


class ArrayLayer(nn.Module):
    """One layer of every member of an array, its weights stacked, run as one fused computation.

    tied: the stacks of earlier array layers of the chain for the weights this layer reads too (tied weights), by
    this layer's names, registered here as they are (the pilot finds them borrowed); general: run through vmap
    whatever the layer (where a tie joins layers whose own ways would lay the stack out differently).

    A linear layer's weights are stacked transposed, members x in x out, under the name ``weight^T``, so that
    the batched matrix multiply reads them contiguously forwards and accumulates their gradients contiguously
    backwards; its biases are stacked as rows, members x 1 x out, under the name ``bias^row``, the shape the
    multiply broadcasts over the batch (no reshaping node to record and walk back every step). Both measured:
    docs/performance.md, "Fused arrays".
    """

    def __init__(self, members: Sequence[nn.Module], shared_input: bool, tied: dict[str, nn.Parameter] | None = None,
                 general: bool = False) -> None:
        super().__init__()
        first = members[0]
        self.size = len(members)
        self.shared_input = shared_input
        self.kind = "vmap" if general else array_kind(first, shared_input)
        self.param_names = [name for name, _ in first.named_parameters()]
        self.constants = {  # read by every member as it is, not stacked: a batched one could not fill a fresh tensor
            name: first.get_buffer(name).detach().clone() for name in sorted(lifted_constants(first))
            if all(torch.equal(member.get_buffer(name), first.get_buffer(name)) for member in members[1:])}
        self.buffer_names = [name for name, _ in first.named_buffers() if name not in self.constants]
        self.pads = pads(first)  # its lookups with a padding row run as runtime.padding's where indices are batched
        self.attends: bool | None = None  # whether it calls attention (runtime.attention folds it): known once run
        with torch.no_grad():
            for name, param in first.named_parameters():
                if tied and name in tied:  # the stack of an earlier layer that reads the same weight
                    self.register_parameter(self.attribute(name), tied[name])
                    continue
                stack = torch.stack([member.get_parameter(name).detach() for member in members])
                attribute = self.attribute(name)
                if attribute.endswith(TRANSPOSED):
                    stack = stack.transpose(1, 2).contiguous()
                elif attribute.endswith(ROW):
                    stack = stack.unsqueeze(1)
                self.register_parameter(attribute, nn.Parameter(stack, requires_grad=param.requires_grad))
            for name in self.buffer_names:
                stack = torch.stack([member.get_buffer(name).detach() for member in members])
                self.register_buffer(stacked_name(name), stack)
        template = retie(copy.deepcopy(first).to("meta"), first)
        object.__setattr__(self, "template", template)
        nn.Module.train(self, first.training)  # the template keeps each submodule's own mode, as the members have it

    def train(self, mode: bool = True) -> ArrayLayer:
        """Set the mode of the layer and of its template, which is not a submodule (its weights are the stacks):
        model.eval() puts a BatchNorm or a Dropout of every member in evaluation mode, as it would the members'."""
        super().train(mode)
        self.template.train(mode)
        return self

    def attribute(self, name: str) -> str:
        """The attribute holding the stack of the members' tensor called name."""
        if self.kind == "linear" and name in ("weight", "bias"):
            return name + (TRANSPOSED if name == "weight" else ROW)
        return stacked_name(name)

    def stacked(self, name: str, grad: bool = False) -> torch.Tensor:
        """The members' tensor called name (or its gradient) stacked along the first dimension (member i's is
        ``[i]``)."""
        attribute = self.attribute(name)
        stack = getattr(self, attribute)
        return member_layout(attribute, stack.grad if grad else stack)

    def extra_repr(self) -> str:
        return f"{self.size} x {self.template!r}, {self.kind}"

    def forward(self, x: Any) -> Any:
        template: nn.Module = self.template
        if self.kind == "elementwise":
            return template(x)
        if self.kind == "linear":
            return self._linear(x, self._parameters["weight" + TRANSPOSED], self._parameters.get("bias" + ROW))
        params = {name: getattr(self, stacked_name(name)) for name in self.param_names}
        buffers = {name: getattr(self, stacked_name(name)) for name in self.buffer_names}
        if self.kind == "batchnorm" and all(t.is_contiguous() for t in [*params.values(), *buffers.values()]):
            return self._batchnorm(x, params, buffers)
        shared = self.shared_input
        if shared and not params and not buffers:
            x = tree_map(lambda t: t.unsqueeze(0).expand(self.size, *t.shape) if isinstance(t, torch.Tensor) else t, x)
            shared = False

        call = bind(template)
        constants = self._constants([*params.values(), *buffers.values(), *tree_flatten(x)[0]]) if self.constants \
            else {}
        sizes: list[Any] = []  # the output's structure and its leaves that are not tensors (a traced stage's sizes)

        def member(member_params: dict[str, torch.Tensor], member_buffers: dict[str, torch.Tensor], value: Any
                   ) -> list[torch.Tensor]:
            leaves, structure = tree_flatten(call({**member_params, **member_buffers, **constants}, value))
            sizes[:] = [structure, [TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]]
            return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]

        dims = None if shared else tree_map(lambda leaf: 0 if isinstance(leaf, torch.Tensor) else None, x)
        lookups = PaddedLookups() if self.pads and not shared else nullcontext()
        attention = FoldedAttention() if self.attends is not False else nullcontext()
        with warnings.catch_warnings(), lookups, attention:  # an op vmap loops over (attention with dropout)
            warnings.filterwarnings("ignore", message=FALLBACK_WARNING)
            tensors = iter(vmap(member, in_dims=(0, 0, dims), randomness="different")(params, buffers, x))
        if isinstance(attention, FoldedAttention):
            self.attends = attention.calls > 0
        structure, leaves = sizes
        return tree_unflatten([next(tensors) if leaf is TENSOR else leaf for leaf in leaves], structure)

    def _constants(self, beside: list[Any]) -> dict[str, torch.Tensor]:
        """The shared constants on the device of the first tensor beside (the stacks, then the input's leaves: this
        layer moves to a device without them)."""
        device = next((value.device for value in beside if isinstance(value, torch.Tensor)), None)
        if device is not None and any(value.device != device for value in self.constants.values()):
            self.constants = {name: value.to(device) for name, value in self.constants.items()}
        return self.constants

    def _linear(self, x: torch.Tensor, transposed: torch.Tensor, rows_bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias for every member at once; transposed is the members' weights, members x in x out,
        rows_bias their biases, members x 1 x out.

        Rows go to the batched multiply as they come where they already are members x rows x features (every
        view is a node that autograd records and walks back, a tenth of a small layer's time)."""
        features = transposed.shape[1]
        if self.shared_input:
            rows = x.expand(self.size, *x.shape) if x.dim() == 2 else x.reshape(1, -1, features).expand(
                self.size, -1, -1)
            leading = x.shape[:-1]
        else:
            rows = x if x.dim() == 3 else x.reshape(self.size, -1, features)
            leading = x.shape[1:-1]
        out = torch.bmm(rows, transposed) if rows_bias is None else torch.baddbmm(rows_bias, rows, transposed)
        return out if len(leading) == 1 else out.reshape(self.size, *leading, transposed.shape[2])

    def _batchnorm(self, x: torch.Tensor, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> Any:
        """Every member's BatchNorm as one over members x channels: the members move into the channel dimension,
        so each (member, channel) is normalized over its own batch and updates its own running statistics."""
        template: nn.Module = self.template
        members, batch, channels = x.shape[0], x.shape[1], x.shape[2]
        merged = x.transpose(0, 1).reshape(batch, members * channels, *x.shape[3:])
        if template.training:
            buffers["num_batches_tracked"].add_(1)
        weight, bias = params.get("weight"), params.get("bias")
        out = nn.functional.batch_norm(
            merged,
            buffers["running_mean"].view(-1),
            buffers["running_var"].view(-1),
            None if weight is None else weight.view(-1),
            None if bias is None else bias.view(-1),
            template.training,
            template.momentum,
            template.eps,
        )
        return out.reshape(batch, members, channels, *x.shape[3:]).transpose(0, 1)

    def unstack_into(self, members: Sequence[nn.Module]) -> None:
        """Copy every member's slice of the stacked weights and buffers back into that member's layer."""
        with torch.no_grad():
            for index, member in enumerate(members):
                for name in self.param_names:
                    member.get_parameter(name).copy_(self.stacked(name)[index])
                for name in self.buffer_names:
                    member.get_buffer(name).copy_(getattr(self, stacked_name(name))[index])


def consecutive(members: list[int]) -> bool:
    """Whether members (increasing) follow one another, so that their rows of a stack are one view of it."""
    return members == list(range(members[0], members[0] + len(members)))


def member_rows(stack: torch.Tensor, live: list[int]) -> torch.Tensor:
    """The live members' rows of a stack (members first), in order: a view where they are consecutive, else a copy
    whose gradient goes back into the stack's rows."""
    if consecutive(live):
        return stack.narrow(0, live[0], len(live))
    return stack.index_select(0, torch.tensor(live, device=stack.device))


def narrowed_bytes(module: nn.Module, live: list[int]) -> int:
    """The bytes narrowed(module, live) copies: the live members' rows of every stack, unless they are consecutive."""
    if consecutive(live):
        return 0
    layers = [layer for layer in module.modules() if isinstance(layer, ArrayLayer)]
    return sum(tensor[0].nbytes * len(live) for layer in layers
               for tensor in [*layer._parameters.values(), *layer._buffers.values()] if tensor is not None)


@contextmanager
def sized(module: nn.Module, members: int) -> Iterator[None]:
    """Within the block, module's ArrayLayers compute that many members (their rows given as the tensors of a
    functional call, or by narrowed)."""
    layers = [layer for layer in module.modules() if isinstance(layer, ArrayLayer)]
    sizes = [layer.size for layer in layers]
    try:
        for layer in layers:
            layer.size = members
        yield
    finally:
        for layer, size in zip(layers, sizes):
            layer.size = size


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """Within the block, module in eval mode; after it, every part of it (an ArrayLayer's template's too, which is
    not a submodule) in the mode it had, so that a layer the user put in eval mode stays in it."""
    parts = [part for layer in module.modules()
             for part in (layer, *(layer.template.modules() if isinstance(layer, ArrayLayer) else ()))]
    modes = [part.training for part in parts]
    module.eval()
    try:
        yield
    finally:
        for part, training in zip(parts, modes):
            part.training = training


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@contextmanager
def narrowed(module: nn.Module, live: list[int], rows: dict[int, torch.Tensor] | None = None) -> Iterator[None]:
    """Within the block, the ArrayLayers of module compute the members at positions live alone (in that order, one
    row of each output per live member): a fused array whose other members stopped (pruned, or their loss no longer
    finite) computes only those still training.

    A parameter's live rows are rows[id(parameter)] where given (leaves of their own, whose gradient is those rows'
    alone), else member_rows of it, whose gradient reaches the full stack (zeros in the other members' rows).
    Buffers the layers update in place (BatchNorm's running statistics) are written back to the live members' rows
    as the block ends. What the layers draw at random is drawn for the live members alone, so their masks differ
    from the full array's.
    """
    rows = rows or {}
    layers = [layer for layer in module.modules() if isinstance(layer, ArrayLayer)]
    saved = [(dict(layer._parameters), dict(layer._buffers)) for layer in layers]
    try:
        for layer in layers:
            for table in (layer._parameters, layer._buffers):
                for name, tensor in table.items():
                    if tensor is not None:
                        given = rows.get(id(tensor))
                        table[name] = member_rows(tensor, live) if given is None else given  # type: ignore[assignment]
        with sized(module, len(live)):
            yield
    finally:
        index = torch.tensor(live)
        for layer, (parameters, buffers) in zip(layers, saved):
            with torch.no_grad():
                for name, full in buffers.items():
                    used = layer._buffers[name]
                    if full is not None and used is not None and not _shares_storage(used, full):  # a copy
                        full.index_copy_(0, index.to(full.device), used)
            layer._parameters.update(parameters)
            layer._buffers.update(buffers)


def retie(template: nn.Module, original: nn.Module) -> nn.Module:
    """template with the parameters original shares between modules (tied embeddings: GPT-2's ``wte`` and
    ``lm_head``) shared again: moving a module to the meta device gives each use a parameter of its own, and
    a functional call then fills the first use alone, leaving the others on meta."""
    names: dict[int, list[str]] = {}
    for name, parameter in original.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    for tied in names.values():
        shared = template.get_parameter(tied[0])
        for alias in tied[1:]:
            owner, _, attribute = alias.rpartition(".")
            setattr(template.get_submodule(owner), attribute, shared)
    return template


def array_kind(first: nn.Module, shared_input: bool) -> str:
    """How an array of layers like first runs: linear, batchnorm, elementwise or vmap (see ArrayLayer)."""
    if type(first) in LINEAR_TYPES:
        return "linear"
    if (
        type(first) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
        and first.track_running_stats
        and first.momentum is not None
        and not shared_input
    ):
        return "batchnorm"
    if isinstance(first, ELEMENTWISE) and not shared_input:
        return "elementwise"
    return "vmap"


def simple_attributes(module: nn.Module) -> tuple[tuple[str, str], ...]:
    """A module's plain configuration (numbers, strings, flags, tuples of them), what its forward may read."""
    plain = (bool, int, float, str, type(None))
    items = []
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or name == "training":
            continue
        if isinstance(value, plain) or (isinstance(value, tuple) and all(isinstance(v, plain) for v in value)):
            items.append((name, repr(value)))
    return tuple(items)


def configuration(model: nn.Module) -> Hashable:
    """What a model's code reads besides its tensors: each module's class and plain configuration, and the other
    objects its modules keep (settings). torch.export and torch.fx bake these into a graph (an activation's kind, an
    epsilon, a dropout rate): models of one architecture whose configurations differ compute differently, and one's
    graph cannot stand for the other's. Classes and functions count as the objects they are: one redefined (a
    notebook's cell run again) is another."""
    modules = tuple((name, type(module), simple_attributes(module)) for name, module in model.named_modules())
    return modules, settings(model.modules())


def settings(modules: Iterable[nn.Module]) -> tuple[Hashable, ...]:
    """The objects modules keep that a forward may compute with besides tensors, modules, plain values and
    containers (a module's bookkeeping: fx's meta, a model's warnings issued), each once: a function as itself, a
    settings object (a Hugging Face model's config) by its values."""
    kept: dict[int, Hashable] = {}
    for module in modules:
        for attribute, value in sorted(vars(module).items()):
            if not attribute.startswith("_") and not isinstance(value, (bool, int, float, str, tuple, type(None),
                                                                         torch.Tensor, nn.Module, dict, list, set)):
                kept.setdefault(id(value), _setting(value))
    return tuple(kept.values())


def _setting(value: object) -> Hashable:
    """An object a module keeps, as what it computes with (settings)."""
    if isinstance(value, types.MethodType):
        value = value.__func__  # not the object it is bound to: a model's own method would hold its weights
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return value
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return repr(sorted(to_dict().items()))
    if hasattr(value, "__dict__") and not callable(value):
        return f"{type(value).__qualname__}{sorted(vars(value).items())!r}"
    return repr(value)


def layer_signature(layer: nn.Module) -> tuple[Any, ...]:
    """What must agree for layers of different models to be fused: types, configuration, shapes, dtypes, a traced
    stage's code (which holds the constants its model's configuration put there: an epsilon, a rate) and the
    settings its modules keep (an activation function kept as an attribute, a config object): an array runs its
    first member's code for all of them."""
    parts: list[Any] = []
    for name, module in layer.named_modules():
        parts.append((name, type(module).__qualname__, type(module).__module__, module.training,
                      simple_attributes(module), module.code if isinstance(module, fx.GraphModule) else None))
    for name, param in layer.named_parameters():
        parts.append((name, tuple(param.shape), str(param.dtype), param.requires_grad, str(param.device)))
    for name, buffer in layer.named_buffers():
        parts.append((name, tuple(buffer.shape), str(buffer.dtype), str(buffer.device)))
    parts.append(settings(layer.modules()))
    return tuple(parts)


def member_slice(tree: Any, index: int) -> Any:
    return tree_map(lambda t: t[index] if isinstance(t, torch.Tensor) else t, tree)


def same_callable(functions: Sequence[Callable[..., Any]]) -> bool:
    """Whether every function computes the same thing: the same object, or loss modules of one configuration."""
    first = functions[0]
    if all(function is first for function in functions):
        return True
    if not isinstance(first, nn.Module):
        return False
    return all(
        type(function) is type(first)
        and simple_attributes(function) == simple_attributes(first)
        and not any(True for _ in function.parameters())
        and not any(True for _ in function.buffers())
        for function in functions
    )


def _is_plain_cross_entropy(fn: Callable[..., Any]) -> bool:
    if fn is nn.functional.cross_entropy:
        return True
    return (
        type(fn) is nn.CrossEntropyLoss
        and fn.weight is None
        and fn.ignore_index == -100
        and fn.reduction == "mean"
        and fn.label_smoothing == 0.0
    )


def _is_plain_mse(fn: Callable[..., Any]) -> bool:
    return fn is nn.functional.mse_loss or (type(fn) is nn.MSELoss and fn.reduction == "mean")


class ArrayLoss:
    """The members' losses on the stacked output and the shared targets, as a vector (one per member).

    How it runs (mode): "cross_entropy" and "mse" compute the members' mean losses with one batched
    operator over the stacked output (for the default F.cross_entropy / F.mse_loss and their modules);
    "vmap" vmaps a loss all members share; "loop" calls each member's own loss on its slice.
    """

    def __init__(self, loss_fns: Sequence[Callable[..., torch.Tensor]], mode: str) -> None:
        self.loss_fns = list(loss_fns)
        self.mode = mode

    @property
    def vectorized(self) -> bool:
        return self.mode != "loop"

    def narrowed(self, live: list[int]) -> ArrayLoss:
        """The losses of the members at positions live alone, on an output narrowed to them (see narrowed)."""
        return ArrayLoss([self.loss_fns[position] for position in live], self.mode)

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        members = len(self.loss_fns)
        if self.mode == "cross_entropy":
            targets = target.expand(members, -1).reshape(-1)  # every member's copy (a third of repeat's cost)
            flat = nn.functional.cross_entropy(output.flatten(0, 1), targets, reduction="none")
            return flat.view(members, -1).mean(1)
        if self.mode == "mse":
            return (output - target).pow(2).flatten(1).mean(1)
        if self.mode == "vmap":
            return vmap(self.loss_fns[0], in_dims=(0, None))(output, target).reshape(members)
        losses = [fn(member_slice(output, index), target) for index, fn in enumerate(self.loss_fns)]
        return torch.stack([loss.reshape(()) for loss in losses])


def _modes(loss_fns: Sequence[Callable[..., torch.Tensor]], output: Any, target: Any) -> list[str]:
    """The ways to run these losses on this output, fastest first (each still checked against the loop)."""
    if not same_callable(loss_fns):
        return []
    modes = []
    plain_tensors = isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)
    if plain_tensors and _is_plain_cross_entropy(loss_fns[0]) and output.dim() == 3 and target.dim() == 1:
        modes.append("cross_entropy")
    if plain_tensors and _is_plain_mse(loss_fns[0]) and output.shape[1:] == target.shape:
        modes.append("mse")
    return [*modes, "vmap"]


def array_loss(loss_fns: Sequence[Callable[..., torch.Tensor]], output: Any, target: Any) -> ArrayLoss:
    """An ArrayLoss for the members: the fastest mode that gives what each member's own loss gives on output."""
    looped = ArrayLoss(loss_fns, "loop")
    with torch.no_grad():
        reference = looped(output, target)
        for mode in _modes(loss_fns, output, target):
            candidate = ArrayLoss(loss_fns, mode)
            try:
                fused = candidate(output, target)
            except Exception:
                continue
            if fused.shape == reference.shape and torch.allclose(fused, reference, rtol=1e-5, atol=1e-6,
                                                                 equal_nan=True):
                return candidate
    return looped
