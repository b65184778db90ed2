"""Unit tests of the late-binding state machine, run without any cluster."""

from __future__ import annotations

from harmony.tasks.binding import BindingState, ModelWork
from harmony.tasks.graph import BatchInput, TaskId


def drive(state: BindingState, steps: dict[int, int], order: list[tuple[TaskId, str]]) -> None:
    """Play the driver: feed batches, bind on every device, complete tasks in binding order."""
    in_flight: list[TaskId] = []
    while not state.finished:
        for model, step in state.wanted_batches():
            if step < steps[model]:
                state.add_batch(model, step)
            else:
                state.end_of_data(model)
        for device in state.devices:
            while (task := state.bind(device)) is not None:
                in_flight.append(task)
                order.append((task, device))
        if not in_flight and state.finished:
            break
        assert in_flight, "the binder stalled"
        state.complete(in_flight.pop(0))


def test_runs_every_task_once_in_dependency_order() -> None:
    state = BindingState([ModelWork((100, 100, 100))], {"cpu-0": 10_000})
    order: list[tuple[TaskId, str]] = []
    drive(state, {0: 2}, order)
    tasks = [task for task, _ in order]
    assert len(tasks) == len(set(tasks)) == 2 * (2 + 3), "one group: each bwd applies its pack's update"
    position = {task: i for i, task in enumerate(tasks)}
    assert position[TaskId("bwd", 0, 2, 0)] > position[TaskId("fwd", 0, 1, 0)]
    assert position[TaskId("fwd", 0, 0, 1)] > position[TaskId("bwd", 0, 0, 0)]
    assert state.steps_done == [2]


def test_with_one_group_the_next_step_waits_for_the_backward_that_updated_the_pack() -> None:
    """A model with one micro-batch group, resident or swapped, updates inside its bwd: the next step's tasks
    of a pack depend on that bwd, and a step has no upd tasks; with vDP groups an upd reduces them first."""
    works = [ModelWork((100,)), ModelWork((100, 100)), ModelWork((100, 100), groups=2)]
    state = BindingState(works, {"cpu-0": 10_000, "cpu-1": 10_000}, homes={0: "cpu-0"})
    assert state.dependencies(TaskId("bwd", 0, 0, 3)) == [TaskId("bwd", 0, 0, 2)]
    assert state.dependencies(TaskId("fwd", 1, 0, 3)) == [TaskId("bwd", 1, 0, 2)]
    assert state.dependencies(TaskId("bwd", 1, 1, 3)) == [TaskId("fwd", 1, 0, 3), TaskId("bwd", 1, 1, 2)]
    assert state.dependencies(TaskId("fwd", 2, 0, 3, 1)) == [TaskId("upd", 2, 0, 2)]
    assert state.dependencies(TaskId("upd", 2, 1, 3)) == [TaskId("bwd", 2, 1, 3, 0), TaskId("bwd", 2, 1, 3, 1)]
    order: list[tuple[TaskId, str]] = []
    drive(state, {0: 3, 1: 3, 2: 3}, order)
    assert state.steps_done == [3, 3, 3]
    kinds = {model: sorted({task.kind for task, _ in order if task.model == model}) for model in range(3)}
    assert kinds == {0: ["bwd"], 1: ["bwd", "fwd"], 2: ["bwd", "fwd", "upd"]}
    position = {task: i for i, (task, _) in enumerate(order)}
    assert all(position[TaskId("bwd", 0, 0, s + 1)] > position[TaskId("bwd", 0, 0, s)] for s in range(2))
    assert all(position[TaskId("fwd", 1, 0, s + 1)] > position[TaskId("bwd", 1, 0, s)] for s in range(2))


def test_models_are_interleaved_not_run_one_after_another() -> None:
    state = BindingState([ModelWork((10, 10)), ModelWork((10, 10))], {"cpu-0": 10_000}, slots_per_device=1)
    order: list[tuple[TaskId, str]] = []
    drive(state, {0: 3, 1: 3}, order)
    first_of_model_1 = next(i for i, (task, _) in enumerate(order) if task.model == 1)
    last_of_model_0 = max(i for i, (task, _) in enumerate(order) if task.model == 0)
    assert first_of_model_1 < last_of_model_0 / 3


def test_a_device_prefers_the_task_whose_pack_it_holds() -> None:
    state = BindingState([ModelWork((10, 10)), ModelWork((10, 10))], {"a": 1000, "b": 1000}, slots_per_device=1)
    state.add_batch(0, 0)
    state.add_batch(1, 0)
    first = state.bind("a")
    assert first is not None
    state.bind("b")
    state.complete(first)
    pack = (first.model, first.pack)
    assert pack in state.devices["a"].resident
    follow = state.bind("a")
    assert follow is not None
    assert (follow.model, follow.pack) == (first.model, first.pack + 1)


