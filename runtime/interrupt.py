"""Ctrl-C during a run is never lost: one that Python swallows is raised again by the driver's loop.

Python runs the SIGINT handler in the main thread at its next bytecode, whatever it is running, and the handler's
exception (the default handler's KeyboardInterrupt, or whatever a handler of the user's raises: a SystemExit, say)
is raised there. When that is a garbage-collection callback (distributed's scheduler installs one in the process it
runs in, to time collections), the exception is printed as "Exception ignored in" and dropped, and a run of 100,000
epochs goes on as if the user had never pressed Ctrl-C. ``watching_interrupts`` wraps the handler for the run: the
exception it raises is recorded before it is raised as usual, and the driver calls ``raise_if_interrupted`` after
each completed task, so a swallowed one is raised there and the run cleans up as for any other. The user's handler
is called once, as Python would call it; one that raises nothing leaves nothing to raise.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

_pending: list[BaseException] = []  # what a SIGINT's handler raised during the watched block, until raised again

Handler = Callable[[int, FrameType | None], object]


def _recording(handler: Handler) -> Handler:
    """handler, with whatever it raises recorded before it is raised."""

    def handle(signum: int, frame: FrameType | None) -> object:
        try:
            return handler(signum, frame)
        except BaseException as error:
            _pending[:] = [error]
            raise

    return handle


@contextmanager
def watching_interrupts() -> Iterator[None]:
    """Record what SIGINT's handler raises during the block, where this is the main thread and SIGINT has a Python
    handler (Python's default one, or the user's)."""
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    _pending.clear()
    signal.signal(signal.SIGINT, _recording(handler))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        _pending.clear()


def raise_if_interrupted() -> None:
    """Raise again what SIGINT's handler raised during the watched block, if it was swallowed (or this is the first
    place that can see it)."""
    if _pending:
        raise _pending.pop()
