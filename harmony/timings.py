"""The pilot's timings kept for this process's later calls, so that a re-run cell plans without timing again.

A call's pilot times the first model of each architecture (its layers' forwards and the chain's backward) and its
optimizer's update, and fuse="auto" times a trial array of each size it weighs. A later call in the same process,
with models of the same architecture on batches of the same shapes, the same precision and as many threads, takes
those timings: its models' layers are still called once each (runtime.pilot.decompose checks that they are the
ones timed, and sizes their outputs), a trial array whose timings are kept is predicted without being built, and
one that an earlier call found without room at a budget (NO_ROOM) is not built again there.
Timings are the machine's at the moment they were taken; harmony.shutdown() forgets them with the warm cluster.
The exports a planning made (a model torch.export cut: seconds each) are kept here too, without their models'
weights (runtime.pilot.Exports), for later calls' models of the same architecture and configuration on inputs its
guards allow (harmony.plan's, and train's after it).

Only what a key names is shared: anything else a layer's time depends on (values, a data-dependent branch) is
taken as its first call found it, as within one call the models of one architecture already take the first's.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from harmony.runtime.pilot import input_shapes
from harmony.tasks.profile import ModelProfile

KEPT: dict[Hashable, ModelProfile] = {}  # by kind and key: "model", "trial"
EXPORTS: dict[Hashable, Any] = {}  # torch.export's graphs, weightless, by runtime.pilot.Exports' key
RATES: dict[Hashable, float | None] = {}  # an optimizer's update seconds per byte, by architecture and optimizer
NO_ROOM: set[Hashable] = set()  # trial arrays (KEPT's key, budget) built and found not to fit, or to fit only without
# prefetching with their members cut again: built again at that budget they would come out the same


def context(sample: Any, precision: str) -> Hashable:
    """What besides the layers a pilot's timings depend on: the micro-batch's structure, shapes, dtypes and device,
    the precision and this process's threads (the pilot runs with a device worker's)."""
    return (*input_shapes(sample), precision, torch.get_num_threads())


def forget() -> None:
    """Drop every kept timing: the next call times its models again."""
    KEPT.clear()
    EXPORTS.clear()
    RATES.clear()
    NO_ROOM.clear()
