"""harmony.plan: the plan and its predictions, printed readably, with no worker started."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import harmony
from harmony.tasks.graph import TaskId
from tests.conftest import deep_mlp, param_bytes, regression_batches

pytestmark = pytest.mark.usefixtures("no_cluster_may_start")


def test_plan_on_this_machine_predicts_packs_peaks_and_swaps() -> None:
    models = [deep_mlp(seed=s) for s in range(3)]
    plan = harmony.plan(models, regression_batches(128, 16), microbatches=4, devices=2, device_memory=24_000,
                        packs_per_task=1)  # sections other than the last read their weights a third time
    assert [len(p.packs) for p in plan.packings] == [12, 12, 12]
    assert set(plan.budgets) == {"cpu-0", "cpu-1"}
    assert all(0 < peak <= 24_000 for peak in plan.peak_device_bytes.values())
    weights = param_bytes(models[0])
    assert plan.grads_out_per_step == weights
    assert weights <= plan.weights_in_per_step <= 2 * weights
    assert plan.step_seconds > 0
    text = str(plan)
    assert "model 0 (Sequential): 12 packs" in text and "predicted:" in text and "cpu-1" in text


def test_packs_per_task_auto_weighs_a_whole_pass_a_task_beside_a_pack_a_task_and_its_sections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Pack calls of 2 ms each: the sections the task cost proposes (several packs each, not the whole pass) recompute
    their later packs' inputs, calls the simulator charges, and predict slower than a pack a task; a whole pass a task
    recomputes none and predicts fastest, so auto takes it."""
    hardware = harmony.Hardware("costly calls", task_overhead=1e-3, call_seconds=2e-3, shared_cores=True)
    with caplog.at_level(logging.INFO, logger="harmony"):
        auto = harmony.plan([deep_mlp(seed=s) for s in range(2)], regression_batches(128, 16), microbatches=4,
                            devices=1, device_memory=24_000, hardware=hardware)
    [line] = [record.message for record in caplog.records if record.message.startswith("packs_per_task auto")]
    predicted = dict(re.findall(r"(a pack a task|sections|a pass a task) ([\d.]+) ms", line))
    assert list(predicted) == ["a pack a task", "sections", "a pass a task"], line
    ranked = sorted(predicted, key=lambda name: float(predicted[name]))
    assert ranked == ["a pass a task", "a pack a task", "sections"], line
    assert [job.sections for job in auto.plan.jobs] == [(0,), (0,)]
    assert "12 packs [" in str(auto) and "one task a pass (12 packs)" in str(auto)


def test_plan_for_hardware_that_is_not_here() -> None:
    gpus = harmony.Hardware("4 GPUs on PCIe 4", compute_scale=50, host_link=25e9, peer_link=25e9)
    plan = harmony.plan([deep_mlp()], regression_batches(64, 16), microbatches=2, devices=4,
                        device_memory="1MB", hardware=gpus, compile=True)
    assert list(plan.budgets) == ["dev-0", "dev-1", "dev-2", "dev-3"]
    assert "(4 GPUs on PCIe 4)" in str(plan) and ", every pack through torch.compile" in str(plan)
    here = harmony.plan([deep_mlp()], regression_batches(64, 16), microbatches=2, devices=4, device_memory="1MB")
    assert plan.step_seconds < here.step_seconds and "torch.compile" not in str(here)


def test_plan_needs_a_count_and_a_budget_for_hypothetical_hardware() -> None:
    with pytest.raises(harmony.InputError, match="devices as a count"):
        harmony.plan([deep_mlp()], regression_batches(64, 16), devices=["cuda:0"], hardware=harmony.Hardware())
    with pytest.raises(harmony.InputError, match="pass device_memory"):
        harmony.plan([deep_mlp()], regression_batches(64, 16), devices=2, hardware=harmony.Hardware())


def test_plan_refuses_a_budget_too_small() -> None:
    with pytest.raises(harmony.InputError, match="device_memory is too small"):
        harmony.plan([deep_mlp()], regression_batches(64, 16), device_memory="8kB")


