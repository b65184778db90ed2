"""Cut a model's layer chain into layer packs that fit a device budget, with balanced packs."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from harmony.tasks.layout import TensorSpec
from harmony.tasks.profile import BACKWARD_RATIO, LayerProfile, ModelProfile


class LayerTooLarge(ValueError):
    """A single layer (or a run of layers that cannot be cut) needs more bytes than the device budget."""

    def __init__(self, first: int, stop: int, need: PackCost, budget: int, description: str,
                 per_sample: float = 0.0, samples: int = 1) -> None:
        self.first = first
        self.stop = stop
        self.need = need
        self.per_sample = per_sample  # the bytes of need.workspace per sample of the micro-batch (the rest is fixed)
        self.samples = samples  # the micro-batch's, which need was counted for
        self.budget = budget
        self.description = description
        super().__init__(
            f"layer {first}{'' if stop == first + 1 else f'..{stop - 1}'} ({description}) needs "
            f"{self.alone:,} bytes on a device (weights {need.weights:,} + gradients {need.grads:,} + activations "
            f"{need.workspace:,}), {need.total:,} to prefetch beside it (the next pack's weights, and where values "
            f"are copied ahead the next micro-batch's), but the device budget is {budget:,} bytes"
        )

    @property
    def alone(self) -> int:
        """The smallest budget the layer runs in, without prefetching beside it."""
        return self.need.total - self.need.prefetch

    @property
    def fixed(self) -> int:
        """The part of alone that no micro-batch size changes: weights, gradients and the fixed part of the
        activations (workspace_bytes's largest fresh gradient, autocast's copies, what layers keep whatever the
        micro-batch)."""
        return self.alone - round(self.per_sample * self.samples)

    @property
    def one_sample(self) -> int:
        """alone, for micro-batches of one sample: the least budget any number of micro-batches gets it into."""
        return self.fixed + round(self.per_sample)

    def largest_microbatch(self) -> int | None:
        """The most samples a micro-batch may have for the layer to fit the budget alone; None where not one does."""
        if self.per_sample <= 0:
            return None
        largest = math.floor((self.budget - self.fixed) / self.per_sample)
        return largest if largest >= 1 else None


@dataclass(frozen=True)
class PackCost:
    """Bytes a pack holds on a device while its backward runs on one micro-batch. weights are its device copy's: the
    halved ones (Pack.halved) at two bytes. prefetch is the room for what comes in meanwhile: the next pack's weights
    and, where micro-batch values are copied ahead (ahead_bytes), the next micro-batch's."""

    weights: int
    grads: int
    workspace: int
    prefetch: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.workspace + self.prefetch

    def explain(self) -> str:
        return (
            f"weights {self.weights:,} + gradients {self.grads:,} + activations {self.workspace:,} "
            f"+ prefetch buffer {self.prefetch:,}"
        )


