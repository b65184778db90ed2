"""Pruning a sweep: at each evaluation step, which of the models still training stop there.

A pruner is a callable(step, standings) -> the indices of the models to stop, given every model still training
with its validation figures at that step (the binding state holds every model at the step until all of them are
evaluated there, so that the choice does not depend on which model the devices served first). The two built in
rank by validation loss, a loss that is not finite last and equal losses by model index.

Both built-in pruners stop the worse half (rounded down) of the models still training, so how many train after each
pruning step is known before the run, though not which: computed_share gives fusion (tasks.fusion) what a sub-array
size is expected to compute under them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

Pruner = Callable[[int, list["Standing"]], Collection[int]]


@dataclass(frozen=True)
class Standing:
    """A model still training at a pruning step: its index (as the user ordered the models), name, validation loss
    and metrics there."""

    index: int
    name: str
    val_loss: float
    metrics: dict[str, float] = field(default_factory=dict)


def _rank(standing: Standing) -> tuple[float, int]:
    loss = standing.val_loss
    return (loss if math.isfinite(loss) else math.inf), standing.index


def halving(step: int, standings: Sequence[Standing]) -> list[int]:
    """Successive halving: the worse half (rounded down) by validation loss stops, so that one model is left at the
    end of as many evaluations as halvings it takes."""
    ranked = sorted(standings, key=_rank)
    return [standing.index for standing in ranked[len(ranked) - len(ranked) // 2:]]


def median(step: int, standings: Sequence[Standing]) -> list[int]:
    """The median rule (Optuna's MedianPruner at one step): a model whose validation loss is worse than the median of
    the models still training stops (one whose loss is not finite always)."""
    finite = [standing.val_loss for standing in standings if math.isfinite(standing.val_loss)]
    middle = statistics.median(finite) if finite else math.inf
    return [standing.index for standing in standings if not standing.val_loss <= middle]


PRUNERS: dict[str, Pruner] = {"halving": halving, "median": median}


def every_member(live: int, size: int) -> float:
    """What a step of an array that computes every member while any trains costs with live of them training, as a
    share of its whole step."""
    return 1.0 if live else 0.0


def live_members(live: int, size: int) -> float:
    """The share of an array's members a step computes with live of them training, where it computes those alone."""
    return live / size


def computed_share(sizes: Sequence[int], contenders: int, steps: int, every: int,
                   cost: Callable[[int, int], float] = every_member) -> float:
    """The expected share of a group's array-steps computed (weighted by what each costs) when its arrays have sizes
    members each and a built-in pruner stops the worse half of contenders (every model the run ranks) after each
    every steps, of steps.

    cost(live, size) is what a step of an array of size members costs with live of them training, as a share of
    its whole step: a compiled array computes every member while any trains (every_member); others compute their
    members still training alone (runtime.array.narrowed, runtime.rows), at a cost tasks.fusion.narrowed_cost
    predicts (a swapped one still pays its tasks' fixed costs: harmony.plan simulates that). Which
    models survive is not known when fusing, so the survivors of each pruning step are taken as drawn at random from
    the contenders: with s survivors, an array of k members has j of them with probability
    C(k, j) C(contenders - k, s - j) / C(contenders, s). Unfused models (sizes of 1) compute their share of
    model-steps.
    """
    ends = [*range(every, steps, every), steps]
    training = [contenders]
    for _ in ends[1:]:
        training.append(training[-1] - training[-1] // 2)
    computed = 0.0
    start = 0
    for end, alive in zip(ends, training):
        for size in sizes:
            expected = sum(math.comb(size, live) * math.comb(contenders - size, alive - live) * cost(live, size)
                           for live in range(min(size, alive) + 1)) / math.comb(contenders, alive)
            computed += (end - start) * expected
        start = end
    return computed / (steps * len(sizes))
