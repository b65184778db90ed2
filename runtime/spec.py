"""What a run tells its device workers: its jobs' packs (skeletons, layouts), user callables and the devices."""

from __future__ import annotations

from dataclasses import dataclass, field

from harmony.runtime.code import JobCode
from harmony.runtime.devices import DeviceSpec
from harmony.runtime.scaler import Settings
from harmony.runtime.skeleton import dump_code, dump_skeleton
from harmony.tasks.layout import BufferLayout, Halved, Slot, halve, lay_out
from harmony.tasks.runplan import PRECISIONS, RunPlan, section_packs


@dataclass(frozen=True)
class PackRuntime:
    """A pack as a worker runs it: its skeleton module, its weight and gradient layouts, its workspace.

    weights is the layout of a slot of its host weights; the device copy's is device_weights, which differs where
    weights are halved: the halved tensors come first in both, so that the rest (other weights, buffers) is one
    contiguous copy from the host slot, and the halved part one copy from the host's mirror of them (runtime.files).
    Gradients are always in the weights' own dtypes."""

    skeleton: bytes
    weights: BufferLayout
    grads: BufferLayout
    buffers_offset: int
    workspace: int
    borrowed: tuple[tuple[str, int, str], ...] = ()  # tied weights another pack holds: (name here, pack, name there)
    lent: tuple[tuple[int, str, str], ...] = ()  # own weights later packs borrow: (pack, name there, name here)
    halved: Halved | None = None  # weights whose device copy is in autocast's dtype (weights is then halved.host)
    device_update: bool = False  # its bwd steps its optimizer on the device (tasks.updates)
    stash: bool = False  # its forward keeps its activations on the device for its backward (runtime.stash)
    first: int = 0  # its first layer's index in the model's chain
    drawing: tuple[int, ...] = ()  # its layers (by index in the chain) that draw from their own streams (seeding)

    @property
    def device_weights(self) -> BufferLayout:
        """The layout of the pack's weights on the device (and in the cache's bytes)."""
        return self.weights if self.halved is None else self.halved.device

    @property
    def device_buffers_offset(self) -> int:
        """Where the buffers start in the device copy (they follow the halved weights' split, as on the host)."""
        if self.halved is None:
            return self.buffers_offset
        return self.buffers_offset - self.halved.host_split + self.halved.device_split

    @property
    def stepped(self) -> list[Slot]:
        """The gradients of the weights this pack holds and steps (not of those it borrows: their holder steps
        them, with these gradients added)."""
        borrowed = {here for here, _, _ in self.borrowed}
        return [slot for slot in self.grads.slots if slot.spec.name not in borrowed]

    @property
    def has_buffers(self) -> bool:
        return self.buffers_offset < self.weights.nbytes

    @property
    def device_buffers(self) -> list[Slot]:
        """Where its buffers lie in its device copy (after its weights, as in the host slot)."""
        return [slot for slot in self.device_weights.slots if slot.offset >= self.device_buffers_offset]

    @property
    def buffer_names(self) -> list[str]:
        return [slot.spec.name for slot in self.device_buffers]