def test_values_are_released_once_their_readers_finish() -> None:
    state = BindingState([ModelWork((10, 10))], {"cpu-0": 1000}, slots_per_device=1)
    state.add_batch(0, 0)
    released = []
    while True:
        task = state.bind("cpu-0")
        if task is None:
            break
        released += state.complete(task)
    assert BatchInput(0, 0) in released
    assert TaskId("fwd", 0, 0, 0) in released
    assert not state.readers


def test_at_most_two_steps_of_a_model_are_open() -> None:
    state = BindingState([ModelWork((10,))], {"cpu-0": 1000})
    assert state.wanted_batches() == [(0, 0), (0, 1)], "both first steps may open at once"
    state.add_batch(0, 0)
    assert state.wanted_batches() == [(0, 1)]
    state.add_batch(0, 1)
    assert state.wanted_batches() == []
    bwd = state.bind("cpu-0")
    assert bwd == TaskId("bwd", 0, 0, 0)
    state.complete(bwd)
    assert state.wanted_batches() == [(0, 2)]
    state.complete(state.bind("cpu-0"))  # step 1 ends before the driver has opened step 2
    assert state.wanted_batches() == [(0, 2), (0, 3)]


def test_sharded_lrtf_serves_the_model_with_the_longest_remaining_time() -> None:
    works = [ModelWork((10,), steps=4, step_seconds=1.0), ModelWork((10,), steps=4, step_seconds=5.0)]
    state = BindingState(works, {"cpu-0": 1000}, slots_per_device=1, policy="lrtf")
    state.add_batch(0, 0)
    state.add_batch(1, 0)
    assert state.bind("cpu-0") == TaskId("bwd", 1, 0, 0)
    robin = BindingState(works, {"cpu-0": 1000}, slots_per_device=1, policy="round_robin")
    robin.add_batch(0, 0)
    robin.add_batch(1, 0)
    assert robin.bind("cpu-0") == TaskId("bwd", 0, 0, 0)


def test_lrtf_lets_all_models_finish_close_together() -> None:
    """Three short models and one long one on two devices: LRTF starts the long one first and keeps it
    going, so the spread of finishing times is smaller than under round-robin."""
    from harmony.tasks.simulator import Hardware, simulate
    from tests.test_simulator import chain_plan

    plans = [chain_plan(layers=2, seconds=1e-3)] * 3 + [chain_plan(layers=2, seconds=4e-3)]
    steps = [6, 6, 6, 6]
    spreads = {}
    for policy in ("lrtf", "round_robin"):
        run = simulate(plans, steps, [8] * 4, {"a": 10**9, "b": 10**9}, Hardware(task_overhead=0.0), policy=policy)
        finish = [max(end for task, (_, end) in run.times.items() if task.model == m) for m in range(4)]
        spreads[policy] = (max(finish) - min(finish), max(finish))
    assert spreads["lrtf"][1] <= spreads["round_robin"][1]
    assert spreads["lrtf"][0] < spreads["round_robin"][0]


def test_a_resident_models_spans_are_re_cut_as_their_step_time_is_measured() -> None:
    """The state counts spans as its steps: a measurement re-cuts the spans not yet opened and the total."""
    work = ModelWork((10,), steps=40, step_seconds=0.05, depth=10, task_seconds=0.003, batch_bytes=100)
    state = BindingState([work], {"cpu-0": 1000}, homes={0: "cpu-0"})
    assert state.total_steps(0) == 4 and state.wanted_batches() == [(0, 0), (0, 1)]
    for span in (0, 1):
        first, count = state.next_span(0)
        assert (first, count) == (10 * span, 10)
        state.add_batch(0, span, count)
    assert state.span(0, 1) == (10, 10), "an open span's first training step and length"
    state.complete(state.bind("cpu-0"))
    assert state.span(0, 0) is None, "a finished span is forgotten"
    assert state.steps_done == [1] and state.trained == [10]
    assert state.remaining_seconds(0) == 30 * 0.05
    state.measured(0, 0.5, 10)  # 50 ms steps: 6 steps per task for the 20 steps not yet opened
    assert state.total_steps(0) == 2 + 4 and state.next_span(0) == (20, 6)
    spans = []
    while not state.finished:
        for _, span in state.wanted_batches():
            first, count = state.next_span(0)
            spans.append((first, count))
            state.add_batch(0, span, count)
        state.complete(state.bind("cpu-0"))
    assert spans == [(20, 6), (26, 6), (32, 6), (38, 2)] and state.trained == [40] and state.steps_done == [6]


def test_a_model_stepping_one_step_per_task_has_no_spans() -> None:
    state = BindingState([ModelWork((10,), steps=4, step_seconds=0.05)], {"cpu-0": 1000}, homes={0: "cpu-0"})
    state.add_batch(0, 0)
    assert state.span(0, 0) is None
