"""The driver carries out the binding state's instructions on a Dask client."""

from __future__ import annotations

import time
import types
from typing import Any

import torch

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.data import LoaderFeed, SharedFeed
from harmony.runtime.driver import Driver
from harmony.runtime.handoff import LocalResult
from harmony.runtime.hoststore import HostStore
from harmony.runtime.shipping import BatchFiles
from harmony.tasks.binding import BindingState, WorkerLost
from tests.test_binding import job


class RecordingClient:
    """Stands in for a Dask client: records what the driver submits, runs nothing."""

    def __init__(self) -> None:
        self.submitted: list[tuple[str, dict[str, Any]]] = []

    def submit(self, function: Any, *args: Any, key: str, **options: Any) -> Any:
        self.submitted.append((key, options))
        return types.SimpleNamespace(key=key, add_done_callback=lambda callback: None)


def test_a_resident_models_next_task_is_queued_on_its_worker_with_no_scheduler_edge(store: HostStore) -> None:
    batches = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(12)]
    feed = SharedFeed(LoaderFeed(batches, iter(batches[1:]), batches[0], epochs=1, steps=None), starts=[0])
    homed = job(1024, steps=6, step_seconds=0.01, depth=2, home="cpu-0")
    state = BindingState([homed], {"cpu-0": 1 << 20}, homes={0: "cpu-0"})
    client = RecordingClient()
    driver = Driver(client, "run", [store], [BatchFiles(store)], state, [feed], {"cpu-0": "tcp://worker"},  # type: ignore[arg-type]
                    microbatches=1)
    driver._carry_out(state.start())
    keys = [key for key, _ in client.submitted]
    assert keys == ["bwd-m0-p0-s0-run", "bwd-m0-p0-s1-run"], "both open spans go to the worker at once"
    assert [(options["first"], options["steps"]) for _, options in client.submitted] == [(0, 2), (2, 2)]
    assert [options["after"] for _, options in client.submitted] == [[], [LocalResult("bwd-m0-p0-s0-run")]], (
        "the worker orders them, not the scheduler: the second checks that the first ran"
    )
    assert [options["priority"] for _, options in client.submitted] == [0, -1], "the first bound runs first"
    driver.cancel()


def test_a_machine_without_devices_is_waited_for_until_its_timeout_then_its_jobs_fail(
    store: HostStore, monkeypatch: Any
) -> None:
    """Nothing in flight while a machine's jobs wait for its lost devices is not a stalled run: the driver waits
    (DEVICE_TIMEOUT), then fails those jobs alone (it raised at once, in the machine-loss test about half the
    time: when the other machine's jobs had all finished before the timeout)."""
    batches = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(4)]
    feed = SharedFeed(LoaderFeed(batches, iter(batches[1:]), batches[0], epochs=1, steps=None), starts=[0])
    machines = {"a0": "A", "b0": "B"}
    state = BindingState([job(1024, steps=4, machine="B", home="b0")], dict.fromkeys(machines, 1 << 20),
                         homes={0: "b0"}, machines=machines)
    driver = Driver(RecordingClient(), "run", [store], [BatchFiles(store)], state, [feed],  # type: ignore[arg-type]
                    {"a0": "tcp://a", "b0": "tcp://b"}, microbatches=1)
    driver._carry_out(state.start())
    driver._carry_out(state.handle(WorkerLost("b0", 1.0)))
    assert state.stranded("B") == [0] and not state.bound and not state.finished
    monkeypatch.setattr("harmony.runtime.driver.DEVICE_TIMEOUT", 0.2)
    driver._check_progress(None)
    assert not state.finished, "waited for, not failed at once"
    time.sleep(0.3)
    driver._check_progress(None)
    assert state.finished and list(state.failed) == [0]
    assert "every worker of its machine has been lost" in str(state.failed[0]["reason"])
    driver.cancel()