@dataclass(frozen=True)
class ModelRuntime:
    """A job (a model, or a fused array of `members` models) as workers see it: its packs, loss and optimizer;
    prefetch False when its budget leaves no room to copy a pack's weights in while another computes; overlap
    when its updates run in upd tasks beside the device rather than in its bwd tasks (tasks.graph); sections the
    first packs of the packs each of its tasks runs (tasks.runplan.Job.sections); state_ratio its optimizer
    state's predicted bytes per gradient byte (what a pack updated on the device reserves there)."""

    name: str
    packs: tuple[PackRuntime, ...]
    loss_fn: bytes
    optimizer: bytes
    seed: int
    groups: int = 1
    home: str | None = None
    members: int = 1
    prefetch: bool = True
    overlap: bool = False
    sections: tuple[int, ...] = ()
    scaled: bool = False
    clip: tuple[float, ...] = ()
    state_ratio: float = 2.0

    @property
    def reduced(self) -> bool:
        """Whether its packs' optimizers step with the reduced gradients file (runtime.files): there are several
        micro-batch groups' gradients to sum, a scaled loss's to unscale or clipped ones to scale, out of place."""
        return self.groups > 1 or self.scaled or bool(self.clip)

    def section(self, index: int) -> range:
        """The packs that the tasks of section index run, in order."""
        return section_packs(self.sections, len(self.packs), index)

    def held_bytes(self, pack: int) -> int:
        """The device bytes of a pack's weights and of the weights it borrows (each lender's whole copy)."""
        runtime = self.packs[pack]
        lenders = {lender for _, lender, _ in runtime.borrowed}
        return runtime.device_weights.nbytes + sum(self.packs[lender].device_weights.nbytes for lender in lenders)


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs for one run; workers find their device by their Dask worker name."""

    run: str
    store_directory: str
    models: tuple[ModelRuntime, ...]
    devices: tuple[DeviceSpec, ...]
    prefetch: bool = True  # weights copied in while the task before computes
    group: bool = True
    ahead: bool = True  # micro-batch values copied in (out) while the one before (after) computes, given a link
    autocast: str | None = None  # the dtype forward and backward compute in under torch.autocast (None: as is)
    scaler: Settings = field(default_factory=Settings)  # the loss scaler's arguments (jobs whose loss is scaled)
    compile: bool = False  # packs run through torch.compile
    adaptive: bool = True  # a CPU device times one thread against all (runtime.threads) and takes idle devices'
    profile: tuple[str, int] | None = None  # (directory, steps): trace that many steps' tasks (runtime.profiling)

    def device_index(self, worker_name: str) -> int:
        for index, device in enumerate(self.devices):
            if device.name == worker_name:
                return index
        raise KeyError(f"worker {worker_name!r} is not one of this run's devices")


def describe(plan: RunPlan, codes: list[JobCode]) -> tuple[ModelRuntime, ...]:
    """Every job of the plan as workers run it: per pack, its modules without weights and its byte layouts."""
    autocast = PRECISIONS[plan.options.precision]
    models = []
    for job, code in zip(plan.jobs, codes):
        packs = []
        held = job.device_packing
        for index, pack in enumerate(job.packing.packs):
            halved_names = job.halved(index)
            halved = halve(pack.weights, halved_names, autocast) if halved_names and autocast else None
            weights = lay_out(pack.weights) if halved is None else halved.host
            buffer_names = {spec.name for spec in pack.buffers}
            packs.append(
                PackRuntime(
                    skeleton=dump_skeleton(code.pack_module(job.packing, index)),
                    weights=weights,
                    grads=lay_out(pack.trainable),
                    buffers_offset=min(
                        (slot.offset for slot in weights.slots if slot.spec.name in buffer_names),
                        default=weights.nbytes,
                    ),
                    workspace=held.packs[index].cost.workspace,
                    borrowed=pack.borrowed,
                    lent=tuple((later.index, there, here) for later in reversed(job.packing.packs)
                               for there, owner, here in later.borrowed if owner == index),
                    halved=halved,
                    device_update=index in job.device_updates,
                    stash=index in job.stashes and not plan.options.compile,  # a compiled pack's graph is its own
                    first=pack.first,
                    drawing=pack.drawing,
                )
            )
        models.append(
            ModelRuntime(
                name=job.packing.model,
                packs=tuple(packs),
                loss_fn=dump_code(code.loss_fn),
                optimizer=dump_code(code.optimizer),
                seed=job.seed,
                groups=job.groups,
                home=job.home,
                members=len(job.members),
                prefetch=job.packing.prefetch,
                overlap=job.overlap,
                sections=job.sections,
                scaled=job.scaled,
                clip=job.clip,
                state_ratio=job.state_ratio,
            )
        )
    return tuple(models)
