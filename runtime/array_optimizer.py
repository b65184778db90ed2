"""The optimizer of a fused array: every member's own optimizer and hyperparameters, over stacked weights.

Each member's factory is called on that member's slices of the stacked parameters (views, so an update
writes into the stack; shaped as the member's own parameters, also where the array stores them transposed or
as rows), which gives its optimizer class and hyperparameters exactly as the user wrote them. When every member
uses plain SGD, Adam or AdamW, the array steps as a StackedOptimizer: each member by torch's own fused
implementation over its rows of every stack, one call per member and group instead of one per member and
tensor; otherwise the members' optimizers are merged into one torch optimizer over the slices, one param group
per member's group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam
from torch.optim.adamw import adamw
from torch.optim.sgd import sgd

from harmony.runtime.array import member_layout
from harmony.runtime.schedule import at_step, schedules

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

STACKABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
PER_MEMBER = {
    torch.optim.SGD: ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    torch.optim.Adam: ("lr", "beta1", "beta2", "eps", "weight_decay"),
    torch.optim.AdamW: ("lr", "beta1", "beta2", "eps", "weight_decay"),
}
FUSED_DEVICES = ("cpu", "cuda")  # where torch's fused SGD and Adam kernels run
COLUMNS_ELEMENTS = 2**18  # a member's elements in a group under this: SGD steps every member at once (see update)
SHARED_FLAGS = ("maximize", "amsgrad", "capturable", "differentiable", "fused", "decoupled_weight_decay")


def member_slices(params: Sequence[nn.Parameter], member: int, names: Sequence[str]) -> list[nn.Parameter]:
    """Parameters viewing member's slice of each stacked parameter (called names in the array's module), with
    its slice of the gradient, each in the member's own shape (see member_layout)."""
    slices = []
    for param, name in zip(params, names):
        view = nn.Parameter(member_layout(name, param.detach())[member], requires_grad=param.requires_grad)
        if param.grad is not None:
            view.grad = member_layout(name, param.grad)[member]
        slices.append(view)
    return slices


Columns = dict[str, torch.Tensor | None]  # an SGD group's hyperparameters, one value a member


