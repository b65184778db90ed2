"""The optimizer of a fused array: every member's own optimizer and hyperparameters, over stacked weights.

Each member's factory is called on that member's slices of the stacked parameters (views, so an update
writes into the stack; shaped as the member's own parameters, also where the array stores them transposed or
as rows), which gives its optimizer class and hyperparameters exactly as the user wrote them. When every member
uses plain SGD, Adam or AdamW, the array steps once over the stacked tensors with the members' hyperparameters
as per-member columns (the same arithmetic as torch's single-tensor implementations, a few kernels per tensor
instead of one call per member and tensor); otherwise the members' optimizers are merged into one torch
optimizer over the slices, one param group per member's group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from harmony.runtime.array import consecutive, member_layout, member_rows
from harmony.runtime.schedule import at_step, schedules

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

STACKABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
PER_MEMBER = {
    torch.optim.SGD: ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    torch.optim.Adam: ("lr", "beta1", "beta2", "eps", "weight_decay"),
    torch.optim.AdamW: ("lr", "beta1", "beta2", "eps", "weight_decay"),
}
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


Columns = dict[str, Any]


class StackedOptimizer(torch.optim.Optimizer):
    """SGD, Adam or AdamW over stacked parameters, each hyperparameter a list with one value per member.

    The hyperparameters become columns (one value per member, broadcasting against a stack) built once per
    group and stack shape and rebuilt only if a group's values change; Adam's bias corrections are computed
    once per step for all of a group's stacks, in double precision as torch does, then rounded once. With live
    set, a step updates those members' rows of every stack and of its state alone (the others' stay as they are),
    run by run of consecutive members, on views; their gradient is row_grads' where given (a narrowed array's rows
    computed as leaves of their own), else those rows of the stack's.
    """

    def __init__(self, algorithm: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> None:
        self.algorithm = algorithm
        self.live: list[int] | None = None  # the members whose rows a step updates, where not every member's
        self.row_grads: dict[int, torch.Tensor] = {}  # by id of a stack, its live rows' gradient (else param.grad's)
        self.columns: dict[tuple[Any, ...], Columns] = {}
        self.hyperparameters: dict[int, list[list[Any]]] = {}
        self.corrections: dict[tuple[Any, ...], tuple[float, Columns]] = {}
        super().__init__(groups, {})

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """torch's entry point (its profiler range and step hooks); the runtime calls update, see step_optimizer."""
        self.update()

    @torch.no_grad()
    def update(self) -> None:
        """One step of every stack."""
        for index, group in enumerate(self.param_groups):
            values = [group[name] for name in PER_MEMBER[self.algorithm]]
            if self.hyperparameters.get(index) != values:  # first step, or a group's values changed: rebuild
                self.hyperparameters[index] = [list(v) for v in values]
                self.columns = {key: columns for key, columns in self.columns.items() if key[0] != index}
                self.corrections = {key: cached for key, cached in self.corrections.items() if key[0] != index}
            for param in group["params"]:
                rows = self.row_grads.get(id(param)) if self.live is not None else None
                if rows is None and param.grad is None:
                    continue
                columns = self._columns(index, group, param)
                if self.live is None:
                    grad = -param.grad if group["maximize"] else param.grad
                    self._step(index, param, grad, columns, self.state[param])
                else:
                    rows = member_rows(param.grad, self.live) if rows is None else rows
                    self._step_rows(index, param, -rows if group["maximize"] else rows, columns, self.live)

    def _step(self, index: int, param: torch.Tensor, grad: torch.Tensor, columns: Columns, state: dict[str, Any]
              ) -> None:
        if self.algorithm is torch.optim.SGD:
            self._sgd(param, grad, columns, state)
        else:
            self._adam(index, param, grad, columns, state)

    def _step_rows(self, index: int, param: torch.Tensor, grad: torch.Tensor, columns: Columns, live: list[int]
                   ) -> None:
        """One step of the live members' rows of param and of its state, grad being those rows' gradient: run by
        run of consecutive members, on views (no copies); the step that makes the state (its first) on copies of
        the rows, the state's other rows zeros."""
        state = self.state[param]
        momentum = self.algorithm is torch.optim.SGD and columns["momentum"] is not None
        if (momentum and "momentum_buffer" not in state) or (self.algorithm is not torch.optim.SGD and not state):
            self._first_step_rows(index, param, grad, columns, live, state)
            return
        count = state.get("step")
        rows: dict[str, Any] = {}
        for first, members, offset in consecutive_runs(live):
            rows = {name: value.narrow(0, first, members) for name, value in state.items() if name != "step"}
            if count is not None:
                rows["step"] = count.clone()  # each run takes the step once, from where it was
            self._step(index, param.narrow(0, first, members), grad.narrow(0, offset, members),
                       {name: None if column is None else column.narrow(0, first, members)
                        for name, column in columns.items()}, rows)
        if count is not None:
            count.copy_(rows["step"])

    def _first_step_rows(self, index: int, param: torch.Tensor, grad: torch.Tensor, columns: Columns,
                         live: list[int], state: dict[str, Any]) -> None:
        picked = member_rows(param, live)
        rows: dict[str, Any] = {name: member_rows(value, live) if name != "step" else value
                                for name, value in state.items()}
        self._step(index, picked, grad,
                   {name: None if column is None else member_rows(column, live) for name, column in columns.items()},
                   rows)
        copied = not consecutive(live)  # else views, stepped in place
        where = torch.tensor(live, device=param.device)
        if copied:
            param.index_copy_(0, where, picked)
        for name, value in rows.items():
            if name == "step" or name not in state:  # made by this step: the others' rows zeros
                state[name] = value if name == "step" else torch.zeros_like(param).index_copy_(0, where, value)
            elif copied:
                state[name].index_copy_(0, where, value)

    def _columns(self, index: int, group: dict[str, Any], like: torch.Tensor) -> Columns:
        """The group's hyperparameter columns shaped to broadcast against like (members first)."""
        key = (index, like.dim(), like.dtype, like.device)
        columns = self.columns.get(key)
        if columns is None:
            columns = self.columns[key] = self._build_columns(group, like)
        return columns

    def _build_columns(self, group: dict[str, Any], like: torch.Tensor) -> Columns:
        shape = (-1, *[1] * (like.dim() - 1))

        def column(values: Sequence[float], dtype: torch.dtype = like.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=like.device).reshape(shape)

        if self.algorithm is torch.optim.SGD:
            momentum, nesterov = group["momentum"], group["nesterov"]
            uses_buffer = [m != 0 for m in momentum]
            return {
                "weight_decay": column(group["weight_decay"]) if any(group["weight_decay"]) else None,
                "momentum": column(momentum) if any(momentum) else None,
                "kept": column([1 - d if m != 0 else 1.0 for m, d in zip(momentum, group["dampening"])]),
                "nesterov": column([bool(n) for n in nesterov], torch.bool) if any(nesterov) else None,
                "uses_buffer": None if all(uses_buffer) else column(uses_buffer, torch.bool),
                "negative_lr": column([-lr for lr in group["lr"]]),
            }
        decay = group["weight_decay"]
        decoupled = group["decoupled_weight_decay"]
        return {
            "decay": column([1 - lr * wd for lr, wd in zip(group["lr"], decay)]) if any(decay) and decoupled else None,
            "weight_decay": column(decay) if any(decay) and not decoupled else None,
            "first_kept": column([1 - b for b in group["beta1"]]),
            "beta2": column(group["beta2"]),
            "second_kept": column([1 - b for b in group["beta2"]]),
            "eps": column(group["eps"]),
            "lr64": column(group["lr"], torch.float64),
            "beta1_64": column(group["beta1"], torch.float64),
            "beta2_64": column(group["beta2"], torch.float64),
        }

    def _sgd(self, param: torch.Tensor, grad: torch.Tensor, columns: Columns, state: dict[str, Any]) -> None:
        if columns["weight_decay"] is not None:
            grad = torch.addcmul(grad, param, columns["weight_decay"])
        momentum = columns["momentum"]
        if momentum is not None:
            buffer = state.get("momentum_buffer")
            if buffer is None:
                buffer = torch.clone(grad).detach()
                state["momentum_buffer"] = buffer
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

    def _corrections(self, index: int, like: torch.Tensor, step: float, columns: Columns) -> Columns:
        """Adam's step-dependent columns: minus the step size, and the second moment's correction."""
        key = (index, like.dim(), like.dtype, like.device)
        cached = None if self.live is not None else self.corrections.get(key)  # rows: their own columns
        if cached is None or cached[0] != step:
            step_size = columns["lr64"] / (1 - columns["beta1_64"] ** step)
            correction = (1 - columns["beta2_64"] ** step).sqrt()
            cached = (step, {"negative_step_size": (-step_size).to(like.dtype),
                             "correction": correction.to(like.dtype)})
            if self.live is None:
                self.corrections[key] = cached
        return cached[1]

    def _adam(self, index: int, param: torch.Tensor, grad: torch.Tensor, columns: Columns, state: dict[str, Any]
              ) -> None:
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        if columns["decay"] is not None:
            param.mul_(columns["decay"])
        elif columns["weight_decay"] is not None:
            grad = torch.addcmul(grad, param, columns["weight_decay"])
        corrections = self._corrections(index, param, float(state["step"]), columns)
        state["exp_avg"].lerp_(grad, columns["first_kept"])
        state["exp_avg_sq"].mul_(columns["beta2"]).addcmul_(columns["second_kept"] * grad, grad)
        update = state["exp_avg_sq"].sqrt().div_(corrections["correction"]).add_(columns["eps"])
        torch.div(state["exp_avg"], update, out=update)  # one stack-sized buffer for the denominator and the step
        param.addcmul_(update, corrections["negative_step_size"])


def consecutive_runs(members: list[int]) -> list[tuple[int, int, int]]:
    """members (increasing) as runs of consecutive ones: (first, how many, where the run starts in members)."""
    runs: list[tuple[int, int, int]] = []
    for offset, member in enumerate(members):
        if runs and runs[-1][0] + runs[-1][1] == member:
            first, count, start = runs[-1]
            runs[-1] = (first, count + 1, start)
        else:
            runs.append((member, 1, offset))
    return runs


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


def step_optimizer(optimizer: torch.optim.Optimizer, step: int) -> None:
    """optimizer.step() for the update of step (its learning rate on schedule); an array's StackedOptimizer is
    updated directly, without the profiler range and hook lookups torch wraps every step in (docs/performance.md,
    "Fused arrays")."""
    at_step(optimizer, step)
    if isinstance(optimizer, StackedOptimizer):
        optimizer.update()
    else:
        optimizer.step()


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
