"""Every file a run keeps in its host store: its name, its size, who writes it and who reads it.

Per job (``m<job>``) and pack:
  weights   parameters then buffers in the pack's layout; filled by the run, stepped by the pack's updates;
  grads     one file per micro-batch group, written by bwd tasks (the update reduces the groups into group 0's);
  optim     the optimizer's state (runtime.optimizer), a generation per layout, with a msgpack description.
Per job:
  versions  per pack, the step its host weights are ready for (int64): an update is applied once, by version;
  timing    a homed job's multi-step tasks' timed seconds and steps, added up (2 float64; the driver reads it);
  losses    blocks of LOSS_BLOCK steps x members float64, one per micro-batch group: each step's share of the loss.
Per device:
  counters  bytes moved by kind, peak, busy time (runtime.counters), published by its worker after every task.
Batch files (``batch-<n>``) belong to shipping.
"""

from __future__ import annotations

import torch

from harmony.runtime.code import JobCode, named_state
from harmony.runtime.counters import BLOCK_BYTES, Counters
from harmony.runtime.hoststore import HostStore, tensors_at
from harmony.runtime.spec import ModelRuntime
from harmony.tasks.runplan import RunPlan

LOSS_BLOCK = 4096
SPAN_TIMING_BYTES = 16


def weights_name(model: int, pack: int) -> str:
    return f"m{model}-p{pack}-weights"


def grads_name(model: int, pack: int, group: int = 0) -> str:
    """A pack's gradients from one micro-batch group (the update reduces the groups into group 0's)."""
    return f"m{model}-p{pack}-grads" if group == 0 else f"m{model}-p{pack}-g{group}-grads"


def optimizer_name(model: int, pack: int, generation: int) -> str:
    return f"m{model}-p{pack}-optim{generation}"


def optimizer_meta_name(model: int, pack: int) -> str:
    return f"m{model}-p{pack}-optim-meta"


def versions_name(model: int) -> str:
    """Per pack, how many updates the host store's weights have had (the step they are ready for)."""
    return f"m{model}-versions"


def span_timing_name(model: int) -> str:
    """The seconds and the steps (float64) a homed job's multi-step tasks have timed so far, added up."""
    return f"m{model}-span-timing"


def counters_name(device: int) -> str:
    return f"device{device}-counters"


def losses_name(model: int, block: int, group: int = 0) -> str:
    """A block of LOSS_BLOCK steps of one micro-batch group's share of the loss of each member."""
    return f"m{model}-losses{block}" if group == 0 else f"m{model}-g{group}-losses{block}"


class RunFiles:
    """The run's files in its host store: created, filled and read back by the driver's process."""

    def __init__(self, store: HostStore, plan: RunPlan, models: tuple[ModelRuntime, ...]) -> None:
        self.store = store
        self.plan = plan
        self.models = models

    def create(self, codes: list[JobCode]) -> None:
        """Every job's weights (copied in from its layers), gradients, versions and timing, every device's counters."""
        for m, (job, code, runtime) in enumerate(zip(self.plan.jobs, codes, self.models)):
            for p, pack in enumerate(runtime.packs):
                host = self.store.create(weights_name(m, p), pack.weights.nbytes)
                state = named_state(code.pack_module(job.packing, p))
                with torch.no_grad():
                    for name, view in tensors_at(host, pack.weights).items():
                        view.copy_(state[name].detach().cpu())
                for group in range(job.groups):
                    self.store.create(grads_name(m, p, group), pack.grads.nbytes)
            self.store.create(versions_name(m), 8 * len(runtime.packs))
            self.store.create(span_timing_name(m), SPAN_TIMING_BYTES)
        for index in range(len(self.plan.budgets)):
            self.store.create(counters_name(index), BLOCK_BYTES)

    def open_step(self, model: int, step: int) -> None:
        """A job's step is about to be fetched: its loss block exists once its first step is."""
        if step % LOSS_BLOCK == 0:
            for group in range(self.plan.jobs[model].groups):
                nbytes = 8 * LOSS_BLOCK * self.models[model].members
                self.store.create(losses_name(model, step // LOSS_BLOCK, group), nbytes)

    def history(self, model: int, steps: int) -> list[list[float]]:
        """Per member of a job, the loss of every step: the sum over micro-batch groups of their shares."""
        members = self.models[model].members
        blocks = []
        for block in range(-(-steps // LOSS_BLOCK)):
            size = min(LOSS_BLOCK, steps - block * LOSS_BLOCK)
            shares = [
                self.store.attach(losses_name(model, block, group), 8 * LOSS_BLOCK * members)
                .view(torch.float64)
                .view(LOSS_BLOCK, members)[:size]
                for group in range(self.plan.jobs[model].groups)
            ]
            blocks.append(sum(shares[1:], shares[0].clone()))
        if not blocks:
            return [[] for _ in range(members)]
        return torch.cat(blocks).T.tolist()

    def counters(self) -> dict[str, dict[str, int]]:
        """Per device, what its worker last published."""
        return {
            name: Counters(self.store.attach(counters_name(index), BLOCK_BYTES)).read()
            for index, (name, _) in enumerate(self.plan.budgets)
        }

    def copy_back(self, codes: list[JobCode]) -> None:
        """Write the trained weights (and buffers) from the host store into the user's modules, in place."""
        with torch.no_grad():
            for m, (job, code, runtime) in enumerate(zip(self.plan.jobs, codes, self.models)):
                for p, pack in enumerate(runtime.packs):
                    state = named_state(code.pack_module(job.packing, p))
                    host = self.store.attach(weights_name(m, p), pack.weights.nbytes)
                    for name, view in tensors_at(host, pack.weights).items():
                        state[name].copy_(view)
                code.copy_back()
