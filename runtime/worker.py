"""The device worker plugin: per run, the device cache, host store mappings, skeletons and optimizers.

Registered by the driver for each run; on each worker it finds the worker's device by the worker's
name, maps the device's counters from the host store and builds a DeviceCache with the device's budget.
Task bodies look the run up by its id and their worker's address (several workers may share
a process). Teardown drops everything the run held on the worker.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from distributed import WorkerPlugin, get_worker
from torch import nn

from harmony.runtime import (
    collector,
    serialization,  # noqa: F401  (tensor serializers on every worker)
)
from harmony.runtime.allocator import keep_freed_memory
from harmony.runtime.array import ArrayLoss
from harmony.runtime.cache import DeviceCache, Part, Source
from harmony.runtime.clipping import Norms, coefficients, on_device, scale, tensor_norms, total_norms
from harmony.runtime.compiled import PackCall, pack_call
from harmony.runtime.counters import IN_KINDS, OUT_KINDS, Counters, block_bytes
from harmony.runtime.divergence import Members
from harmony.runtime.files import (
    MIRROR_HEADER,
    Versions,
    counters_name,
    grad_norms_name,
    grads_name,
    mirror_bytes,
    mirror_name,
    record_rows,
    reduced_grads_name,
    slot_bytes,
    threads_name,
    versions_name,
    weights_name,
    weights_slot,
)
from harmony.runtime.handoff import FinishedKeys
from harmony.runtime.homed import HomedModel
from harmony.runtime.hoststore import HostStore, identity, tensor_at, tensors_at, torch_dtype
from harmony.runtime.optimizer import PackOptimizer, pack_lock, update, update_on_device
from harmony.runtime.optimstate import OptimizerState
from harmony.runtime.orphans import gone, sweep
from harmony.runtime.peer import Exported, Outbox, take
from harmony.runtime.profiling import TaskProfiler
from harmony.runtime.rows import Rows, computed_rows, member_spans
from harmony.runtime.scaler import Scaler
from harmony.runtime.serial_copy import copy_serially
from harmony.runtime.shipping import ShippedTensors, unship
from harmony.runtime.skeleton import load_code, load_skeleton
from harmony.runtime.spec import RunSpec
from harmony.runtime.threads import TaskKey, Threads
from harmony.tasks.graph import TaskId, parse_key

RUNS: dict[tuple[str, str], RunContext] = {}


def counted(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A RunContext method whose calls its device's counters count (name + "s") and time (name + "_ns"), however
    each ends."""

    def decorate(method: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(method)
        def run(self: RunContext, *args: Any, **kwargs: Any) -> None:
            started = time.perf_counter_ns()
            try:
                method(self, *args, **kwargs)
            finally:
                self.counters.add(f"{name}_ns", time.perf_counter_ns() - started)
                self.counters.add(f"{name}s", 1)

        return run

    return decorate


class RunContext:
    """One run's state on one device worker."""

    def __init__(self, spec: RunSpec, worker_name: str) -> None:
        self.spec = spec
        self.device_index = spec.device_index(worker_name)
        self.device_spec = spec.devices[self.device_index]
        self.device = torch.device(self.device_spec.torch_device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)  # the run's own peak: see DeviceCache.reserved
        self.store = HostStore(spec.run, spec.store_directory, pin=self.device.type == "cuda")
        counters = Counters(self.store.attach(counters_name(self.device_index), block_bytes(len(spec.models))))
        self.threads = self.store.attach(threads_name(self.device_index), 8).view(torch.int64)
        self.choice = Threads()  # one thread or all (CPU devices of several)
        self.threads_now = 0  # what the device's last task computed with (the dashboard's)
        self._timing: tuple[TaskKey, int, int, float] | None = None  # the fwd or bwd task running: its threads,
        # the device's share then, its start
        self.cache = DeviceCache(
            self.device_spec.name, self.device, self.device_spec.budget, counters, self.device_spec.link_bandwidth,
            ahead=spec.ahead,
        )
        self.timeline: list[tuple[str, float, float, float]] = []  # per task: key, wall start, end, copy seconds
        directory, steps = spec.profile or (None, 0)
        self.profiler = TaskProfiler(directory, steps, self.device_spec.name, self.device.type == "cuda",
                                     len(spec.models))
        self.machine = identity(Path(spec.store_directory))
        self.outbox = Outbox(self.store, self.device_index, self.device)
        self.exports = len(spec.devices) > 1  # see runtime.peer
        self.finished = FinishedKeys()
        self.early_starts: dict[str, float] = {}  # producer key: when a reader first came before it
        self.successor: TaskId | None = None
        self.attempt = 0  # of the task the device runs (runtime.bodies.Attempt)
        self.files: list[ShippedTensors] = []  # that the task the device runs reads (writing)
        self.homed_models: dict[int, HomedModel] = {}
        self._modules: dict[tuple[int, int], nn.Module] = {}
        self._loss_fns: dict[int, Any] = {}
        self._factories: dict[int, Any] = {}
        self._optimizers: dict[tuple[int, int, int], PackOptimizer] = {}
        self._states: dict[tuple[int, int], OptimizerState] = {}
        self._members: dict[int, Members] = {}
        self._scalers: dict[int, Scaler] = {}
        self._norms: dict[int, Norms] = {}
        self._calls: dict[tuple[int, int], PackCall] = {}
        self._row_sizes: dict[int, list[tuple[int, int]]] = {}  # per array, its packs' held bytes and workspaces
        self.froze = False  # whether setting the run up froze the worker's objects (runtime.collector)

    @property
    def counters(self) -> Counters:
        return self.cache.counters

    @property
    def computing_threads(self) -> int:
        """The CPU threads this device's next task computes with: its own share of the cores, or more once devices
        of its machine with nothing left to compute give theirs (runtime.devices.shared_threads)."""
        return int(self.threads[0]) or self.device_spec.threads

    def use_threads(self, key: TaskKey | None = None) -> int:
        """Give torch computing_threads in the thread that runs the tasks, or for a fwd or bwd task (key) of a CPU
        device that adapts (threads="auto") the one thread or all that it chose or is timing (runtime.threads);
        returns how many. The task before it, if a fwd or bwd, is timed from its start to this one's (what it cost
        the device, the runtime's work after it included)."""
        now = time.perf_counter()
        threads = self.computing_threads
        if self._timing is not None:
            timed, used, share, began = self._timing
            one = self.choice.finished(timed, used, share, now - began)
            if one is not None:  # the latest choice (a new share times afresh)
                self.counters.set("threads_chosen", 1)
                self.counters.set("one_thread", int(one))
        self._timing = None
        if key is not None and self.device.type == "cpu" and self.spec.adaptive:
            share, threads = threads, self.choice.threads_for(key, threads)
            self._timing = (key, threads, share, now)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.threads_now = threads
        return threads

    def autocast(self) -> AbstractContextManager[object]:
        """Where forward and backward compute (and a loss is taken): under torch.autocast in the run's precision
        (bf16: weights, gradients and optimizer state stay float32), else as the model's dtypes say."""
        if self.spec.autocast is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.spec.autocast))

    def module(self, model: int, pack: int) -> nn.Module:
        key = (model, pack)
        if key not in self._modules:
            self._modules[key] = load_skeleton(self.spec.models[model].packs[pack].skeleton)
        return self._modules[key]

    def call(self, model: int, pack: int) -> PackCall:
        """What runs a pack: (its tensors by name, its input) -> its output, compiled where the run asks (once per
        pack and worker, again where grad mode, training mode or shapes change; see runtime.compiled)."""
        key = (model, pack)
        if key not in self._calls:
            runtime = self.spec.models[model].packs[pack]
            self._calls[key] = pack_call(self.module(model, pack), f"model_{model}_pack_{pack}", self.spec.compile,
                                         runtime.first, runtime.drawing)
        return self._calls[key]

    def loss_fn(self, model: int) -> Any:
        if model not in self._loss_fns:
            self._loss_fns[model] = load_code(self.spec.models[model].loss_fn)
        return self._loss_fns[model]

    def optimizer_factory(self, model: int) -> Any:
        if model not in self._factories:
            self._factories[model] = load_code(self.spec.models[model].optimizer)
        return self._factories[model]

    def weights_slot(self, model: int, pack: int, slot: int) -> torch.Tensor:
        """One slot of a pack's host weights."""
        nbytes = self.spec.models[model].packs[pack].weights.nbytes
        return weights_slot(self.store.attach(weights_name(model, pack), 2 * slot_bytes(nbytes)), slot, nbytes)

    def host_weights(self, model: int, pack: int, version: int) -> torch.Tensor:
        """A pack's host weights at version: the current one, or the one before it (a step being run again)."""
        return self.weights_slot(model, pack, self.versions(model).slot(pack, version))

    def device_source(self, model: int, pack: int, version: int) -> Source:
        """What the device copy of a pack's weights at version is copied from: the host slot of that version, or,
        where weights are halved, their mirror (see mirror) followed by the rest of the slot."""
        halved = self.spec.models[model].packs[pack].halved
        slot = self.versions(model).slot(pack, version)
        host = self.weights_slot(model, pack, slot)
        if halved is None:
            return host
        return self.mirror(model, pack, version, slot), host[halved.host_split :]

    def mirror(self, model: int, pack: int, version: int, slot: int, locked: bool = False) -> torch.Tensor:
        """The mirror of a pack's halved weights at version (in slot): made from the weights slot, under the pack's
        lock (unless the caller holds it), by whoever needs it first. A slot's weights do not change while their
        version is read (two slots, see runtime.files), so a mirror made from a version stays right until its
        slot takes another."""
        runtime = self.spec.models[model].packs[pack]
        halved = runtime.halved
        assert halved is not None
        mapped = self.store.attach(mirror_name(model, pack), mirror_bytes(halved.device_split))
        made = mapped[:16].view(torch.int64)
        part = weights_slot(mapped[MIRROR_HEADER:], slot, halved.device_split)
        if int(made[slot]) != version + 1:
            with nullcontext() if locked else pack_lock(self.store, weights_name(model, pack)):
                if int(made[slot]) != version + 1:
                    made[slot] = 0
                    host = tensors_at(self.weights_slot(model, pack, slot), runtime.weights)
                    for place in halved.device.slots[: len(halved.names)]:  # the halved ones come first
                        tensor_at(part, place).copy_(host[place.spec.name])
                    made[slot] = version + 1
        return part

    def next_weights(self, model: int, pack: int, version: int) -> torch.Tensor:
        """The slot the version after version goes into (the other one): where a step's buffers are written."""
        return self.weights_slot(model, pack, 1 - self.versions(model).slot(pack, version))

    @contextmanager
    def borrowed(self, model: int, pack: int, version: int) -> Iterator[dict[str, torch.Tensor]]:
        """Device copies, at version, of the tied weights the pack reads from the packs that hold them, by the pack's
        names for them; their bytes are charged while the block runs."""
        runtime = self.spec.models[model].packs[pack]
        if not runtime.borrowed:
            yield {}
            return
        packs = self.spec.models[model].packs
        sources = {here: tensors_at(self.host_weights(model, owner, version), packs[owner].weights)[there]
                   for here, owner, there in runtime.borrowed}
        with self.cache.scratch(sum(tensor.nbytes for tensor in sources.values()), f"tied weights of pack {pack}"):
            yield {here: self.cache.copy_in(tensor, "weights") for here, tensor in sources.items()}

    def add_lent_grads(self, model: int, pack: int, group: int, grads: dict[str, torch.Tensor]) -> None:
        """Add to the pack's gradients those that later packs computed for the weights they borrow from it, in
        backward order (as autograd accumulates a tied weight's uses)."""
        packs = self.spec.models[model].packs
        for later, there, here in packs[pack].lent:
            their = tensors_at(self.host_grads(model, later, group), packs[later].grads)
            if there in their and here in grads:
                grads[here].add_(self.cache.copy_in(their[there], "grads"))

    def host_grads(self, model: int, pack: int, group: int = 0) -> torch.Tensor:
        return self.store.attach(grads_name(model, pack, group), self.spec.models[model].packs[pack].grads.nbytes)

    def reduce_grads(self, model: int, pack: int) -> None:
        """Sum the micro-batch groups' gradients into the reduced file, which the optimizer reads (out of place, so
        that an update run again sums the same gradients). The caller holds the pack's lock."""
        runtime = self.spec.models[model].packs[pack]
        total = self.store.attach(reduced_grads_name(model, pack), runtime.grads.nbytes)
        groups = [tensors_at(self.host_grads(model, pack, group), runtime.grads)
                  for group in range(self.spec.models[model].groups)]
        for name, reduced in tensors_at(total, runtime.grads).items():
            torch.sum(torch.stack([grads[name] for grads in groups]), 0, out=reduced)

    def homed(self, model: int, weights: torch.Tensor) -> HomedModel:
        """The state of a model homed on this device, created when its weights first arrive (at the version the
        host store holds, with the optimizer state of that version: a model moved here after its device was
        lost takes up where its last flush left it)."""
        if model not in self.homed_models:
            runtime = self.spec.models[model].packs[0]
            version, slot = self.versions(model).current(0)
            scaler = None
            if self.spec.models[model].scaled:
                scaler = torch.amp.GradScaler(self.device.type)
                scaler.load_state_dict(self.spec.scaler.state_dict(*self.scaler(model).state(version)))
            self.homed_models[model] = HomedModel(
                self.cache, model, runtime, weights, load_skeleton(runtime.skeleton), self.optimizer_factory(model),
                self.optimizer_state(model, 0), version, slot, scaler, self.spec.compile, self.spec.models[model].clip,
                self.spec.models[model].members,
            )
        if self.spec.models[model].members > 1:  # members pruned while the job waited since its last task
            self.homed_models[model].stop(self.members(model).stopped())
        return self.homed_models[model]

    def homed_next_step(self, model: int) -> int:
        """The step a model homed on this device trains next: where its device state is, else where the host
        store's version of it is."""
        state = self.homed_models.get(model)
        return self.versions(model).current(0)[0] if state is None else state.next_step

    def flush_homed(self, model: int) -> None:
        """Write a homed model's weights and optimizer state into the host store as the next version (after each
        of its tasks: what it takes up from if its device is lost)."""
        state = self.homed_models[model]
        with pack_lock(self.store, weights_name(model, 0)):
            versions = self.versions(model)
            version, slot = versions.current(0)
            state.flush(self.weights_slot(model, 0, 1 - slot), self.optimizer_state(model, 0), 1 - slot)
            if state.scaler is not None:
                self.scaler(model).save(state.next_step, state.scaler.get_scale(),
                                        state.scaler._get_growth_tracker(), after=version)
            versions.publish(0, state.next_step, 1 - slot)

    def versions(self, model: int) -> Versions:
        """Per pack of model, the version the host store's weights are at, and its slot."""
        return Versions(self.store.attach(versions_name(model), 8 * len(self.spec.models[model].packs)))

    def members(self, model: int) -> Members:
        """Which members of a job still train (see divergence)."""
        if model not in self._members:
            self._members[model] = Members(self.store, model, self.spec.models[model].members)
        return self._members[model]

    def rows(self, model: int, members: list[int]) -> Rows | None:
        """The members of a fused array a step or an evaluation computes where only members (increasing) of them
        should (runtime.rows); None for a model alone, a compiled run (a narrower call would be compiled again as
        members stop) and an array whose members' losses are not one ArrayLoss."""
        spec = self.spec.models[model]
        if spec.members == 1 or self.spec.compile or not isinstance(self.loss_fn(model), ArrayLoss):
            return None
        if model not in self._row_sizes:
            self._row_sizes[model] = [(spec.held_bytes(pack), runtime.workspace)
                                      for pack, runtime in enumerate(spec.packs)]
        return computed_rows(members, spec.members, self._row_sizes[model])

    def part(self, model: int, pack: int, rows: Rows | None) -> Part | None:
        """What of a pack's weights a task computing rows reads (runtime.cache.Part); None for all of them: every
        member computed, a homed model (its copy stays whole on its device), a pack updated on its device (its
        whole copy is stepped and goes back), halved weights."""
        spec = self.spec.models[model]
        runtime = spec.packs[pack]
        if rows is None or spec.home is not None or runtime.device_update or runtime.halved is not None:
            return None
        layout, buffers = runtime.device_weights, runtime.device_buffers_offset
        return Part(frozenset(rows.computing), rows.spans(layout, buffers),
                    functools.partial(member_spans, layout, spec.members, end=buffers, shared=False))

    def training_rows(self, model: int, step: int) -> Rows | None:
        """The members a swapped fused array's step computes where some of them stopped (runtime.rows); None for a
        model alone, or where it computes every member."""
        return None if self.spec.models[model].members == 1 else self.rows(model, self.members(model).training(step))

    def optimizer_state(self, model: int, pack: int) -> OptimizerState:
        key = (model, pack)
        if key not in self._states:
            self._states[key] = OptimizerState(self.store, model, pack)
        return self._states[key]

    def scaler(self, model: int) -> Scaler:
        """The loss-scaling state of a job whose loss is scaled (fp16, see runtime.scaler)."""
        if model not in self._scalers:
            spec = self.spec.models[model]
            self._scalers[model] = Scaler(self.store, model, len(spec.packs), spec.groups, self.spec.scaler)
        return self._scalers[model]

    @contextmanager
    def writing(self, model: int, pack: int, step: int) -> Iterator[bool]:
        """Hold the pack's lock while the device's running task writes into the host store what it computed for step
        (the pack's gradients and their flags, running statistics, losses), and say whether it may: only while the
        pack is at step's version, before the update that reads them (a span run again finds it applied, and what it
        would write written). StaleBatch where a file the task read has been given another use since: the task is an
        earlier attempt of a span run again since, whose inputs were released under it (tasks.binding)."""
        with pack_lock(self.store, weights_name(model, pack)):
            _check(self.files, self.store)
            yield self.versions(model).current(pack)[0] == step

    @counted("update")
    def update(self, model: int, pack: int, step: int, files: Sequence[ShippedTensors] = ()) -> None:
        """Apply a swapped pack's update for step on the host store, once (see runtime.optimizer), reducing the micro-
        batch groups' gradients first (vDP). With a scaled loss its gradients are unscaled first, the update is
        skipped (the version still advances) when any gradient of the step was not finite, and the model's last pack
        writes the next step's scale (see runtime.scaler). files are those the gradients were computed from, by the
        task that applies it (see writing)."""
        spec = self.spec.models[model]
        runtime = spec.packs[pack]
        stopped = self.members(model).stopped() if spec.members > 1 else []
        if spec.clip and spec.groups > 1 and runtime.stepped:  # the step's norm first: it sums every pack's groups
            with pack_lock(self.store, weights_name(model, pack)):
                _check(files, self.store)
                current = self.versions(model).current(pack)[0] == step
            if current:
                self.norms(model).totals(step, torch.float64, lambda: self.step_norms(model, step))
        with pack_lock(self.store, weights_name(model, pack)):
            _check(files, self.store)
            current = self.versions(model).current(pack)[0] == step
            if current and spec.groups > 1 and not (spec.clip and self.norms(model).reduced(step, pack)):
                self.reduce_grads(model, pack)
            skip = False
            if spec.scaled and current:
                scaler = self.scaler(model)
                skip = scaler.found(step)
                reduced = self.store.attach(reduced_grads_name(model, pack), runtime.grads.nbytes)
                if not skip:
                    scaler.unscale(reduced if spec.groups > 1 else self.host_grads(model, pack), reduced,
                                   runtime.grads, step)
            if spec.clip and current and runtime.stepped:
                self.clip_grads(model, pack, step, skip)
            update(runtime, self.versions(model), pack, step, lambda slot: self.weights_slot(model, pack, slot),
                   lambda slot: self.pack_optimizer(model, pack, slot), stopped, skip)
            if runtime.halved is not None:  # here, beside the device, rather than at the next read
                version, slot = self.versions(model).current(pack)
                self.mirror(model, pack, version, slot, locked=True)
            if spec.scaled and pack == len(spec.packs) - 1 and not self.scaler(model).holds(step + 1):
                self.scaler(model).advance(step)

    def clip_grads(self, model: int, pack: int, step: int, skip: bool) -> None:
        """Scale a swapped pack's gradients of step, in the reduced file its optimizer reads (summed over groups and
        unscaled already where they are; copied in here where not, so that an update run again scales the same
        gradients), by its members' clipping coefficients for step (runtime.clipping), and record the step's norms.
        A step fp16's scaler skips has its norms recorded (not finite, as clip_grad_norm_ returns them) and nothing
        scaled. The caller holds the pack's lock."""
        spec = self.spec.models[model]
        runtime = spec.packs[pack]
        reduced = self.store.attach(reduced_grads_name(model, pack), runtime.grads.nbytes)
        grads = self.stepped_grads(model, pack, reduced)
        totals = self.norms(model).totals(step, grads[0][1].dtype, lambda: self.step_norms(model, step))
        record_rows(self.store, lambda block: grad_norms_name(model, block), spec.members, step,
                    torch.stack(totals).double()[None])  # every pack's update writes the same row
        if skip:
            return
        if spec.groups == 1 and not spec.scaled:
            copy_serially(reduced, self.host_grads(model, pack))
        scale(grads, coefficients(totals, spec.clip))

    def stepped_grads(self, model: int, pack: int, grads: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The gradients a pack's optimizer steps, by name, as views of grads (its gradients' bytes)."""
        runtime = self.spec.models[model].packs[pack]
        return [(slot.spec.name, tensor_at(grads, slot)) for slot in runtime.stepped]

    def record_norms(self, model: int, pack: int, step: int, grads: torch.Tensor) -> None:
        """Record a swapped pack's gradient norms of step, taken where grads (its gradients' bytes) are, for the
        step's total (runtime.clipping.on_device). Called by the device's running task, holding the pack's lock."""
        named = self.stepped_grads(model, pack, grads)
        self.norms(model).record(step, pack, tensor_norms(named, self.spec.models[model].members))

    def step_norms(self, model: int, step: int) -> list[torch.Tensor]:
        """Each member's total norm of every pack's gradients of step, as the packs' optimizers read them: of the norms
        their bwd tasks recorded where it can (runtime.clipping.on_device; fp16's times the inverse scale), else
        computed here with fp16's unscaled, from the files each group's backward wrote (which hold step's until every
        pack's update of it has read this, see runtime.clipping); with micro-batch groups, from their sum, written into
        each pack's reduced file for its update (Norms.reduced says it is there). Called by the step's first update,
        holding no pack's lock: no update of step has begun, and none can until this is done."""
        spec = self.spec.models[model]
        norms: list[list[torch.Tensor]] = [[] for _ in range(spec.members)]
        inverse = self.scaler(model).inverse(step) if spec.scaled else None
        if on_device(spec.groups):
            for pack, runtime in enumerate(spec.packs):
                dtypes = [torch_dtype(slot.spec.dtype) for slot in runtime.stepped]
                for member, each in enumerate(self.norms(model).recorded(step, pack, dtypes)):
                    norms[member].extend(each if inverse is None else [norm * inverse for norm in each])
            return total_norms(norms)
        for pack, runtime in enumerate(spec.packs):
            if spec.groups > 1 and runtime.stepped:  # summed once, for the norm and for the pack's update
                self.reduce_grads(model, pack)
                source = self.store.attach(reduced_grads_name(model, pack), runtime.grads.nbytes)
            else:
                source = self.host_grads(model, pack)
            grads = [(name, grad if inverse is None else grad * inverse)
                     for name, grad in self.stepped_grads(model, pack, source)]
            each = tensor_norms(grads, spec.members)
            if spec.groups > 1 and runtime.stepped:
                self.norms(model).record(step, pack, each)
            for member, row in enumerate(each):
                norms[member].extend(row)
        return total_norms(norms)

    def norms(self, model: int) -> Norms:
        """The per-step gradient norms of a swapped job that is clipped (runtime.clipping)."""
        if model not in self._norms:
            spec = self.spec.models[model]
            self._norms[model] = Norms(self.store, model, spec.members, [len(pack.stepped) for pack in spec.packs])
        return self._norms[model]

    @counted("device_update")
    def update_on_device(self, model: int, pack: int, step: int, weights: torch.Tensor, grads: torch.Tensor) -> None:
        """Apply a swapped pack's update for step on this device, once (see runtime.optimizer.update_on_device);
        weights, its device bytes, are stepped in place: the caller drops them from the cache when it lets them go.
        Called by the device's running task, whose files it checks first (see writing)."""
        spec = self.spec.models[model]
        runtime = spec.packs[pack]
        stopped = self.members(model).stopped() if spec.members > 1 else []
        with pack_lock(self.store, weights_name(model, pack)):
            _check(self.files, self.store)
            update_on_device(runtime, self.versions(model), pack, step, weights, grads,
                             lambda slot: self.weights_slot(model, pack, slot), self.optimizer_factory(model),
                             self.optimizer_state(model, pack), self.cache,
                             round(spec.state_ratio * runtime.grads.nbytes), stopped)

    def next_queued(self) -> TaskId | None:
        """The fwd or bwd task of this run that this worker will run next, read off its task queue."""
        queued = []
        for state in list(get_worker().state.tasks.values()):
            if state.state not in ("ready", "constrained", "waiting", "fetch", "flight"):
                continue
            parsed = parse_key(state.key) if isinstance(state.key, str) else None
            if parsed is not None and parsed[1] == self.spec.run and parsed[0].kind != "upd":
                queued.append((state.priority or (), parsed[0]))
        return min(queued, key=lambda item: item[0])[1] if queued else None

    def prefetch_next(self, keep_free: int) -> None:
        """Copy the next task's weights in while this one computes, if the host store has their version.

        The next task is the first one queued on this worker, else the running task's successor in its
        model's chain (which Dask sends only once this task's output exists).
        """
        if not self.spec.prefetch:
            return
        task = self.next_queued() or self.successor
        if task is None:
            return
        self.prefetch_pack(task.model, self.spec.models[task.model].section(task.pack)[0], task.span, keep_free)

    def prefetch_pack(self, model: int, pack: int, version: int, keep_free: int) -> None:
        """Copy a pack's weights at version in while the running task computes, if the host store has that version
        (a swapped pack's span is its step: prefetch only the weights it will read) and they fit beside keep_free."""
        if not self.spec.prefetch or not self.spec.models[model].prefetch:
            return
        if self.versions(model).current(pack)[0] != version:
            return
        self.cache.prefetch((model, pack), version, self.device_source(model, pack, version), keep_free,
                            self.part(model, pack, self.training_rows(model, version)))

    def pack_optimizer(self, model: int, pack: int, slot: int) -> PackOptimizer:
        """The optimizer of a swapped pack over one slot of its host weights (built once per slot)."""
        key = (model, pack, slot)
        if key not in self._optimizers:
            spec = self.spec.models[model]
            runtime = spec.packs[pack]
            grads = (self.store.attach(reduced_grads_name(model, pack), runtime.grads.nbytes)
                     if spec.reduced else self.host_grads(model, pack))
            self._optimizers[key] = PackOptimizer(self.optimizer_factory(model), self.weights_slot(model, pack, slot),
                                                  grads, runtime, self.optimizer_state(model, pack))
        return self._optimizers[key]

    def export(self, key: str, result: Any) -> Any:
        """What a fwd or bwd task leaves in its worker's memory for its readers (see runtime.peer)."""
        if not self.exports or result is None:
            return result
        return Exported(result, key, self.outbox, self.machine, direct=self.device.type == "cpu")

    def read(self, value: Any) -> Any:
        """The tree a task reads from an argument: a batch file's, an exported result's, or the value itself."""
        return take(unship(value, self.store), self.store, self.machine)

    def close(self) -> None:
        self.outbox.release_all()
        self.profiler.finish()
        self.homed_models.clear()
        self.cache.clear()
        self._optimizers.clear()
        self._states.clear()
        self._modules.clear()
        self._calls.clear()
        self.store.close()


