"""torch.profiler traces of a device worker's tasks (train's profile_steps): one Chrome trace per device.

The worker records its tasks of the steps after the first (the first compiles, allocates and warms the caches) for
as many steps as asked: each such task runs inside a profiler session of its own, a range named by its Dask key
around the ops it ran (with a GPU's kernels and copies on their streams where the device is one). A session per
task rather than one across tasks: torch's profiler must stop on the thread that started it, and a worker's tasks
change threads (an upd task secedes). The sessions' events share one clock, so the trace is their union, written
to <directory>/profile-<device>.json, readable by its owner alone (chrome://tracing or ui.perfetto.dev open it),
once every model of the run has started a task past those steps on this device, or when the run ends.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function


class TaskProfiler:
    """Profiles one device's tasks of steps [1, 1 + steps) of a run of models jobs, or nothing where directory is
    None."""

    def __init__(self, directory: str | None, steps: int, device: str, cuda: bool, models: int) -> None:
        self.path = None if directory is None or steps < 1 else Path(directory) / f"profile-{device}.json"
        self.stop_step = 1 + steps
        self.activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        self.models = models
        self.past: set[int] = set()  # models that started a task past the profiled steps here
        self.events: list[dict[str, Any]] = []
        self.named: set[tuple[Any, ...]] = set()  # the metadata events kept (process and thread names)
        self.base: int | None = None
        self.private: Path | None = None  # where each session's trace is written, the owner's alone
        self.done = False

    @contextmanager
    def task(self, key: str, model: int, step: int) -> Iterator[None]:
        """Around a task of model at step: recorded, under its key, when its step is one of those profiled."""
        if self.path is None or self.done or step < 1:
            yield
            return
        if step >= self.stop_step:
            self.past.add(model)
            if len(self.past) == self.models:
                self.finish()
            yield
            return
        with profile(activities=self.activities, record_shapes=True) as session, record_function(key):
            yield
        self._keep(session)

    def _keep(self, session: profile) -> None:
        """Add one session's events to the trace (its process and thread names once)."""
        if self.private is None:
            assert self.path is not None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.private = Path(tempfile.mkdtemp(dir=self.path.parent))
        written = self.private / "session.json"
        session.export_chrome_trace(str(written))
        trace = json.loads(written.read_text())
        self.base = trace.get("baseTimeNanoseconds", self.base)
        for event in trace.get("traceEvents", []):
            if event.get("ph") == "M":
                name = (event.get("name"), event.get("pid"), event.get("tid"), json.dumps(event.get("args")))
                if name in self.named:
                    continue
                self.named.add(name)
            self.events.append(event)

    def finish(self) -> None:
        """Write the trace (once; nothing if no task was recorded)."""
        if self.done:
            return
        self.done = True
        try:
            if self.events and self.path is not None and self.private is not None:
                trace = {"schemaVersion": 1, "displayTimeUnit": "ms", "traceEvents": self.events,
                         **({"baseTimeNanoseconds": self.base} if self.base is not None else {})}
                written = self.private / self.path.name
                with os.fdopen(os.open(written, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
                    json.dump(trace, handle)
                os.replace(written, self.path)
        finally:
            self.events = []
            if self.private is not None:
                shutil.rmtree(self.private, ignore_errors=True)
