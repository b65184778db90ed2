"""Every file a run keeps in its host store: its name, its size, who writes it and who reads it.

Per job (``m<job>``) and pack:
  weights   two slots, each the parameters then buffers in the pack's layout. Filled by the run; a step's update
            (or a homed job's flush) writes the next version into the slot the current one is not in and then
            publishes it, so a worker that dies in the middle leaves the current version intact, and a swapped
            pack's previous version stays readable while its step may be run again;
  halved    where a pack's device copy holds weights in autocast's dtype (PackRuntime.halved): a header saying, per
            slot, which version it was made from (version + 1; 0 none), then two slots of those weights in that
            dtype, made from the weights slot of the same number by the first reader of a version or by the update
            that wrote it (RunContext.mirror), so that a swap copies them in at half the bytes;
  grads     one file per micro-batch group, written by bwd tasks; with several groups the update sums them into
            the reduced file (out of place: an update run again sums the same groups again), and with a scaled
            loss (fp16) unscales them there (runtime.scaler);
  optim     the optimizer's state per slot (runtime.optimstate), with a layout and a msgpack description.
Per job:
  versions  per pack, the version its host weights are at and the slot it is in, one int64 (version * 2 + slot,
            written at once): an update is applied once, by version (``Versions``);
  timing    a homed job's multi-step tasks' timed seconds and steps, added up (2 float64; the driver reads it);
  diverged  per member, the step at which its loss stopped being finite, -1 while it trains (runtime.divergence);
  losses    blocks of LOSS_BLOCK steps x members float64, one per micro-batch group: each step's share of the loss;
  scaler, found  with a scaled loss (fp16), the scale of each step and which packs' gradients were not finite
            (runtime.scaler).
Per device:
  counters  bytes moved by kind, peak, busy time (runtime.counters), published by its worker after every task;
  threads   the CPU threads it computes with from its next task on, 0 for its own (the driver writes it once devices
            of its machine have nothing left to compute, runtime.devices.shared_threads).
Batch files (``batch-<n>``) belong to shipping.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress

import torch

from harmony.runtime.clipping import Norms
from harmony.runtime.code import JobCode, named_state
from harmony.runtime.counters import Counters, block_bytes
from harmony.runtime.hoststore import HostStore, tensors_at
from harmony.runtime.machines import MachineUnreachable, RemoteStore
from harmony.runtime.scaler import Scaler, Settings
from harmony.runtime.spec import ModelRuntime
from harmony.tasks.runplan import Job, RunPlan

LOSS_BLOCK = 4096
SPAN_TIMING_BYTES = 16


SLOT_ALIGNMENT = 64


def weights_name(model: int, pack: int) -> str:
    return f"m{model}-p{pack}-weights"


def slot_bytes(nbytes: int) -> int:
    """The bytes one slot of a weights file takes (each slot starts at a multiple of SLOT_ALIGNMENT)."""
    return -(-max(nbytes, 1) // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def weights_slot(mapped: torch.Tensor, slot: int, nbytes: int) -> torch.Tensor:
    """One slot of a weights file (mapped whole)."""
    start = slot * slot_bytes(nbytes)
    return mapped[start : start + nbytes]


class Versions:
    """Per pack of a job, the version its host weights are at and the slot that holds it (see the module)."""

    def __init__(self, block: torch.Tensor) -> None:
        self.words = block.view(torch.int64)

    def current(self, pack: int) -> tuple[int, int]:
        """The pack's version and its slot."""
        return divmod(int(self.words[pack]), 2)

    def slot(self, pack: int, version: int) -> int:
        """The slot holding version of the pack's weights: the current one, or the other, which holds the
        version published before the current one. The caller knows version is that one: a step run again (its
        update is the current version), or a checkpoint's step (the driver writes it before it submits anything
        of the span after the one running past it). (A homed job's versions advance by its spans, so the one before
        need not be current - 1, and only the current one is recorded: an older version cannot be told from it. An
        earlier attempt of a span run again may so read the other slot's bytes; nothing it computes from them
        reaches the run, see RunContext.writing.)"""
        current, slot = self.current(pack)
        if version == current:
            return slot
        if version < current:
            return 1 - slot
        raise RuntimeError(f"pack {pack} is at version {current}: version {version} of its weights is not in the "
                           "host store")

    def publish(self, pack: int, version: int, slot: int) -> None:
        """The pack's weights are at version, in slot (one write: a reader sees the old pair or the new one)."""
        self.words[pack] = version * 2 + slot

    def trained(self) -> int:
        """The version every pack has reached: the steps the job has completed."""
        return int(self.words.min()) // 2


