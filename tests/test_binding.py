"""The late-binding state machine, played without any cluster: events in, instructions out, invariants checked
after every event (validate=True)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from harmony.tasks.binding import BindingState
from harmony.tasks.events import (
    BatchReady,
    Cancel,
    Checkpoint,
    Evaluate,
    Evaluated,
    Fail,
    Fetch,
    Idle,
    Instruction,
    Leave,
    MachineLost,
    Prune,
    Rank,
    Ranked,
    ReadTiming,
    Release,
    StepTimed,
    Submit,
    TaskFailed,
    TaskFinished,
    WorkerJoined,
    WorkerLost,
)
from harmony.tasks.graph import BatchInput, TaskId
from harmony.tasks.hardware import Hardware
from harmony.tasks.packing import Pack, PackCost, Packing
from harmony.tasks.runplan import Job


def job(*pack_bytes: int, steps: int | None = None, home: str | None = None, **fields: object) -> Job:
    """A job of packs with these weight bytes (and as many gradient bytes)."""
    packs = tuple(Pack(i, i, i + 1, (), (), (), PackCost(b, b, 0, 0), 0.0) for i, b in enumerate(pack_bytes))
    defaults: dict[str, object] = {"members": (0,), "step_seconds": 0.0, "batch_bytes": 0}
    return Job(label="m", feed=0, seed=0, packing=Packing("m", packs, 10**12, 1), steps=steps, home=home,
               **{**defaults, **fields})  # type: ignore[arg-type]


class Player:
    """Plays the driver: answers fetches from loaders of steps[m] steps, keeps submitted tasks in flight in the
    order they came, records releases, answers timing reads with timings[model] (seconds, steps) and rankings with
    rank's answer."""

    def __init__(self, state: BindingState, steps: dict[int, int | None],
                 timings: dict[int, tuple[float, int]] | None = None,
                 rank: Callable[[Rank], Ranked] | None = None) -> None:
        self.state = state
        self.steps = steps
        self.timings = timings or {}
        self.in_flight: list[Submit] = []
        self.submitted: list[Submit] = []
        self.released: list[object] = []
        self.fetched: list[Fetch] = []
        self.cancelled: list[TaskId] = []
        self.left: list[Leave] = []
        self.evaluations: list[Evaluate] = []
        self.rank = rank
        self.rankings: list[Rank] = []
        self.pruned: list[Prune] = []
        self.checkpoints: list[Checkpoint] = []
        self.clock = 0.0

    def carry_out(self, instructions: list[Instruction]) -> None:
        queue = list(instructions)
        while queue:
            instruction = queue.pop(0)
            if isinstance(instruction, Fetch):
                self.fetched.append(instruction)
                total = self.steps[instruction.model]
                left = instruction.count if total is None else max(0, min(instruction.count, total - instruction.first))
                queue += self.state.handle(BatchReady(instruction.model, instruction.span, left))
            elif isinstance(instruction, Submit):
                self.in_flight.append(instruction)
                self.submitted.append(instruction)
            elif isinstance(instruction, Release):
                self.released.append(instruction.value)
            elif isinstance(instruction, Cancel):
                self.cancelled.append(instruction.task)
                self.in_flight = [submit for submit in self.in_flight if submit.task != instruction.task]
            elif isinstance(instruction, Leave):
                self.left.append(instruction)
            elif isinstance(instruction, Evaluate):
                self.evaluations.append(instruction)
            elif isinstance(instruction, ReadTiming):
                seconds, steps = self.timings.get(instruction.model, (0.0, 0))
                queue += self.state.handle(StepTimed(instruction.model, seconds, steps))
            elif isinstance(instruction, Rank):
                assert self.rank is not None, f"{instruction} in a run without pruning"
                self.rankings.append(instruction)
                queue += self.state.handle(self.rank(instruction))
            elif isinstance(instruction, Prune):
                self.pruned.append(instruction)
            elif isinstance(instruction, Checkpoint):
                self.checkpoints.append(instruction)

    def finish(self, submit: Submit) -> None:
        self.in_flight.remove(submit)
        self.clock += 1.0
        self.carry_out(self.state.handle(TaskFinished(submit.task, self.clock)))

    def handle(self, event: object) -> list[Instruction]:
        instructions = self.state.handle(event)  # type: ignore[arg-type]
        self.carry_out(instructions)
        return instructions

    def play(self, pick: random.Random | None = None) -> list[tuple[TaskId, str]]:
        """Run to the end, finishing the first task in flight, or a random one of those whose dependencies have
        finished (as Dask would run them); the bindings in order."""
        self.carry_out(self.state.start())
        while not self.state.finished:
            if not self.in_flight and self.state.evaluating:
                evaluation = next(iter(self.state.evaluating.values()))
                self.clock += 1.0
                self.carry_out(self.state.handle(Evaluated(evaluation.model, evaluation.step, evaluation.attempt,
                                                           self.clock)))
                continue
            assert self.in_flight, "the binder stalled"
            if pick is None:
                self.finish(self.in_flight[0])
                continue
            runnable = [submit for submit in self.in_flight
                        if not any(dep in self.state.bound for dep in self.state.dependencies(submit.task))]
            assert runnable, "tasks in flight wait for each other"
            self.finish(pick.choice(runnable))
        return [(submit.task, submit.device) for submit in self.submitted]

    def play_evaluating(self, check: Callable[[Evaluate], None]) -> None:
        """Run to the end, finishing every task in flight before answering an evaluation (the lowest job's first,
        after check has looked at the state it is asked in)."""
        self.carry_out(self.state.start())
        while not self.state.finished:
            if self.in_flight:
                self.finish(self.in_flight[0])
                continue
            assert self.state.evaluating, "the binder stalled"
            evaluation = min(self.state.evaluating.values(), key=lambda e: e.model)
            check(evaluation)
            self.clock += 1.0
            self.carry_out(self.state.handle(Evaluated(evaluation.model, evaluation.step, evaluation.attempt,
                                                       self.clock)))