def _check(files: Sequence[ShippedTensors], store: HostStore) -> None:
    """StaleBatch where one of files has been given another use since the running task read it."""
    for shipped in files:
        shipped.check(store)


class QuietFailures(logging.Filter):
    """Drops Dask's "Compute Failed" report of Harmony's tasks: the driver reports each failure itself (a model's
    own, with its traceback, as the model's; one of Harmony's, as the run's error), and a model that diverges or
    raises is an expected event of a sweep, not a worker's error."""

    def filter(self, record: logging.LogRecord) -> bool:
        failed = isinstance(record.msg, str) and record.msg.startswith("Compute Failed")
        key = record.args[0] if failed and isinstance(record.args, tuple) and record.args else None
        return not (isinstance(key, str) and parse_key(key) is not None)


def quiet_failures() -> None:
    """Install QuietFailures on this process's Dask worker logger (once)."""
    worker_logger = logging.getLogger("distributed.worker")
    if not any(isinstance(existing, QuietFailures) for existing in worker_logger.filters):
        worker_logger.addFilter(QuietFailures())


def wait_for_warmup() -> None:
    """On a worker: return once its preloaded background imports are done, so they compete with nothing."""
    warmup = sys.modules.get("harmony.runtime.warmup")
    if warmup is not None:
        warmup.wait()