def test_auto_microbatches_are_the_fewest_at_which_every_layer_fits() -> None:
    batches = regression_batches(512, 256)
    fewest = harmony.plan([deep_mlp()], batches, device_memory=30_000, microbatches="auto")
    count = fewest.plan.options.microbatches
    assert count > 1 and f", {count} micro-batches a step" in str(fewest)
    assert harmony.plan([deep_mlp()], batches, device_memory=30_000, microbatches=count).packings == fewest.packings
    with pytest.raises(harmony.BudgetTooSmall):
        harmony.plan([deep_mlp()], batches, device_memory=30_000, microbatches=count - 1)
    assert harmony.plan([deep_mlp()], batches, device_memory=10_000_000, microbatches="auto"
                        ).plan.options.microbatches == 1, "the whole batch fits"
    with pytest.raises(harmony.BudgetTooSmall, match="in any number of micro-batches") as refused:
        harmony.plan([deep_mlp()], batches, device_memory=9_000, microbatches="auto")
    least = refused.value.minimum  # its message's figure: micro-batches of one sample fit there, not a byte below
    alone = harmony.plan([deep_mlp()], batches, device_memory=least, microbatches="auto")
    assert alone.plan.options.microbatches == 256
    with pytest.raises(harmony.BudgetTooSmall):
        harmony.plan([deep_mlp()], batches, device_memory=least - 1, microbatches=256)
    with pytest.raises(harmony.InputError, match="more than the 16 samples of model 1"):
        harmony.plan([deep_mlp(), deep_mlp(seed=1)], [batches, regression_batches(32, 16)], device_memory=16_000,
                     microbatches="auto")
    with pytest.raises(harmony.InputError, match="a positive integer or 'auto'"):
        harmony.plan([deep_mlp()], batches, microbatches="fewest")


def test_auto_microbatches_warn_that_batchnorm_then_sees_micro_batches(caplog: pytest.LogCaptureFixture) -> None:
    normed = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), *list(deep_mlp())[1:])
    batches = regression_batches(512, 256)
    with caplog.at_level("WARNING", logger="harmony"):
        harmony.plan([normed], batches, device_memory=10_000_000, microbatches="auto")
        assert not caplog.records, "the whole batch fits: nothing to warn of"
        assert harmony.plan([normed], batches, device_memory=40_000, microbatches="auto").plan.options.microbatches > 1
    assert any("BatchNorm" in record.getMessage() for record in caplog.records)


def test_plan_takes_a_loader_without_length_when_steps_are_given() -> None:
    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from regression_batches(64, 16)

    plan = harmony.plan([deep_mlp()], batches(), steps=3, device_memory=1_000_000)
    assert plan.steps == [3]


def test_auto_mode_simulates_every_mode_on_several_devices_and_picks_the_fastest() -> None:
    plan = harmony.plan([deep_mlp(seed=s) for s in range(2)], regression_batches(64, 16), microbatches=4,
                        devices=2, device_memory=24_000)
    assert set(plan.predicted_modes) == {"free", "vpp", "vdp"}
    assert plan.mode == min(plan.predicted_modes, key=plan.predicted_modes.get)
    assert "modes (predicted per step):" in str(plan)
    vdp = harmony.plan([deep_mlp()], regression_batches(64, 16), microbatches=4, devices=2, device_memory=24_000,
                       mode="vdp")
    assert vdp.mode == "vdp" and set(vdp.predicted_modes) == {"vdp"}
    assert any(task.group == 1 for task in vdp.simulation.order["cpu-1"])


def test_plan_takes_trains_arguments_and_refuses_others() -> None:
    with pytest.raises(harmony.InputError, match="takes no 'epoch'"):
        harmony.plan([deep_mlp()], regression_batches(64, 16), epoch=2)
    forecast = harmony.plan([deep_mlp()], regression_batches(64, 16), epochs=2, device_memory=1_000_000)
    assert forecast.steps == [8] and forecast.plan.options.epochs == 2 and forecast.plan.options.fuse == "auto"


