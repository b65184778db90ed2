"""Unit tests of pure planning: layouts, micro-batches, packing, the task graph."""

from __future__ import annotations

import pytest

from harmony.tasks.amortize import MAX_DEPTH, MAX_SHIPPED_BYTES, Spans, steps_per_task
from harmony.tasks.graph import BatchInput, BatchTargets, TaskId, consumers, dependencies, inputs, span_tasks
from harmony.tasks.layout import TensorSpec, lay_out
from harmony.tasks.microbatch import loss_weights, split_sizes
from harmony.tasks.packing import LayerTooLarge, cut_packs
from harmony.tasks.profile import LayerProfile, ModelProfile


def linear(width: int, seconds: float = 1e-6, cut: bool = True) -> LayerProfile:
    return LayerProfile(
        description=f"Linear({width})",
        params=(TensorSpec("weight", "float32", (width, width)), TensorSpec("bias", "float32", (width,))),
        buffers=(),
        input_bytes_per_sample=4 * width,
        output_bytes_per_sample=4 * width,
        forward_seconds_per_sample=seconds,
        cut_before=cut,
    )


def test_layout_packs_tensors_at_natural_alignment_without_padding_between_same_dtypes() -> None:
    layout = lay_out([TensorSpec("a", "float32", (3,)), TensorSpec("b", "float32", (2, 2))])
    assert [slot.offset for slot in layout.slots] == [0, 12]
    assert layout.nbytes == layout.payload_bytes == 28
    mixed = lay_out([TensorSpec("x", "uint8", (3,)), TensorSpec("y", "float64", ())])
    assert [slot.offset for slot in mixed.slots] == [0, 8]
    assert mixed.nbytes == 16


@pytest.mark.parametrize(
    ("batch", "micro", "expected"), [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (3, 4, [1, 1, 1])]
)
def test_split_sizes_are_even_and_cover_the_batch(batch: int, micro: int, expected: list[int]) -> None:
    assert split_sizes(batch, micro) == expected
    assert sum(loss_weights(expected)) == pytest.approx(1.0)


def test_loss_weights_are_sample_fractions() -> None:
    assert loss_weights([3, 1]) == [0.75, 0.25]


def profile(layers: list[LayerProfile]) -> ModelProfile:
    return ModelProfile("model 0 (Test)", tuple(layers))


def test_everything_in_one_pack_when_the_budget_is_large() -> None:
    plan = cut_packs(profile([linear(16)] * 4), budget=10**9, samples=8)
    assert [(p.first, p.stop) for p in plan.packs] == [(0, 4)]


def test_packs_fit_the_budget_with_their_prefetch_buffer() -> None:
    layers = [linear(16)] * 10
    budget = 6000
    plan = cut_packs(profile(layers), budget=budget, samples=4)
    assert len(plan.packs) > 1
    assert plan.packs[0].first == 0 and plan.packs[-1].stop == 10
    assert all(a.stop == b.first for a, b in zip(plan.packs, plan.packs[1:]))
    for pack in plan.packs:
        assert pack.cost.total <= budget
        neighbours = [plan.packs[i].weight_bytes for i in (pack.index - 1, pack.index + 1) if 0 <= i < len(plan.packs)]
        assert pack.cost.prefetch == max(neighbours, default=0)


def test_packs_are_balanced_by_profiled_time() -> None:
    slow, fast = linear(16, seconds=1e-3), linear(16, seconds=1e-6)
    plan = cut_packs(profile([slow, fast, fast, fast, slow, fast]), budget=8000, samples=1)
    times = [p.forward_seconds_per_sample for p in plan.packs]
    assert max(times) < 2.5e-3


def test_no_cut_where_a_layer_input_is_not_a_single_tensor() -> None:
    layers = [linear(16), linear(16, cut=False), linear(16), linear(16, cut=False)]
    plan = cut_packs(profile(layers), budget=9000, samples=1)
    cuts = {p.first for p in plan.packs}
    assert 1 not in cuts and 3 not in cuts


def test_layer_too_large_says_how_many_bytes_it_needs() -> None:
    with pytest.raises(LayerTooLarge) as raised:
        cut_packs(profile([linear(16), linear(64)]), budget=20000, samples=8)
    error = raised.value
    assert error.first == 1
    assert error.need.total > 20000
    assert f"{error.need.total:,} bytes" in str(error)


