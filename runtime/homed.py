"""A model homed on its device: master weights, a gradient buffer and the optimizer, all on the device.

Its weights are copied in once and pinned; its module is bound to them once (parameters that view the
device weights), so that every step runs the module directly, as a plain PyTorch loop would; the update
steps the optimizer over the same parameters, whose state is charged to the device budget after its first
step (with a loss scaler for fp16, through torch.amp.GradScaler, its state flushed beside the weights). After
each of its tasks its weights and optimizer state go to the host store as the next version (a task runs a span
of steps sized so that this costs about as little as the task itself): a model whose device is lost is taken up
from there, on its device when it comes back or on another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from harmony.runtime.array import ArrayLoss, member_rows, narrowed, narrowed_bytes
from harmony.runtime.array_optimizer import StackedOptimizer, build_optimizer, optimizer_params, step_optimizer
from harmony.runtime.cache import DeviceCache
from harmony.runtime.clipping import clip_in_place
from harmony.runtime.compiled import module_call
from harmony.runtime.divergence import keep_stopped
from harmony.runtime.hoststore import tensors_at
from harmony.runtime.optimstate import OptimizerState
from harmony.runtime.schedule import at_step
from harmony.runtime.spec import PackRuntime


def bind(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make every parameter and buffer of module (under each of its names, tied ones too) the given tensor."""
    aliases: dict[int, list[str]] = {}
    members = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, value in members:
        aliases.setdefault(id(value), []).append(name)
    for names in aliases.values():
        value = next(tensors[name] for name in names if name in tensors)
        for name in names:
            owner, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(owner), attribute, value)