def test_updates_are_overlapped_where_the_simulator_predicts_it_faster_and_the_plan_says_so() -> None:
    """On this machine's CPU devices a host thread takes the devices' own cores: updates stay in backward. On
    accelerators of their own, whose backward takes longer than a pack's update, they go beside the device; asked
    for, they go there anyway."""
    models, batches = [deep_mlp(seed=0)], regression_batches(64, 16)
    here = harmony.plan(models, batches, devices=1, device_memory=24_000)
    assert not here.plan.jobs[0].overlap and "updates beside" not in str(here)
    accelerators = harmony.Hardware("accelerators", compute_scale=0.01, host_link=25e9, task_overhead=1e-4,
                                    optimizer_bytes_per_second=1e7)
    there = harmony.plan(models, batches, devices=1, device_memory=24_000, hardware=accelerators)
    assert there.plan.jobs[0].overlap and "updates beside the device" in str(there)
    assert there.simulation.order["dev-0"].count(TaskId("upd", 0, 0, 0)) == 1
    asked = harmony.plan(models, batches, devices=1, device_memory=24_000, overlap_update=True)
    assert asked.plan.jobs[0].overlap
    homed = harmony.plan(models, batches, devices=1, overlap_update=True)
    assert homed.plan.jobs[0].home is not None and not homed.plan.jobs[0].overlap, "a homed job updates on its device"
    with pytest.raises(harmony.InputError, match="overlap_update"):
        harmony.plan(models, batches, overlap_update=1)