def mirror_name(model: int, pack: int) -> str:
    """A pack's halved weights in autocast's dtype, per slot (see the module)."""
    return f"m{model}-p{pack}-halved"


MIRROR_HEADER = SLOT_ALIGNMENT  # the made-from versions of the two slots (int64 each), padded


def mirror_bytes(nbytes: int) -> int:
    """The bytes of a mirror file whose slots hold nbytes each."""
    return MIRROR_HEADER + 2 * slot_bytes(nbytes)


def reduced_grads_name(model: int, pack: int) -> str:
    """A pack's gradients summed over its micro-batch groups (vDP), what its optimizer steps with."""
    return f"m{model}-p{pack}-grads-reduced"


def grads_name(model: int, pack: int, group: int = 0) -> str:
    """A pack's gradients from one micro-batch group (the update reduces the groups into group 0's)."""
    return f"m{model}-p{pack}-grads" if group == 0 else f"m{model}-p{pack}-g{group}-grads"


def optimizer_name(model: int, pack: int, slot: int) -> str:
    return f"m{model}-p{pack}-optim{slot}"


def optimizer_meta_name(model: int, pack: int, slot: int) -> str:
    return f"m{model}-p{pack}-optim-meta{slot}"


def optimizer_layout_name(model: int, pack: int) -> str:
    return f"m{model}-p{pack}-optim-layout"


def versions_name(model: int) -> str:
    """Per pack, how many updates the host store's weights have had (the step they are ready for)."""
    return f"m{model}-versions"


def span_timing_name(model: int) -> str:
    """The seconds and the steps (float64) a homed job's multi-step tasks have timed so far, added up."""
    return f"m{model}-span-timing"


def diverged_name(model: int) -> str:
    return f"m{model}-diverged"


def pruned_name(model: int) -> str:
    """Per member of a job, the pruning step it stopped at (float64, -1 while it trains; see divergence)."""
    return f"m{model}-pruned"


def counters_name(device: int) -> str:
    return f"device{device}-counters"


def threads_name(device: int) -> str:
    """The CPU threads a device computes with from its next task on (int64; 0: its own, see
    runtime.devices.shared_threads)."""
    return f"device{device}-threads"


def losses_name(model: int, block: int, group: int = 0) -> str:
    """A block of LOSS_BLOCK steps of one micro-batch group's share of the loss of each member."""
    return f"m{model}-losses{block}" if group == 0 else f"m{model}-g{group}-losses{block}"


def grad_norms_name(model: int, block: int) -> str:
    """A block of LOSS_BLOCK steps of each member's total gradient norm before clipping (a clipped job's)."""
    return f"m{model}-gradnorms{block}"


def record_rows(store: HostStore, name: Callable[[int], str], members: int, first: int, rows: torch.Tensor) -> None:
    """Write steps first, first + 1, ...'s per-member values (rows) into the blocks name(block) of LOSS_BLOCK steps
    each (loss shares, gradient norms)."""
    step, row = first, 0
    while row < len(rows):
        block_index, offset = divmod(step, LOSS_BLOCK)
        count = min(len(rows) - row, LOSS_BLOCK - offset)
        block = store.attach(name(block_index), 8 * LOSS_BLOCK * members)
        block.view(torch.float64).view(LOSS_BLOCK, members)[offset : offset + count] = rows[row : row + count]
        step, row = step + count, row + count


