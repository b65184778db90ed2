"""The task graph: a span's tasks, their dependencies, who reads each value, Dask keys."""

from __future__ import annotations

from harmony.tasks.graph import (
    BatchInput,
    BatchTargets,
    TaskId,
    consumers,
    dependencies,
    inputs,
    key_attempt,
    span_tasks,
)


def test_span_tasks_and_dependencies() -> None:
    tasks = span_tasks(model=3, packs=3, span=5)
    assert [t.key("r") for t in tasks][:3] == ["fwd-m3-p0-s5-r", "fwd-m3-p1-s5-r", "bwd-m3-p2-s5-r"]
    assert [t.kind for t in tasks] == ["fwd", "fwd", "bwd", "bwd", "bwd"], "one group: bwd applies the update"
    assert dependencies(TaskId("bwd", 3, 1, 5), 3) == [
        TaskId("fwd", 3, 0, 5),
        TaskId("bwd", 3, 2, 5),
        TaskId("bwd", 3, 1, 4),
    ]
    assert dependencies(TaskId("bwd", 3, 1, 5, 1), 3, groups=2)[-1] == TaskId("upd", 3, 1, 4)
    assert dependencies(TaskId("upd", 3, 0, 5), 3, groups=2) == [TaskId("bwd", 3, 0, 5, 0), TaskId("bwd", 3, 0, 5, 1)]
    assert [t.kind for t in span_tasks(3, 3, 5, groups=2)].count("upd") == 3
    assert inputs(TaskId("bwd", 3, 2, 5), 3) == (TaskId("fwd", 3, 1, 5), BatchTargets(3, 5))
    assert inputs(TaskId("fwd", 3, 0, 5), 3) == (BatchInput(3, 5),)


def test_every_value_is_read_by_exactly_its_consumers() -> None:
    packs = 4
    tasks = span_tasks(0, packs, 0)
    reads: dict[object, list[TaskId]] = {}
    for task in tasks:
        for value in inputs(task, packs):
            reads.setdefault(value, []).append(task)
    for value, readers in reads.items():
        assert sorted(readers) == sorted(consumers(value, packs))


def test_dask_groups_keys_by_task_kind() -> None:
    from dask.utils import key_split

    assert key_split(TaskId("fwd", 3, 2, 17).key("a1b2c3")) == "fwd"
    assert key_split(TaskId("upd", 0, 0, 0).key("abcdef")) == "upd"


def test_a_keys_attempt_is_read_back() -> None:
    assert [key_attempt(TaskId("bwd", 3, 2, 17, group).key("a1b2c3", attempt)) for group, attempt in
            ((0, 0), (1, 0), (0, 2), (1, 12))] == [0, 0, 2, 12]


def test_an_overlapped_jobs_updates_are_upd_tasks_that_the_next_step_waits_for() -> None:
    tasks = span_tasks(model=1, packs=3, span=2, overlap=True)
    assert [t.kind for t in tasks] == ["fwd", "fwd", "bwd", "bwd", "bwd", "upd", "upd", "upd"]
    assert dependencies(TaskId("upd", 1, 2, 2), 3, overlap=True) == [TaskId("bwd", 1, 2, 2)]
    assert dependencies(TaskId("fwd", 1, 0, 3), 3, overlap=True) == [TaskId("upd", 1, 0, 2)]


def test_an_update_that_reads_the_whole_step_waits_for_every_bwd_of_it() -> None:
    """fp16's overflow or clipping's norm: each upd of a step waits for every pack's bwd in every group."""
    assert dependencies(TaskId("upd", 1, 0, 2), 3, groups=2, overlap=True, whole_step=True) == [
        TaskId("bwd", 1, pack, 2, group) for pack in range(3) for group in range(2)]
    assert dependencies(TaskId("bwd", 1, 0, 2), 3, overlap=True, whole_step=True) == [
        TaskId("bwd", 1, 1, 2), TaskId("upd", 1, 0, 1)]
    assert dependencies(TaskId("bwd", 1, 2, 3), 3, overlap=True) == [TaskId("fwd", 1, 1, 3), TaskId("upd", 1, 2, 2)]
    assert dependencies(TaskId("bwd", 1, 1, 2), 3, overlap=True)[:2] == [TaskId("fwd", 1, 0, 2), TaskId("bwd", 1, 2, 2)]
    assert consumers(TaskId("upd", 1, 0, 2), 3) == []