def test_a_sweep_of_one_architecture_is_timed_on_its_first_model(timed_calls: list[int],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The pilot times the first model of an architecture (and the first array of a fused size) and the others
    take its timings, each of their layers called once: a sweep of large models is planned in a fraction of the
    forwards. Its update is timed once per optimizer class (here SGD and Adam), for the packs of each model."""
    from harmony import planner

    calls = timed_calls
    updates: list[type] = []
    rate = planner.update_rate
    monkeypatch.setattr(planner, "update_rate", lambda factory, layers: updates.append(
        type(factory([nn.Parameter(torch.zeros(1))]))) or rate(factory, layers))
    batches = regression_batches(samples=16 * 3, batch=16)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    adam = lambda p: torch.optim.Adam(p, lr=0.1)  # noqa: E731
    forecast = harmony.plan([deep_mlp(seed=s) for s in range(4)], batches, nn.functional.mse_loss,
                            [sgd, sgd, adam, sgd], devices=["cpu"], fuse=False)
    layers = calls.count(7)
    assert layers > 1 and calls == [7] * layers + [1] * 3 * layers, calls
    jobs = forecast.plan.jobs
    assert len({job.step_seconds for job in jobs}) == 1, "the followers' packs are timed alike"
    assert updates == [torch.optim.SGD, torch.optim.Adam]
    seconds = [sum(pack.update_seconds for pack in job.packing.packs) for job in jobs]
    assert seconds[0] == seconds[1] == seconds[3] > 0 and seconds[2] > 0 and seconds[2] != seconds[0]
    ratio = jobs[0].packing.packs[0].backward_ratio
    said = f"pilot: a backward {ratio:.1f}x its forward, its optimizer's step {seconds[0] * 1e3:.2f} ms"
    assert said in str(forecast)


def test_updates_go_on_the_device_where_the_simulator_predicts_it_faster_and_the_plan_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a GPU with a slow host optimizer the state's trip over the link costs less than the host's passes: the
    updates go on the device. On this machine's CPU devices (the same cores, no faster) they stay on the host. A
    state that does not fit beside its pack keeps them there, and update_on="device" cannot change that."""
    models, batches = [deep_mlp(seed=0)], regression_batches(64, 16)
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    gpu = harmony.Hardware("gpu", compute_scale=50.0, host_link=25e9, task_overhead=1e-4,
                           optimizer_bytes_per_second=2e9)
    there = harmony.plan(models, batches, optimizer=adam, devices=1, device_memory=24_000, hardware=gpu)
    assert there.plan.jobs[0].device_update and not there.plan.jobs[0].overlap
    assert "updates on the device" in str(there) and "weight bytes out" in str(there)
    assert there.memory.grads_out == 0 and there.memory.weights_out > 0
    host = harmony.plan(models, batches, optimizer=adam, devices=1, device_memory=24_000, hardware=gpu,
                        update_on="host")
    assert not host.plan.jobs[0].device_update and host.step_seconds > there.step_seconds
    here = harmony.plan(models, batches, optimizer=adam, devices=1, device_memory=24_000)
    assert not here.plan.jobs[0].device_update and "updates on the device" not in str(here)
    asked = harmony.plan(models, batches, optimizer=adam, devices=1, device_memory=24_000, update_on="device")
    assert asked.plan.jobs[0].device_update
    with caplog.at_level("INFO", logger="harmony"):
        tight = harmony.plan(models, batches, optimizer=adam, devices=1, device_memory=16_000, microbatches=8,
                             update_on="device")
    assert not tight.plan.jobs[0].device_update
    assert "update on the host store: their optimizer state does not fit beside their weights" in caplog.text
    with pytest.raises(harmony.InputError, match="update_on"):
        harmony.plan(models, batches, update_on="gpu")
    with pytest.raises(harmony.InputError, match="overlap_update=True"):
        harmony.plan(models, batches, update_on="device", overlap_update=True)
    with pytest.raises(harmony.InputError, match="fp16"):
        harmony.plan(models, batches, update_on="device", precision="fp16")


def test_a_clipped_model_updates_in_upd_tasks_once_its_whole_backward_is_done() -> None:
    """Clipping reads every pack's gradients of a step, so its upd tasks come after every bwd of it, in the plan's
    graph and in the simulated order; a model that is not clipped keeps its per-pack dependencies."""
    models, batches = [deep_mlp(seed=0), deep_mlp(seed=1)], regression_batches(64, 16)
    forecast = harmony.plan(models, batches, devices=1, device_memory=24_000, clip_grad_norm=[1.0, None], fuse=False,
                            packs_per_task=1)
    clipped, free = forecast.plan.jobs
    assert clipped.clip == (1.0,) and clipped.whole_step and clipped.overlap
    assert free.clip == () and not free.whole_step
    lines = str(forecast).splitlines()
    assert "gradients clipped at norm 1 (every update after the whole backward)" in lines[1]
    assert "clipped" not in lines[2]
    packs = len(clipped.packing.packs)
    order = forecast.simulation.order["cpu-0"]
    assert max(order.index(TaskId("bwd", 0, pack, 0)) for pack in range(packs)) < order.index(TaskId("upd", 0, 0, 0))


def test_the_hosts_work_per_pack_call_is_predicted_and_weighs_in_how_many_packs_a_task_runs() -> None:
    """A GPU whose kernels are short against the runtime's work per pack call: the plan predicts the step from that
    work, and with each pack's forward that long its tasks need fewer packs to keep Dask's cost per task small."""
    batches = regression_batches(64, 16)
    budget = param_bytes(deep_mlp()) // 3
    steps = {}
    for cost in (0.0, 0.2):
        gpu = harmony.Hardware("a GPU", compute_scale=100.0, host_link=1e12, task_overhead=0.01, call_seconds=cost)
        forecast = harmony.plan([deep_mlp()], batches, devices=1, device_memory=budget, microbatches=2, hardware=gpu)
        job = forecast.plan.jobs[0]
        packs = len(job.packing.packs)
        assert job.home is None and packs > 2
        steps[cost] = forecast.step_seconds, job.section_count
        assert ("per pack call" in str(forecast)) == (cost > 0)
    calls = (packs - 1) * 2 + 2 * packs * 2  # a step: every pack's forward but the last's, every backward twice
    assert steps[0.0][1] == 1, "kernels this short: the whole pass one task"
    assert steps[0.2][1] == packs, "a pack's call alone outlasts ten times a task's cost"
    assert steps[0.2][0] >= calls * 0.2 > 10 * steps[0.0][0]