def test_runs_every_task_once_in_dependency_order() -> None:
    state = BindingState([job(100, 100, 100)], {"cpu-0": 10_000}, validate=True)
    tasks = [task for task, _ in Player(state, {0: 2}).play()]
    assert len(tasks) == len(set(tasks)) == 2 * (2 + 3), "one group: each bwd applies its pack's update"
    position = {task: i for i, task in enumerate(tasks)}
    assert position[TaskId("bwd", 0, 2, 0)] > position[TaskId("fwd", 0, 1, 0)]
    assert position[TaskId("fwd", 0, 0, 1)] > position[TaskId("bwd", 0, 0, 0)]
    assert state.spans_done == [2]


def test_with_one_group_the_next_step_waits_for_the_backward_that_updated_the_pack() -> None:
    """A model with one micro-batch group, homed or swapped, updates inside its bwd: the next step's tasks
    of a pack depend on that bwd, and a step has no upd tasks; with vDP groups an upd reduces them first."""
    jobs = [job(100, home="cpu-0"), job(100, 100), job(100, 100, groups=2)]
    state = BindingState(jobs, {"cpu-0": 10_000, "cpu-1": 10_000}, homes={0: "cpu-0"}, validate=True)
    assert state.dependencies(TaskId("bwd", 0, 0, 3)) == [TaskId("bwd", 0, 0, 2)]
    assert state.dependencies(TaskId("fwd", 1, 0, 3)) == [TaskId("bwd", 1, 0, 2)]
    assert state.dependencies(TaskId("bwd", 1, 1, 3)) == [TaskId("fwd", 1, 0, 3), TaskId("bwd", 1, 1, 2)]
    assert state.dependencies(TaskId("fwd", 2, 0, 3, 1)) == [TaskId("upd", 2, 0, 2)]
    assert state.dependencies(TaskId("upd", 2, 1, 3)) == [TaskId("bwd", 2, 1, 3, 0), TaskId("bwd", 2, 1, 3, 1)]
    order = Player(state, {0: 3, 1: 3, 2: 3}).play()
    assert state.spans_done == [3, 3, 3]
    kinds = {model: sorted({task.kind for task, _ in order if task.model == model}) for model in range(3)}
    assert kinds == {0: ["bwd"], 1: ["bwd", "fwd"], 2: ["bwd", "fwd", "upd"]}
    position = {task: i for i, (task, _) in enumerate(order)}
    assert all(position[TaskId("bwd", 0, 0, s + 1)] > position[TaskId("bwd", 0, 0, s)] for s in range(2))
    assert all(position[TaskId("fwd", 1, 0, s + 1)] > position[TaskId("bwd", 1, 0, s)] for s in range(2))


def test_overlapped_updates_run_beside_the_device_that_ran_their_backward_and_take_none_of_its_slots() -> None:
    """An upd task goes to the device of its pack's bwd (which holds that result), is never handed over in the
    worker's order (it runs on a host thread, not in the device's order: its readers wait for it through Dask),
    and does not count against the device's slots; every step's tasks wait for the update of the step before."""
    jobs = [job(100, 100, 100, overlap=True), job(100, 100, overlap=True)]
    state = BindingState(jobs, {"cpu-0": 10_000, "cpu-1": 10_000}, slots_per_device=2, mode="vpp", validate=True)
    player = Player(state, {0: 3, 1: 3})
    order = player.play()
    assert state.spans_done == [3, 3]
    device_of = dict(order)
    updates = [task for task, _ in order if task.kind == "upd"]
    assert len(updates) == 3 * 3 + 3 * 2
    for task in updates:
        assert device_of[task] == device_of[TaskId("bwd", task.model, task.pack, task.span)]
    position = {task: index for index, (task, _) in enumerate(order)}
    for submit in player.submitted:
        assert not any(isinstance(value, TaskId) and value.kind == "upd" for value in (*submit.local, *submit.checks))
        if submit.task.kind != "upd" and submit.task.span > 0:
            update = TaskId("upd", submit.task.model, submit.task.pack, submit.task.span - 1)
            assert position[update] < position[submit.task]


def test_a_job_whose_tasks_run_sections_of_packs_has_one_task_per_section_and_pass() -> None:
    """Sections are what the graph numbers as packs: a 5-pack job in sections (0, 2) runs fwd s0, bwd s1, bwd s0 a
    step; the device's cache is predicted for a section's bytes."""
    jobs = [job(100, 100, 100, 100, 100, sections=(0, 2)), job(100, 100, 100, sections=(0, 2), overlap=True)]
    state = BindingState(jobs, {"cpu-0": 10_000, "cpu-1": 10_000}, validate=True)
    assert jobs[0].section(1) == range(2, 5) and jobs[0].section_bytes(1) == 300
    order = Player(state, {0: 2, 1: 2}).play()
    assert state.spans_done == [2, 2]
    assert sorted(task for task, _ in order if task.model == 0 and task.span == 0) == [
        TaskId("bwd", 0, 0, 0), TaskId("bwd", 0, 1, 0), TaskId("fwd", 0, 0, 0)]
    assert sorted(task for task, _ in order if task.model == 1 and task.span == 1) == [
        TaskId("bwd", 1, 0, 1), TaskId("bwd", 1, 1, 1), TaskId("fwd", 1, 0, 1), TaskId("upd", 1, 0, 1),
        TaskId("upd", 1, 1, 1)]


def test_a_checkpoint_comes_before_a_second_span_past_it_is_submitted_even_with_upd_tasks() -> None:
    """The host store keeps two versions of a pack: a checkpoint of step s, written when span s - 1 is done, must find
    at most span s run past it. With upd tasks (updates beside the device, vDP) a span's backward ends before its
    updates do, so the span after next opens only once a span is done, not once its backward is."""
    class Checking(Player):
        def carry_out(self, instructions: list[Instruction]) -> None:
            for instruction in instructions:
                if isinstance(instruction, Checkpoint):
                    spans = [submit.task.span for submit in self.submitted if submit.task.model == instruction.model]
                    assert max(spans) <= instruction.step, (instruction, max(spans))
            super().carry_out(instructions)

    for seed in range(20):  # tasks finish in any order their dependencies allow, upd tasks late among them
        jobs = [job(100, 100, 100, overlap=True), job(100, 100, groups=2)]
        state = BindingState(jobs, {"cpu-0": 10_000, "cpu-1": 10_000}, checkpoint_every=1, mode="vdp", validate=True)
        Checking(state, {0: 6, 1: 6}).play(random.Random(seed))
        assert state.spans_done == [6, 6]