@dataclass(frozen=True)
class Pack:
    """Layers [first, stop) of a model's chain, run as one unit on one device."""

    index: int
    first: int
    stop: int
    weights: tuple[TensorSpec, ...]
    trainable: tuple[TensorSpec, ...]
    buffers: tuple[TensorSpec, ...]
    cost: PackCost
    forward_seconds_per_sample: float
    input_bytes_per_sample: float = 0.0
    borrowed: tuple[tuple[str, int, str], ...] = ()  # (name here, pack that holds it, its name there): tied weights
    halved: tuple[str, ...] = ()  # own parameters autocast only casts (LayerProfile.halved)
    drawing: tuple[int, ...] = ()  # its layers (by index in the chain) that draw random numbers (LayerProfile.draws)
    backward_ratio: float = BACKWARD_RATIO  # its backward's seconds per its forward's (ModelProfile.backward_ratio)
    transient: int = 0  # of its workspace, what one layer's backward allocates beyond its reserve (no stash holds it)
    copies: int = 0  # of its workspace, autocast's copies of its weights (LayerProfile.copy_bytes; a stash holds them)
    update_seconds: float | None = None  # its optimizer step where measured (ModelProfile.update_seconds_per_byte)

    @property
    def weight_bytes(self) -> int:
        """What the pack's weights hold on a device (the halved ones in a 2-byte dtype)."""
        return self.cost.weights

    @property
    def stash_bytes(self) -> int:
        """Predicted bytes of one micro-batch's stash (runtime.stash): its workspace's activations without their
        gradients, without the largest parameter's gradient and without what a backward allocates beyond them
        (workspace_bytes), and autocast's copies of its weights whole (saved for the backward, they have no
        gradient to leave out)."""
        largest = max((spec.nbytes for spec in self.weights), default=0)
        return max(self.cost.workspace - largest - self.transient - self.copies, 0) // 2 + self.copies

    @property
    def halved_bytes(self) -> int:
        """The float32 bytes of the weights whose device copy is in autocast's 2-byte dtype."""
        return sum(spec.nbytes for spec in self.weights if spec.name in self.halved)

    @property
    def float_workspace(self) -> int:
        """The workspace where the device holds every weight in float32 (a homed model, a fused array): autocast
        copies the halved ones too, in each forward."""
        return self.cost.workspace + self.halved_bytes // 2

    @property
    def float_bytes(self) -> int:
        """What the pack's weights hold in their own dtypes, as the host store, its optimizer and a device that
        keeps them whole (a homed model) hold them."""
        return self.cost.weights + self.halved_bytes // 2

    @property
    def grad_bytes(self) -> int:
        return self.cost.grads

    def state_bytes(self, state_ratio: float) -> int:
        """Its optimizer state: state_ratio bytes per trainable parameter byte."""
        return round(state_ratio * self.grad_bytes)


@dataclass(frozen=True)
class Packing:
    """How a model (or array) is cut: its packs, and the budget and micro-batch size they were cut for."""

    model: str
    packs: tuple[Pack, ...]
    budget: int
    microbatch_samples: int
    prefetch: bool = True
    ahead: bool = False  # cut with room for the next micro-batch's values (ahead_bytes)

    def explain(self) -> str:
        sizes = ", ".join(f"{pack.first}-{pack.stop - 1}" for pack in self.packs)
        peak = max(pack.cost.total for pack in self.packs)
        total = sum(pack.float_bytes for pack in self.packs)
        return (
            f"{self.model}: {sum(p.stop - p.first for p in self.packs)} layers, {total:,} weight bytes -> "
            f"{len(self.packs)} pack{'s' if len(self.packs) != 1 else ''} (layers {sizes}); "
            f"peak need {peak:,} of {self.budget:,} bytes at micro-batch {self.microbatch_samples}"
            + ("" if self.prefetch or len(self.packs) == 1 else "; no room to prefetch the next pack's weights")
            + ("; the prefetch room also holds the next micro-batch's values" if self.ahead and self.prefetch
               and len(self.packs) > 1 else "")
        )


def workspace_bytes(layers: tuple[LayerProfile, ...] | list[LayerProfile], samples: int) -> int:
    """Activation bytes of one micro-batch through layers while their backward runs.

    The boundary input and its gradient, every layer's output and what it keeps inside for its backward
    (LayerProfile.saved_bytes_per_sample) and their gradients, the largest parameter's freshly computed gradient
    before it is accumulated, the most one layer's backward allocates beyond those
    (LayerProfile.transient_bytes_per_sample), and autocast's copies of the weights (LayerProfile.copy_bytes). The
    parts of what a layer keeps and allocates that do not grow with the micro-batch (LayerProfile.saved_bytes,
    transient_bytes) count as they are; the most of each part of a backward's allocation counts, which holds the
    most of their sum.
    """
    if not layers:
        return 0
    return (round(activation_bytes_per_sample(layers) * samples) + max(layer.largest_param_bytes for layer in layers)
            + sum(layer.copy_bytes + 2 * layer.saved_bytes for layer in layers)
            + max(layer.transient_bytes for layer in layers))


