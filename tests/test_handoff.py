"""Results handed over between tasks on one worker, with no edge through the scheduler."""

from __future__ import annotations

import time
import types

import pytest
import torch
from distributed import Reschedule

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.handoff import LocalResult, LostResult


def test_a_local_result_is_read_from_the_worker_or_the_reader_comes_back_later(monkeypatch: pytest.MonkeyPatch) -> None:
    states = {"done": "memory", "moved": "released", "queued": "ready", "failed": "error"}
    worker = types.SimpleNamespace(
        data={"done": [torch.ones(2)]},
        state=types.SimpleNamespace(tasks={key: types.SimpleNamespace(state=s) for key, s in states.items()}),
    )
    monkeypatch.setattr(handoff, "get_worker", lambda: worker)
    finished = handoff.FinishedKeys(capacity=2)
    finished.add("done")
    finished.add("moved")
    early: dict[str, float] = {}
    assert handoff.receive("plain", finished, early) == "plain"
    assert handoff.receive(LocalResult("done"), finished, early) is worker.data["done"]
    with pytest.raises(LostResult, match="no longer in this worker's memory"):
        handoff.receive(LocalResult("moved"), finished, early)
    handoff.wait_for(LocalResult("moved"), finished, early)
    for key in ("queued", "not-arrived"):
        with pytest.raises(Reschedule):
            handoff.receive(LocalResult(key), finished, early)
        with pytest.raises(Reschedule):
            handoff.wait_for(LocalResult(key), finished, early)
    with pytest.raises(LostResult, match="failed"):
        handoff.wait_for(LocalResult("failed"), finished, early)
    finished.add("later")
    assert "done" not in finished and "moved" in finished and len(finished) == 2, "the oldest key goes"
    handoff.wait_for(LocalResult("done"), finished, early)  # its result is still in the worker's memory
    with pytest.raises(Reschedule):
        handoff.receive(LocalResult("not-arrived"), finished, early)  # however often it came early before
    early["not-arrived"] = time.monotonic() - handoff.PATIENCE - 1
    with pytest.raises(LostResult, match="never ran"):
        handoff.receive(LocalResult("not-arrived"), finished, early)