def test_pack_tensor_names_match_a_sequential_of_its_layers() -> None:
    plan = cut_packs(profile([linear(4)] * 3), budget=10**9, samples=1)
    names = [spec.name for spec in plan.packs[0].weights]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]


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


def test_steps_per_task_keeps_scheduling_near_one_percent_within_its_limits() -> None:
    assert steps_per_task(0.5, 0.003, 1_000, None) == 1, "long steps need no grouping"
    assert steps_per_task(0.010, 0.003, 1_000, None) == 30, "one task of 3 ms over 1% of 10 ms"
    assert steps_per_task(0.010, 0.003, 1_000, None, share=0.02) == 15
    assert steps_per_task(0.0001, 0.003, 1_000, None) == MAX_DEPTH
    assert steps_per_task(0.0001, 0.003, MAX_SHIPPED_BYTES // 4, None) == 4, "at most 64 MiB of batches per task"
    assert steps_per_task(0.0001, 0.003, 1_000, 40) == 10, "at most a quarter of the run"
    assert steps_per_task(0.0001, 0.003, 1_000, 3) == 1
    assert steps_per_task(0.0, 0.003, 1_000, None) == 1, "an unknown step time groups nothing"


def cut(plan: Spans, measurements: dict[int, tuple[float, int]] | None = None) -> list[tuple[int, int]]:
    """Open span after span until the plan has none left; before opening span i, report measurements[i]."""
    spans = []
    while plan.spans_left():
        if measurements and len(spans) in measurements:
            plan.measured(*measurements[len(spans)])
        first, count = plan.next_span()
        spans.append((first, count))
        plan.open(count)
    assert plan.next_span()[1] == 0 and plan.spans_left() == 0
    return spans


def test_a_span_plan_cuts_the_steps_in_order_and_the_last_span_holds_the_rest() -> None:
    assert cut(Spans(10, depth=4)) == [(0, 4), (4, 4), (8, 2)]
    assert cut(Spans(3, depth=1)) == [(0, 1), (1, 1), (2, 1)]
    assert cut(Spans(1030, depth=256)) == [(0, 256), (256, 256), (512, 256), (768, 262)], (
        "a tail shorter than a quarter of the depth (6 steps) joins the last full span")
    assert cut(Spans(1088, depth=256)) == [(0, 256), (256, 256), (512, 256), (768, 256), (1024, 64)], (
        "a quarter of the depth is a span of its own")
    plan = Spans(1030, depth=256)
    assert plan.spans_left() == 4
    fixed = Spans(10, depth=4)
    assert not fixed.adaptive
    assert cut(fixed, {1: (1.0, 1000)}) == [(0, 4), (4, 4), (8, 2)], "without a task cost the depth stays"


def test_an_adaptive_span_plan_re_cuts_the_spans_not_yet_opened_from_measured_step_times() -> None:
    plan = Spans(1200, depth=150, task_seconds=0.0078, batch_bytes=1_000)
    assert plan.adaptive
    spans = cut(plan, {2: (0.3575, 149)})  # 2.4 ms steps: 0.0078 / (1% of 2.4 ms) is 325, capped at 256
    assert spans == [(0, 150), (150, 150), (300, 256), (556, 256), (812, 256), (1068, 132)]
    slower = cut(Spans(40, depth=10, task_seconds=0.003, batch_bytes=1_000), {1: (0.5, 10)})
    assert slower == [(0, 10), (10, 6), (16, 6), (22, 6), (28, 6), (34, 6)], "50 ms steps: 3 ms over 1% is 6"
    unmeasured = Spans(40, depth=10, task_seconds=0.003, batch_bytes=1_000)
    unmeasured.measured(0.0, 0)
    assert unmeasured.depth == 10, "a first span of one step times nothing (its warm-up is not timed)"


def test_a_span_plan_of_unknown_length_cuts_full_spans_until_the_loader_ends() -> None:
    plan = Spans(None, depth=4, task_seconds=0.003, batch_bytes=1_000)
    assert plan.spans_left() is None and plan.next_span() == (0, 4)
    plan.open(4)
    plan.measured(4.0, 4)  # 1 s steps need no grouping
    assert plan.next_span() == (4, 1)
    plan.open(1)
    plan.end()
    assert plan.steps == 5 and plan.spans_left() == 0 and plan.next_span() == (5, 0)