def test_models_are_interleaved_not_run_one_after_another() -> None:
    state = BindingState([job(10, 10), job(10, 10)], {"cpu-0": 10_000}, slots_per_device=1, validate=True)
    order = Player(state, {0: 3, 1: 3}).play()
    first_of_model_1 = next(i for i, (task, _) in enumerate(order) if task.model == 1)
    last_of_model_0 = max(i for i, (task, _) in enumerate(order) if task.model == 0)
    assert first_of_model_1 < last_of_model_0 / 3


def test_a_device_prefers_the_task_whose_pack_it_holds() -> None:
    state = BindingState([job(10, 10, steps=1), job(10, 10, steps=1)], {"a": 1000, "b": 1000}, slots_per_device=1,
                         validate=True)
    player = Player(state, {0: 1, 1: 1})
    player.carry_out(state.start())
    [first] = [submit for submit in player.submitted if submit.device == "a"]
    player.finish(first)
    pack = (first.task.model, first.task.pack)
    assert state.memory["a"].holds(pack, 0), "the device caches the pack its task just ran"
    follow = player.submitted[-1]
    assert follow.device == "a"
    assert (follow.task.model, follow.task.pack) == (first.task.model, first.task.pack + 1)


def test_a_task_waiting_for_a_producer_is_queued_beside_it_alone_so_jobs_do_not_crowd_one_device() -> None:
    """Two one-pack jobs (a step is one bwd, waiting for the step before) on two devices of four slots: a step's
    task is ready while the step before runs, and is queued on that one's device alone; the device that lists first
    once queued the other job's too, and ran both jobs while the other idled."""
    state = BindingState([job(100), job(100)], {"a": 10_000, "b": 10_000}, validate=True)
    order = Player(state, {0: 6, 1: 6}).play()
    assert state.spans_done == [6, 6]
    devices = {model: {device for task, device in order if task.model == model} for model in (0, 1)}
    assert devices == {0: {"a"}, 1: {"b"}}


def run_in_time(state: BindingState, player: Player) -> dict[str, list[TaskId]]:
    """Plays the devices on a clock: each runs its tasks one at a time in the order they were submitted to it, each
    taking a second from when the device is free and its dependencies have ended; returns what each device ran."""
    player.carry_out(state.start())
    free = dict.fromkeys(state.device_names, 0.0)
    ended: dict[TaskId, float] = {}
    after = {submit.task: state.dependencies(submit.task) for submit in player.in_flight}
    ran: dict[str, list[TaskId]] = {device: [] for device in state.device_names}
    while player.in_flight:
        heads = {}
        for submit in player.in_flight:
            heads.setdefault(submit.device, submit)
        startable = [submit for submit in heads.values() if all(dep in ended for dep in after[submit.task])]
        assert startable, "every device waits"
        ends = {submit.task: max([free[submit.device], *(ended[dep] for dep in after[submit.task])]) + 1.0
                for submit in startable}
        submit = min(startable, key=lambda submit: ends[submit.task])
        free[submit.device] = ended[submit.task] = ends[submit.task]
        ran[submit.device].append(submit.task)
        player.in_flight.remove(submit)
        player.clock = ended[submit.task]
        player.carry_out(state.handle(TaskFinished(submit.task, player.clock)))
        after.update({submit.task: state.dependencies(submit.task) for submit in player.in_flight
                      if submit.task not in after})
    return ran


def test_a_device_with_work_queued_leaves_a_task_another_starts_sooner() -> None:
    """Three one-pack jobs on two devices of four slots, each step a second: job 0's second step would wait behind
    job 2's first on a, and starts on b as job 1's first ends; the jobs' chains move between the devices and each
    device runs half the steps, where a job's step queued beside its last ran 2:1 (a: jobs 0 and 2, b: job 1)."""
    state = BindingState([job(100), job(100), job(100)], {"a": 10_000, "b": 10_000}, validate=True)
    player = Player(state, {0: 12, 1: 12, 2: 12})
    ran = run_in_time(state, player)
    assert [submit.device for submit in player.submitted[:4]] == ["a", "b", "a", "b"]
    assert player.submitted[3].task == TaskId("bwd", 0, 0, 1)
    assert sorted(len(tasks) for tasks in ran.values()) == [18, 18]
    assert player.clock == 18.0
    assert state.finished


def test_a_device_queue_weighs_each_step_of_a_homed_span() -> None:
    """A homed job's task of four steps counts four of its steps in its device's queue (with the task cost once;
    its first two spans are queued), so that the free jobs' steps wait behind each other on b rather than behind
    eight homed steps on a (job 2's second step would go there if each span counted as one step)."""
    jobs = [job(10, steps=8, step_seconds=1.5, depth=4, home="a"), job(10, steps=8, step_seconds=1.0),
            job(10, steps=8, step_seconds=1.0)]
    state = BindingState(jobs, {"a": 1000, "b": 1000}, validate=True, hardware=Hardware(task_overhead=0.01))
    player = Player(state, {0: 8, 1: 8, 2: 8})
    player.carry_out(state.start())
    assert set(state.running["a"]) == {TaskId("bwd", 0, 0, 0), TaskId("bwd", 0, 0, 1)}
    assert state.queued("a") == pytest.approx(2 * (4 * 1.5 + 0.01))
    assert {submit.task: submit.device for submit in player.submitted if submit.task.model > 0} == {
        TaskId("bwd", model, 0, span): "b" for model in (1, 2) for span in (0, 1)}


