"""Preloaded by every embedded device worker: import what the first optimizer step needs, in the background.

The first torch optimizer a process builds imports torch._dynamo, which takes a second or two; started
when the worker process starts, the import overlaps with the worker joining the scheduler and the driver
setting up, instead of stalling the run's first update.
"""

from __future__ import annotations

import importlib
import threading


def _import_optimizer_machinery() -> None:
    importlib.import_module("torch._dynamo")


threading.Thread(target=_import_optimizer_machinery, name="harmony-warmup", daemon=True).start()
