"""Steps per task and the cutting of a homed model's steps into spans; packs per task (sections)."""

from __future__ import annotations

from harmony.tasks.amortize import MAX_DEPTH, MAX_SHIPPED_BYTES, Spans, even_sections, pack_sections, steps_per_task


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


def test_spans_cut_the_steps_in_order_and_the_last_span_holds_the_rest() -> None:
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


def test_adaptive_spans_re_cuts_the_spans_not_yet_opened_from_measured_step_times() -> None:
    plan = Spans(1200, depth=150, task_seconds=0.0078, batch_bytes=1_000)
    assert plan.adaptive
    spans = cut(plan, {2: (0.3575, 149)})  # 2.4 ms steps: 0.0078 / (1% of 2.4 ms) is 325, capped at 256
    assert spans == [(0, 150), (150, 150), (300, 256), (556, 256), (812, 256), (1068, 132)]
    slower = cut(Spans(40, depth=10, task_seconds=0.003, batch_bytes=1_000), {1: (0.5, 10)})
    assert slower == [(0, 10), (10, 6), (16, 6), (22, 6), (28, 6), (34, 6)], "50 ms steps: 3 ms over 1% is 6"
    unmeasured = Spans(40, depth=10, task_seconds=0.003, batch_bytes=1_000)
    unmeasured.measured(0.0, 0)
    assert unmeasured.depth == 10, "a first span of one step times nothing (its warm-up is not timed)"


def test_spans_of_unknown_length_are_cut_full_until_the_loader_ends() -> None:
    plan = Spans(None, depth=4, task_seconds=0.003, batch_bytes=1_000)
    assert plan.spans_left() is None and plan.next_span() == (0, 4)
    plan.open(4)
    plan.measured(4.0, 4)  # 1 s steps need no grouping
    assert plan.next_span() == (4, 1)
    plan.open(1)
    plan.end()
    assert plan.steps == 5 and plan.spans_left() == 0 and plan.next_span() == (5, 0)


def test_packs_join_a_section_until_its_forward_is_ten_times_the_task_cost() -> None:
    assert pack_sections([0.1] * 6, 0.003) == (), "long packs run one per task"
    assert pack_sections([0.01] * 10, 0.003) == (0, 3, 6, 9), "3 ms is a tenth of 3 packs' 30 ms"
    assert pack_sections([0.01] * 10, 0.003, share=0.05) == (0, 6), "a twentieth of 6 packs' 60 ms"
    assert pack_sections([1e-6] * 12, 0.003) == (0,), "tiny packs: one task for the whole pass"
    assert pack_sections([1e-6] * 12, 0.003, fewest=4) == (0, 3, 6, 9), "at least one section per device (vpp)"
    assert pack_sections([0.02, 1e-6, 1e-6, 0.02, 1e-6], 0.001) == (0, 1, 4), "a section closes once it is long enough"
    assert pack_sections([1e-6], 0.003) == () and pack_sections([1e-6] * 4, 0.0) == ()
    assert even_sections(7, 3) == (0, 3, 6) and even_sections(7, 1) == () and even_sections(1, 4) == ()