class StackedOptimizer(torch.optim.Optimizer):
    """SGD, Adam or AdamW over stacked parameters (members first), each hyperparameter a list with one value per
    member.

    Each member steps by torch's own implementation (torch.optim.sgd.sgd, adam.adam, adamw.adamw), fused where
    the device has the fused kernels, over its rows of the group's stacks and of their state, with its own
    hyperparameters: one kernel per member and group, not several per stack. Only SGD over small members (under
    COLUMNS_ELEMENTS each in a group), every member stepping, goes stack by stack instead, each hyperparameter a
    column of per-member values: there a call per member costs more than the arithmetic (docs/performance.md,
    "The stacked optimizer"). Its rows are the member's tensors whatever their layout (the update is elementwise).
    Adam's step count is per member (a [members] tensor, each row the 0-dim count a member's own Adam keeps). With
    live set, only those members step (the others' rows stay as they are); their gradient is row_grads' where
    given (a narrowed array's live rows computed as leaves of their own: row j is live[j]'s), else their rows of
    the stack's.
    """

    def __init__(self, algorithm: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> None:
        self.algorithm = algorithm
        self.live: list[int] | None = None  # the members that step, where not every member does
        self.row_grads: dict[int, torch.Tensor] = {}  # by id of a stack, its live rows' gradient (else param.grad's)
        self.columns: dict[tuple[Any, ...], Columns] = {}  # see _columns
        super().__init__(groups, {})

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """torch's entry point (its profiler range and step hooks); the runtime calls update, see step_optimizer."""
        self.update()

    @torch.no_grad()
    def update(self) -> None:
        """One step of every member (or of the live ones) over every stack with a gradient."""
        for group in self.param_groups:
            stepped = [param for param in group["params"] if param.grad is not None
                       or (self.live is not None and id(param) in self.row_grads)]
            if not stepped:
                continue
            count = len(group["lr"])
            if (self.algorithm is torch.optim.SGD and self.live is None
                    and sum(param.numel() for param in stepped) < COLUMNS_ELEMENTS * count):
                self._sgd_columns(group, stepped)
                continue
            members = range(count) if self.live is None else self.live
            params = [param.unbind(0) for param in stepped]  # per stack, its members' rows (views)
            grads = [self._grads(param) for param in stepped]
            if self.algorithm is torch.optim.SGD:
                self._sgd(group, members, stepped, params, grads)
            else:
                self._adam(group, members, stepped, params, grads)

    def _grads(self, param: torch.Tensor) -> Sequence[torch.Tensor] | dict[int, torch.Tensor]:
        """A stack's gradient rows, by member."""
        rows = self.row_grads.get(id(param)) if self.live is not None else None
        return param.grad.unbind(0) if rows is None else dict(zip(self.live or [], rows.unbind(0)))

    def _sgd(self, group: dict[str, Any], members: Sequence[int], stepped: list[torch.Tensor],
             params: list[Sequence[torch.Tensor]], grads: list[Any]) -> None:
        """A stack without a momentum buffer takes its first step: torch makes each member's, and the stack's
        buffer is made of them (the rows of members that do not step zeros)."""
        buffers = [self.state[param].get("momentum_buffer") for param in stepped]
        rows = [None if buffer is None else buffer.unbind(0) for buffer in buffers]
        fused = _fused(stepped[0])
        for member in members:
            made = [None if row is None else row[member] for row in rows]
            sgd([row[member] for row in params], [row[member] for row in grads], made, fused=fused,
                weight_decay=group["weight_decay"][member], momentum=group["momentum"][member],
                lr=group["lr"][member], dampening=group["dampening"][member],
                nesterov=bool(group["nesterov"][member]), maximize=group["maximize"])
            for param, buffer, row in zip(stepped, buffers, made):
                if buffer is None and row is not None:
                    stack = self.state[param].get("momentum_buffer")
                    if stack is None:
                        stack = self.state[param]["momentum_buffer"] = torch.zeros_like(param)
                    stack[member].copy_(row)

    def _sgd_columns(self, group: dict[str, Any], stepped: list[torch.Tensor]) -> None:
        """SGD of every member at once, stack by stack, each hyperparameter a column of per-member values
        broadcasting against the stack: the arithmetic of torch's single-tensor SGD."""
        for param in stepped:
            columns = self._columns(group, param)
            grad = param.grad if not group["maximize"] else -param.grad
            if columns["weight_decay"] is not None:
                grad = torch.addcmul(grad, param, columns["weight_decay"])
            momentum = columns["momentum"]
            if momentum is not None:
                buffer = self.state[param].get("momentum_buffer")
                if buffer is None:
                    buffer = self.state[param]["momentum_buffer"] = torch.clone(grad).detach()
                else:
                    buffer.mul_(momentum).addcmul_(grad, columns["kept"])
                uses_buffer = columns["uses_buffer"]
                if columns["nesterov"] is not None:
                    nesterov = grad.add(buffer * momentum)
                    grad = torch.where(columns["nesterov"], nesterov,
                                       buffer if uses_buffer is None else torch.where(uses_buffer, buffer, grad))
                elif uses_buffer is None:
                    grad = buffer
                else:
                    grad = torch.where(uses_buffer, buffer, grad)
            param.addcmul_(grad, columns["negative_lr"])

    def _columns(self, group: dict[str, Any], like: torch.Tensor) -> Columns:
        """The group's SGD hyperparameters as columns shaped to broadcast against like, kept while they hold."""
        values = tuple(tuple(group[name]) for name in PER_MEMBER[torch.optim.SGD])
        key = (values, like.dim(), like.dtype, like.device)
        columns = self.columns.get(key)
        if columns is not None:
            return columns
        shape = (-1, *[1] * (like.dim() - 1))

        def column(values: Sequence[float], dtype: torch.dtype = like.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=like.device).reshape(shape)

        momentum, nesterov = group["momentum"], group["nesterov"]
        uses_buffer = [m != 0 for m in momentum]
        columns = {
            "weight_decay": column(group["weight_decay"]) if any(group["weight_decay"]) else None,
            "momentum": column(momentum) if any(momentum) else None,
            "kept": column([1 - d if m != 0 else 1.0 for m, d in zip(momentum, group["dampening"])]),
            "nesterov": column([bool(n) for n in nesterov], torch.bool) if any(nesterov) else None,
            "uses_buffer": None if all(uses_buffer) else column(uses_buffer, torch.bool),
            "negative_lr": column([-lr for lr in group["lr"]]),
        }
        self.columns = {k: v for k, v in self.columns.items() if k[1:] != key[1:]}  # a schedule's old values go
        self.columns[key] = columns
        return columns

    def _adam(self, group: dict[str, Any], members: Sequence[int], stepped: list[torch.Tensor],
              params: list[Sequence[torch.Tensor]], grads: list[Any]) -> None:
        states = [self.state[param] for param in stepped]
        for param, state in zip(stepped, states):
            if not state:
                state["step"] = torch.zeros(param.shape[0], dtype=torch.float32, device=param.device)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            elif state["step"].dim() == 0:
                raise RuntimeError("this array's Adam state holds one step count for all its members, as Harmony "
                                   "saved it before counts were per member: resume the run with the Harmony that "
                                   "checkpointed it, or start it again")
        steps, firsts, seconds = ([state[name].unbind(0) for state in states]
                                  for name in ("step", "exp_avg", "exp_avg_sq"))
        fused = _fused(stepped[0])
        step = adamw if group["decoupled_weight_decay"] else adam
        for member in members:
            step([row[member] for row in params], [row[member] for row in grads], [row[member] for row in firsts],
                 [row[member] for row in seconds], [], [row[member] for row in steps], fused=fused, amsgrad=False,
                 beta1=group["beta1"][member], beta2=group["beta2"][member], lr=group["lr"][member],
                 weight_decay=group["weight_decay"][member], eps=group["eps"][member], maximize=group["maximize"])


def _fused(param: torch.Tensor) -> bool | None:
    """torch's fused kernels where param's device has them (else its default implementation)."""
    return True if param.device.type in FUSED_DEVICES and param.dtype.is_floating_point else None


def _stacked_groups(
    members: list[torch.optim.Optimizer], params: Sequence[nn.Parameter], slices: list[list[nn.Parameter]]
) -> list[dict[str, Any]] | None:
    """The stacked optimizer's param groups, or None when the members cannot be stepped as one."""
    algorithm = type(members[0])
    if algorithm not in STACKABLE or any(type(member) is not algorithm for member in members):
        return None
    layouts = []
    for member, views in zip(members, slices):
        position = {id(view): index for index, view in enumerate(views)}
        layout = []
        for group in member.param_groups:
            if any(id(p) not in position for p in group["params"]):
                return None
            layout.append(tuple(position[id(p)] for p in group["params"]))
        layouts.append(tuple(layout))
    if any(layout != layouts[0] for layout in layouts):
        return None
    groups = []
    for index, positions in enumerate(layouts[0]):
        per_member = [member.param_groups[index] for member in members]
        group: dict[str, Any] = {"params": [params[p] for p in positions]}
        for flag in SHARED_FLAGS:
            values = {bool(g.get(flag) or False) for g in per_member}
            if len(values) != 1 or (flag not in ("maximize", "decoupled_weight_decay") and values != {False}):
                return None
            group[flag] = values.pop()
        for g in per_member:
            if isinstance(g["lr"], torch.Tensor):
                return None
            if "betas" in g:
                g = {**g, "beta1": g["betas"][0], "beta2": g["betas"][1]}
            for name in PER_MEMBER[algorithm]:
                value = g[name]
                if isinstance(value, torch.Tensor):
                    return None
                group.setdefault(name, []).append(float(value))
        if algorithm is torch.optim.AdamW:
            group["decoupled_weight_decay"] = True
        groups.append(group)
    return groups


class ArrayOptimizer:
    """The optimizer factory of an array: builds each member's optimizer on its slices and steps them as one."""

    def __init__(self, factories: Sequence[OptimizerFactory], stack: bool = True) -> None:
        self.factories = list(factories)
        self.stack = stack

    def __call__(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return self.build(params, [""] * len(params))

    def build(self, params: list[nn.Parameter], names: Sequence[str]) -> torch.optim.Optimizer:
        """The array's optimizer over params, called names in the array's module (which tells how each is
        stacked)."""
        slices = [member_slices(params, member, names) for member in range(len(self.factories))]
        members = [factory(views) for factory, views in zip(self.factories, slices)]
        groups = _stacked_groups(members, params, slices) if self.stack else None
        if groups is not None:
            stacked = StackedOptimizer(type(members[0]), groups)
            if any(getattr(member, "lr_schedules", None) for member in members):
                for group in stacked.param_groups:
                    group["initial_lr"] = list(group["lr"])
                stacked.lr_schedules = [list(entries) for entries in zip(*map(schedules, members))]  # type: ignore[attr-defined]
            return stacked
        merged = members[0]
        merged.lr_schedules = [entry for member in members for entry in schedules(member)]  # type: ignore[attr-defined]
        for member in members[1:]:
            for group in member.param_groups:
                merged.add_param_group(group)
        merged.member_origins = {  # type: ignore[attr-defined]
            id(view): (member, name) for member, views in enumerate(slices) for view, name in zip(views, names)
        }
        return merged


def build_optimizer(
    factory: OptimizerFactory, params: list[nn.Parameter], names: Sequence[str]
) -> torch.optim.Optimizer:
    """factory's optimizer over params; an array's is also told the parameters' names."""
    if isinstance(factory, ArrayOptimizer):
        return factory.build(params, names)
    return factory(params)


def step_optimizer(optimizer: torch.optim.Optimizer, step: int, stopped: Sequence[int] = ()) -> None:
    """optimizer.step() for the update of step (its learning rate on schedule); an array's StackedOptimizer is
    updated directly, without the profiler range and hook lookups torch wraps every step in (docs/performance.md,
    "Fused arrays"), and steps its members not in stopped alone (another optimizer steps every member: the caller
    puts the stopped members' weights back, runtime.divergence)."""
    at_step(optimizer, step)
    if not isinstance(optimizer, StackedOptimizer):
        optimizer.step()
    elif stopped and optimizer.live is None:
        optimizer.live = [member for member in range(len(optimizer.param_groups[0]["lr"])) if member not in stopped]
        try:
            optimizer.update()
        finally:
            optimizer.live = None
    else:
        optimizer.update()


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter an optimizer steps, in a fixed order (what its persisted state is indexed by)."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def param_origins(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], names: Sequence[str]
) -> list[tuple[int | None, str]]:
    """For each parameter optimizer steps (in optimizer_params order), the array member it is a slice of (None for
    a whole tensor: a single model's, or an array's stack) and the name of the tensor it comes from, among params
    called names (what build_optimizer built it over)."""
    by_id = {id(param): (None, name) for param, name in zip(params, names)}
    by_id.update(getattr(optimizer, "member_origins", {}))
    return [by_id[id(param)] for param in optimizer_params(optimizer)]
