"""The schedule simulator: memory replay with the device cache's rules, refusals, and time prediction."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from harmony.tasks.graph import TaskId, span_tasks
from harmony.tasks.layout import TensorSpec
from harmony.tasks.packing import Packing, cut_packs
from harmony.tasks.profile import LayerProfile, ModelProfile
from harmony.tasks.simulator import (
    Hardware,
    MemoryReport,
    ScheduleExceedsBudget,
    Simulation,
    boundary_bytes,
    fit_least,
    pack_tasks,
    replay_memory,
    simulate,
)
from harmony.tasks.work import task_seconds, update_seconds


def chain_packing(layers: int = 4, width: int = 16, seconds: float = 1e-4, budget: int = 10**9) -> Packing:
    layer = LayerProfile(
        description="Linear",
        params=(TensorSpec("weight", "float32", (width, width)),),
        buffers=(),
        input_bytes_per_sample=4 * width,
        output_bytes_per_sample=4 * width,
        forward_seconds_per_sample=seconds,
    )
    return cut_packs(ModelProfile("m", (layer,) * layers), budget, samples=4)


def test_replay_counts_swaps_and_peaks_like_the_cache() -> None:
    packing = chain_packing(layers=4, budget=6000)
    assert len(packing.packs) == 4
    order = {"d": [t for s in range(2) for t in span_tasks(0, 4, s)]}
    report = replay_memory(order, [packing], {"d": 6000})
    w = packing.packs[0].weight_bytes
    assert report.grads_out == 2 * 4 * w
    assert 2 * 4 * w <= report.weights_in <= 2 * 7 * w
    assert report.peak["d"] <= 6000


def test_replay_refuses_a_schedule_over_budget_naming_the_task_and_bytes() -> None:
    packing = chain_packing(layers=2, budget=10**9)
    with pytest.raises(ScheduleExceedsBudget) as raised:
        replay_memory({"d": span_tasks(0, len(packing.packs), 0)}, [packing], {"d": 1000})
    error = raised.value
    assert error.task == TaskId("bwd", 0, 0, 0) and error.need == packing.packs[0].weight_bytes
    assert "needs" in str(error) and "1,000-byte budget" in str(error)


def test_simulation_runs_every_task_and_predicts_link_cost() -> None:
    packing = chain_packing(layers=6, budget=7000)
    fast = simulate([packing], [3], [8], {"d": 7000}, Hardware(task_overhead=0.0))
    slow = simulate([packing], [3], [8], {"d": 7000}, Hardware(task_overhead=0.0, host_link=1e6), prefetch=False)
    hidden = simulate([packing], [3], [8], {"d": 7000}, Hardware(task_overhead=0.0, host_link=1e6), prefetch=True)
    assert sum(len(tasks) for tasks in fast.order.values()) == 3 * (2 * len(packing.packs) - 1), "bwd applies updates"
    assert fast.makespan < hidden.makespan <= slow.makespan
    assert replay_memory(fast.order, [packing], {"d": 7000}).peak["d"] <= 7000


def test_single_pack_models_are_homed_where_their_whole_state_fits() -> None:
    from harmony.tasks.homes import choose_homes, homed_bytes

    small = chain_packing(layers=2)
    split = chain_packing(layers=4, budget=6000)
    need = homed_bytes(small, 2.0)
    homes, room = choose_homes([small, small, split], [2.0, 2.0, 1.0], {"a": need + 10**4, "b": need + 10**4},
                               floors=[0, 0, 6000])
    assert set(homes) == {0, 1} and homes[0] != homes[1]
    assert all(left >= 6000 for left in room.values())
    assert choose_homes([small], [2.0], {"a": need - 1}, floors=[0]) == ({}, {"a": need - 1})
    assert choose_homes([small, split], [2.0, 1.0], {"a": need + 100}, floors=[0, 6000])[0] == {}


def test_replay_keeps_a_boundary_for_the_task_that_reads_it_next_where_it_fits() -> None:
    packing = chain_packing(layers=4, budget=6000)
    order = {"d": span_tasks(0, 4, 0)}
    boundary = packing.packs[1].input_bytes_per_sample * 2
    roomy = replay_memory(order, [packing], {"d": 10**6}, microbatch_samples=[[2, 2]])
    # fwd 0 -> fwd 1 -> fwd 2 -> bwd 3 hand over outputs; bwd 3 -> bwd 2 -> bwd 1 -> bwd 0 hand over gradients.
    assert roomy.kept == 2 * (3 + 3) * boundary
    assert roomy.peak["d"] > replay_memory(order, [packing], {"d": 10**6}).peak["d"]
    interleaved = {"d": [t for pair in zip(span_tasks(0, 4, 0), span_tasks(1, 4, 0)) for t in pair]}
    assert replay_memory(interleaved, [packing, packing], {"d": 10**6}, microbatch_samples=[[2, 2]] * 2).kept == 0, (
        "a boundary outlived a task that was not its consumer")
    tight = replay_memory(order, [packing], {"d": 6000}, microbatch_samples=[[2, 2]])
    assert tight.peak["d"] <= 6000


def test_overlapped_updates_hide_behind_earlier_packs_backward_unless_the_host_shares_the_devices_cores() -> None:
    packing = chain_packing(layers=6, budget=7000)
    slow_optimizer = {"task_overhead": 1e-4, "optimizer_bytes_per_second": 2e6}
    for shared in (False, True):
        hardware = Hardware(shared_cores=shared, **slow_optimizer)
        inline = simulate([packing], [3], [8], {"d": 7000}, hardware)
        beside = simulate([packing], [3], [8], {"d": 7000}, hardware, overlap=[True])
        updates = [task for task in beside.order["d"] if task.kind == "upd"]
        assert len(updates) == 3 * len(packing.packs)
        for task in updates:
            start, _ = beside.times[task]
            assert start >= beside.times[TaskId("bwd", 0, task.pack, task.span)][1], "an update before its backward"
        if shared:
            assert beside.makespan >= inline.makespan, "on the devices' own cores nothing hides"
        else:
            assert beside.makespan < 0.85 * inline.makespan, "the updates of later packs hide behind earlier backward"
            next_forward = beside.times[TaskId("fwd", 0, 0, 1)][0]
            assert next_forward >= beside.times[TaskId("upd", 0, 0, 0)][1], "a step read weights not yet updated"


def test_a_task_of_several_packs_is_predicted_and_replayed_pack_by_pack() -> None:
    """A section's task costs its packs' compute (bwd: their inputs recomputed first) plus one task overhead, its
    weights are swapped one pack after another within the budget, and a pass has one task per section."""
    packing = chain_packing(layers=6, budget=7000)
    packs = len(packing.packs)
    assert packs == 6
    assert pack_tasks(TaskId("bwd", 0, 1, 2), (0, 2, 5), packs) == [
        TaskId("fwd", 0, 2, 2), TaskId("fwd", 0, 3, 2), TaskId("bwd", 0, 4, 2), TaskId("bwd", 0, 3, 2),
        TaskId("bwd", 0, 2, 2)]
    assert pack_tasks(TaskId("fwd", 0, 0, 2), (0, 2, 5), packs) == [TaskId("fwd", 0, 0, 2), TaskId("fwd", 0, 1, 2)]
    forward = packing.packs[0].forward_seconds_per_sample * 8
    hardware = Hardware(task_overhead=0.01)
    assert task_seconds(TaskId("bwd", 0, 0, 0), packing, 8, hardware, range(0, 3)) == pytest.approx(11 * forward)
    single = simulate([packing], [3], [8], {"d": 7000}, hardware)
    sectioned = simulate([packing], [3], [8], {"d": 7000}, hardware, sections=[(0, 3)])
    assert len(sectioned.order["d"]) == 3 * 3, "a step: one fwd section, two bwd sections"
    assert sectioned.makespan < single.makespan, "fewer task costs, a little more compute"
    report = replay_memory(sectioned.order, [packing], {"d": 7000}, sections=[(0, 3)],
                           microbatch_samples=[[4, 4]])
    assert report.peak["d"] <= 7000
    assert report.grads_out == 3 * sum(pack.grad_bytes for pack in packing.packs)
    assert report.weights_in >= 3 * sum(pack.weight_bytes for pack in packing.packs)


def test_a_section_that_recomputes_its_inputs_copies_its_inner_packs_inputs_out_and_in_again() -> None:
    """The whole pass as one bwd task, stash off, prefetch off, one pack's weights cached at a time: its copies are
    every load's weights in, every pack's gradients out, and its inner packs' inputs out before the forward that may
    change them and in again for their backward (runtime.bodies, again): halving the link's speed adds half of
    exactly those bytes."""
    packing = chain_packing(layers=6, budget=7000)
    packs = len(packing.packs)
    task = TaskId("bwd", 0, 0, 0)
    loads = [part.pack for part in pack_tasks(task, (0,), packs)]
    moved = (sum(packing.packs[pack].weight_bytes for pack in loads) + sum(p.grad_bytes for p in packing.packs)
             + 2 * sum(boundary_bytes(TaskId("bwd", 0, pack, 0), packing, 8) for pack in range(1, packs - 1)))
    link = 1e6
    fast, slow = (simulate([packing], [1], [8], {"d": 1500}, Hardware(task_overhead=0.0, host_link=speed),
                           prefetch=False, sections=[(0,)], stash=False) for speed in (2 * link, link))
    seconds = [run.times[task][1] - run.times[task][0] for run in (fast, slow)]
    assert seconds[1] - seconds[0] == pytest.approx(moved / (2 * link))


def test_a_sections_replay_keeps_what_the_section_itself_reads_later() -> None:
    """In the bwd of a section that is not a pass's last, the upstream gradient kept for it survives the forwards that
    recompute its packs' inputs, and the recomputed input of its last pack is kept for that pack's backward: every
    boundary of one step is taken on the device (12 of them, per micro-batch), none copied in again."""
    packing = chain_packing(layers=6, budget=7000)
    order = {"d": [TaskId("fwd", 0, 0, 0), TaskId("bwd", 0, 1, 0), TaskId("bwd", 0, 0, 0)]}
    report = replay_memory(order, [packing], {"d": 10**6}, microbatch_samples=[[4, 4]], sections=[(0, 3)])
    boundary = packing.packs[1].input_bytes_per_sample * 4
    assert report.kept == 12 * 2 * boundary


def test_boundary_copies_of_every_micro_batch_but_the_first_in_and_the_last_out_hide_behind_the_tasks_compute(
) -> None:
    """With prefetch=True a task's boundary values of micro-batches 2..M come in, and those of 1..M-1 go out, while
    its compute runs (runtime.cache: ahead, send); with prefetch="weights" every one waits. A fwd task whose input its
    predecessor left on the device sends its output: M = 4 micro-batches hide 3/4 of it behind compute longer than
    that; with one micro-batch nothing hides."""
    packing = chain_packing(layers=6, seconds=1e-3, budget=7000)
    link = 1e6
    hardware = Hardware(task_overhead=0.0, host_link=link)
    for samples, hidden in ((16, 0.75), (4, 0.0)):
        ahead, waiting = (simulate([packing], [1], [samples], {"d": 7000}, hardware, prefetch=prefetch)
                          for prefetch in (True, "weights"))
        assert ahead.order == waiting.order
        for pack in range(1, len(packing.packs) - 1):
            task = TaskId("fwd", 0, pack, 0)
            boundary = boundary_bytes(task, packing, samples) / link
            assert packing.packs[pack].forward_seconds_per_sample * samples > boundary, "compute covers the copies"
            seconds = [run.times[task][1] - run.times[task][0] for run in (ahead, waiting)]
            assert seconds[1] - seconds[0] == pytest.approx(hidden * boundary)


def test_an_update_on_the_device_costs_its_state_over_the_link_and_the_optimizer_at_the_devices_speed() -> None:
    """A bwd task that updates on its device is predicted with the optimizer's passes at the device's compute scale
    and the state in and out over the link (the weights out take the gradients' place); its replay holds the state
    beside the pack's weights and gradients and counts the weights out instead of the gradients."""
    packing = chain_packing(layers=6, budget=7000)
    link, rate, scale = 1e6, 2e6, 50.0
    hardware = Hardware(task_overhead=0.0, host_link=link, optimizer_bytes_per_second=rate, compute_scale=scale)
    host = simulate([packing], [1], [8], {"d": 7000}, hardware, prefetch=False)
    every = tuple(range(len(packing.packs)))
    device = simulate([packing], [1], [8], {"d": 7000}, hardware, prefetch=False, device_updates=[every])
    first = simulate([packing], [1], [8], {"d": 7000}, hardware, prefetch=False, device_updates=[(0,)])
    for pack in packing.packs:
        task = TaskId("bwd", 0, pack.index, 0)
        seconds = [run.times[task][1] - run.times[task][0] for run in (host, device)]
        update = 4 * pack.float_bytes / rate
        assert seconds[1] - seconds[0] == pytest.approx(update / scale - update + 2 * 2 * pack.grad_bytes / link)
    for task in (TaskId("fwd", 0, 0, 0), TaskId("fwd", 0, 1, 0)):
        assert host.times[task][1] - host.times[task][0] == device.times[task][1] - device.times[task][0]
    host_s, device_s, first_s = ([run.times[TaskId("bwd", 0, pack, 0)][1] - run.times[TaskId("bwd", 0, pack, 0)][0]
                                  for pack in (0, 1)] for run in (host, device, first))
    assert first_s == pytest.approx([device_s[0], host_s[1]]), "pack 0 on the device, pack 1 on the host"
    order = {"d": span_tasks(0, len(packing.packs), 0)}
    inline = replay_memory(order, [packing], {"d": 10**6})
    there = replay_memory(order, [packing], {"d": 10**6}, device_updates={0: every})
    grads = sum(pack.grad_bytes for pack in packing.packs)
    assert (inline.grads_out, inline.weights_out) == (grads, 0) and (there.grads_out, there.weights_out) == (0, grads)
    wide = chain_packing(layers=3, width=32, budget=20_000)  # a state larger than a micro-batch's activations
    order = {"d": span_tasks(0, len(wide.packs), 0)}
    held = max(pack.cost.weights + pack.cost.grads + 2 * pack.grad_bytes for pack in wide.packs)
    assert replay_memory(order, [wide], {"d": held - 1}).peak["d"] < held
    updated = {0: tuple(range(len(wide.packs)))}
    with pytest.raises(ScheduleExceedsBudget, match="more bytes"):
        replay_memory(order, [wide], {"d": held - 1}, device_updates=updated)
    assert replay_memory(order, [wide], {"d": held}, device_updates=updated).peak["d"] == held


def test_the_runtimes_work_per_update_lengthens_a_swapped_packs_bwd_that_updates_but_not_a_homed_step() -> None:
    """Hardware.update_call_seconds: a swapped pack's bwd that updates, on the host store or on its device, takes
    it more; a homed step (the model's own optimizer over its module, timed by the planner) nothing more."""
    packing = chain_packing(layers=6, budget=7000)
    plain = Hardware(task_overhead=0.0, host_link=1e6, optimizer_bytes_per_second=2e6)
    costly = dataclasses.replace(plain, update_call_seconds=0.01)
    every = tuple(range(len(packing.packs)))

    def seconds(hardware: Hardware, **options: Any) -> list[float]:
        run = simulate([packing], [1], [8], {"d": 7000}, hardware, prefetch=False, **options)
        return [run.times[TaskId("bwd", 0, pack, 0)][1] - run.times[TaskId("bwd", 0, pack, 0)][0] for pack in every]

    assert seconds(costly) == pytest.approx([second + 0.01 for second in seconds(plain)])
    assert seconds(costly, device_updates=[every]) == pytest.approx(
        [second + 0.01 for second in seconds(plain, device_updates=[every])])
    single = chain_packing(layers=2)
    homed = [simulate([single], [1], [8], {"d": 10**9}, hardware, homes={0: "d"}).makespan
             for hardware in (plain, costly)]
    assert homed[0] == homed[1]


def test_a_section_whose_later_packs_stashes_are_predicted_recomputes_none_of_their_inputs() -> None:
    """Six one-layer packs in two sections ([0, 1, 2], [3, 4, 5]): the first section's bwd recomputes the inputs of
    packs 1 and 2 (the forwards of packs 0 and 1) unless both their stashes are on the device, with the room its
    backward needs beside them. With room for every stash, a step saves those 2 forwards beside the 5 packs' own;
    with room for packs 3 and 4 only, their 2; with room for one micro-batch of pack 4's two, half its forward."""
    packing = chain_packing(layers=6, budget=7000)
    assert len(packing.packs) == 6
    forward = packing.packs[0].forward_seconds_per_sample * 8
    hardware = Hardware(task_overhead=0.0)
    for budget, saved in ((10**6, 5 + 2), (4096 + 2 * 1024, 2), (4096 + 512, 0.5), (4096 + 512 - 1, 0)):
        runs = [simulate([packing], [3], [8], {"d": budget}, hardware, sections=[(0, 3)], stash=stash)
                for stash in (False, True)]
        assert runs[0].makespan - runs[1].makespan == pytest.approx(3 * saved * forward), budget


def test_a_backward_whose_stash_is_predicted_on_the_device_does_not_recompute_its_forward() -> None:
    """A pack's stash is half its workspace less its largest weight per micro-batch (here 2 x 512 bytes) and a
    backward first holds its weights, gradients and workspace (4,096): each 512 bytes of room beside that keep one
    more micro-batch's stash, the last fwd's first, each saving its half of the pack's forward; with none, every pack
    recomputes."""
    packing = chain_packing(layers=6, budget=7000)
    forward = packing.packs[0].forward_seconds_per_sample * 8
    hardware = Hardware(task_overhead=0.0)
    assert packing.packs[0].stash_bytes == (2048 - 1024) // 2 and packing.microbatch_samples == 4
    for budget, halves, stashed in ((10**6, 10, range(5)), (4096 + 5 * 1024, 10, range(5)),
                                    (4096 + 2 * 1024 + 512, 5, (2, 3, 4)), (4096 + 2 * 1024, 4, (3, 4)),
                                    (4096 + 1024, 2, (4,)), (4096 + 512, 1, (4,)), (4096 + 512 - 1, 0, ())):
        recomputing = simulate([packing], [3], [8], {"d": budget}, hardware, stash=False)
        stashing = simulate([packing], [3], [8], {"d": budget}, hardware)
        assert recomputing.makespan - stashing.makespan == pytest.approx(3 * halves * forward / 2), budget
        assert stashing.stashed == ({0: set(stashed)} if stashed else {})
    roomy = simulate([packing], [3], [8], {"d": 10**6}, hardware)
    start, end = roomy.times[TaskId("bwd", 0, 2, 1)]
    update = update_seconds(packing, range(2, 3), hardware)
    assert end - start == pytest.approx(2 * forward + update), "a backward without its recompute, and its update"


def test_the_memory_replay_keeps_the_stashes_the_plan_makes() -> None:
    """Six one-layer packs, two micro-batches of 4 samples, packs 0-4 stashing 512 bytes each per micro-batch
    (Pack.stash_bytes): with room for all, the last pack's backward runs beside all ten, the peak that much higher
    and the weights copied the same; with room for the stashes but not for caching every pack's weights too, more
    weights come in again. In two sections ([0, 1, 2], [3, 4, 5]), the first one's bwd, its later packs stashed,
    recomputes no input: the two boundaries per micro-batch that its forwards kept on the device are not made."""
    packing = chain_packing(layers=6, budget=7000)
    stash, boundary = packing.packs[0].stash_bytes, 4 * 4 * 16
    microbatches = [[packing.microbatch_samples] * 2]
    every = {0: (0, 1, 2, 3, 4)}

    def replay(budget: int, stashes: dict[int, tuple[int, ...]] | None = None, sectioned: bool = False
               ) -> MemoryReport:
        tasks = 2 if sectioned else 6
        order = {"d": span_tasks(0, tasks, 0) + span_tasks(0, tasks, 1)}
        return replay_memory(order, [packing], {"d": budget}, microbatch_samples=microbatches,
                             sections=[(0, 3)] if sectioned else None, stashes=stashes)

    recomputing, stashing = replay(10**6), replay(10**6, every)
    assert stashing.peak["d"] - recomputing.peak["d"] == 5 * 2 * stash
    assert stashing.weights_in == recomputing.weights_in
    tight = 4096 + 5 * 1024
    recomputing, stashing = replay(tight), replay(tight, every)
    assert stashing.peak["d"] <= tight and stashing.weights_in > recomputing.weights_in
    recomputing = replay(10**6, sectioned=True)
    assert replay(10**6, every, sectioned=True).kept == recomputing.kept - 2 * 2 * 2 * boundary
    assert replay(10**6, {0: (0, 1, 3, 4)}, sectioned=True).kept == recomputing.kept, "pack 2 recomputes its input"


def test_a_section_takes_its_later_packs_stashes_at_once_only_with_room_for_its_backward_and_device_state() -> None:
    """The first section's bwd of six packs in two sections finds packs 1 and 2's stashes (2 micro-batches each):
    it takes them only where its largest pack's backward (weights, gradients, workspace: 4,096 bytes), and, where
    its optimizer steps on the device, that pack's state (2 x its gradients), fit beside them, as the runtime
    counts (runtime.bodies._backward_bytes)."""
    from harmony.tasks.memory import DeviceMemory
    from harmony.tasks.simulator import _stash_key, _taken_together

    packing = chain_packing(layers=6, budget=7000)
    task, stash = TaskId("bwd", 0, 0, 0), packing.packs[0].stash_bytes
    stashes = 2 * 2 * stash
    for updated, room in (((), 4096), ((0, 1, 2), 4096 + 2 * 1024)):
        for budget, taken in ((stashes + room, True), (stashes + room - 1, False)):
            memory = DeviceMemory("d", budget)
            for pack in (1, 2):
                for index in (0, 1):
                    memory.reserve(stash, "activations")
                    assert memory.stash(_stash_key(task, pack, index), (0, pack), stash, stash, 0)
            together = _taken_together(memory, task, packing, range(3), (1, 2), 2, updated, 2.0)
            assert (together is not None) == taken, (updated, budget)
            assert len(together or {}) == (4 if taken else 0)


def test_a_homed_step_takes_its_measured_update_else_the_host_stores_passes_at_the_devices_speed() -> None:
    """A homed single-pack model's step is one bwd task: its forward and backward, and its update, at what the
    planner measured of its own optimizer (Pack.update_seconds), or where it measured nothing the host store's
    passes over its weights; either on a device twice this machine's speed takes half."""
    from harmony.tasks.packing import with_update_rate

    packing = chain_packing(layers=2, seconds=1e-3)
    profile = ModelProfile("m", ())  # with_update_rate sets its rate alone
    measured = with_update_rate(profile, packing, 1e-6)[1]
    trainable = sum(spec.nbytes for spec in packing.packs[0].trainable)
    assert measured.packs[0].update_seconds == pytest.approx(1e-6 * trainable)
    hardware = Hardware(task_overhead=0.0, optimizer_bytes_per_second=1e6)
    compute = task_seconds(TaskId("bwd", 0, 0, 0), packing, 8, hardware)

    def step(packing: Packing, hardware: Hardware) -> float:
        return simulate([packing], [1], [8], {"d": 10**9}, hardware, homes={0: "d"}).makespan

    assert step(measured, hardware) == pytest.approx(compute + 1e-6 * trainable)
    assert step(packing, hardware) == pytest.approx(compute + update_seconds(packing, range(1), hardware))
    faster = dataclasses.replace(hardware, compute_scale=2.0)
    assert step(measured, faster) == pytest.approx((compute + 1e-6 * trainable) / 2)


def test_the_runtimes_host_work_per_pack_call_adds_to_a_cpu_devices_compute_and_runs_beside_a_gpus() -> None:
    """Hardware.call_seconds: a swapped step's pack calls (each pack's forward but the last's, and every pack's
    backward, a recompute and a backward, per micro-batch) each cost it on the host: on CPU devices after the
    compute, on a GPU beside it, so that only host work longer than the kernels shows."""
    packing = chain_packing(layers=6, budget=7000)
    packs, microbatches, steps = len(packing.packs), 8 // packing.microbatch_samples, 3
    assert packs == 6 and microbatches == 2
    calls = (packs - 1) * microbatches + 2 * packs * microbatches

    def makespan(shared: bool, cost: float, stash: bool = False) -> float:
        hardware = Hardware(task_overhead=0.0, shared_cores=shared, call_seconds=cost)
        return simulate([packing], [steps], [8], {"d": 7000}, hardware, stash=stash).makespan

    assert makespan(True, 0.0) == makespan(False, 0.0)
    assert makespan(True, 1e-3) - makespan(True, 0.0) == pytest.approx(steps * calls * 1e-3)
    assert makespan(False, 1e-7) == pytest.approx(makespan(False, 0.0)), "hidden behind longer kernels"
    assert makespan(False, 1e-2) == pytest.approx(steps * calls * 1e-2), "the host's work is the step"
    one_task = [simulate([packing], [steps], [8], {"d": 7000}, Hardware(task_overhead=0.0, shared_cores=True,
                                                                         call_seconds=cost),
                         stash=False, sections=[(0,)]).makespan for cost in (0.0, 1e-3)]
    assert one_task[1] - one_task[0] == pytest.approx(steps * (3 * packs - 1) * microbatches * 1e-3), (
        "a pass in one task: each pack's input recomputed first, but the last's")
    stashed = steps * calls - (makespan(True, 1e-3, stash=True) - makespan(True, 0.0, stash=True)) / 1e-3
    assert stashed == pytest.approx(round(stashed)) and 0 < round(stashed) <= steps * (packs - 1) * microbatches, (
        "a backward that finds its stash makes no recompute's call")


def test_the_call_cost_fitted_to_a_measured_step_is_the_one_that_predicts_it() -> None:
    packing = chain_packing(layers=6, budget=7000)

    def step(cost: float) -> float:
        hardware = Hardware(task_overhead=1e-3, shared_cores=False, call_seconds=cost)
        return simulate([packing], [3], [8], {"d": 7000}, hardware).makespan / 3

    assert step(2e-3) > step(0.0)
    assert fit_least(step, step(2e-3)) == pytest.approx(2e-3, rel=0.02)
    assert fit_least(step, step(0.0)) == 0.0, "a step the plan already predicts costs nothing more per call"
    assert fit_least(step, 0.5 * step(0.0)) == 0.0
    assert fit_least(step, 1e3, largest=0.1) == 0.1, "a step no call cost explains takes the largest"
    costs: list[float] = []

    def line(cost: float) -> float:
        costs.append(cost)
        return 0.1 + 30 * cost

    assert fit_least(line, 0.1 + 30 * 3.7e-3) == pytest.approx(3.7e-3, rel=0.01)
    assert len(costs) <= 4, "a figure linear in the cost: bracketed at once around the line's guess"
    assert fit_least(line, 0.1 + 30 * 2e-7) == pytest.approx(2e-7, rel=0.01), "below the guess's floor"


def test_the_handling_of_a_task_lies_between_tasks_and_busy_counts_their_work_alone() -> None:
    packing = chain_packing(layers=6, budget=7000)
    steps = 3

    def run(overhead: float, handling: float, calls: float = 0.0) -> Simulation:
        hardware = Hardware(task_overhead=overhead, handling_seconds=handling, call_seconds=calls, shared_cores=True)
        return simulate([packing], [steps], [8], {"d": 7000}, hardware, overlap=[False])

    plain = run(0.0, 0.0)
    tasks = len(plain.times)
    assert run(2e-3, 0.0).makespan - plain.makespan == pytest.approx(tasks * 2e-3), "one device: every task waits"
    assert run(0.0, 2e-3).makespan == pytest.approx(run(2e-3, 0.0).makespan), "handling is paid as Dask's cost is"
    cost = Hardware(task_overhead=1e-3, task_cpu=2e-3, handling_seconds=4e-3).task_cost
    assert cost == pytest.approx(6e-3), "what sections and spans amortize: the larger of Dask's two, and handling"
    assert run(1e-3, 2e-3).busy == pytest.approx(plain.busy), "neither is the devices' busy time"
    assert plain.busy["d"] == pytest.approx(plain.makespan), "one device, no per-task cost: busy all along"
    calls = run(0.0, 0.0, 1e-3)
    assert calls.makespan > plain.makespan
    assert calls.busy["d"] - plain.busy["d"] == pytest.approx(calls.makespan - plain.makespan), (
        "the calls' cost is the tasks' work")

def test_the_hosts_work_for_calls_follows_the_compute_on_cpu_devices_and_runs_beside_a_gpus() -> None:
    cpu, gpu = Hardware(shared_cores=True, call_seconds=1e-3), Hardware(shared_cores=False, call_seconds=1e-3)
    assert cpu.with_calls(2e-3, 3) == pytest.approx(5e-3)
    assert gpu.with_calls(2e-3, 3) == pytest.approx(3e-3) and gpu.with_calls(1e-2, 3) == 1e-2
    assert Hardware().with_calls(2e-3, 3) == 2e-3, "no call cost: the compute"


def test_a_result_from_another_device_reaches_its_reader_an_edge_after_its_task_ends() -> None:
    """One job of six packs for two steps on two devices: in vpp its packs alternate devices, so every task of a
    step's chain reads the one before from the other device (ten edges a step: five forwards, then six backwards);
    a step's first forward reads the backward on its own device. In free mode its chain stays on one device."""
    packing = chain_packing(layers=6, budget=7000)
    steps = 2
    assert len(packing.packs) == 6

    def makespan(mode: str, edge: float) -> float:
        hardware = Hardware(task_overhead=1e-3, edge_seconds=edge, shared_cores=True)
        return simulate([packing], [steps], [8], {"a": 7000, "b": 7000}, hardware, mode=mode,
                        overlap=[False]).makespan

    assert makespan("vpp", 0.01) - makespan("vpp", 0.0) == pytest.approx(steps * 10 * 0.01)
    assert makespan("free", 0.01) == pytest.approx(makespan("free", 0.0))