def activation_bytes_per_sample(layers: tuple[LayerProfile, ...] | list[LayerProfile]) -> float:
    """The part of workspace_bytes that grows with the micro-batch, per sample: one layer's backward runs at a time,
    so the most any allocates beyond its reserve (LayerProfile.transient_bytes_per_sample) is counted once."""
    return 2 * layers[0].input_bytes_per_sample + 2 * sum(
        layer.output_bytes_per_sample + layer.saved_bytes_per_sample for layer in layers) + max(
        layer.transient_bytes_per_sample for layer in layers)


def _prefixed(layers: list[LayerProfile], pick: str) -> tuple[TensorSpec, ...]:
    """The layers' params or buffers, named as in nn.Sequential(*layers)."""
    return tuple(
        TensorSpec(f"{offset}.{spec.name}", spec.dtype, spec.shape)
        for offset, layer in enumerate(layers)
        for spec in getattr(layer, pick)
    )


def make_pack(profile: ModelProfile, index: int, first: int, stop: int, samples: int, prefetch: int,
              bounds: list[tuple[int, int]] | None = None) -> Pack:
    """Describe layers [first, stop) as a pack, with tensor names as they appear in nn.Sequential(*layers).

    A parameter a layer borrows from a layer of another pack (bounds: every pack's layers) is not the pack's own:
    it is read from the lender's pack, and its gradient, in the pack's gradients, is added to the lender's."""
    layers = list(profile.layers[first:stop])
    frozen = {f"{offset}.{name}" for offset, layer in enumerate(layers) for name in layer.frozen}
    params = _prefixed(layers, "params")
    buffers = _prefixed(layers, "buffers")
    borrowed, lent_grads = [], []
    for offset, layer in enumerate(layers):
        for spec, (lender, name) in zip(layer.borrowed, layer.lenders):
            if first <= lender < stop:
                continue  # the pack holds the lender too: the tie is inside it
            assert bounds is not None, "a pack that borrows from another needs every pack's bounds"
            owner = next(i for i, (a, b) in enumerate(bounds) if a <= lender < b)
            local = f"{offset}.{spec.name}"
            borrowed.append((local, owner, f"{lender - bounds[owner][0]}.{name}"))
            if local not in frozen:
                lent_grads.append(TensorSpec(local, spec.dtype, spec.shape))
    trainable = tuple(spec for spec in params if spec.name not in frozen) + tuple(lent_grads)
    cost = PackCost(
        weights=chunk_weight_bytes(profile.layers, first, stop),
        grads=chunk_grad_bytes(profile.layers, first, stop),
        workspace=workspace_bytes(layers, samples),
        prefetch=prefetch,
    )
    return Pack(
        index=index,
        first=first,
        stop=stop,
        weights=params + buffers,
        trainable=trainable,
        buffers=buffers,
        cost=cost,
        forward_seconds_per_sample=sum(layer.forward_seconds_per_sample for layer in layers),
        input_bytes_per_sample=layers[0].input_bytes_per_sample,
        borrowed=tuple(borrowed),
        halved=tuple(f"{offset}.{name}" for offset, layer in enumerate(layers) for name in sorted(layer.halved)),
        drawing=tuple(first + offset for offset, layer in enumerate(layers) if layer.draws),
        backward_ratio=profile.backward_ratio,
        update_seconds=_update_seconds(trainable, profile.update_seconds_per_byte),
        transient=round(max(layer.transient_bytes_per_sample for layer in layers) * samples)
        + max(layer.transient_bytes for layer in layers),
        copies=sum(layer.copy_bytes for layer in layers),
    )


def _update_seconds(trainable: tuple[TensorSpec, ...], rate: float | None) -> float | None:
    return None if rate is None else rate * sum(spec.nbytes for spec in trainable)


