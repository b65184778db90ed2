"""Ctrl-C is never lost: one that Python swallows is raised again by the driver's loop."""

from __future__ import annotations

import gc
import signal
from collections.abc import Iterator

import pytest

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.interrupt import raise_if_interrupted, watching_interrupts


@pytest.fixture(autouse=True)
def pythons_ctrl_c() -> Iterator[None]:
    """Python's own SIGINT handler, as at a terminal: a suite run in the background of a shell without job control
    (``pytest &``) inherits SIGINT ignored, where the driver has nothing to watch."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def ctrl_c_while_collecting() -> None:
    """A SIGINT that arrives while a garbage collection's callback runs: what its handler raises is dropped there."""

    def interrupted_while_collecting(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            signal.raise_signal(signal.SIGINT)

    gc.callbacks.append(interrupted_while_collecting)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(interrupted_while_collecting)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_that_python_swallows_is_raised_again_by_the_driver_loop() -> None:
    with watching_interrupts():
        ctrl_c_while_collecting()
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
        raise_if_interrupted()  # raised once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_what_a_users_ctrl_c_handler_raises_is_raised_again_where_python_swallowed_it() -> None:
    """The user's handler ends the program with sys.exit while a collection's callback runs: Python drops the
    SystemExit there; the driver's loop raises it again (the handler is called once)."""
    calls: list[int] = []

    def users_handler(signum: int, frame: object) -> None:
        calls.append(signum)
        raise SystemExit(3)

    previous = signal.signal(signal.SIGINT, users_handler)
    try:
        with watching_interrupts():
            ctrl_c_while_collecting()
            with pytest.raises(SystemExit) as raised:
                raise_if_interrupted()
            assert raised.value.code == 3 and calls == [signal.SIGINT]
            raise_if_interrupted()  # raised once
        assert signal.getsignal(signal.SIGINT) is users_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_handler_of_the_users_is_kept() -> None:
    calls: list[int] = []

    def users_handler(signum: int, frame: object) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGINT, users_handler)
    try:
        with watching_interrupts():
            signal.raise_signal(signal.SIGINT)
            raise_if_interrupted()  # the user's handler took it: nothing recorded
        assert calls == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is users_handler
    finally:
        signal.signal(signal.SIGINT, previous)