class HomedModel:
    """One homed single-pack model's state on its device.

    Gradients: when the optimizer steps the bound parameters themselves (a torch optimizer, or an array's
    stacked one), each step starts with no gradients and backward hands its fresh gradient tensors to the
    parameters, as ``zero_grad(set_to_none=True)`` does in a plain loop (no zeroing, no accumulation pass);
    the budget is charged for them all the same. An optimizer over other tensors (an array's members merged
    into one torch optimizer steps views of the stacked gradients) gets a gradient buffer zeroed every step.

    A fused array whose members stopped computes the others alone (narrowing; runtime.array.narrowed), and its
    stacked optimizer steps their rows alone, by the gradients of their leaves (a clipped array, or one whose
    members' optimizers are merged, gets whole gradients, and its stopped members' weights are put back after each
    update); compiled, it computes every member (a narrowed module would be compiled again as its members change).
    The copies an update makes (the rows its first step makes its state on) are transient, as the update's own
    temporaries are.
    """

    def __init__(
        self,
        cache: DeviceCache,
        model: int,
        runtime: PackRuntime,
        weights: torch.Tensor,
        module: nn.Module,
        factory: Callable[..., torch.optim.Optimizer],
        saved: OptimizerState,
        version: int,
        slot: int,
        scaler: torch.amp.GradScaler | None = None,
        compile: bool = False,
        clip: tuple[float, ...] = (),
        members: int = 1,
    ) -> None:
        self.cache = cache
        self.members = members
        self.narrowable = members > 1 and not compile
        self.workspace = runtime.workspace
        self.live: list[int] | None = None  # the members that compute, where not all of them do
        self.leaves: dict[int, torch.Tensor] = {}  # by id of a stack, its live rows as a leaf (see narrowing)
        self.scaler = scaler
        self.clip = clip
        self.grad_norms: list[torch.Tensor] = []  # each clipped step's members' norms, since the task began
        self.model = model
        self.weights = weights
        cache.hold((model, 0))
        buffer: torch.Tensor | None = cache.allocate(runtime.grads.nbytes, f"homed gradients of model {model}")
        grads = tensors_at(buffer, runtime.grads)
        parameter_names = {name for name, _ in module.named_parameters()}
        bound: dict[str, torch.Tensor] = {}
        for name, view in tensors_at(weights, runtime.weights).items():
            if name in parameter_names:
                param = nn.Parameter(view, requires_grad=name in grads)
                param.grad = grads.get(name)
                bound[name] = param
            else:
                bound[name] = view
        bind(module, bound)
        self.module = module
        self.forward = module_call(module, f"homed_model_{model}", compile, runtime.first, runtime.drawing)
        names = [slot.spec.name for slot in runtime.grads.slots]
        self.names = names
        self.params = [bound[name] for name in names]
        self.buffers = [bound[name] for name in runtime.buffer_names]
        self.optimizer = build_optimizer(factory, self.params, names)  # type: ignore[arg-type]
        self.fresh_grads = {id(p) for p in optimizer_params(self.optimizer)} == {id(p) for p in self.params}
        if self.fresh_grads:
            buffer = None  # the bytes stay charged; backward allocates the gradients
        self.grad_buffer = buffer
        self.optimizer_params = optimizer_params(self.optimizer)
        self.state_bytes = 0
        self.next_step = version
        self.stopped: list[int] = []
        self.kept: list[torch.Tensor] = []
        self.kept_buffers: list[torch.Tensor] = []
        if version:
            saved.load(self.optimizer, self.optimizer_params, slot, bind=False)
            self._charge_state()

    def clear_grads(self) -> None:
        """Before a step's first backward: no gradients yet (or a zeroed buffer, see the class)."""
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
            return
        for param in self.params:
            param.grad = None

    def stop(self, members: list[int]) -> None:
        """Members of this array that stopped (their loss stopped being finite, or they were pruned) keep their
        weights as they are now (before the update of the step they stopped at) for the rest of the run (see
        divergence); members already stopped are kept as they were."""
        if set(members) - set(self.stopped):
            if self.stopped:  # those stopped before keep their statistics of then, whatever this step's forward did
                keep_stopped(self.buffers, self.kept_buffers, self.stopped)
            self.stopped = sorted({*self.stopped, *members})
            index = torch.tensor(self.stopped, device=self.params[0].device)
            self.kept = [param.detach().index_select(0, index) for param in self.params]
            self.kept_buffers = [buffer.index_select(0, index) for buffer in self.buffers]

    @property
    def training(self) -> list[int]:
        """The members not stopped (every one of a single model)."""
        return [member for member in range(self.members) if member not in self.stopped]

    @contextmanager
    def narrowing(self) -> Iterator[None]:
        """A step (its update too) of a fused array with stopped members computes the others alone (live): their
        rows of each stack are leaves of their own (leaves), whose gradients the stacked optimizer steps them by, the
        copy of them (members not consecutive) charged beyond the room their fewer activations leave in the step's
        workspace; where that copy does not fit the budget now, the step computes every member."""
        training = self.training
        self.live = None
        with ExitStack() as reserved:
            if self.narrowable and 0 < len(training) < self.members:
                freed = int(self.workspace * (1 - len(training) / self.members))
                extra = max(0, narrowed_bytes(self.module, training) - freed)
                if self.cache.fits(extra + self.workspace):  # beside the step's activations, reserved next
                    reserved.enter_context(self.cache.scratch(extra, f"rows of model {self.model}'s live members"))
                    self.live = training
                    self.leaves = {id(param): member_rows(param.detach(), training).requires_grad_()
                                   for param in self.params}
            try:
                yield
            finally:
                self.leaves = {}

    @property
    def computing(self) -> int:
        """How many members a step computes."""
        return self.members if self.live is None else len(self.live)

    def losses(self, loss_fn: Callable[..., torch.Tensor], x: torch.Tensor, target: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's losses: those to backpropagate (the computing members'), and one per member of the
        array (NaN for a member that no longer computes, which stopped before)."""
        if self.live is None:
            losses = loss_fn(self.forward(x), target)
            return losses, losses
        assert isinstance(loss_fn, ArrayLoss), "only a fused array's members stop apart"
        with narrowed(self.module, self.live, self.leaves):
            computed = loss_fn.narrowed(self.live)(self.forward(x), target)
        every = torch.full((self.members,), float("nan"), dtype=computed.dtype, device=computed.device)
        every[self.live] = computed.detach().reshape(-1)
        return computed, every

    @property
    def scaled(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What multiplies the gradient of the step's loss by its scale (fp16: GradScaler.scale), or None."""
        return None if self.scaler is None else self.scaler.scale

    def step(self, step: int) -> None:
        """Apply the update on the device; the device weights become version step + 1. With a loss scaler, as a
        plain loop with torch.amp.GradScaler: unscaled, skipped when a gradient is not finite, the scale updated.
        Clipped (runtime.clipping) after unscaling, as clip_grad_norm_ between GradScaler.unscale_ and step."""
        training = self.training
        rows = isinstance(self.optimizer, StackedOptimizer) and bool(self.stopped) and bool(training)
        if self.leaves:
            if rows and self.live == training and self.scaler is None and not self.clip:
                self.optimizer.row_grads = {key: leaf.grad for key, leaf in self.leaves.items()
                                            if leaf.grad is not None}
            else:  # clipped, loss-scaled, another optimizer, or a member stopped within the step: whole gradients
                self._gather_grads()
        if rows:
            self.optimizer.live = training  # the stopped members' rows stay as they are
        try:
            if self.scaler is not None:
                at_step(self.optimizer, step)
                if self.clip:
                    self.scaler.unscale_(self.optimizer)
                    self._clip()
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                if self.clip:
                    self._clip()
                step_optimizer(self.optimizer, step)
        finally:
            if rows:
                self.optimizer.live = None
                self.optimizer.row_grads = {}
        if self.stopped and not rows:
            keep_stopped([param.detach() for param in self.params], self.kept, self.stopped)
        if self.stopped:  # running statistics a step's forward through every member changed
            keep_stopped(self.buffers, self.kept_buffers, self.stopped)
        self._charge_state()
        self.cache.set_version((self.model, 0), step + 1)
        self.next_step = step + 1

    def _gather_grads(self) -> None:
        """The stacks' gradients from their live rows' leaves (zeros in the other members' rows)."""
        assert self.live is not None
        where = torch.tensor(self.live, device=self.params[0].device)
        for param in self.params:
            leaf = self.leaves.get(id(param))
            if leaf is not None and leaf.grad is not None:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                param.grad.index_copy_(0, where, leaf.grad)

    def _clip(self) -> None:
        """Clip the step's gradients to each member's largest norm, and keep the norms (on the device: the task
        takes them to the host with its losses)."""
        totals = clip_in_place([(name, param.grad) for name, param in zip(self.names, self.params)
                                if param.grad is not None], self.clip)
        self.grad_norms.append(torch.stack([total.to(self.params[0].device) for total in totals]))

    def _charge_state(self) -> None:
        """Charge the device for optimizer state it holds beyond what was charged (after its first step)."""
        held = sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )
        if held > self.state_bytes:
            self.cache.charge(held - self.state_bytes, f"optimizer state of model {self.model}")
            self.state_bytes = held

    def flush(self, host: torch.Tensor, saved: OptimizerState, slot: int) -> None:
        """Write the device's weights and optimizer state into a slot of the host store (host is its weights)."""
        self.cache.write_back(self.weights, host, "weights")
        saved.save(self.optimizer, self.optimizer_params, slot)
        self.cache.counters.add("out_state", self.state_bytes)
