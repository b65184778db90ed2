"""The runtime's host costs per pack call and per task, fitted to a run's steps and taken by the process's later
plans."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from torch import nn

import harmony
from harmony import calls, fitfiles
from harmony.result import Stats
from harmony.tasks.hardware import Hardware
from tests.conftest import deep_mlp, regression_batches


def sgd(parameters: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.01)


def weight_bytes(model: nn.Module) -> int:
    return sum(parameter.nbytes for parameter in model.parameters())


def train(budget: int, steps: int = 10) -> harmony.TrainResult:
    """A pack a task, so that its forwards and backwards make different counts of pack calls."""
    return harmony.train(deep_mlp(), regression_batches(16 * steps, 16), loss_fn=nn.functional.mse_loss,
                         optimizer=sgd, devices=["cpu"], device_memory=budget, microbatches=4, packs_per_task=1,
                         progress=False)


def assert_predicts(result: harmony.TrainResult, fit: calls.Fit) -> None:
    """fit's call cost is the slope of the run's task durations over their pack calls (calls.per_call), and its cost
    per task, with that call cost, the least (to the fit's hundredth) at which the run's plan predicts its steady
    step."""
    figures = calls.figures(result.stats)
    assert figures is not None
    step, busy, durations = figures
    assert 0 < busy < 2 * step, "two devices at most busy all along"
    assert fit.update_call_seconds == calls.update_cost(result), "measured"
    hardware = dataclasses.replace(result.plan.hardware, call_seconds=0.0, handling_seconds=0.0,
                                   update_call_seconds=fit.update_call_seconds or 0.0)
    plan = dataclasses.replace(result.plan, hardware=hardware)
    assert {kind for kind, *_ in durations} == {"fwd", "bwd"}, "a pack a task: forwards and backwards timed"
    cost = fit.call_seconds
    assert cost == calls.per_call(plan, [16], durations)
    assert calls.steady(plan, [16], cost, fit.handling_seconds)[0] >= step
    assert fit.handling_seconds == 0 or calls.steady(plan, [16], cost, 0.98 * fit.handling_seconds)[0] < step


def test_the_call_cost_is_the_slope_of_the_task_durations_beside_a_cost_per_task_inside_them() -> None:
    """Durations made by the simulator at 2 ms a call, with 3 ms more per task: the slope finds the 2 ms (the busy
    time's sum, the old fit, would put the 3 ms in the calls too); where every kind of task makes as many calls (a
    whole pass a task), it cannot tell them apart and says nothing, nor on devices whose calls run beside their
    kernels."""
    result = train(weight_bytes(deep_mlp()) // 3)
    plan = dataclasses.replace(result.plan, hardware=dataclasses.replace(result.plan.hardware, call_seconds=0.0,
                                                                          handling_seconds=0.0))
    made = calls.simulated(plan, [16], 2e-3, 0.0)
    taken: dict[calls.TaskKind, list[float]] = {}
    for task, seconds in made.work.items():
        if task.span >= calls.STEPS[0]:
            taken.setdefault((task.kind, task.model, task.pack, task.group), []).append(seconds + 3e-3)
    durations = {kind: sum(seconds) / len(seconds) for kind, seconds in taken.items()}
    assert len({round(seconds, 9) for seconds in durations.values()}) > 2
    assert calls.per_call(plan, [16], durations) == pytest.approx(2e-3)
    backward = {kind: seconds for kind, seconds in durations.items() if kind[0] == "bwd" and kind[2] in (1, 2)}
    assert calls.per_call(plan, [16], backward) is None, "one count of calls: no slope"
    assert calls.per_call(plan, [16], {}) is None
    beside = dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, shared_cores=False))
    assert calls.per_call(beside, [16], durations) is None, "a GPU's calls run beside its kernels: not a slope"


def test_a_swapped_run_fits_the_costs_that_predict_its_steady_step_and_later_plans_take_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fitted: list[calls.Pending] = []
    fit_run = calls._fit
    monkeypatch.setattr(calls, "_fit", lambda run, plan: fitted.append(run) or fit_run(run, plan))
    budget = weight_bytes(deep_mlp()) // 3
    result = train(budget)
    assert result.plan.jobs[0].home is None and len(result.plan.jobs[0].packing.packs) > 2, "a swapped model"
    cold = result.plan.hardware
    assert cold.call_seconds == 0.0 and cold.handling_seconds == max(0.0, cold.task_cpu - cold.task_overhead), (
        "the first run planned without fits: pack calls free, a task's handling the CPU the calibration measured a "
        "task to take beyond its latency")
    assert fitted == [], "train returned without fitting"
    assert result.call_seconds is not None and result.handling_seconds is not None
    fit = calls.Fit(result.call_seconds, result.handling_seconds, result.update_call_seconds)
    updates = sum(result.stats.updates.values()) + sum(result.stats.device_updates.values())
    assert fit.update_call_seconds is not None and updates == 10 * len(result.plan.jobs[0].packing.packs), (
        "an update per pack and step, timed")
    assert fitted == [result.host_costs] and calls.FITS["cpu"] == fitted, "fitted when first asked, once"
    assert calls.fits("cpu") == [fit] and calls.learned("cpu") == fit
    assert_predicts(result, fit)

    def timed(updates: int, seconds: float, device: bool = False) -> harmony.TrainResult:
        stats = dataclasses.replace(result.stats, updates={"cpu-0": 0 if device else updates},
                                    update_seconds={"cpu-0": 0.0 if device else seconds},
                                    device_updates={"cpu-0": updates if device else 0},
                                    device_update_seconds={"cpu-0": seconds if device else 0.0})
        hardware = dataclasses.replace(result.plan.hardware, compute_scale=2.0)
        job = dataclasses.replace(result.plan.jobs[0], device_updates=tuple(range(len(packs))) if device else ())
        return dataclasses.replace(result, stats=stats, plan=dataclasses.replace(result.plan, jobs=(job,),
                                                                                  hardware=hardware))

    packs = result.plan.jobs[0].packing.packs
    passes = sum(4 * pack.float_bytes for pack in packs) / len(packs) / result.plan.hardware.optimizer_bytes_per_second
    assert calls.update_cost(timed(10, 0.01)) == pytest.approx(1e-3 - passes), "per update, less the passes"
    assert calls.update_cost(timed(10, 0.01, device=True)) == pytest.approx(1e-3 - passes / 2), (
        "on the device, at its speed")
    assert calls.update_cost(timed(10, 0.0)) == 0.0 and calls.update_cost(timed(0, 0.0)) is None
    slow = dataclasses.replace(result, stats=dataclasses.replace(
        result.stats, step_seconds=[[100.0 * step for step in range(10)]]))
    unexplained = calls.learn(slow, [16], "cpu")
    assert unexplained is not None and unexplained.fit() is None, "100 s steps: no costs explain them"
    assert calls.fits("cpu") == [fit] and calls.learned("cpu") == fit, "nothing taken of it"
    calls.FITS["cpu"].pop()
    def every(evaluations: int | None, checkpoints: int | None) -> harmony.TrainResult:
        options = dataclasses.replace(result.plan.options, eval_every=evaluations, checkpoint_every=checkpoints)
        return dataclasses.replace(result, val_history=[[(5, 0.5)]] if evaluations else [],
                                   plan=dataclasses.replace(result.plan, options=options))

    assert calls.learn(every(2, None), [16], "cpu") is None, "the simulator predicts no evaluation: one every 2 steps"
    assert calls.learn(every(None, 2), [16], "cpu") is None, "nor checkpoints"
    assert calls.learn(dataclasses.replace(result, pruned={0: 4}), [16], "cpu") is None, (
        "a model pruned at step 4: too few steps of the plan's jobs all training")
    assert calls.fits("cpu") == [fit]
    phase = calls.learn(dataclasses.replace(result, pruned={0: 8}), [16], "cpu")
    assert phase is not None and phase.step == calls.figures(result.stats, range(8))[0], "the steps before step 8"
    assert calls.figures(result.stats, range(8))[:2] != calls.figures(result.stats)[:2]
    calls.FITS["cpu"].pop()
    for spaced in (every(3, None), every(None, 4)):
        kept = calls.learn(spaced, [16], "cpu")
        assert kept is not None and kept.fit() == fit, "every third step or fewer: the median step stands clear"
        calls.FITS["cpu"].pop()
    stopped = dataclasses.replace(result, stats=dataclasses.replace(
        result.stats, step_seconds=[result.stats.step_seconds[0], [0.5]]))
    kept = calls.learn(stopped, [16], "cpu")
    assert kept is not None and kept.fit() == fit, "a model stopped after one step leaves the others' steps"
    calls.FITS["cpu"].pop()

    forecast = harmony.plan(deep_mlp(), regression_batches(160, 16), devices=["cpu"], device_memory=budget,
                            microbatches=4)
    assert (forecast.hardware.call_seconds, forecast.hardware.handling_seconds,
            forecast.hardware.update_call_seconds) == dataclasses.astuple(fit)[:3]
    line = (f"with {fit.call_seconds * 1e6:,.0f} µs of the runtime's host work per pack call and "
            f"{fit.handling_seconds * 1e6:,.0f} µs per task")
    assert (line in str(forecast)) == (fit.call_seconds > 0 or fit.handling_seconds > 0)
    assert f"({fit.update_call_seconds * 1e6:,.0f} µs per update of a pack)" in str(forecast)
    again = train(budget)
    assert again.plan.hardware.call_seconds == fit.call_seconds, "the next run on such devices plans with them"
    assert again.plan.hardware.handling_seconds == fit.handling_seconds
    assert again.call_seconds is not None and again.handling_seconds is not None
    assert again.plan.hardware.update_call_seconds == fit.update_call_seconds
    refit = calls.Fit(again.call_seconds, again.handling_seconds, again.update_call_seconds)
    assert_predicts(again, refit)
    assert refit.update_call_seconds is not None
    assert calls.learned("cpu") == calls.Fit(
        pytest.approx((fit.call_seconds + refit.call_seconds) / 2),
        pytest.approx((fit.handling_seconds + refit.handling_seconds) / 2),
        pytest.approx((fit.update_call_seconds + refit.update_call_seconds) / 2)), "the medians of the fits"
    for _ in range(calls.KEPT):
        calls.learn(again, [16], "cpu")
    assert calls.fits("cpu") == [refit] * calls.KEPT and len(calls.FITS["cpu"]) == calls.KEPT, "the last few fits"

    harmony.shutdown()
    assert calls.FITS == {} and calls.learned("cpu") is None


def test_a_pruned_run_reads_its_first_steps_between_pruning_steps_long_enough_with_the_plan_that_ran_them() -> None:
    """Three models, two of them fused: the plan of a phase keeps the jobs training in it, an array with a member
    stopped narrowed to the other (compiled, it computes both); phases shorter than PHASE are passed over."""
    plan = harmony.plan([deep_mlp() for _ in range(3)], regression_batches(160, 16), devices=["cpu"],
                        device_memory=weight_bytes(deep_mlp()), microbatches=4, fuse=2).plan
    assert all(job.home is None for job in plan.jobs), "swapped"
    array, alone = (next(index for index, job in enumerate(plan.jobs) if len(job.members) == size) for size in (2, 1))
    first, second = plan.jobs[array].members
    steps, whole, stopped = calls.phase(plan, {plan.jobs[alone].members[0]: 8}, 20)
    assert steps == range(8) and whole == plan and stopped == [0, 1], "every job training for 8 steps"
    steps, narrowed, kept = calls.phase(plan, {plan.jobs[alone].members[0]: 3, first: 4}, 20)
    assert steps == range(4, 20) and kept == [array], "3 and 1 steps before: too few"
    assert narrowed.jobs == (plan.jobs[array].narrowed(0.5),)
    packs = zip(narrowed.jobs[0].packing.packs, plan.jobs[array].packing.packs)
    assert all(pack.forward_seconds_per_sample == 0.5 * whole_pack.forward_seconds_per_sample
               for pack, whole_pack in packs)
    compiled = dataclasses.replace(plan, options=dataclasses.replace(plan.options, compile=True))
    assert calls.phase(compiled, {first: 4}, 20)[1].jobs == compiled.jobs, "every member computed, compiled"
    assert calls.phase(plan, {first: 5, second: 5, plan.jobs[alone].members[0]: 10}, 14) is None, "5, 5 and 4 steps"


def test_a_run_pruned_early_fits_its_longer_later_steps() -> None:
    """Two swapped models, one stopped at step 3: the fit reads steps 3 to 15, the other model alone."""
    batches = regression_batches(16 * 15, 16)
    result = harmony.train([deep_mlp(), deep_mlp()], batches, loss_fn=nn.functional.mse_loss, optimizer=sgd,
                           devices=["cpu"], device_memory=weight_bytes(deep_mlp()) // 3, microbatches=4,
                           packs_per_task=1, fuse=False, val_loaders=batches[:1], eval_every=3,
                           prune=lambda step, standings: [1] if step == 3 else [], progress=False)
    assert result.pruned == {1: 3}
    pending = result.host_costs
    assert pending is not None and len(pending.plan.jobs) == 1 and pending.plan.jobs[0].members == (0,)
    assert pending.step == calls.figures(result.stats, range(3, 15))[0]
    assert {job for _, job, _, _ in pending.durations} == {0}
    assert result.call_seconds is not None, "a fit of the later steps"


def test_a_runs_busy_time_per_step_is_its_devices_tasks_over_its_slowest_models_steady_steps() -> None:
    """Model 0's steps end each second (steady from step 1 to step 10), model 1's faster and fewer; the device
    tasks count where they fall between 1 and 10 s, a host update (upd) not at all."""
    timeline = {"d0": [(0.5, 1.5, 0.0, "fwd-m0-p0-s0-x"), (2.0, 2.5, 0.0, "upd-m0-p0-s1-x"),
                       (9.5, 11.0, 0.0, "bwd-m0-p0-s9-x")],
                "d1": [(3.0, 4.0, 0.0, "bwd-m1-p0-s2-x")]}
    stats = Stats(peak_device_bytes={}, bytes_in={}, bytes_out={}, steps=[11, 5], tasks=4, wall_seconds=11.0,
                  step_seconds=[[float(step) for step in range(11)], [0.1, 0.2, 0.3, 0.4, 0.5]], timeline=timeline)
    assert calls.figures(stats)[:2] == pytest.approx((1.0, (0.5 + 0.5 + 1.0) / 9))
    paused = [float(step) + (4.0 if step >= 5 else 0.0) for step in range(11)]  # an evaluation after step 4
    assert calls.figures(dataclasses.replace(stats, step_seconds=[paused, [0.1]]))[0] == pytest.approx(1.0), (
        "the median step")
    spans = [0.0, 1.0, 3.0, 3.0, 5.0, 5.0, 7.0, 7.0, 9.0, 9.0, 10.0]  # steps finishing two by two (spans)
    assert calls.figures(dataclasses.replace(stats, step_seconds=[spans, [0.1]]))[0] == pytest.approx(1.0)
    assert calls.figures(dataclasses.replace(stats, step_seconds=[[1.0], [2.0]])) is None, "no steady steps"


def test_a_run_whose_tasks_make_as_many_calls_each_puts_their_cost_in_its_cost_per_task() -> None:
    """Two swapped models of one pack each: every task (a forward and backward of its micro-batches) makes four
    calls, so no slope tells a call's cost from the task's own work. On CPU devices it fits none, and its cost per
    task takes it all: the least at which its plan predicts its steady step."""
    result = harmony.train([deep_mlp(depth=3, seed=seed) for seed in range(2)], regression_batches(16 * 12, 16),
                           loss_fn=nn.functional.mse_loss, optimizer=sgd, devices=["cpu"], microbatches=4,
                           resident=False, fuse=False, progress=False)
    assert [len(job.packing.packs) for job in result.plan.jobs] == [1, 1] and not result.plan.homes
    run = result.host_costs
    assert run is not None and calls.per_call(run.plan, run.samples, run.durations) is None, "one count of calls"
    fit = run.fit()
    assert fit is not None and fit.call_seconds == 0.0 and not fit.call_measured and fit.handling_seconds > 0
    plan = dataclasses.replace(run.plan, hardware=dataclasses.replace(run.plan.hardware,
                                                                      update_call_seconds=run.update or 0.0))
    assert calls.steady(plan, run.samples, 0.0, fit.handling_seconds)[0] >= run.step
    assert calls.steady(plan, run.samples, 0.0, 0.98 * fit.handling_seconds)[0] < run.step
    assert calls.learned("cpu") == fit


def test_fits_of_runs_that_trained_arrays_and_of_runs_that_did_not_are_kept_apart_once_both_are_kept() -> None:
    """A fit carries what the pilot mispredicts of the way a run trained (an array's layers, a model's). A run of
    two models as an array keeps its fit under their architectures as arrays, and plans take it for both ways until a
    run trains them unfused; from then on each way is predicted with its own runs' fits."""
    models = [deep_mlp(depth=3, seed=seed) for seed in range(2)]
    batches = regression_batches(16 * 12, 16)
    settings = {"loss_fn": nn.functional.mse_loss, "optimizer": sgd, "devices": ["cpu"], "resident": False,
                "device_memory": 4 * weight_bytes(models[0]), "progress": False}
    fused = harmony.train(models, batches, fuse=True, **settings)
    assert fused.arrays == [[0, 1]] and fused.plan.jobs[0].home is None
    architectures = calls.architectures(models)
    arrays, unfused = calls.keyed(architectures, True), calls.keyed(architectures, False)
    assert fused.host_costs is not None and fused.host_costs.models == arrays
    fit = fused.host_costs.fit()
    assert fit is not None and calls.learned("cpu", arrays) == fit
    assert calls.learned("cpu", unfused) == fit, "no run of them unfused yet: the arrays' fit"
    alone = harmony.train([deep_mlp(depth=3, seed=seed) for seed in range(2)], batches, fuse=False, **settings)
    assert alone.host_costs is not None and alone.host_costs.models == unfused
    own = alone.host_costs.fit()
    assert own is not None and own != fit
    assert calls.learned("cpu", unfused) == own and calls.learned("cpu", arrays) == fit


def test_a_homed_run_says_nothing_of_the_call_cost() -> None:
    result = train(10 * weight_bytes(deep_mlp()))
    assert all(job.home is not None for job in result.plan.jobs)
    assert calls.FITS == {} and result.call_seconds is None and result.handling_seconds is None
    assert result.host_costs is None
    assert calls.learn(result, [16], "cpu") is None
    assert calls.learn(result, [16], None) is None


def test_a_run_too_short_for_a_steady_step_keeps_nothing() -> None:
    result = train(weight_bytes(deep_mlp()) // 3, steps=1)
    assert result.plan.jobs[0].home is None
    assert calls.FITS == {} and result.call_seconds is None


def test_later_plans_take_the_medians_of_the_fits_for_their_kind_of_device(monkeypatch: pytest.MonkeyPatch) -> None:
    made = [calls.Fit(1e-3, 5e-3, 4e-4), calls.Fit(2e-3, 1e-3, None), calls.Fit(0.04, 3e-3, 2e-4),
            calls.Fit(0.0, 2e-3, None, call_measured=False)]
    monkeypatch.setattr(calls, "_fit", lambda run, plan: made[int(run.step)])
    calls.FITS["cuda"] = [calls.Pending(None, [16], float(index), 0.0, "cuda")  # type: ignore[arg-type]
                          for index in range(4)]  # the fit stands in for one simulating a plan
    hardware = calls.fitted(Hardware(), "cuda")
    assert (hardware.call_seconds, hardware.handling_seconds) == (2e-3, 2.5e-3), (
        "one run's outlier moves nothing; a run that could not tell a call's cost from a task's is not counted in the "
        "call cost's median")
    assert hardware.update_call_seconds == pytest.approx(3e-4), "the median of the runs that updated on the host"
    assert calls.fitted(Hardware(), "cpu") == Hardware(), "none fitted for CPU devices"
    assert calls.fitted(Hardware(), None) == Hardware(), "devices of several kinds"


def test_a_plan_takes_the_fits_of_runs_of_its_own_architectures_and_no_call_cost_from_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A call's fitted cost depends on the models (what the pilot mispredicts of their layers lands in it): a plan
    of architectures some kept runs trained the same way (as arrays or not) takes their fits alone, else those of
    its architectures' runs the other way; one of architectures no run trained takes other architectures' costs per
    task and per update, and no call cost."""
    made = [calls.Fit(3e-4, 1e-3, 5e-4), calls.Fit(1e-4, 4e-3, 1e-3), calls.Fit(5e-4, 2e-3, None),
            calls.Fit(2e-4, 9e-3, 2e-3)]
    monkeypatch.setattr(calls, "_fit", lambda run, plan: made[int(run.step)])
    keys = ["gpt/models", "mlp/models", "gpt/models", "mlp/arrays"]
    calls.FITS["cuda"] = [calls.Pending(None, [16], float(index), 0.0, "cuda", models=models)  # type: ignore[arg-type]
                          for index, models in enumerate(keys)]
    assert calls.learned("cuda", "mlp/models") == made[1], "its own architectures' run, trained that way"
    assert calls.learned("cuda", "mlp/arrays") == made[3]
    assert calls.learned("cuda", "gpt/models") == calls.Fit(pytest.approx(4e-4), pytest.approx(1.5e-3), 5e-4), (
        "the medians of its own runs")
    assert calls.learned("cuda", "gpt/arrays") == calls.learned("cuda", "gpt/models"), (
        "no run of them as arrays: their runs unfused")
    assert calls.learned("cuda", "cnn/models") == calls.Fit(0.0, 3e-3, pytest.approx(1e-3), call_measured=False), (
        "every run's handling and update, no call cost")
    assert calls.learned("cuda") == calls.Fit(pytest.approx(2.5e-4), 3e-3, pytest.approx(1e-3)), (
        "every run's, where none is asked")
    assert calls.keyed("gpt", True) == "gpt/arrays" and calls.keyed("gpt", False) == "gpt/models"
    mlp = deep_mlp()
    assert calls.architectures([mlp, deep_mlp(seed=1)]) == calls.architectures([deep_mlp(seed=2)]), (
        "the distinct architectures, not the models or how many")
    assert calls.architectures([mlp]) != calls.architectures([deep_mlp(depth=3)])
    assert calls.architectures([mlp]) != calls.architectures([mlp, deep_mlp(depth=3)])


LATER_PROCESS = """
from harmony import calls
runs = calls._kept("cpu")
fitted = [run._fitted for run in runs]
fit = calls.learned("cpu")
print(fitted, fit.call_seconds, fit.handling_seconds)
"""


def later_process() -> tuple[str, float, float]:
    """What a new process on this machine reads of the kept runs: whether each was fitted already, and the costs its
    plans take."""
    done = subprocess.run([sys.executable, "-c", LATER_PROCESS], capture_output=True, text=True, timeout=300,
                          check=True)
    fitted, call, handling = done.stdout.strip().rsplit(" ", 2)
    return fitted, float(call), float(handling)


def test_a_later_process_on_this_machine_plans_with_the_fit_of_a_run_kept_on_disk() -> None:
    result = train(weight_bytes(deep_mlp()) // 3)
    file = fitfiles.path("cpu")
    assert file is not None and file.exists(), "the run's figures kept, not fitted yet"
    assert [run["fitted"] for run in fitfiles.load("cpu")] == [False]
    assert later_process()[0] == "[False]", "the next process finds them unfitted"
    fitted, call, handling = later_process()
    assert fitted == "[True]", "and fitted them for the next: this one reads the fit"
    assert (call, handling) == (result.call_seconds, result.handling_seconds), "the fit this run's figures give"

    calls.forget()
    assert calls.learned("cpu") is None, "forgotten in this process"
    assert file.exists() and later_process()[1:] == (call, handling), "kept for later ones"
    calls.forget(files=True)
    assert not file.exists()


def test_a_run_on_another_machines_devices_or_with_no_cache_directory_keeps_nothing_on_disk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    result = train(weight_bytes(deep_mlp()) // 3)
    file = fitfiles.path("cpu")
    assert file is not None
    file.unlink()
    assert calls.learn(result, [16], "cpu", local=False) is not None and not file.exists()
    monkeypatch.setenv("HARMONY_CACHE_DIR", "")
    assert calls.learn(result, [16], "cpu", local=True) is not None and not file.exists()
    assert len(calls.fits("cpu")) == 3, "kept in this process all the same"