def with_update_rate(profile: ModelProfile, packing: Packing, rate: float | None) -> tuple[ModelProfile, Packing]:
    """profile and packing with the optimizer's measured seconds per trainable byte (None: not measured)."""
    packs = tuple(dataclasses.replace(pack, update_seconds=_update_seconds(pack.trainable, rate))
                  for pack in packing.packs)
    return (dataclasses.replace(profile, update_seconds_per_byte=rate),
            dataclasses.replace(packing, packs=packs))


def _shared_inside(layers: tuple[LayerProfile, ...], first: int, stop: int, grads: bool) -> int:
    """Bytes of the parameters layers [first, stop) borrow from one another (counted once, with the lender)."""
    return sum(spec.nbytes for layer in layers[first:stop] for spec, (lender, _) in zip(layer.borrowed, layer.lenders)
               if first <= lender < stop and not (grads and spec.name in layer.frozen))


def chunk_weight_bytes(layers: tuple[LayerProfile, ...], first: int, stop: int) -> int:
    """The weights layers [first, stop) hold as one pack on a device (LayerProfile.device_bytes): a tied parameter
    they all read, once (a tied parameter is never halved)."""
    return sum(layer.device_bytes for layer in layers[first:stop]) - _shared_inside(layers, first, stop, False)


def chunk_grad_bytes(layers: tuple[LayerProfile, ...], first: int, stop: int) -> int:
    return sum(layer.grad_bytes for layer in layers[first:stop]) - _shared_inside(layers, first, stop, True)


def _units(layers: tuple[LayerProfile, ...]) -> list[tuple[int, int]]:
    """Runs of layers between the places where a pack may be cut."""
    starts = [i for i, layer in enumerate(layers) if i == 0 or layer.cut_before]
    return [(start, stop) for start, stop in zip(starts, [*starts[1:], len(layers)])]


def _fixed_bytes(layers: tuple[LayerProfile, ...], first: int, stop: int, samples: int) -> int:
    return (chunk_weight_bytes(layers, first, stop) + chunk_grad_bytes(layers, first, stop)
            + workspace_bytes(layers[first:stop], samples))


def ahead_bytes(layers: tuple[LayerProfile, ...], first: int, stop: int, samples: int, ahead: bool = True) -> int:
    """Room for the next micro-batch's values, copied in while one computes (runtime.cache.DeviceCache.ahead): the
    pack's input and its output's gradient; none where the run does not copy ahead."""
    if not ahead:
        return 0
    return round((layers[first].input_bytes_per_sample + layers[stop - 1].output_bytes_per_sample) * samples)


def _greedy(
    layers: tuple[LayerProfile, ...], units: list[tuple[int, int]], budget: int, cap: int, samples: int,
    prefetch: bool = True, ahead: bool = False,
) -> list[tuple[int, int]] | None:
    """Longest packs from the front whose weights stay within cap and that fit beside a cap-sized prefetch, and with
    ahead the next micro-batch's values (with prefetch; alone without)."""

    def fits(first: int, stop: int) -> bool:
        reserve = cap + ahead_bytes(layers, first, stop, samples, ahead) if prefetch else 0
        return _fixed_bytes(layers, first, stop, samples) + reserve <= budget

    bounds: list[tuple[int, int]] = []
    first = units[0][0]
    stop = first
    for unit_first, unit_stop in units:
        weights = chunk_weight_bytes(layers, first, unit_stop)
        if stop > first and (weights > cap or not fits(first, unit_stop)):
            bounds.append((first, stop))
            first = unit_first
        stop = unit_stop
        alone = chunk_weight_bytes(layers, first, stop)
        if alone > cap or not fits(first, stop):
            return None
    bounds.append((first, stop))
    return bounds


