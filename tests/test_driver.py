"""The driver carries out the binding state's instructions on a Dask client."""

from __future__ import annotations

import types
from typing import Any

import torch

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.data import LoaderFeed, SharedFeed
from harmony.runtime.driver import Driver
from harmony.runtime.handoff import LocalResult
from harmony.runtime.hoststore import HostStore
from harmony.runtime.shipping import BatchFiles
from harmony.tasks.binding import BindingState
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
