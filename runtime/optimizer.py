"""A swapped pack's update on the host store, applied exactly once per step whatever dies in the middle, with
torch's fused CPU kernel where the optimizer has one (fused_on_host).

The update for step s reads the pack's weights at version s (slot s % 2) and writes version s + 1 into the other
slot: it copies the trainable parameters and the optimizer's state across, steps the optimizer there (a torch
optimizer built by the user's factory over views of that slot, its gradients views of the gradient file), then
publishes the version. A worker that dies before the version is published leaves version s whole, and the update
is simply run again; one that finds the version published already leaves it. Updates of one pack are serialized
by a lock on its weights file, so that a task still running on one worker and its rerun on another never step
the same slot at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import nn

from harmony.runtime.array_optimizer import build_optimizer, optimizer_params, step_optimizer
from harmony.runtime.cache import DeviceCache
from harmony.runtime.divergence import keep_stopped
from harmony.runtime.files import Versions
from harmony.runtime.hoststore import HostStore, tensor_at, tensors_at
from harmony.runtime.optimstate import OptimizerState
from harmony.runtime.serial_copy import copy_serially
from harmony.runtime.spec import PackRuntime
from harmony.tasks.layout import BufferLayout

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class PackOptimizer:
    """A torch optimizer over one slot of one pack's weights in the host store, with its state kept per slot."""

    def __init__(
        self, factory: OptimizerFactory, weights: torch.Tensor, grads: torch.Tensor, runtime: PackRuntime,
        state: OptimizerState,
    ) -> None:
        params = stepped_parameters(runtime, runtime.weights, weights, grads)
        self.optimizer = build_optimizer(factory, params, [slot.spec.name for slot in runtime.stepped])
        fused_on_host(self.optimizer)
        self.params = optimizer_params(self.optimizer)
        self.state = state

    def step(self, slot: int, step: int, stopped: Sequence[int] = ()) -> None:
        """Apply the update of step to the parameters of this optimizer's slot, with the state that slot holds, and
        keep the new state; an array's stacked optimizer leaves its stopped members out (step_optimizer)."""
        self.state.load(self.optimizer, self.params, slot, bind=True)
        step_optimizer(self.optimizer, step, stopped)
        self.state.save(self.optimizer, self.params, slot)


def stepped_parameters(runtime: PackRuntime, layout: BufferLayout, weights: torch.Tensor, grads: torch.Tensor
                       ) -> list[nn.Parameter]:
    """The pack's trainable parameters as views of weights (laid out as layout), each with its gradient a view of
    grads, in the order of its gradient layout (what its optimizer's state is indexed by)."""
    by_name = {slot.spec.name: slot for slot in layout.slots}
    params = []
    for grad_slot in runtime.stepped:
        param = nn.Parameter(tensor_at(weights, by_name[grad_slot.spec.name]))
        param.grad = tensor_at(grads, grad_slot)
        params.append(param)
    return params


def next_slot(versions: Versions, pack: int, step: int) -> int | None:
    """The slot the pack's update for step writes version step + 1 into, or None where that version is published
    already (the update ran); an update that comes before its step's version is an error."""
    current, slot = versions.current(pack)
    if current > step:
        return None
    if current < step:
        raise RuntimeError(f"the update of step {step} of pack {pack} came before step {current}'s")
    return 1 - slot


def fused_on_host(optimizer: torch.optim.Optimizer) -> None:
    """Step with torch's fused CPU kernel where the optimizer has one and its factory chose no implementation
    (neither fused nor foreach): on the host store it is several times torch's default per-tensor loop and differs
    from it by rounding alone (docs/performance.md, "The host optimizer"). Parameters that are not floating point
    or not on the CPU keep the default."""
    defaults = optimizer.defaults
    if defaults.get("fused", False) is not None or defaults.get("foreach") is not None:
        return
    if defaults.get("differentiable") or defaults.get("capturable"):
        return
    for group in optimizer.param_groups:
        if all(param.device.type == "cpu" and param.is_floating_point() for param in group["params"]):
            group["fused"] = True


def pack_lock(store: HostStore, name: str) -> AbstractContextManager[None]:
    """Hold the pack's lock (on its weights file) across processes for the block."""
    return store.locked(name)


