"""Pruning a sweep: at each evaluation step, which of the models still training stop there.

A pruner is a callable(step, standings) -> the indices of the models to stop, given every model still training
with its validation figures at that step (the binding state holds every model at the step until all of them are
evaluated there, so that the choice does not depend on which model the devices served first). The two built in
rank by validation loss, a loss that is not finite last and equal losses by model index.
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