def test_a_task_stays_beside_its_producer_where_the_edge_costs_more_than_the_queue() -> None:
    """The same three jobs, where a result read from the other device costs two steps' time (Hardware.edge_seconds):
    no chain moves, and a runs jobs 0 and 2."""
    state = BindingState([job(100), job(100), job(100)], {"a": 10_000, "b": 10_000}, validate=True,
                         hardware=Hardware(edge_seconds=2.0, task_overhead=0.0))
    ran = run_in_time(state, Player(state, {0: 12, 1: 12, 2: 12}))
    assert {device: sorted({task.model for task in tasks}) for device, tasks in ran.items()} == {"a": [0, 2], "b": [1]}


def test_values_are_released_once_their_readers_finish() -> None:
    state = BindingState([job(10, 10)], {"cpu-0": 1000}, slots_per_device=1, validate=True)
    player = Player(state, {0: 1})
    player.play()
    assert BatchInput(0, 0) in player.released
    assert TaskId("fwd", 0, 0, 0) in player.released
    assert not state.readers and not state.placed and not state.done


def test_at_most_two_steps_of_a_model_are_open() -> None:
    state = BindingState([job(10)], {"cpu-0": 1000}, validate=True)
    assert state.wanted_batches() == [(0, 0), (0, 1)], "both first steps may open at once"
    assert [(f.model, f.span) for f in state.start() if isinstance(f, Fetch)] == [(0, 0)], "one fetch at a time"
    assert state.handle(BatchReady(0, 0, 1)) == [Fetch(0, 1, 1, 1, 1, False)]
    instructions = state.handle(BatchReady(0, 1, 1))
    assert [i.task for i in instructions if isinstance(i, Submit)] == [TaskId("bwd", 0, 0, 0), TaskId("bwd", 0, 0, 1)]
    assert state.wanted_batches() == []
    assert Fetch(0, 2, 2, 1, 1, False) in state.handle(TaskFinished(TaskId("bwd", 0, 0, 0), 1.0))
    assert not any(isinstance(i, Fetch) for i in state.handle(TaskFinished(TaskId("bwd", 0, 0, 1), 2.0))), (
        "a second fetch while the first is unanswered")
    assert state.wanted_batches() == [(0, 2), (0, 3)], "step 1 ended before the driver opened step 2: both open"


def test_sharded_lrtf_serves_the_model_with_the_longest_remaining_time() -> None:
    jobs = [job(10, steps=4, step_seconds=1.0), job(10, steps=4, step_seconds=5.0)]
    for policy, first in (("lrtf", TaskId("bwd", 1, 0, 0)), ("round_robin", TaskId("bwd", 0, 0, 0))):
        state = BindingState(jobs, {"cpu-0": 1000}, slots_per_device=1, policy=policy, validate=True)
        player = Player(state, {0: 4, 1: 4})
        player.carry_out(state.start())
        assert player.submitted[0].task == first, policy


def test_lrtf_lets_all_models_finish_close_together() -> None:
    """Three short models and one long one on two devices: LRTF starts the long one first and keeps it
    going, so the spread of finishing times is smaller than under round-robin."""
    from harmony.tasks.hardware import Hardware
    from harmony.tasks.simulator import simulate
    from tests.test_simulator import chain_packing

    packings = [chain_packing(layers=2, seconds=1e-3)] * 3 + [chain_packing(layers=2, seconds=4e-3)]
    spreads = {}
    for policy in ("lrtf", "round_robin"):
        run = simulate(packings, [6] * 4, [8] * 4, {"a": 10**9, "b": 10**9}, Hardware(task_overhead=0.0),
                       policy=policy)
        finish = [max(end for task, (_, end) in run.times.items() if task.model == m) for m in range(4)]
        spreads[policy] = (max(finish) - min(finish), max(finish))
    assert spreads["lrtf"][1] <= spreads["round_robin"][1]
    assert spreads["lrtf"][0] < spreads["round_robin"][0]


def test_a_homed_models_spans_are_re_cut_as_their_step_time_is_measured() -> None:
    """The state counts spans: a measurement re-cuts the spans not yet opened and the total."""
    homed = job(10, steps=40, step_seconds=0.05, depth=10, task_seconds=0.003, batch_bytes=100, home="cpu-0")
    state = BindingState([homed], {"cpu-0": 1000}, homes={0: "cpu-0"}, validate=True)
    assert state.total_spans(0) == 4 and state.wanted_batches() == [(0, 0), (0, 1)]
    player = Player(state, {0: 40}, timings={0: (0.5, 10)})  # 50 ms steps: 6 steps per task for the 20 left
    player.carry_out(state.start())
    assert [(f.first, f.count, f.stacked) for f in player.fetched] == [(0, 10, True), (10, 10, True)]
    assert [submit.steps for submit in player.submitted] == [10, 10], "multi-step tasks carry their steps"
    assert state.open_spans[(0, 1)] == (10, 10), "an open span's first training step and length"
    player.finish(player.in_flight[0])
    assert (0, 0) not in state.open_spans, "a finished span is forgotten"
    assert state.spans_done == [1] and state.steps_trained == [10]
    assert state.total_spans(0) == 2 + 4 and player.fetched[-1].first == 20 and player.fetched[-1].count == 6
    assert state.remaining_seconds(0) == 30 * 0.05
    while not state.finished:
        player.finish(player.in_flight[0])
    spans = [(f.first, f.count) for f in player.fetched]
    assert spans[2:] == [(20, 6), (26, 6), (32, 6), (38, 2)]
    assert state.steps_trained == [40] and state.spans_done == [6] and len(state.step_times[0]) == 40


def test_a_model_stepping_one_step_per_task_has_no_spans() -> None:
    state = BindingState([job(10, steps=4, step_seconds=0.05, home="cpu-0")], {"cpu-0": 1000}, homes={0: "cpu-0"},
                         validate=True)
    player = Player(state, {0: 4})
    player.carry_out(state.start())
    assert player.submitted and all(submit.steps is None for submit in player.submitted)
    assert not any(fetch.stacked for fetch in player.fetched)


