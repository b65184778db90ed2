"""What displays read while a run goes: here, the run's events as the lines the progress display and the page show."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harmony.runtime.view import Latest, RunView, event_line


def test_a_worker_lost_or_joined_a_job_failed_and_models_pruned_are_one_line_each() -> None:
    jobs = [SimpleNamespace(label="model 0 (MLP)"), SimpleNamespace(label="array of models 1-4 (MLP)")]
    lost = {"at": 12.345, "event": "worker lost", "device": "cpu-1", "suspects": [1],
            "jobs redone": {0: "any device", 1: "its evaluation at step 16"}}
    assert event_line(lost, jobs) == (
        "cpu-1's worker was lost 12.3 s into the run, busy with array of models 1-4 (MLP); redoing "
        "model 0 (MLP) on any device, array of models 1-4 (MLP): its evaluation at step 16")
    idle = {**lost, "suspects": [], "jobs redone": {}}
    assert event_line(idle, jobs) == "cpu-1's worker was lost 12.3 s into the run"
    joined = {"at": 20.0, "event": "worker joined", "device": "cpu-1"}
    assert event_line(joined, jobs) == "cpu-1's worker joined 20.0 s into the run"
    failed = {"at": 3.0, "event": "job failed", "job": 0, "step": 2, "reason": "its loss became nan"}
    assert event_line(failed, jobs) == "model 0 (MLP) stopped at step 2 (3.0 s into the run): its loss became nan"
    pruned = {"at": 4.0, "event": "models pruned", "models": [1, 3], "step": 16}
    assert event_line(pruned, jobs) == "models 1, 3 pruned at step 16 (4.0 s into the run)"
    assert event_line({**pruned, "models": [2]}, jobs) == "model 2 pruned at step 16 (4.0 s into the run)"


def test_a_pruned_member_of_an_array_shows_its_figures_of_the_step_it_stopped_at() -> None:
    state = SimpleNamespace(jobs=[SimpleNamespace(members=(3, 4))], steps_trained=[6], pruned_members={0: {1: 2}})
    history = [[0.1 * step, 0.2 * step] for step in range(1, 7)]  # per step, per member
    files = SimpleNamespace(stores=[object()], history=lambda job, steps, first: [
        [row[member] for row in history[first:steps]] for member in (0, 1)])
    validation = [[(step, {"loss": [step * 1.0, step * 2.0]}) for step in (2, 4, 6)]]
    view = RunView(state, files, validation, 0.0)  # type: ignore[arg-type]
    assert view.latest() == [Latest(3, 6, pytest.approx(0.6), 6.0, 6), Latest(4, 2, pytest.approx(0.4), 4.0, 2)]
