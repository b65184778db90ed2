"""A live progress display for a terminal or a notebook: steps with rate and time left, each model's latest loss and
validation loss, the devices' busy share, and a line of its own for each model that stops and each device worker
lost or joined.

With tqdm installed (a dependency of transformers; ``pip install tqdm``) it is a tqdm bar (``tqdm.auto``: a widget
in Jupyter) counting model-steps, with one status row per model (the best ROWS when there are more) under it;
without it, a line rewritten in place.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, TextIO

from harmony.runtime.view import RunView, event_line, model_name

REASON_CHARS = 100
ROWS = 8


def newly_stopped(view: RunView, reported: set[int]) -> list[str]:
    """A line for each model that stopped (a job that failed, a fused member whose loss stopped being finite, a
    model pruned) and is not in reported yet; adds them to reported."""
    state = view.state
    stopped = {state.jobs[job].members[position]: (step, f"pruned (prune=) at step {step}")
               for job, members in state.pruned_members.items() for position, step in members.items()}
    stopped.update({model: (failure["step"], str(failure["reason"]))
                    for job, failure in state.failed.items() for model in state.jobs[job].members
                    if model not in stopped})
    for model, step in view.stopped_members().items():
        stopped.setdefault(model, (step, f"its loss stopped being finite at step {step}"))
    lines = []
    for model in sorted(set(stopped) - reported):
        step, reason = stopped[model]
        reason = reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 1] + "…"
        lines.append(f"harmony: model {model} stopped at step {step}: {reason}")
        reported.add(model)
    return lines


class WorkerEvents:
    """The device workers lost or joined since the last call, as lines (a job failed has newly_stopped's line)."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, view: RunView) -> list[str]:
        events = view.state.events[self.seen:]
        self.seen += len(events)
        return [f"harmony: {event_line(event, view.state.jobs)}" for event in events
                if event["event"] in ("worker lost", "worker joined")]


class Announcements:
    """What a display writes once above itself, as it happens: each model that stopped, each device worker lost or
    joined."""

    def __init__(self) -> None:
        self.stopped: set[int] = set()
        self.workers = WorkerEvents()

    def __call__(self, view: RunView) -> list[str]:
        return newly_stopped(view, self.stopped) + self.workers(view)


class EventLog:
    """Where no display is shown (stderr is no terminal: a batch job's log): each device worker lost or joined as a
    warning of the logger, as it happens."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.workers = WorkerEvents()

    def __call__(self, view: RunView) -> None:
        for line in self.workers(view):
            self.logger.warning("%s", line)


def model_rows(view: RunView, names: list[str] | None = None) -> list[tuple[float, str]]:
    """Per model, its latest loss and validation loss as a line, with the figure it ranks by (the validation loss,
    else the loss; lower first)."""
    rows = []
    for latest in view.latest():
        text = f"{model_name(latest.model, names)}: step {latest.steps}"
        text += f", loss {latest.loss:.4g}" if latest.loss is not None else ""
        text += f", val {latest.val_loss:.4g} (step {latest.val_step})" if latest.val_loss is not None else ""
        rank = latest.val_loss if latest.val_loss is not None else latest.loss if latest.loss is not None else math.inf
        rows.append((rank if math.isfinite(rank) else math.inf, text))
    return rows


def busy_share(view: RunView) -> float | None:
    """The devices' share of the run's time spent running tasks, so far."""
    devices = view.devices()
    seconds = view.seconds * len(devices)
    if not devices or seconds <= 0:
        return None
    return min(1.0, sum(values["busy_ns"] for values in devices.values()) / 1e9 / seconds)


class ProgressLine:
    """Rewrites one line on a stream: steps done by all models, tasks run, the best loss, models stopped, elapsed
    time. A model that stops (its loss no longer finite, or its own code raised) and a device worker lost or joined
    are written once above the line."""

    def __init__(self, stream: TextIO | None = None, interval: float = 0.2, names: list[str] | None = None) -> None:
        self.stream = stream or sys.stderr
        self.interval = interval
        self.names = names
        self.started = time.perf_counter()
        self.last = 0.0
        self.announcements = Announcements()

    def __call__(self, view: RunView) -> None:
        state = view.state
        now = time.perf_counter()
        if now - self.last < self.interval and not state.finished:
            return
        self.last = now
        for line in self.announcements(view):
            self.stream.write(f"\r{line}\033[K\n")
        done, total = state.model_steps()
        models = sum(len(job.members) for job in state.jobs)
        stopped = self.announcements.stopped
        failures = f", {len(stopped)} stopped" if stopped else ""
        rows = sorted(model_rows(view, self.names))
        best = f", best {rows[0][1]}" if rows and math.isfinite(rows[0][0]) else ""
        self.stream.write(
            f"\rharmony: {models} models, steps {done}{'' if total is None else f'/{total}'}, "
            f"{state.tasks_finished} tasks{failures}, "
            f"{now - self.started:.1f}s{best}\033[K"
        )
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line above the display (the dashboard's address)."""
        self.stream.write(f"\r{text}\033[K\n")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


class ProgressBar:
    """A tqdm bar of the model-steps done by all models (rate and time left from tqdm), the tasks run, the devices'
    busy share and the models stopped beside it, and under it one row per model (its step, latest loss and
    validation loss; the best ROWS by validation loss, else loss, when there are more); a model that stops and a
    device worker lost or joined are written once above the bar, as it happens."""

    def __init__(self, stream: TextIO | None = None, interval: float = 0.2, names: list[str] | None = None) -> None:
        from tqdm.auto import tqdm

        self.tqdm = tqdm
        self.stream = stream or sys.stderr
        self.bar = tqdm(file=self.stream, unit=" model-steps", dynamic_ncols=True, mininterval=interval,
                        desc="harmony", smoothing=0.1)
        self.rows: list[Any] = []
        self.names = names
        self.interval = interval
        self.last = 0.0
        self.announcements = Announcements()

    def __call__(self, view: RunView) -> None:
        state = view.state
        done, total = state.model_steps()
        if total is not None and self.bar.total != total:
            self.bar.total = total
        now = time.perf_counter()
        if now - self.last >= self.interval or state.finished:  # what follows reads files
            self.last = now
            for line in self.announcements(view):
                self.bar.write(line, file=self.bar.fp)
            busy = busy_share(view)
            stopped = self.announcements.stopped
            postfix = f"{sum(len(job.members) for job in state.jobs)} models, {state.tasks_finished} tasks" + (
                f", devices {busy:.0%} busy" if busy is not None else "") + (
                f", {len(stopped)} stopped" if stopped else "")
            self.bar.set_postfix_str(postfix, refresh=False)
            self._show_rows(view)
        self.bar.update(done - self.bar.n)

    def _show_rows(self, view: RunView) -> None:
        rows = model_rows(view, self.names)
        shown = [text for _, text in (sorted(rows)[:ROWS] if len(rows) > ROWS else rows)]
        if len(rows) > ROWS:
            shown[-1] += f"  (best {ROWS} of {len(rows)} shown)"
        while len(self.rows) < len(shown):
            self.rows.append(self.tqdm(file=self.stream, bar_format="  {desc}", position=len(self.rows) + 1,
                                       leave=True, dynamic_ncols=True))
        for row, text in zip(self.rows, shown):
            row.set_description_str(text, refresh=True)

    def note(self, text: str) -> None:
        """A line above the bar (the dashboard's address)."""
        self.bar.write(text, file=self.bar.fp)

    def close(self) -> None:
        self.bar.refresh()
        self.bar.close()
        for row in self.rows:
            row.close()


def display(stream: TextIO | None = None, names: list[str] | None = None) -> ProgressBar | ProgressLine:
    """The progress display: a tqdm bar where tqdm is installed, else the line."""
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return ProgressLine(stream, names=names)
    return ProgressBar(stream, names=names)


def wants_progress(progress: bool | None) -> bool:
    """Whether to show progress: as asked, or (None) in a terminal or a Jupyter kernel (whose stderr is no
    terminal, but where tqdm.auto draws a widget)."""
    if progress is not None:
        return bool(progress)
    return sys.stderr.isatty() or "ipykernel" in sys.modules