def test_any_completion_order_runs_every_task_once_and_keeps_the_invariants() -> None:
    """Tasks finishing in random orders (as several devices finish them), in every mode, with vDP groups and a
    model whose loader ends early: every task runs once after its dependencies, every value is released."""
    for seed in range(12):
        rng = random.Random(seed)
        mode = ("free", "vpp", "vdp")[seed % 3]
        groups = 2 if mode == "vdp" else 1
        jobs = [job(100, 100, 100, groups=groups), job(50, 50, groups=groups), job(80, groups=groups)]
        state = BindingState(jobs, {"a": 250, "b": 250}, slots_per_device=rng.choice([1, 2, 4]), mode=mode,
                             validate=True)
        player = Player(state, {0: 3, 1: 4, 2: 2})
        finished: list[TaskId] = []
        original = player.finish

        def finish(submit: Submit, original=original, finished=finished, state=state) -> None:
            deps = state.dependencies(submit.task)
            assert all(dep in finished for dep in deps), f"{submit.task} finished before its dependencies"
            finished.append(submit.task)
            original(submit)

        player.finish = finish  # type: ignore[method-assign]
        order = player.play(rng)
        tasks = [task for task, _ in order]
        assert len(tasks) == len(set(tasks)), "a task was bound twice"
        assert state.steps_trained == [3, 4, 2]
        assert not state.readers and not state.bound and not state.placed
        assert len(state.story) > 0 and state.story[-1][0] is not None


def test_a_lost_workers_jobs_run_their_open_spans_again_on_the_devices_left_and_the_others_go_on() -> None:
    jobs = [job(100, 100, 100), job(50, 50), job(40)]
    state = BindingState(jobs, {"a": 10_000, "b": 10_000}, slots_per_device=2, mode="vpp", validate=True)
    player = Player(state, {0: 3, 1: 3, 2: 3})
    player.carry_out(state.start())
    for _ in range(5):
        player.finish(player.in_flight[0])
    on_a = {submit.task.model for submit in player.in_flight if submit.device == "a"}
    unaffected = {m for m in range(3) if m not in on_a and all(device != "a" for task, device in state.placed.items()
                                                               if task.model == m)}
    before = len(player.submitted)
    running_on_a = {submit.task for submit in player.in_flight if submit.device == "a"}
    player.handle(WorkerLost("a", 5.5))
    assert "a" not in state.device_names and not any(submit.device == "a" for submit in player.in_flight)
    again = player.submitted[before:]
    assert again and all(submit.device == "b" for submit in again)
    redone = {task.model for task in state.attempts}
    assert on_a <= redone and not redone & unaffected, "only the jobs that had work on the lost device run again"
    assert running_on_a and running_on_a <= set(player.cancelled)
    assert all(submit.attempt == 1 for submit in again if submit.task.model in redone)
    lost = state.events[-1]
    assert lost["event"] == "worker lost" and set(lost["jobs redone"]) == redone
    player.handle(WorkerJoined("a", 6.0))
    assert state.device_names == ["a", "b"]
    while not state.finished:
        runnable = [s for s in player.in_flight if not any(d in state.bound for d in state.dependencies(s.task))]
        player.finish(runnable[0])
    assert state.steps_trained == [3, 3, 3] and not state.failed
    assert not state.readers and not state.bound and not state.placed and not state.attempts


def test_a_task_waiting_for_a_finished_result_of_a_lost_device_runs_again() -> None:
    """A task submitted while a producer on another device ran waits for that producer's Dask result, which lives on
    the producer's worker after the producer is done and forgotten here. Lose that worker and Dask runs the producer
    again on the address it was bound to, which never comes back: the waiting task's job runs again instead (a
    user's nanny cluster hung so). Here an upd task of vDP's first group waits for the second group's backward; in
    free mode a task is submitted early only to the device of the producers it waits for."""
    jobs = [job(100, 100, groups=2), job(100, 100, groups=2)]
    state = BindingState(jobs, {"a": 10_000, "b": 10_000, "c": 10_000}, slots_per_device=2, mode="vdp",
                         validate=True)
    player = Player(state, {0: 4, 1: 4})
    player.carry_out(state.start())
    pick = random.Random(0)

    def runnable() -> list[Submit]:
        return [s for s in player.in_flight if not any(dep in state.bound for dep in state.dependencies(s.task))]

    def waiting() -> tuple[Submit, str] | None:
        """An in-flight task waiting for a finished producer on another device that holds nothing else of its job."""
        for submit in player.in_flight:
            for producer in submit.after:
                at = state.edges[submit.task][producer]
                held = {task.model for task, device in state.placed.items() if device == at}
                if producer not in state.bound and at != submit.device and submit.task.model not in held:
                    return submit, at
        return None

    while (found := waiting()) is None:
        player.finish(pick.choice(runnable()))
    submit, device = found
    player.handle(WorkerLost(device, 9.0))
    assert submit.task in player.cancelled and submit.task.model in state.events[-1]["jobs redone"]
    assert state.attempts.get(submit.task) == 1
    player.handle(WorkerJoined(device, 10.0))
    while not state.finished:
        player.finish(runnable()[0])
    assert state.steps_trained == [4, 4] and not state.failed


def test_a_job_homed_on_a_lost_device_moves_and_every_device_lost_waits_for_one_to_join() -> None:
    jobs = [job(10, home="a"), job(10, home="b")]
    state = BindingState(jobs, {"a": 1000, "b": 1000}, homes={0: "a", 1: "b"}, validate=True)
    player = Player(state, {0: 4, 1: 4})
    player.carry_out(state.start())
    player.handle(WorkerLost("a", 1.0))
    assert state.homes == {0: "b", 1: "b"} and all(submit.device == "b" for submit in player.in_flight)
    player.handle(WorkerLost("b", 2.0))
    assert not state.device_names and not state.bound and not player.in_flight
    player.handle(WorkerJoined("a", 3.0))
    assert state.homes == {0: "a", 1: "a"} and player.in_flight
    while not state.finished:
        player.finish(player.in_flight[0])
    assert state.steps_trained == [4, 4]
    assert [event["event"] for event in state.events] == ["worker lost", "worker lost", "worker joined"]


