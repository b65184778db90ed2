"""A live progress display for a terminal or a notebook, with a line of its own for each model that stops.

With tqdm installed (a dependency of transformers; ``pip install tqdm``) it is a tqdm bar (``tqdm.auto``: a widget
in Jupyter) counting model-steps, with their rate and the time left; without it, a line rewritten in place.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from harmony.tasks.binding import BindingState

REASON_CHARS = 100


def newly_stopped(state: BindingState, stopped_members: Callable[[], dict[int, int]] | None,
                  reported: set[int]) -> list[str]:
    """A line for each model that stopped (a job that failed, a fused member whose loss stopped being finite) and
    is not in reported yet; adds them to reported."""
    stopped = {model: (failure["step"], str(failure["reason"]))
               for job, failure in state.failed.items() for model in state.jobs[job].members}
    for model, step in (stopped_members() if stopped_members is not None else {}).items():
        stopped.setdefault(model, (step, f"its loss stopped being finite at step {step}"))
    lines = []
    for model in sorted(set(stopped) - reported):
        step, reason = stopped[model]
        reason = reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 1] + "…"
        lines.append(f"harmony: model {model} stopped at step {step}: {reason}")
        reported.add(model)
    return lines


class ProgressLine:
    """Rewrites one line on a stream: steps done by all models, tasks run, models stopped, elapsed time. A model that
    stops (its loss no longer finite, or its own code raised) is written once above the line, as it happens."""

    def __init__(self, stream: TextIO | None = None, interval: float = 0.2) -> None:
        self.stream = stream or sys.stderr
        self.interval = interval
        self.started = time.perf_counter()
        self.last = 0.0
        self.reported: set[int] = set()

    def __call__(self, state: BindingState, stopped_members: Callable[[], dict[int, int]] | None = None) -> None:
        """Show state; stopped_members, when given, reads which members of fused arrays stopped (model -> step)."""
        now = time.perf_counter()
        if now - self.last < self.interval and not state.finished:
            return
        self.last = now
        for line in newly_stopped(state, stopped_members, self.reported):
            self.stream.write(f"\r{line}\033[K\n")
        stopped = self.reported
        members = [len(job.members) for job in state.jobs]  # a fused array's step is a step of each member
        done = sum(steps * count for steps, count in zip(state.steps_trained, members))
        totals = [spans.steps * count for spans, count in zip(state.spans, members) if spans.steps is not None]
        total = f"/{sum(totals)}" if len(totals) == len(state.spans) else ""
        models = sum(members)
        failures = f", {len(stopped)} stopped" if stopped else ""
        self.stream.write(
            f"\rharmony: {models} models, steps {done}{total}, {state.tasks_finished} tasks{failures}, "
            f"{now - self.started:.1f}s\033[K"
        )
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


class ProgressBar:
    """A tqdm bar of the model-steps done by all models (rate and time left from tqdm), the tasks run and the
    models stopped beside it; a model that stops is written once above the bar, as it happens."""

    def __init__(self, stream: TextIO | None = None, interval: float = 0.2) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(file=stream or sys.stderr, unit=" model-steps", dynamic_ncols=True, mininterval=interval,
                        desc="harmony", smoothing=0.1)
        self.interval = interval
        self.last = 0.0
        self.reported: set[int] = set()

    def __call__(self, state: BindingState, stopped_members: Callable[[], dict[int, int]] | None = None) -> None:
        """Show state; stopped_members, when given, reads which members of fused arrays stopped (model -> step)."""
        members = [len(job.members) for job in state.jobs]  # a fused array's step is a step of each member
        totals = [(state.steps_trained[job] if job in state.failed else spans.steps) * count  # a stopped job ends
                  for job, (spans, count) in enumerate(zip(state.spans, members)) if spans.steps is not None]
        if len(totals) == len(state.spans) and self.bar.total != sum(totals):
            self.bar.total = sum(totals)
        now = time.perf_counter()
        if now - self.last >= self.interval or state.finished:  # reading stopped members costs file reads
            self.last = now
            self._report_stopped(state, stopped_members)
        done = sum(steps * count for steps, count in zip(state.steps_trained, members))
        postfix = f"{sum(members)} models, {state.tasks_finished} tasks" + (
            f", {len(self.reported)} stopped" if self.reported else "")
        if postfix != self.bar.postfix:
            self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(done - self.bar.n)

    def _report_stopped(self, state: BindingState, stopped_members: Callable[[], dict[int, int]] | None) -> None:
        """Write a line above the bar for each model that stopped since the last call."""
        for line in newly_stopped(state, stopped_members, self.reported):
            self.bar.write(line, file=self.bar.fp)

    def close(self) -> None:
        self.bar.refresh()
        self.bar.close()


def display(stream: TextIO | None = None) -> ProgressBar | ProgressLine:
    """The progress display: a tqdm bar where tqdm is installed, else the line."""
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return ProgressLine(stream)
    return ProgressBar(stream)


def wants_progress(progress: bool | None) -> bool:
    """Whether to show progress: as asked, or (None) in a terminal or a Jupyter kernel (whose stderr is no
    terminal, but where tqdm.auto draws a widget)."""
    if progress is not None:
        return bool(progress)
    return sys.stderr.isatty() or "ipykernel" in sys.modules