def device_metrics(run: str) -> dict[str, Any]:
    """The worker metrics of a run's device (the /harmony page's figures, runtime.dashboard): callables of the
    worker, read at each heartbeat."""
    last = {"at": time.perf_counter(), "busy_ns": 0}

    def figures(worker: Any) -> RunContext | None:
        return RUNS.get((run, worker.address))

    def busy(worker: Any) -> float:
        context = figures(worker)
        if context is None:
            return 0.0
        now, busy_ns = time.perf_counter(), context.counters.values["busy_ns"]
        share = (busy_ns - last["busy_ns"]) / 1e9 / max(now - last["at"], 1e-9)
        last.update(at=now, busy_ns=busy_ns)
        return round(min(1.0, max(0.0, share)), 3)

    def counter(*names: str) -> Any:
        def read(worker: Any) -> int:
            context = figures(worker)
            return 0 if context is None else sum(context.counters.values[name] for name in names)
        return read

    return {
        "harmony_budget": lambda worker: 0 if figures(worker) is None else figures(worker).cache.budget,
        "harmony_cached": lambda worker: 0 if figures(worker) is None else figures(worker).cache.memory.used,
        "harmony_in": counter(*(f"in_{kind}" for kind in IN_KINDS)),
        "harmony_out": counter(*(f"out_{kind}" for kind in OUT_KINDS)),
        "harmony_busy": busy,
        "harmony_threads": lambda worker: 0 if figures(worker) is None else (figures(worker).threads_now
                                                                             or figures(worker).computing_threads),
    }