def estimate(jobs: list[Job], batch_files: int) -> int:
    """The host store's bytes for these jobs before they run: two slots of every pack's weights (and of the mirror
    of its halved weights), its gradients, two slots of its optimizer state, the loss blocks and versions, and
    batch_files files of the largest batch."""
    total = 0
    for job in jobs:
        for index, pack in enumerate(job.packing.packs):
            total += (2 * slot_bytes(pack.float_bytes) + pack.grad_bytes * job.groups
                      + 2 * pack.state_bytes(job.state_ratio))
            halved = job.halved_bytes(index)
            if halved:  # a mirror in a 2-byte dtype: half the float32 bytes, twice
                total += mirror_bytes(halved // 2)
        total += 8 * LOSS_BLOCK * len(job.members) * job.groups + 8 * len(job.packing.packs) + SPAN_TIMING_BYTES
    return total + batch_files * max((job.batch_bytes for job in jobs), default=0)


class RunFiles:
    """The run's files in its host stores: created, filled and read back by the driver's process.

    stores has each job's store (its machine's), device_stores each device's; a store the driver does not map
    itself is pushed after it is filled and pulled before it is read (runtime.machines)."""

    def __init__(self, stores: list[HostStore], device_stores: list[HostStore], plan: RunPlan,
                 models: tuple[ModelRuntime, ...]) -> None:
        self.stores = stores
        self.device_stores = device_stores
        self.plan = plan
        self.models = models
        self.settings = Settings(**(plan.options.grad_scaler or {}))

    def scaler(self, job: int) -> Scaler:
        """The loss-scaling state of a job whose loss is scaled (fp16)."""
        return Scaler(self.stores[job], job, len(self.models[job].packs), self.plan.jobs[job].groups, self.settings)

    def store(self, job: int) -> HostStore:
        """The host store of the job's machine."""
        return self.stores[job]

    def pull(self, job: int, *names: str) -> bool:
        """Bring the job's files (those named, else all) from its machine; False when they are out of reach."""
        return self.stores[job].pull(names or (f"m{job}-",))

    def pull_results(self) -> None:
        """Bring from machines the driver does not map what a finished run reads: every job's weights, versions,
        losses (and gradient norms) and stopped members and every device's counters (not gradients or optimizer
        state), one pull per store."""
        wanted: dict[int, tuple[HostStore, list[str]]] = {}
        for job, runtime in enumerate(self.models):
            names = [*(weights_name(job, pack) for pack in range(len(runtime.packs))), versions_name(job),
                     f"m{job}-losses", f"m{job}-g", diverged_name(job), pruned_name(job)]  # -g: g<group>-…
            wanted.setdefault(id(self.stores[job]), (self.stores[job], []))[1].extend(names)
        for index, store in enumerate(self.device_stores):
            wanted.setdefault(id(store), (store, []))[1].append(counters_name(index))
        for store, names in wanted.values():
            store.pull(tuple(names))

    def create(self, codes: list[JobCode]) -> None:
        """Every job's weights (copied in from its layers), gradients, versions and timing, every device's counters."""
        for m, (job, code, runtime) in enumerate(zip(self.plan.jobs, codes, self.models)):
            store = self.stores[m]
            for p, pack in enumerate(runtime.packs):
                mapped = store.create(weights_name(m, p), 2 * slot_bytes(pack.weights.nbytes))
                state = named_state(code.pack_module(job.packing, p))
                with torch.no_grad():
                    for slot in (0, 1):
                        host = weights_slot(mapped, slot, pack.weights.nbytes)
                        for name, view in tensors_at(host, pack.weights).items():
                            view.copy_(state[name].detach().cpu())
                if pack.halved is not None:
                    store.create(mirror_name(m, p), mirror_bytes(pack.halved.device_split))
                for group in range(job.groups):
                    store.create(grads_name(m, p, group), pack.grads.nbytes)
                if runtime.reduced:
                    store.create(reduced_grads_name(m, p), pack.grads.nbytes)
            store.create(versions_name(m), 8 * len(runtime.packs))
            store.create(span_timing_name(m), SPAN_TIMING_BYTES)
            store.create(diverged_name(m), 8 * runtime.members).view(torch.float64).fill_(-1.0)
            store.create(pruned_name(m), 8 * runtime.members).view(torch.float64).fill_(-1.0)
            if job.scaled:
                Scaler.create(store, m, len(runtime.packs), job.groups, self.settings)
            if job.clip and job.home is None:
                Norms.create(store, m, runtime.members, [len(pack.stepped) for pack in runtime.packs])
        for index, store in enumerate(self.device_stores):
            store.create(counters_name(index), block_bytes(len(self.plan.jobs)))
            store.create(threads_name(index), 8)

    def open_step(self, model: int, step: int) -> None:
        """A job's step is about to be fetched: its loss block exists once its first step is."""
        if step % LOSS_BLOCK == 0:
            names = [losses_name(model, step // LOSS_BLOCK, group) for group in range(self.plan.jobs[model].groups)]
            if self.plan.jobs[model].clip:
                names.append(grad_norms_name(model, step // LOSS_BLOCK))
            for name in names:
                self.stores[model].create(name, 8 * LOSS_BLOCK * self.models[model].members)
                self.stores[model].push([name])

    def history(self, model: int, steps: int, first: int = 0) -> list[list[float]]:
        """Per member of a job, the loss of steps first .. steps - 1: the sum over micro-batch groups of their
        shares (only the blocks holding those steps are read: a display reads the latest ones while a run goes)."""
        groups = range(self.plan.jobs[model].groups)
        return self._series(model, steps, first, lambda block: [losses_name(model, block, group) for group in groups])

    def grad_norms(self, model: int, steps: int, first: int = 0) -> list[list[float]]:
        """Per member of a clipped job, its total gradient norm before clipping at steps first .. steps - 1 (empty
        lists for a job that is not clipped)."""
        if not self.plan.jobs[model].clip:
            return [[] for _ in range(self.models[model].members)]
        return self._series(model, steps, first, lambda block: [grad_norms_name(model, block)])

    def _series(self, model: int, steps: int, first: int, names: Callable[[int], list[str]]) -> list[list[float]]:
        """Per member, steps first .. steps - 1 of a per-step series kept in blocks of LOSS_BLOCK steps: the sum of
        the blocks names(block) gives (only the blocks holding those steps are read)."""
        members = self.models[model].members
        blocks = []
        for block in range(first // LOSS_BLOCK, -(-steps // LOSS_BLOCK)):
            start = max(0, first - block * LOSS_BLOCK)
            size = min(LOSS_BLOCK, steps - block * LOSS_BLOCK)
            parts = [self.stores[model].attach(name, 8 * LOSS_BLOCK * members).view(torch.float64)
                     .view(LOSS_BLOCK, members)[start:size] for name in names(block)]
            blocks.append(sum(parts[1:], parts[0].clone()))
        if not blocks:
            return [[] for _ in range(members)]
        return torch.cat(blocks).T.tolist()

    def stopped(self, model: int) -> dict[int, int]:
        """The members of a job (by position) whose loss stopped being finite, and the step it happened at."""
        return self._steps(model, diverged_name(model))

    def pruned(self, model: int) -> dict[int, int]:
        """The members of a job (by position) that were pruned, and the step they stopped at."""
        return self._steps(model, pruned_name(model))

    def _steps(self, model: int, name: str) -> dict[int, int]:
        steps = self.stores[model].attach(name, 8 * self.models[model].members).view(torch.float64)
        return {position: int(step) for position, step in enumerate(steps.tolist()) if step >= 0}

    def members_stopped(self) -> dict[int, int]:
        """Per model (as the user numbered them) that stopped as a member of a fused array, the step it stopped at."""
        fused = [job for job, runtime in enumerate(self.models) if runtime.members > 1]
        for job in fused:
            self.pull(job, diverged_name(job))
        return {self.plan.jobs[job].members[position]: step
                for job in fused for position, step in self.stopped(job).items()}

    def trained(self, model: int) -> int:
        """The steps whose updates every pack of a job has (its host weights' version where all packs agree)."""
        return self.versions(model).trained()

    def counters(self) -> dict[str, dict[str, int]]:
        """Per device, what its worker last published."""
        return {name: self._counter_block(index).read() for index, (name, _) in enumerate(self.plan.budgets)}

    def share_threads(self, threads: dict[str, int]) -> None:
        """Tell each device worker the CPU threads it computes with from its next task on (runtime.devices
        .shared_threads); a machine out of reach keeps what it had."""
        for index, (name, _) in enumerate(self.plan.budgets):
            if name in threads:
                store = self.device_stores[index]
                store.attach(threads_name(index), 8).view(torch.int64)[0] = threads[name]
                with suppress(MachineUnreachable):
                    store.overwrite((threads_name(index),))

    def _counter_block(self, device: int) -> Counters:
        return Counters(self.device_stores[device].attach(counters_name(device), block_bytes(len(self.plan.jobs))))

    def executing(self, device: str) -> frozenset[int] | None:
        """The jobs the device's worker was busy with when it last marked them: its task thread's and those whose
        host updates ran beside it (None: a device on a machine whose store the driver does not map)."""
        index = [name for name, _ in self.plan.budgets].index(device)
        if isinstance(self.device_stores[index], RemoteStore):
            return None
        return frozenset(self._counter_block(index).busy_jobs())

    def copy_back(self, codes: list[JobCode]) -> None:
        """Write the trained weights (and buffers) from the host store into the user's modules, in place: the
        version of each job's last complete step (a job that stopped in the middle of one has packs a version
        further; their slot before it is intact)."""
        with torch.no_grad():
            for m, (job, code, runtime) in enumerate(zip(self.plan.jobs, codes, self.models)):
                versions = self.versions(m)
                version = versions.trained()
                for p, pack in enumerate(runtime.packs):
                    state = named_state(code.pack_module(job.packing, p))
                    host = self.weights(m, p, versions.slot(p, version))
                    for name, view in tensors_at(host, pack.weights).items():
                        state[name].copy_(view)
                code.copy_back()

    def versions(self, model: int) -> Versions:
        """Per pack of a job, the version its host weights are at."""
        return Versions(self.stores[model].attach(versions_name(model), 8 * len(self.models[model].packs)))

    def weights(self, model: int, pack: int, slot: int) -> torch.Tensor:
        """The bytes of one slot of a pack's weights."""
        nbytes = self.models[model].packs[pack].weights.nbytes
        mapped = self.stores[model].attach(weights_name(model, pack), 2 * slot_bytes(nbytes))
        return weights_slot(mapped, slot, nbytes)
