"""Ctrl-C during a run is never lost: one that Python swallows is raised again by the driver's loop.

Python delivers SIGINT by raising KeyboardInterrupt in the main thread at its next bytecode, whatever it is
running. When that is a garbage-collection callback (distributed installs one to time collections), the
exception is printed as "Exception ignored in" and dropped, and a run of 100,000 epochs goes on as if the
user had never pressed Ctrl-C. ``watching_interrupts`` records every SIGINT during a run before raising it
as usual, and the driver calls ``raise_if_interrupted`` after each completed task, so a swallowed one is
raised there and the run cleans up as for any KeyboardInterrupt. A handler the user installed is kept.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_pending = threading.Event()


def _record_and_raise(signum: int, frame: FrameType | None) -> None:
    _pending.set()
    raise KeyboardInterrupt


@contextmanager
def watching_interrupts() -> Iterator[None]:
    """Record SIGINT for the block, where this is the main thread and SIGINT has Python's default handler."""
    watch = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    if not watch:
        yield
        return
    _pending.clear()
    signal.signal(signal.SIGINT, _record_and_raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _pending.clear()


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt if SIGINT arrived during the watched block (and was swallowed, or this is
    the first place that can see it)."""
    if _pending.is_set():
        _pending.clear()
        raise KeyboardInterrupt
