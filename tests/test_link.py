"""The simulated link: one copy at a time each way, both ways at once."""

from __future__ import annotations

import time

from pytest import approx

from harmony.runtime.link import IN, OUT, Link


def test_copies_the_same_way_share_the_link_and_opposite_ones_do_not() -> None:
    link = Link(bandwidth=1000.0)
    start = time.perf_counter() + 100  # a moment no copy has reached: the schedule alone decides
    assert link.schedule(500, IN, start) == approx(start + 0.5)
    assert link.schedule(500, IN, start) == approx(start + 1.0), "a second copy in waits for the first"
    assert link.schedule(500, OUT, start) == approx(start + 0.5), "a copy out runs beside them"
    assert link.schedule(100, IN, start + 2.0) == approx(start + 2.1), "an idle link starts a copy when it begins"


def test_carry_holds_the_thread_until_the_link_has_carried_the_copy() -> None:
    link = Link(bandwidth=1e6)
    started = time.perf_counter()
    link.carry(20_000, IN, started)
    link.carry(20_000, IN, started)
    assert time.perf_counter() - started >= 0.04
