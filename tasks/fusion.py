"""Fusion choices (pure): which models form arrays, how to split them into sub-arrays, which size wins.

Models whose keys are equal (same architecture layer by layer, same loader, same optimizer class; the
caller computes the key) and not None can be fused. A group of n such models runs as sub-arrays of a
chosen size s: ceil(n / s) arrays with sizes as even as possible. The size is chosen by predicted
throughput, which the caller obtains from the simulator for every candidate size whose packs fit, weighted, where a
built-in pruner stops models during the run, by the share of its steps each size is expected to compute
(tasks.pruning.computed_share: a swapped array computes its pruned members until all of them stop, a homed one its
members still training, at what an array of that many costs: narrowed_cost). A size whose
trial array (trial_bytes) would not fit the memory it is built in is not tried: the caller builds each trial array
beside the members' own weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from harmony.tasks.packing import workspace_bytes
from harmony.tasks.profile import ModelProfile


def fusion_groups(keys: Sequence[Hashable | None]) -> list[list[int]]:
    """Indices of models sharing a key, in order of first appearance; only groups of two or more."""
    groups: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        if key is not None:
            groups.setdefault(key, []).append(index)
    return [members for members in groups.values() if len(members) > 1]


def candidate_sizes(members: int) -> list[int]:
    """Sub-array sizes worth predicting for a group: the powers of two below its size, and its size."""
    sizes = []
    size = 1
    while size < members:
        sizes.append(size)
        size *= 2
    sizes.append(members)
    return sizes


def trial_bytes(profile: ModelProfile, size: int, samples: int) -> int:
    """What building and piloting an array of size members of profile's architecture holds at once, at samples a
    micro-batch: the stacked copy of their weights, and one layer's gradients and activations while it is timed
    (packing's accounting of a one-layer pack, times the members)."""
    layer = max(workspace_bytes([layer], samples) + layer.grad_bytes for layer in profile.layers)
    return size * (profile.weight_bytes + layer)


def split(members: Sequence[int], size: int, interleaved: bool = False) -> list[list[int]]:
    """members in sub-arrays of at most size models, as even as possible: consecutive, or interleaved (the first
    array takes the first member, the second the second, ... and round again)."""
    count = -(-len(members) // size)
    if interleaved:
        return [list(members[index::count]) for index in range(count)]
    base, extra = divmod(len(members), count)
    arrays = []
    first = 0
    for index in range(count):
        stop = first + base + (1 if index < extra else 0)
        arrays.append(list(members[first:stop]))
        first = stop
    return arrays


def narrowed_cost(group: int, predicted: dict[int, float | None], devices: int) -> Callable[[int, int], float]:
    """What a step of a narrowed array (one that computes its members still training alone) of size members costs
    with live of them training, as a share of its whole step: an array of live members' predicted step over its own
    (tasks.pruning.computed_share's cost).

    predicted is a group of group models' predicted seconds a step in sub-arrays of each size (FusionChoice); one
    array's step is that, times the arrays that run at once (at most one a device), over the arrays. Between the
    sizes predicted it is interpolated linearly (below the smallest, in proportion to the members); a size not
    predicted costs in proportion to its live members.
    """
    steps: dict[int, float] = {}
    for size, seconds in predicted.items():
        if seconds is not None:
            arrays = len(split(range(group), size))
            steps[size] = seconds * min(devices, arrays) / arrays
    known = sorted(steps)

    def step(members: int) -> float:
        below = max((size for size in known if size <= members), default=None)
        above = min((size for size in known if size >= members), default=None)
        if below is None:
            assert above is not None
            return steps[above] * members / above
        if above is None or above == below:
            return steps[below]
        return steps[below] + (steps[above] - steps[below]) * (members - below) / (above - below)

    def cost(live: int, size: int) -> float:
        if live == 0:
            return 0.0
        if size not in steps:
            return live / size
        return min(1.0, step(live) / steps[size])

    return cost


@dataclass(frozen=True)
class FusionChoice:
    """The sub-array size chosen for one group of fusable models, and why.

    predicted maps every candidate size to the predicted seconds for the whole group to advance one step
    (None where the size's packs do not fit the budget, or where it was not tried). unbuilt maps a size that was
    not tried to the host bytes its trial array would have needed (the host had less free). shares maps every
    candidate size to the share of its steps it is expected to compute under the run's pruner (empty without one);
    a size is ranked by predicted times share. interleaved (a pruned run) deals the members out to the arrays in turn:
    a sweep's neighbours (the learning rates next to each other) tend to survive pruning together, and in one array
    they would leave the others' devices with nothing to compute. devices: how many of the run's devices (of
    total) the sizes were predicted on, the group's share of them (harmony.fusing); 0, all of them.
    """

    members: tuple[int, ...]
    predicted: dict[int, float | None]
    size: int
    unbuilt: dict[int, int] = field(default_factory=dict)
    shares: dict[int, float] = field(default_factory=dict)
    interleaved: bool = False
    devices: int = 0
    total: int = 0

    @property
    def arrays(self) -> list[list[int]]:
        return split(self.members, self.size, self.interleaved)

    def explain(self, name: str) -> str:
        tried = ", ".join(f"{size}: {self._outcome(size, seconds)}" for size, seconds in self.predicted.items())
        if self.shares:
            tried += "; pruned, as a built-in pruner is expected to leave them"
        if self.devices:
            tried += (f"; on {self.devices} of the {self.total} devices, its share of the run's compute (the other "
                      "models train beside it)")
        if self.size == 1:
            return f"{len(self.members)} x {name} trained unfused (predicted {tried})"
        arrays = " + ".join(str(len(array)) for array in self.arrays)
        if self.interleaved and len(self.arrays) > 1:
            arrays += " (members dealt out in turn: " + " | ".join(",".join(map(str, a)) for a in self.arrays) + ")"
        return f"{len(self.members)} x {name} fused as {arrays} (sub-array size {self.size}; predicted {tried})"

    def _outcome(self, size: int, seconds: float | None) -> str:
        if size in self.unbuilt:
            return f"not tried, its trial array needs {self.unbuilt[size] / 1e9:.1f} GB of host memory"
        if seconds is None:
            return "does not fit"
        rate = len(self.members) / seconds  # a sweep of large models on a CPU steps well under one a second
        shown = f"{rate:,.0f} model-steps/s" if rate >= 100 else f"{rate:.3g} model-steps/s"
        return f"{shown} computing {self.shares[size]:.0%} of its steps" if size in self.shares else shown

    def cost(self, size: int) -> float | None:
        """What a size is ranked by: its predicted seconds a step, times the share it computes (None: no fit)."""
        seconds = self.predicted.get(size)
        return None if seconds is None else seconds * self.shares.get(size, 1.0)


def choose_size(
    members: Sequence[int], predicted: dict[int, float | None], unbuilt: dict[int, int] | None = None,
    shares: dict[int, float] | None = None, interleaved: bool = False, devices: tuple[int, int] = (0, 0),
) -> FusionChoice:
    """The size with the best predicted throughput, pruned where shares are given (ties go to the larger size); 1
    when none fits. devices: of how many devices, how many it was predicted on (FusionChoice.devices)."""
    ranked = FusionChoice(tuple(members), dict(predicted), 1, dict(unbuilt or {}), dict(shares or {}), interleaved,
                          *devices)
    fitting = {size: cost for size in predicted if (cost := ranked.cost(size)) is not None}
    best = min(fitting, key=lambda size: (fitting[size], -size)) if fitting else 1
    return dataclasses.replace(ranked, size=best)