def update(
    runtime: PackRuntime,
    versions: Versions,
    pack: int,
    step: int,
    weights: Callable[[int], torch.Tensor],
    optimizer: Callable[[int], PackOptimizer],
    stopped: list[int],
    skip: bool = False,
) -> bool:
    """Apply a pack's update for step once: from the slot of version step into the other slot, then publish
    version step + 1. weights gives a slot's bytes, optimizer the pack's optimizer over a slot; stopped are the
    members of an array that keep their weights (see divergence); skip carries the weights and the optimizer's
    state over unchanged (a step a loss scaler skips). Returns whether it applied the update (not when the version
    says it was applied already). The caller holds the pack's lock."""
    following = next_slot(versions, pack, step)
    if following is None:
        return False
    slot = 1 - following
    if runtime.stepped:  # a pack of activations, frozen layers or borrowed weights has nothing to step
        source, target = weights(slot), weights(following)
        copy_trainable(runtime, source, target)
        stepping = optimizer(following)
        stepping.state.copy_slot(slot, following)
        if not skip:
            stepping.step(following, step, stopped)
        if stopped:
            names = [entry.spec.name for entry in runtime.stepped]
            after, before = tensors_at(target, runtime.weights), tensors_at(source, runtime.weights)
            keep_stopped([after[name] for name in names], [before[name][stopped] for name in names], stopped)
    versions.publish(pack, step + 1, following)
    return True


def update_on_device(
    runtime: PackRuntime,
    versions: Versions,
    pack: int,
    step: int,
    weights: torch.Tensor,
    grads: torch.Tensor,
    host: Callable[[int], torch.Tensor],
    factory: OptimizerFactory,
    state: OptimizerState,
    cache: DeviceCache,
    reserve: int,
    stopped: list[int],
) -> bool:
    """Apply a pack's update for step once, on its device (tasks.updates): weights are its device bytes at version
    step (they are stepped in place, so the caller drops them from the cache afterwards), grads its step's gradients
    there, host gives a slot of its host weights. The optimizer state of version step is copied in, the optimizer
    steps, and the trainable weights and the state are written into the other slot, which is then published as
    version step + 1: the same protocol as update, so that a rerun finds the update applied or version step whole.
    reserve is the state's predicted bytes, charged to the device before the state exists (after its first step the
    state's own size is known: what it holds beyond the reserve is charged when it appears, as for a homed model).
    The caller holds the pack's lock. Returns whether it applied the update."""
    following = next_slot(versions, pack, step)
    if following is None:
        return False
    slot = 1 - following
    if runtime.stepped:
        assert runtime.halved is None, "a halved device copy is not the master weights (tasks.updates)"
        params = stepped_parameters(runtime, runtime.device_weights, weights, grads)
        names = [entry.spec.name for entry in runtime.stepped]
        optimizer = build_optimizer(factory, params, names)
        fused_on_host(optimizer)  # a CPU device steps with the host store's kernel
        listed = optimizer_params(optimizer)
        layout = state.tensors(slot)
        held = sum(tensor.nbytes for tensor in layout if tensor.dim())  # a step count stays on the host
        with cache.scratch(max(held, reserve), f"optimizer state of pack {pack}"):
            state.load(optimizer, listed, slot, bind=False)
            cache.counters.add("in_state", held)
            kept = [tensors_at(host(slot), runtime.weights)[name][stopped] for name in names] if stopped else []
            step_optimizer(optimizer, step, stopped)
            keep_stopped([param.detach() for param in params], kept, stopped)
            made = sum(value.nbytes for values in optimizer.state.values() for value in values.values()
                       if isinstance(value, torch.Tensor) and value.dim())
            with cache.scratch(max(0, made - max(held, reserve)), f"optimizer state of pack {pack} beyond its reserve"):
                target = host(following)
                for where in trainable_ranges(runtime):  # the device copy is laid out as the host slot
                    cache.write_back(weights[where], target[where], "weights")
                state.save(optimizer, listed, following)
                cache.counters.add("out_state", made)
    versions.publish(pack, step + 1, following)
    return True


def trainable_ranges(runtime: PackRuntime) -> list[slice]:
    """Where the trainable parameters lie in a slot of the pack's weights (buffers and frozen parameters are
    written elsewhere: buffers by the step's tasks, frozen parameters into both slots when the run starts)."""
    trainable = {slot.spec.name for slot in runtime.grads.slots}
    return [slice(slot.offset, slot.offset + slot.spec.nbytes) for slot in runtime.weights.slots
            if slot.spec.name in trainable]


def copy_trainable(runtime: PackRuntime, source: torch.Tensor, target: torch.Tensor) -> None:
    """Copy the trainable parameters' bytes of one weights slot into another."""
    for where in trainable_ranges(runtime):
        copy_serially(target[where], source[where])  # on an upd's thread: no pool
