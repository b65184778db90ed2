"""Dask's active memory manager, stopped on a user's cluster while a run uses it.

The manager drops extra copies of a result (one a task on another device read) from workers it chooses. It does
not know that a task of the worker that made the result reads it there, with no edge through the scheduler
(runtime.handoff), and that task would then find nothing. The embedded cluster runs without the manager; on a
user's cluster the run stops it and starts it again when it ends, if it was running.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from distributed import Client


def _set_running(dask_scheduler: Any, running: bool | None) -> bool | None:
    """On the scheduler: stop (False) or start (True) the active memory manager; returns whether it ran."""
    manager = dask_scheduler.extensions.get("amm")
    if manager is None:
        return None
    was = bool(manager.running)
    if running is False and was:
        manager.stop()
    elif running and not was:
        manager.start()
    return was


@contextlib.contextmanager
def replicas_kept(client: Client) -> Iterator[None]:
    """No copy of a result is dropped while the block runs; the manager is as it was afterwards."""
    was = client.run_on_scheduler(_set_running, running=False)
    try:
        yield
    finally:
        if was:
            with contextlib.suppress(Exception):
                client.run_on_scheduler(_set_running, running=True)