def test_a_device_no_job_still_training_is_homed_on_is_idle_until_a_lost_home_moves_a_job_there() -> None:
    """While a job that is not homed trains, every device may get its tasks: none is idle. Once only homed jobs
    train, the devices none of them is homed on are idle (Idle says so each time the set changes), until a lost
    device's job moves there."""
    state = BindingState([job(10, home="a"), job(10, home="b"), job(10)], {"a": 1000, "b": 1000, "c": 1000},
                         homes={0: "a", 1: "b"}, validate=True)
    player = Player(state, {0: 4, 1: 8, 2: 1})
    said: list[frozenset[str]] = []
    player.carry_out(state.start())
    while not state.finished:
        said += [each.devices for each in player.handle(TaskFinished(player.in_flight[0].task, 1.0))
                 if isinstance(each, Idle)]
        player.in_flight.pop(0)
        if state.steps_trained[1] == 6:
            break
    assert state.stopped(2) or state._job_finished(2)
    assert said == [frozenset({"c"}), frozenset({"a", "c"})], "the swapped job ended, then the job homed on a"
    said += [each.devices for each in player.handle(WorkerLost("b", 2.0)) if isinstance(each, Idle)]
    assert state.homes[1] in ("a", "c") and said[-1] == frozenset({"a", "c"} - {state.homes[1]})
    while not state.finished:
        player.finish(player.in_flight[0])
    assert state.steps_trained == [4, 8, 1]


def test_a_job_whose_code_fails_stops_alone_unless_the_run_is_fail_fast() -> None:
    error = RuntimeError("boom")
    for fail_fast in (False, True):
        state = BindingState([job(10, 10), job(10)], {"a": 1000}, validate=True, fail_fast=fail_fast)
        player = Player(state, {0: 3, 1: 3})
        player.carry_out(state.start())
        failing = next(submit for submit in player.in_flight if submit.task.model == 0)
        player.in_flight.remove(failing)
        instructions = player.handle(TaskFailed(failing.task, error, 1.0, isolated=True))
        if fail_fast:
            assert instructions == [Fail(0, error)]
            continue
        assert state.failed[0]["step"] == 0 and state.failed[0]["reason"] == "boom"
        assert player.left == [Leave(0, 2)], "its loader keeps no batch for it from the steps it never opened on"
        assert not any(submit.task.model == 0 for submit in player.in_flight)
        while not state.finished:
            player.finish(player.in_flight[0])
        assert state.steps_trained == [0, 3]
    state = BindingState([job(10)], {"a": 1000}, validate=True)
    player = Player(state, {0: 1})
    player.carry_out(state.start())
    assert state.handle(TaskFailed(player.in_flight[0].task, error, 1.0)) == [Fail(0, error)], (
        "a failure that is not the model's own fails the run")


def test_losses_count_against_a_job_only_in_a_row() -> None:
    state = BindingState([job(20, home="a"), job(20)], {"a": 1000, "b": 1000}, homes={0: "a"}, validate=True)
    player = Player(state, {0: 20, 1: 20})
    player.carry_out(state.start())
    for when in range(6):  # more losses than allowed, with a step of each job done after each
        home = state.homes[0]
        player.handle(WorkerLost(home, float(when)))
        assert state.losses[0] == 1, "the homed job's task ran there"
        player.handle(WorkerJoined(home, when + 0.5))
        trained = list(state.steps_trained)
        while any(now == before for now, before in zip(state.steps_trained, trained)):
            player.finish(player.in_flight[0])
    assert not state.failed and not state.losses
    while not state.finished:
        player.finish(player.in_flight[0])
    assert state.steps_trained == [20, 20]


def test_a_lost_worker_counts_against_the_job_of_the_task_it_ran_first_not_every_job_queued_there() -> None:
    state = BindingState([job(10), job(10)], {"a": 1000}, validate=True)
    player = Player(state, {0: 2, 1: 2})
    player.carry_out(state.start())
    queued = [submit.task for submit in player.in_flight if submit.device == "a"]
    assert {task.model for task in queued} == {0, 1}, "both jobs have tasks queued on the device"
    player.handle(WorkerLost("a", 1.0))
    assert dict(state.losses) == {queued[0].model: 1}, "the worker runs its tasks in order: the first one ran"


def test_a_lost_worker_counts_against_the_job_whose_task_it_marked_as_executing() -> None:
    """Where the driver read what the worker was executing (runtime.bodies marks it), that job is the suspect,
    whichever task was bound first: a worker executes its queue by priority, not in the order of binding."""
    state = BindingState([job(10), job(10)], {"a": 1000, "b": 1000}, validate=True)
    player = Player(state, {0: 2, 1: 2})
    player.carry_out(state.start())
    queued = [submit.task for submit in player.in_flight if submit.device == "a"]
    other = 1 - queued[0].model
    player.handle(WorkerLost("a", 1.0, executing=frozenset({other})))
    assert dict(state.losses) == {other: 1}
    assert state.events[-1]["suspects"] == [other]


def test_a_lost_worker_counts_against_every_job_it_marked_busy_its_tasks_and_its_host_updates() -> None:
    """A job's update on a host thread beside the device may be what killed the worker, as much as the task its
    task thread executed: each job the worker marked counts, no job it did not mark (nor its first task's)."""
    state = BindingState([job(10), job(10), job(10)], {"a": 1000, "b": 1000}, validate=True)
    player = Player(state, {0: 2, 1: 2, 2: 2})
    player.carry_out(state.start())
    first = next(submit.task.model for submit in player.in_flight if submit.device == "a")
    busy = frozenset(range(3)) - {first}
    player.handle(WorkerLost("a", 1.0, executing=busy))
    assert dict(state.losses) == dict.fromkeys(busy, 1)
    assert state.events[-1]["suspects"] == sorted(busy)