class DevicePlugin(WorkerPlugin):
    """Sets up a run on every device worker and tears it down when the driver unregisters it."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec

    def setup(self, worker: Any) -> None:
        wait_for_warmup()
        keep_freed_memory()
        collector.install()
        quiet_failures()
        directory = Path(self.spec.store_directory)
        sweep(directory)  # runs whose drivers are gone, on a cluster that outlived them
        if gone(self.spec.run, directory):
            return  # the scheduler keeps a dead driver's plugin and gives it to workers that join later
        if str(worker.name) not in {device.name for device in self.spec.devices}:
            return  # a worker that joined the cluster after the run chose its devices: it gets none of its tasks
        context = RUNS[(self.spec.run, worker.address)] = RunContext(self.spec, str(worker.name))
        context.froze = collector.freeze()  # a full collection then scans only what the run made
        worker.metrics.update(device_metrics(self.spec.run))

    def teardown(self, worker: Any) -> None:
        for name in [name for name in worker.metrics if name.startswith("harmony_")]:
            del worker.metrics[name]
        context = RUNS.pop((self.spec.run, worker.address), None)
        if context is not None:
            context.close()
            collector.unfreeze(context.froze)
        sweep(Path(self.spec.store_directory))

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """A result leaving a worker's memory frees the file it was exported into, if it was (runtime.peer)."""
        if start != "memory":
            return
        for (run, _), context in list(RUNS.items()):  # this worker's, or the process's: a plugin gives no worker
            if run == self.spec.run:
                context.outbox.release(str(key))


def context(run: str) -> RunContext:
    """The run's context on the worker executing the calling task."""
    try:
        return RUNS[(run, get_worker().address)]
    except KeyError:
        raise RuntimeError(f"harmony run {run} is not set up on this worker") from None
