"""Where jobs are homed: on machines by their predicted work (and on devices: see test_simulator)."""

from __future__ import annotations

import pytest

from harmony.tasks.homes import assign_machines


def test_jobs_go_longest_first_to_the_machine_that_would_finish_first() -> None:
    homes = assign_machines([8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0], ["a", "b"])
    load = {machine: sum(w for w, m in zip([8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0], homes) if m == machine)
            for machine in "ab"}
    assert load == {"a": 18.0, "b": 18.0}


def test_a_machine_with_more_devices_takes_more_work() -> None:
    work = [1.0] * 12
    homes = assign_machines(work, ["a", "a", "a", "b"])
    assert homes.count("a") == 9 and homes.count("b") == 3


def test_one_machine_takes_everything_and_no_device_is_an_error() -> None:
    assert assign_machines([3.0, 1.0], ["x", "x"]) == ["x", "x"]
    with pytest.raises(ValueError, match="no device"):
        assign_machines([1.0], [])
