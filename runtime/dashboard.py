"""The Harmony page on the scheduler's dashboard (``/harmony``): what it samples, serves and is fed by the driver.

Each device worker reports its figures as Dask worker metrics (``harmony_budget``, ``harmony_cached``,
``harmony_in``, ``harmony_out``, ``harmony_busy``, ``harmony_threads``: runtime.worker.device_metrics), which travel
with the workers' heartbeats and show in Dask's own worker table; the driver publishes each model's step, loss and
validation loss as scheduler events (topic ``harmony``). A scheduler plugin samples both every second into bounded
series and serves them: ``/harmony`` is a page that draws them (plain SVG, redrawn every second from
``/harmony/data.json``). The routes are added to the scheduler's own HTTP server, so the embedded cluster and a
user's cluster serve them alike while a run is going (the scheduler needs harmony importable); between runs the page
says that none is going.
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Any

from distributed import Scheduler, SchedulerPlugin
from tornado import web
from tornado.ioloop import PeriodicCallback

from harmony.runtime.view import RunView, event_line, finite, model_name

TOPIC = "harmony"
PLUGIN = "harmony-dashboard"
SAMPLES = 900  # seconds of history kept per series
EVENTS = 50  # the latest events the page lists
PAGE = Path(__file__).with_name("dashboard.html")


class DashboardPage(SchedulerPlugin):
    """On the scheduler: samples the devices' metrics and the run's model events each second and serves the page."""

    name = PLUGIN

    def __init__(self, run: str) -> None:
        self.run = run

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.started = time.time()
        self.devices: dict[str, deque[list[float]]] = {}
        self.models: dict[str, deque[list[Any]]] = {}
        self.latest: dict[str, Any] = {}
        application = getattr(scheduler, "http_application", None)
        if application is not None and not getattr(application, "harmony_routes", False):
            application.add_handlers(r".*", [(r"/harmony/?", PageHandler),
                                             (r"/harmony/data\.json", DataHandler, {"scheduler": scheduler})])
            application.harmony_routes = True
        self.sampler = PeriodicCallback(self.sample, 1000)
        self.sampler.start()
        self.sample()

    async def close(self) -> None:
        self.sampler.stop()

    def sample(self) -> None:
        """One sample of every device's figures and of the models' latest event."""
        at = round(time.time() - self.started, 2)
        for worker in self.scheduler.workers.values():
            metrics = worker.metrics
            if "harmony_budget" not in metrics or not metrics["harmony_budget"]:
                continue
            series = self.devices.setdefault(str(worker.name), deque(maxlen=SAMPLES))
            series.append([at, *(metrics.get(f"harmony_{name}", 0) for name in ("budget", "cached", "in", "out",
                                                                                  "busy", "threads"))])
        events = self.scheduler.get_events(TOPIC)
        for _, message in reversed(events):  # type: ignore[arg-type]
            if isinstance(message, dict) and message.get("run") == self.run:
                self.latest = message
                break
        for name, step, loss, val in self.latest.get("models", []):
            self.models.setdefault(name, deque(maxlen=SAMPLES)).append([at, step, loss, val])

    def data(self) -> dict[str, Any]:
        """What the page draws."""
        return {"run": self.run, "seconds": round(time.time() - self.started, 2),
                "devices": {name: list(series) for name, series in self.devices.items()},
                "models": {name: list(series) for name, series in self.models.items()},
                "steps": self.latest.get("steps"), "total": self.latest.get("total"),
                "events": self.latest.get("events", [])}


class PageHandler(web.RequestHandler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(PAGE.read_text())


class DataHandler(web.RequestHandler):
    def initialize(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def get(self) -> None:
        plugin = self.scheduler.plugins.get(PLUGIN)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(plugin.data() if isinstance(plugin, DashboardPage) else {"run": None}))


class Publisher:
    """On the driver: publishes the models' figures for the page about once a second, and when the run is done."""

    def __init__(self, client: Any, run: str, names: list[str] | None, interval: float = 1.0) -> None:
        self.client = client
        self.run = run
        self.names = names
        self.interval = interval
        self.last = -float("inf")

    def __call__(self, view: RunView) -> None:
        now = time.perf_counter()
        if now - self.last < self.interval and not view.state.finished:
            return
        self.last = now
        self.client.log_event(TOPIC, model_snapshot(self.run, view, self.names))


def model_snapshot(run: str, view: RunView, names: list[str] | None) -> dict[str, Any]:
    """What the driver publishes each second: per model its name, step, latest loss and validation loss; the run's
    latest EVENTS events as lines (a device worker lost or joined, a job failed)."""
    models = [[model_name(latest.model, names), latest.steps, finite(latest.loss),
               finite(latest.val_loss)] for latest in view.latest()]
    steps, total = view.state.model_steps()
    events = [event_line(event, view.state.jobs) for event in view.state.events[-EVENTS:]]
    return {"run": run, "models": models, "steps": steps, "total": total, "events": events}
