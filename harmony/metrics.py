"""The run's metrics as JSON lines (and TensorBoard scalars where tensorboard is installed), written as it goes.

One file per run in log_dir, ``harmony-<date>-<time>-<pid>.jsonl``, readable by its owner alone. Records, one per
line, each with "kind" and "time" (seconds since the run started):

- "step": one per model per training step: model, name, step (1-based: the weights after it), loss, lr (the
  learning rate the step's update used: the optimizer's, on its lr_schedule), samples_per_s (the model's samples
  over the time its step, or its span of steps in one task, took), grad_norm (a clipped model's total gradient norm
  before clipping), and val_loss plus the metrics where the model was evaluated after that step;
- "val": one per evaluation: model, name, step, val_loss and each metric;
- "pruned": one per model that prune= stopped: model, name, step (its last; a fused array's member has no record
  past it, although its array computes on);
- "device": every second or so and at the end, per device: budget, cached (accounted bytes), bytes_in and
  bytes_out (totals so far; the devices count bytes, not models), busy (share of the run so far).

A step's record waits for its evaluation when one is due after it, so that it carries the validation loss. Jobs on
machines the driver does not map have their step records written at the end.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from harmony.runtime.counters import IN_KINDS, OUT_KINDS
from harmony.runtime.schedule import Scheduled
from harmony.runtime.view import RunView, finite, model_name
from harmony.tasks.runplan import RunPlan

DEVICE_INTERVAL = 1.0


def initial_lr(factory: Any) -> float | None:
    """The learning rate an optimizer factory starts at (None where it cannot be built on a probe tensor)."""
    try:
        optimizer = factory([torch.zeros(1, requires_grad=True)])
        return float(optimizer.param_groups[0]["lr"])
    except Exception:
        return None


def learning_rates(factory: Any) -> Callable[[int], float | None]:
    """The learning rate of each step's update (0 for the first) under an optimizer factory: its initial one, on
    its schedule where it has one (runtime.schedule)."""
    initial = initial_lr(factory)
    schedule = factory.schedule if isinstance(factory, Scheduled) else None
    if initial is None or schedule is None:
        return lambda step: initial
    return lambda step: initial * float(schedule(step))


class MetricsLog:
    """Writes a run's records as it goes (call it with the run's view) and the rest at the end (finish)."""

    def __init__(self, directory: str | os.PathLike[str], plan: RunPlan, names: list[str] | None,
                 lrs: list[Callable[[int], float | None]], samples: list[int]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = self.directory / f"harmony-{stamp}-{os.getpid()}.jsonl"
        self.stream: TextIO = os.fdopen(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w")
        self.plan = plan
        self.names = names
        self.lrs = lrs
        self.samples = samples
        self.written = [0] * len(plan.jobs)
        self.evaluations = [0] * len(plan.jobs)
        self.pruned: set[int] = set()
        self.last_device = -math.inf
        self.board = _tensorboard(self.directory / self.path.stem)

    def name(self, model: int) -> str:
        return model_name(model, self.names)

    def __call__(self, view: RunView) -> None:
        """Write what the run has done since the last call: new evaluations, new steps, the devices each second."""
        state = view.state
        for job, members in state.pruned_members.items():
            for position, step in sorted(members.items()):
                model = self.plan.jobs[job].members[position]
                if model not in self.pruned:
                    self.pruned.add(model)
                    self._write({"kind": "pruned", "time": view.seconds, "model": model, "name": self.name(model),
                                 "step": step})
        for job in range(len(self.plan.jobs)):
            ends = state.pruned_members.get(job, {})
            validation = view.validation[job]
            self._evaluations(job, validation, ends)
            held = {evaluation.step for evaluation in state.evaluating.values() if evaluation.model == job}
            held |= {step for model, step in state.evaluations_owed.items() if model == job}
            steps = min([state.steps_trained[job], *(step - 1 for step in held)])
            if steps > self.written[job] and view.mapped(job):
                losses = view.losses(job, steps, self.written[job])
                norms = view.grad_norms(job, steps, self.written[job])
                assert losses is not None and norms is not None
                self._steps(job, steps, losses, norms, state.step_times[job], dict(validation), ends)
        if view.seconds - self.last_device >= DEVICE_INTERVAL or state.finished:
            self.last_device = view.seconds
            self._devices(view)
        self.stream.flush()

    def finish(self, history: list[list[float]], step_seconds: list[list[float]],
               validation: list[list[tuple[int, dict[str, list[float]]]]], grad_norms: list[list[float]]) -> None:
        """Write every step and evaluation not written yet (history, step_seconds and grad_norms per model,
        validation per job), then close the file."""
        for job, spec in enumerate(self.plan.jobs):
            steps = max(len(history[model]) for model in spec.members)
            ends = {position: len(history[model]) for position, model in enumerate(spec.members)
                    if len(history[model]) < steps}  # a member stopped early: its history ends there
            self._evaluations(job, validation[job] if job < len(validation) else [], ends)
            if steps > self.written[job]:
                losses = [history[model][self.written[job]:] for model in spec.members]
                norms = [grad_norms[model][self.written[job]:] for model in spec.members]
                self._steps(job, steps, losses, norms, step_seconds[spec.members[0]],
                            dict(validation[job]) if job < len(validation) else {}, ends)
        self.close()

    def close(self) -> None:
        if not self.stream.closed:
            self.stream.close()
        if self.board is not None:
            self.board.close()
            self.board = None

    def _write(self, record: dict[str, Any]) -> None:
        self.stream.write(json.dumps(record) + "\n")

    def _steps(self, job: int, steps: int, losses: list[list[float]], norms: list[list[float]], times: list[float],
               validation: dict[int, dict[str, list[float]]], ends: dict[int, int]) -> None:
        """Records of the job's steps written .. steps - 1; losses (and norms, a clipped job's gradient norms, else
        empty) per member hold those steps' alone; a member whose position ends holds none from that step on."""
        members = self.plan.jobs[job].members
        first = self.written[job]
        together, done, began = 1, None, 0.0
        for step in range(self.written[job], steps):
            if step >= len(times):
                done, together = None, 1
            elif times[step] != done:  # the steps one task ran finish together: a rate over all of them
                done = times[step]
                start = step
                while start > 0 and times[start - 1] == done:
                    start -= 1
                end = step
                while end < len(times) and times[end] == done:
                    end += 1
                began, together = (times[start - 1] if start else 0.0), end - start
            for position, model in enumerate(members):
                if step >= ends.get(position, steps):
                    continue
                rate = (self.samples[model] * together / (done - began)
                        if done is not None and done > began else None)
                loss = losses[position][step - first]
                record: dict[str, Any] = {"kind": "step", "time": done, "model": model, "name": self.name(model),
                                          "step": step + 1, "loss": finite(loss), "lr": self.lrs[model](step),
                                          "samples_per_s": rate}
                if norms[position]:
                    record["grad_norm"] = finite(norms[position][step - first])
                figures = validation.get(step + 1)
                if figures is not None:
                    record.update({"val_loss" if name == "loss" else name: finite(values[position])
                                   for name, values in figures.items()})
                self._write(record)
                if self.board is not None:
                    self.board.add_scalar(f"loss/{self.name(model)}", loss, step + 1)
                    if record["lr"] is not None:
                        self.board.add_scalar(f"lr/{self.name(model)}", record["lr"], step + 1)
                    if record.get("grad_norm") is not None:
                        self.board.add_scalar(f"grad_norm/{self.name(model)}", record["grad_norm"], step + 1)
        self.written[job] = steps

    def _evaluations(self, job: int, validation: list[tuple[int, dict[str, list[float]]]], ends: dict[int, int]
                     ) -> None:
        for step, figures in validation[self.evaluations[job]:]:
            for position, model in enumerate(self.plan.jobs[job].members):
                if step > ends.get(position, step):
                    continue
                values = {"val_loss" if name == "loss" else name: finite(values[position])
                          for name, values in figures.items()}
                self._write({"kind": "val", "model": model, "name": self.name(model), "step": step, **values})
                if self.board is not None:
                    for name, value in values.items():
                        if value is not None:
                            self.board.add_scalar(f"{name}/{self.name(model)}", value, step)
        self.evaluations[job] = len(validation)

    def _devices(self, view: RunView) -> None:
        seconds = view.seconds
        for name, values in view.devices().items():
            record = {"kind": "device", "time": seconds, "device": name, "budget": values["budget"],
                      "cached": values["used"], "peak": values["peak"],
                      "bytes_in": sum(values[f"in_{kind}"] for kind in IN_KINDS),
                      "bytes_out": sum(values[f"out_{kind}"] for kind in OUT_KINDS),
                      "busy": min(1.0, values["busy_ns"] / 1e9 / seconds) if seconds > 0 else 0.0}
            self._write(record)
            if self.board is not None:
                for figure in ("cached", "bytes_in", "bytes_out", "busy"):
                    self.board.add_scalar(f"{figure}/{name}", record[figure], int(seconds * 1000))


def _tensorboard(directory: Path) -> Any:
    """A TensorBoard writer into directory where tensorboard is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(directory))