def test_a_job_lost_with_its_device_again_and_again_fails_alone() -> None:
    state = BindingState([job(10, home="a"), job(10, home="c")], {"a": 1000, "b": 1000, "c": 1000},
                         homes={0: "a", 1: "c"}, validate=True)  # job 0 moves between a and b, job 1 stays on c
    player = Player(state, {0: 2, 1: 2})
    player.carry_out(state.start())
    for when in range(4):
        assert 0 not in state.failed
        home = state.homes[0]
        player.handle(WorkerLost(home, float(when)))
        player.handle(WorkerJoined(home, when + 0.5))
    assert 0 in state.failed and "died 4 times" in str(state.failed[0]["reason"])
    while not state.finished:
        player.finish(player.in_flight[0])
    assert state.steps_trained[1] == 2


MACHINES = {"a0": "A", "a1": "A", "b0": "B"}


def test_a_jobs_tasks_run_on_its_machines_devices_alone_in_every_mode() -> None:
    for mode in ("free", "vpp", "vdp"):
        jobs = [job(100, 100, machine="A"), job(100, 100, machine="B"), job(100, machine="A", home="a1"),
                job(100, machine="B", home="b0")]
        state = BindingState(jobs, dict.fromkeys(MACHINES, 10_000), mode=mode, homes={2: "a1", 3: "b0"},
                             machines=MACHINES, validate=True)
        bindings = Player(state, dict.fromkeys(range(4), 3)).play(random.Random(1))
        for task, device in bindings:
            assert MACHINES[device] == jobs[task.model].machine, f"{mode}: {task} ran on {device}"
        if mode == "vpp":
            assert {device for task, device in bindings if task.model == 0} == {"a0", "a1"}, "packs over A's devices"


def test_a_homed_job_moves_within_its_machine_and_waits_when_its_machine_has_no_device() -> None:
    jobs = [job(100, machine="A", home="a0"), job(100, machine="B", home="b0")]
    state = BindingState(jobs, dict.fromkeys(MACHINES, 10_000), homes={0: "a0", 1: "b0"}, machines=MACHINES,
                         validate=True)
    player = Player(state, {0: 4, 1: 4})
    player.carry_out(state.start())
    player.handle(WorkerLost("a0", 1.0))
    assert state.homes[0] == "a1", "the A job moves to A's other device"
    player.handle(WorkerLost("b0", 2.0))
    assert state.homes[1] == "b0" and state.stranded("B") == [1] and not state.stranded("A")
    assert all(MACHINES[submit.device] == "A" for submit in player.in_flight), "nothing of B's job is bound on A"
    player.handle(WorkerJoined("b0", 3.0))
    assert not state.stranded("B")
    while not state.finished:
        player.finish(player.in_flight[0])
    assert state.steps_trained == [4, 4] and not state.failed


def test_a_machine_lost_for_good_fails_its_jobs_alone() -> None:
    jobs = [job(100, 100, machine="A"), job(100, 100, machine="B"), job(100, machine="B", home="b0")]
    state = BindingState(jobs, dict.fromkeys(MACHINES, 10_000), homes={2: "b0"}, machines=MACHINES, validate=True)
    player = Player(state, {0: 3, 1: 3, 2: 3})
    player.carry_out(state.start())
    player.finish(player.in_flight[0])
    player.handle(WorkerLost("b0", 1.0))
    assert state.stranded("B") == [1, 2]
    player.handle(MachineLost("B", 120.0, 125.0))
    assert sorted(state.failed) == [1, 2]
    assert "every worker of its machine has been lost for 120 s" in str(state.failed[1]["reason"])
    while not state.finished:
        player.finish(player.in_flight[0])
    assert state.steps_trained[0] == 3


def test_evaluations_come_every_eval_every_steps_and_at_the_end_with_no_later_step_applied_first() -> None:
    """Spans end at evaluation points, nothing past a point opens before its evaluation is done (a swapped job may
    take one step: its update writes the other slot), the end is evaluated once (also when it is a point), and a job
    is finished only once its last evaluation is."""
    jobs = [job(10, 10, steps=7), job(10, steps=12, step_seconds=0.05, depth=4, home="cpu-1")]
    state = BindingState(jobs, {"cpu-0": 1000, "cpu-1": 1000}, homes={1: "cpu-1"}, validate=True, evaluate=True,
                         eval_every=3)
    player = Player(state, {0: 7, 1: 12})

    def check(evaluation: Evaluate) -> None:
        ahead = 0 if evaluation.model in state.homes else 1  # a swapped job's next update writes the other slot
        assert state.spans[evaluation.model].opened <= evaluation.step + ahead, (
            "no step past an evaluation's opened before it is done")

    player.play_evaluating(check)
    assert [(e.model, e.step) for e in player.evaluations if e.model == 0] == [(0, 3), (0, 6), (0, 7)]
    assert [(e.model, e.step, e.device) for e in player.evaluations if e.model == 1] == [
        (1, 3, "cpu-1"), (1, 6, "cpu-1"), (1, 9, "cpu-1"), (1, 12, "cpu-1")], "a homed job evaluates at home"
    assert [(f.first, f.count) for f in player.fetched if f.model == 1] == [(0, 3), (3, 3), (6, 3), (9, 3)]
    assert state.steps_trained == [7, 12]


