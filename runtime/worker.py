"""The device worker plugin: per run, the device cache, host store mappings, skeletons and optimizers.

Registered by the driver for each run; on each worker it finds the worker's device by the worker's
name, maps the device's counters from the host store and builds a DeviceCache with the device's budget.
Task bodies look the run up by its id and their worker's address (several workers may share
a process). Teardown drops everything the run held on the worker.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import cloudpickle
import torch
from distributed import WorkerPlugin, get_worker
from torch import nn

from harmony.runtime import serialization  # noqa: F401  (tensor serializers on every worker)
from harmony.runtime.allocator import keep_freed_memory
from harmony.runtime.cache import DeviceCache
from harmony.runtime.counters import BLOCK_BYTES, Counters
from harmony.runtime.files import counters_name, grads_name, versions_name, weights_name
from harmony.runtime.handoff import FinishedKeys
from harmony.runtime.homed import HomedModel
from harmony.runtime.hoststore import HostStore, tensors_at
from harmony.runtime.optimizer import PackOptimizer
from harmony.runtime.skeleton import load_skeleton
from harmony.runtime.spec import RunSpec
from harmony.tasks.graph import TaskId, parse_key

RUNS: dict[tuple[str, str], RunContext] = {}


class RunContext:
    """One run's state on one device worker."""

    def __init__(self, spec: RunSpec, worker_name: str) -> None:
        self.spec = spec
        self.device_index = spec.device_index(worker_name)
        self.device_spec = spec.devices[self.device_index]
        self.device = torch.device(self.device_spec.torch_device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.store = HostStore(spec.run, spec.store_directory, pin=self.device.type == "cuda")
        counters = Counters(self.store.attach(counters_name(self.device_index), BLOCK_BYTES))
        self.cache = DeviceCache(
            self.device_spec.name, self.device, self.device_spec.budget, counters, self.device_spec.link_bandwidth
        )
        self.executed: list[str] = []
        self.finished = FinishedKeys()
        self.early_starts: Counter[str] = Counter()
        self.successor: TaskId | None = None
        self.homed_models: dict[int, HomedModel] = {}
        self._modules: dict[tuple[int, int], nn.Module] = {}
        self._loss_fns: dict[int, Any] = {}
        self._factories: dict[int, Any] = {}
        self._optimizers: dict[tuple[int, int], PackOptimizer] = {}

    @property
    def counters(self) -> Counters:
        return self.cache.counters

    def use_threads(self) -> None:
        """Give torch this device's share of the CPU cores, in the thread that runs the tasks."""
        if torch.get_num_threads() != self.device_spec.threads:
            torch.set_num_threads(self.device_spec.threads)

    def module(self, model: int, pack: int) -> nn.Module:
        key = (model, pack)
        if key not in self._modules:
            self._modules[key] = load_skeleton(self.spec.models[model].packs[pack].skeleton)
        return self._modules[key]

    def loss_fn(self, model: int) -> Any:
        if model not in self._loss_fns:
            self._loss_fns[model] = cloudpickle.loads(self.spec.models[model].loss_fn)
        return self._loss_fns[model]

    def optimizer_factory(self, model: int) -> Any:
        if model not in self._factories:
            self._factories[model] = cloudpickle.loads(self.spec.models[model].optimizer)
        return self._factories[model]

    def host_weights(self, model: int, pack: int) -> torch.Tensor:
        return self.store.attach(weights_name(model, pack), self.spec.models[model].packs[pack].weights.nbytes)

    def host_grads(self, model: int, pack: int, group: int = 0) -> torch.Tensor:
        return self.store.attach(grads_name(model, pack, group), self.spec.models[model].packs[pack].grads.nbytes)

    def reduce_grads(self, model: int, pack: int) -> None:
        """Add every other micro-batch group's gradients into group 0's, which the optimizer reads."""
        layout = self.spec.models[model].packs[pack].grads
        total = tensors_at(self.host_grads(model, pack), layout)
        for group in range(1, self.spec.models[model].groups):
            for name, grad in tensors_at(self.host_grads(model, pack, group), layout).items():
                total[name].add_(grad)

    def homed(self, model: int, weights: torch.Tensor) -> HomedModel:
        """The state of a model homed on this device, created when its weights first arrive."""
        if model not in self.homed_models:
            runtime = self.spec.models[model].packs[0]
            self.homed_models[model] = HomedModel(self.cache, model, runtime, weights, load_skeleton(runtime.skeleton),
                                                  self.optimizer_factory(model))
        return self.homed_models[model]

    def homed_next_step(self, model: int) -> int:
        """The step a model homed on this device trains next (0 before its first task here)."""
        state = self.homed_models.get(model)
        return 0 if state is None else state.next_step

    def flush_homed(self) -> None:
        """Write every homed model's trained weights to the host store (once, at the end of a run)."""
        for model, state in self.homed_models.items():
            self.cache.write_back(state.weights, self.host_weights(model, 0), "weights")
        self.counters.publish()

    def versions(self, model: int) -> torch.Tensor:
        """Per pack of model, the step the host store's weights are ready for."""
        return self.store.attach(versions_name(model), 8 * len(self.spec.models[model].packs)).view(torch.int64)

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
        if task is None or int(self.versions(task.model)[task.pack]) != task.span:
            return
        self.cache.prefetch(
            (task.model, task.pack), task.span, self.host_weights(task.model, task.pack), keep_free
        )

    def optimizer(self, model: int, pack: int, step: int) -> PackOptimizer:
        """The pack's optimizer ready for step; rebuilt from the host store if another worker stepped it."""
        key = (model, pack)
        cached = self._optimizers.get(key)
        if cached is None or cached.last_step != step - 1:
            cached = PackOptimizer(
                self.optimizer_factory(model), self.store, model, pack, self.spec.models[model].packs[pack]
            )
            self._optimizers[key] = cached
        return cached

    def close(self) -> None:
        self.homed_models.clear()
        self.cache.clear()
        self._optimizers.clear()
        self._modules.clear()
        self.store.close()


def wait_for_warmup() -> None:
    """On a worker: return once its preloaded background imports are done, so they compete with nothing."""
    warmup = sys.modules.get("harmony.runtime.warmup")
    if warmup is not None:
        warmup.wait()


class DevicePlugin(WorkerPlugin):
    """Sets up a run on every device worker and tears it down when the driver unregisters it."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec

    def setup(self, worker: Any) -> None:
        wait_for_warmup()
        keep_freed_memory()
        RUNS[(self.spec.run, worker.address)] = RunContext(self.spec, str(worker.name))

    def teardown(self, worker: Any) -> None:
        context = RUNS.pop((self.spec.run, worker.address), None)
        if context is not None:
            context.close()


def context(run: str) -> RunContext:
    """The run's context on the worker executing the calling task."""
    try:
        return RUNS[(run, get_worker().address)]
    except KeyError:
        raise RuntimeError(f"harmony run {run} is not set up on this worker") from None
