"""The runtime's host cost per pack call, fitted to a run's steps for the plans this process makes after it.

The pilot times a model's layers, never the work the runtime does around each pack's call on a micro-batch
(binding, claiming and copying values, bookkeeping; on a GPU, launching the kernels), which a swapped model
with many small packs or micro-batches can spend most of its step on. A run's steady step, against the
simulator's step for its own plan with a cost per call (Hardware.call_seconds), gives the cost that makes
the two agree (tasks.simulator.fit_calls); the process keeps the last few fits per device kind, and a later
harmony.train or harmony.plan on such devices predicts, and chooses sections and modes, with their median. It is
a fit, not a timer: what the simulator mispredicts otherwise (a layer's time, which the pilot can find tens of
percent off on a busy machine; a copy) lands in it too, and the median keeps one such run from moving every later
plan. harmony.shutdown() forgets them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
from collections.abc import Iterable

from harmony.result import TrainResult
from harmony.runtime.devices import DeviceSpec
from harmony.tasks.hardware import Hardware
from harmony.tasks.runplan import RunPlan
from harmony.tasks.simulator import fit_calls, simulate_machines

logger = logging.getLogger("harmony")

FITS: dict[str, list[float]] = {}  # Hardware.call_seconds by device kind ("cpu", "cuda"): this process's last fits
KEPT = 5  # fits kept per kind
LARGEST = 0.05  # seconds a call may be fitted at: well above any runtime's per-call work (docs/performance.md)
STEPS = (4, 8)  # the simulated runs whose difference is the plan's steady step (the first steps' ramp left out)


def learned(kind: str | None) -> float | None:
    """The call cost later plans on devices of kind take: the median of the process's last fits (None: no run fitted
    one)."""
    fits = FITS.get(kind or "")
    return statistics.median(fits) if fits else None


def kind_of(specs: Iterable[DeviceSpec]) -> str | None:
    """The one kind of device a run's specs are ("cpu", "cuda"), whose fits it takes and adds to; None for several."""
    kinds = {spec.kind for spec in specs}
    return next(iter(kinds)) if len(kinds) == 1 else None


def fitted(hardware: Hardware, kind: str | None) -> Hardware:
    """hardware with the call cost runs on devices of kind fitted (learned), as it is where none did."""
    seconds = learned(kind)
    return hardware if seconds is None else dataclasses.replace(hardware, call_seconds=seconds)


def steady_step(plan: RunPlan, samples: list[int], call_seconds: float) -> float:
    """The plan's predicted seconds per step once running, at a cost per pack call: the makespan of STEPS[1] steps
    less that of STEPS[0], over the steps between (every job runs as many)."""
    hardware = dataclasses.replace(plan.hardware, call_seconds=call_seconds)
    timed = dataclasses.replace(plan, hardware=hardware)
    machines = {device: dict(plan.machines).get(device, "") for device in plan.devices}
    short, long = (simulate_machines(timed, [steps] * len(plan.jobs), samples, machines).makespan for steps in STEPS)
    return (long - short) / (STEPS[1] - STEPS[0])


def learn(result: TrainResult, samples: list[int], kind: str | None) -> float | None:
    """Fit the call cost to a run's steady step (samples: each job's per step) and keep it for devices of kind;
    None (nothing kept) where the run says nothing of it: devices of several kinds, no swapped job, evaluations or
    checkpoints in its steps (the simulator predicts neither), too few steps for a steady rate, or a step no call
    cost up to LARGEST explains."""
    plan = result.plan
    if kind is None or all(job.home is not None for job in plan.jobs):
        return None
    if any(result.val_history) or plan.options.checkpoint_every:  # time the simulator does not predict
        return None
    steady = []
    for model in range(len(result.stats.step_seconds)):
        with contextlib.suppress(ValueError):  # a model that stopped early
            steady.append(result.stats.steady_seconds_per_step(model))
    if not steady:
        return None
    measured = max(steady)
    started = time.perf_counter()
    seconds = fit_calls(lambda cost: steady_step(plan, samples, cost), measured, LARGEST)
    if seconds >= LARGEST:
        logger.info("harmony: this run's %.1f ms steps are more than any host cost per pack call explains (%.0f ms a "
                    "call): its plan mispredicts something else, and later plans are left as they were",
                    measured * 1e3, LARGEST * 1e3)
        return None
    FITS[kind] = [*FITS.get(kind, [])[1 - KEPT:], seconds]
    logger.info("harmony: the runtime's host cost per pack call on %s devices, fitted to this run's %.1f ms steps: "
                "%.0f µs (fitted in %.2f s); later plans take %.0f µs", kind, measured * 1e3, seconds * 1e6,
                time.perf_counter() - started, (learned(kind) or 0.0) * 1e6)
    return seconds


def forget() -> None:
    """Drop the fitted call costs: the next plans predict without one until a run fits it again."""
    FITS.clear()