def cut_packs(profile: ModelProfile, budget: int, samples: int, ahead: bool = False) -> Packing:
    """Cut profile's chain into the fewest packs that fit budget, preferring packs of similar compute.

    A model that fits whole is one pack, with no prefetch buffer (there is no other pack to fetch; its weights stay
    cached from step to step when the budget holds them). Otherwise every pack's weights stay within a cap c, and
    every pack fits beside a prefetch buffer of c bytes (the next pack's weights); among caps giving the fewest
    packs, the one whose slowest pack is fastest wins, which balances compute across packs. A budget with no room
    for the buffer cuts packs that fit alone, and the model runs without prefetching (Packing.prefetch). With ahead
    (the run copies micro-batch values in while the one before computes) the buffer also holds the next
    micro-batch's values (ahead_bytes). Weights
    count at their device copy's bytes: a profile measured under autocast (LayerProfile.halved) is cut for halved
    copies, which a job that does not halve them (homed, fused) must re-count (Job.device_packing).
    """
    layers = profile.layers
    if _fixed_bytes(layers, 0, len(layers), samples) <= budget:
        return Packing(profile.name, (make_pack(profile, 0, 0, len(layers), samples, prefetch=0),), budget, samples,
                       ahead=ahead)
    units = _units(layers)
    floor = max(chunk_weight_bytes(layers, a, b) for a, b in units)
    unit_first, unit_stop = max(units, key=lambda u: _fixed_bytes(layers, u[0], u[1], samples))
    alone = _fixed_bytes(layers, unit_first, unit_stop, samples)
    prefetch = all(_fixed_bytes(layers, a, b, samples) + floor + ahead_bytes(layers, a, b, samples, ahead) <= budget
                   for a, b in units)
    if alone > budget:
        chunk = layers[unit_first:unit_stop]
        cost = PackCost(
            weights=chunk_weight_bytes(layers, unit_first, unit_stop),
            grads=chunk_grad_bytes(layers, unit_first, unit_stop),
            workspace=workspace_bytes(chunk, samples),
            prefetch=floor + ahead_bytes(layers, unit_first, unit_stop, samples, ahead),
        )
        raise LayerTooLarge(unit_first, unit_stop, cost, budget, chunk[0].description,
                            activation_bytes_per_sample(chunk), samples)
    total = chunk_weight_bytes(layers, 0, len(layers))
    steps = 48
    candidates = {floor, total}
    candidates.update(floor + (total - floor) * k // steps for k in range(steps + 1))
    candidates.update(chunk_weight_bytes(layers, a, b) for a, b in units)
    best: tuple[tuple[int, float], list[tuple[int, int]], int] | None = None
    for cap in sorted(c for c in candidates if floor <= c <= max(total, floor)):
        bounds = _greedy(layers, units, budget, cap, samples, prefetch, ahead)
        if bounds is None:
            continue
        slowest = max(sum(layer.forward_seconds_per_sample for layer in layers[a:b]) for a, b in bounds)
        score = (len(bounds), slowest)
        if best is None or score < best[0]:
            best = (score, bounds, cap)
    assert best is not None, "the floor cap always fits once every unit fits"
    _, bounds, cap = best
    packs = tuple(
        make_pack(profile, index, first, stop, samples,
                  prefetch=_neighbour_weights(layers, bounds, index) + ahead_bytes(layers, first, stop, samples, ahead)
                  if prefetch else 0, bounds=bounds)
        for index, (first, stop) in enumerate(bounds)
    )
    return Packing(profile.name, packs, budget, samples, prefetch, ahead)


def _neighbour_weights(layers: tuple[LayerProfile, ...], bounds: list[tuple[int, int]], index: int) -> int:
    """Weights of the packs prefetched while this one runs: the next in forward, the previous in backward."""
    neighbours = [i for i in (index - 1, index + 1) if 0 <= i < len(bounds)]
    return max((chunk_weight_bytes(layers, *bounds[i]) for i in neighbours), default=0)


def minimal_budget(profile: ModelProfile, samples: int, prefetch: bool = False) -> int:
    """The smallest budget cut_packs accepts for profile, what its largest layer needs: alone, or (prefetch)
    beside a prefetch buffer of the largest layer's weights."""
    try:
        cut_packs(profile, 0, samples)
    except LayerTooLarge as error:
        return error.need.total if prefetch else error.alone
    return 0