def test_an_evaluation_on_a_lost_device_runs_again_and_a_failed_one_fails_its_job_alone() -> None:
    jobs = [job(10, steps=2), job(10, steps=2)]
    state = BindingState(jobs, {"cpu-0": 1000, "cpu-1": 1000}, validate=True, evaluate=True)
    player = Player(state, {0: 2, 1: 2})
    player.carry_out(state.start())
    while player.in_flight:
        player.finish(player.in_flight[0])
    assert set(state.evaluating) == {0, 1} and not state.finished
    lost = state.evaluating[0]
    player.handle(WorkerLost(lost.device, 10.0))
    again = state.evaluating[0]
    assert again.device != lost.device and again.attempt == lost.attempt + 1 and again.step == 2
    assert player.handle(Evaluated(0, 2, lost.attempt, 11.0)) == [], "the lost attempt is not heard"
    player.handle(Evaluated(0, 2, again.attempt, 12.0))
    failure = ValueError("the model's own error")
    player.handle(Evaluated(1, 2, state.evaluating[1].attempt, 13.0, error=failure, isolated=True))
    assert state.finished and state.failed[1]["error"] is failure and 0 not in state.failed
    assert state.finish_times[0] == 12.0


def test_a_swapped_job_evaluated_every_step_takes_one_step_while_each_evaluation_runs() -> None:
    """Its next step runs while an evaluation does (its update writes the other slot); the step after waits, and
    the evaluation it reached meanwhile is asked for once the one before is done."""
    state = BindingState([job(10, 10, steps=4)], {"cpu-0": 1000}, validate=True, evaluate=True, eval_every=1)
    player = Player(state, {0: 4})
    trained_while: list[int] = []
    player.play_evaluating(lambda evaluation: trained_while.append(state.steps_trained[0] - evaluation.step))
    assert set(trained_while) <= {0, 1} and 1 in trained_while, "one step, no more, runs while an evaluation does"
    assert [e.step for e in player.evaluations] == [1, 2, 3, 4]


def test_with_pruning_every_job_waits_at_each_pruning_step_until_all_still_training_are_ranked_there() -> None:
    """The jobs still training meet at every evaluation within the run (none opens a step past it before the
    ranking), whatever order their tasks and evaluations finish in; a job stopped whole trains and is evaluated no
    more and is checkpointed at its step; one whose data ends at a pruning step is not ranked there."""
    jobs = [job(10, 10, steps=8), job(10, steps=8, step_seconds=0.05, depth=3, home="b"), job(10, 10, steps=8),
            job(10, steps=4)]
    for seed in range(5):
        state = BindingState(jobs, {"a": 1000, "b": 1000}, homes={1: "b"}, validate=True, evaluate=True,
                             eval_every=2, prune=True, checkpoint_every=100)

        def rank(rank: Rank, state: BindingState = state) -> Ranked:
            for model in range(len(jobs)):
                assert state.stopped(model) or state.spans[model].opened <= rank.step, "a job passed the step"
            stop = max(rank.models)  # the last job still training stops, until one is left
            ended = frozenset({stop}) if len(rank.models) > 1 else frozenset()
            return Ranked(rank.step, {model: (0,) for model in ended}, ended, 0.0)

        player = Player(state, {0: 8, 1: 8, 2: 8, 3: 4}, rank=rank)
        player.play(random.Random(seed))
        assert [(r.step, r.models) for r in player.rankings] == [(2, (0, 1, 2, 3)), (4, (0, 1, 2)), (6, (0, 1))]
        assert state.pruned == {3: 2, 2: 4, 1: 6} and state.steps_trained == [8, 6, 4, 2]
        assert player.pruned == [Prune(3, 2, (0,)), Prune(2, 4, (0,)), Prune(1, 6, (0,))]
        assert [(c.model, c.step) for c in player.checkpoints if c.model != 0] == [(3, 2), (2, 4), (1, 6)]
        assert [(e["step"], e["models"]) for e in state.events] == [(2, [0]), (4, [0]), (6, [0])], (
            "each ranking that stops models is an event (these jobs' one member is each model 0)")
        assert sorted({(e.model, e.step) for e in player.evaluations}) == [
            (0, 2), (0, 4), (0, 6), (0, 8), (1, 2), (1, 4), (1, 6), (2, 2), (2, 4), (3, 2)]
        assert not player.left or all(leave.model != 0 for leave in player.left)
        assert state.finished and not state.failed


def test_a_ranking_that_stops_some_members_of_an_array_goes_on_and_one_that_stops_none_lets_every_job_pass() -> None:
    fused = job(10, 10, steps=4, members=(0, 1, 2))
    state = BindingState([fused, job(10, steps=4)], {"a": 1000}, validate=True, evaluate=True, eval_every=2,
                         prune=True)
    answers = iter([Ranked(2, {0: (1, 2)}, frozenset(), 0.0)])
    player = Player(state, {0: 4, 1: 4}, rank=lambda rank: next(answers))
    player.play()
    assert [r.step for r in player.rankings] == [2], "the end of the data is no pruning step"
    assert player.pruned == [Prune(0, 2, (1, 2))] and not state.pruned and state.steps_trained == [4, 4]


def test_a_resumed_run_with_pruning_ranks_again_where_its_checkpoints_may_not_have_been_ranked() -> None:
    """Checkpoints at steps 4, 4, 2 (pruned there) and 6: a job at step 6 means step 4 was ranked (no job passes an
    unranked one), so the jobs at 4 go on, and the one at 6 is evaluated there again for the ranking it waits for;
    with the jobs at 4, 4 and 2 alone, step 4 may not have been: the jobs at 4 are evaluated there again."""
    jobs = [job(10, steps=8), job(10, steps=8), job(10, steps=8), job(10, steps=8)]
    for starts, owed in (([4, 4, 2, 6], {3: 6}), ([4, 4, 2, 4], {0: 4, 1: 4, 3: 4})):
        state = BindingState(jobs, {"a": 1000}, validate=True, evaluate=True, eval_every=2, prune=True,
                             start=starts, pruned={2: 2})
        assert state.evaluations_owed == owed and state.decided == (4 if 6 in starts else 2)
        player = Player(state, dict.fromkeys(range(4), 8),
                        rank=lambda rank: Ranked(rank.step, {}, frozenset(), 0.0))
        player.play()
        assert [(r.step, r.models) for r in player.rankings] == [*([(4, (0, 1, 3))] if 4 in owed.values() else []),
                                                                  (6, (0, 1, 3))]
        assert state.steps_trained == [8, 8, 2, 8] and state.pruned == {2: 2}
