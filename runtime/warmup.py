"""Preloaded by every embedded device worker: malloc that keeps freed memory, a watchdog that ends the worker
(and removes the files of its driver's runs) once its driver is gone, and, in the background, the imports the
first optimizer step needs.

The first torch optimizer a process builds imports torch._dynamo, which takes a second or two; started
when the worker process starts, the import overlaps with the worker joining the scheduler and the driver
setting up. A run's setup on the worker waits for it to finish (``wait``), so that it never competes with
the run's first tasks for the interpreter.
"""

from __future__ import annotations

import importlib
import threading

from harmony.runtime.allocator import keep_freed_memory
from harmony.runtime.orphans import sweep, watch_parent


def _import_optimizer_machinery() -> None:
    importlib.import_module("torch._dynamo")


keep_freed_memory()
watch_parent()
WARMUP = threading.Thread(target=_import_optimizer_machinery, name="harmony-warmup", daemon=True)
WARMUP.start()


def dask_teardown(worker: object) -> None:
    """When the worker closes (Dask calls this for a preloaded module): remove the files of runs whose driver is
    gone; a worker closes by itself once its driver's scheduler stops answering."""
    sweep()


def wait() -> None:
    """Return once the background import is done (at once in a process that did not preload this module)."""
    WARMUP.join()
