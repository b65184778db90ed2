"""A live one-line progress display for a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from harmony.tasks.binding import BindingState


class ProgressLine:
    """Rewrites one line on a stream: steps done per model, tasks run, elapsed time."""

    def __init__(self, stream: TextIO | None = None, interval: float = 0.2) -> None:
        self.stream = stream or sys.stderr
        self.interval = interval
        self.started = time.perf_counter()
        self.last = 0.0

    def __call__(self, state: BindingState) -> None:
        now = time.perf_counter()
        if now - self.last < self.interval and not state.finished:
            return
        self.last = now
        done = sum(state.steps_trained)
        totals = [spans.steps for spans in state.spans if spans.steps is not None]
        total = f"/{sum(totals)}" if len(totals) == len(state.spans) else ""
        self.stream.write(
            f"\rharmony: {len(state.jobs)} models, steps {done}{total}, {state.tasks_finished} tasks, "
            f"{now - self.started:.1f}s   "
        )
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def wants_progress(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else bool(progress)
