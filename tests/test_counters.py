"""A device's counters block: the named counters a worker publishes after each task, and what it is busy with,
written at once for a driver that outlives it."""

from __future__ import annotations

from harmony.runtime.counters import NAMES, Counters, block_bytes
from harmony.runtime.hoststore import HostStore


def test_a_worker_marks_its_task_threads_job_and_each_job_updating_beside_it_at_once(store: HostStore) -> None:
    worker = Counters(store.create("counters", block_bytes(4)))
    driver = Counters(store.attach("counters", block_bytes(4)))
    assert driver.busy_jobs() == set()
    worker.mark("executing", 2 + 1)
    worker.updating(0, True)
    worker.updating(3, True)
    worker.updating(3, True)  # two sections of job 3 updating at a time
    assert driver.busy_jobs() == {0, 2, 3}, "read before any publish"
    worker.updating(3, False)
    worker.updating(0, False)
    worker.set("executing", 0)
    assert driver.busy_jobs() == {2, 3}, "executing is cleared at the next publish, job 3 still updates once"
    worker.publish()
    assert driver.busy_jobs() == {3}
    worker.updating(3, False)
    assert driver.busy_jobs() == set()


def test_publishing_the_named_counters_leaves_the_update_marks_alone(store: HostStore) -> None:
    worker = Counters(store.create("counters", block_bytes(2)))
    worker.updating(1, True)
    worker.add("tasks", 5)
    worker.add("p2p", 1 << 40)
    worker.publish()
    seen = Counters(store.attach("counters", block_bytes(2)))
    assert seen.read() == {**dict.fromkeys(NAMES, 0), "tasks": 5, "p2p": 1 << 40}
    assert seen.busy_jobs() == {1}
