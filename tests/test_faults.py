"""Nothing lost when things go wrong: a device worker killed at any point of a step, on the embedded cluster and on
a user's dask scheduler + dask worker cluster (with and without a nanny), costs only the lost work; the result
equals plain PyTorch, the run ends in bounded time and leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from distributed import get_worker
from torch import nn

import harmony
from tests.conftest import (
    TiedEnds,
    assert_same_weights,
    clones,
    deep_mlp,
    described,
    harmony_files,
    regression_batches,
    stop,
    train_plain,
    train_plain_scheduled,
)

STEPS = 6


def on_worker_task() -> str | None:
    """The key of the task running this code on a Dask worker, or None in the driver (the pilot pass)."""
    try:
        return str(get_worker().get_current_task())
    except ValueError:
        return None


class Killer(nn.Module):
    """An identity layer that kills its own worker process once, the first time it runs inside a task whose key
    starts with kind, after it has run there calls times (counted across processes in marker's directory)."""

    def __init__(self, marker: str, kind: str, calls: int = 0) -> None:
        super().__init__()
        self.marker = marker
        self.kind = kind
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kill_once(self.marker, self.kind, self.calls)
        return x


def kill_once(marker: str, kind: str, calls: int) -> None:
    key = on_worker_task()
    if key is None or not key.startswith(kind) or os.path.exists(marker):
        return
    counter = marker + ".calls"
    with open(counter, "ab") as handle:
        handle.write(b".")
    if os.path.getsize(counter) > calls:
        Path(marker).write_text(key)
        os.kill(os.getpid(), signal.SIGKILL)


class KillingSGD(torch.optim.SGD):
    """SGD that, once, writes garbage into its parameters and kills its worker in the middle of a step."""

    def __init__(self, params: object, marker: str, calls: int, **options: object) -> None:
        super().__init__(params, **options)  # type: ignore[arg-type]
        self.marker = marker
        self.calls = calls

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        if on_worker_task() is not None and not os.path.exists(self.marker):
            counter = self.marker + ".calls"
            with open(counter, "ab") as handle:
                handle.write(b".")
            if os.path.getsize(counter) > self.calls:
                for group in self.param_groups:
                    for param in group["params"]:
                        param.add_(1000.0)  # half an update, written into the slot being stepped
                Path(self.marker).write_text("update")
                os.kill(os.getpid(), signal.SIGKILL)
        super().step()


def swapped_model(marker: str, kind: str, calls: int, seed: int = 0) -> nn.Sequential:
    """A 12-layer MLP cut into several packs under the tests' budget, with a Killer in its middle."""
    model = deep_mlp(seed=seed)
    layers = list(model)
    return nn.Sequential(*layers[:12], Killer(marker, kind, calls), *layers[12:])


def sgd(parameters: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


def check_against_plain(models: list[nn.Module], references: list[nn.Module], batches: list, factories: list) -> None:
    for model, reference, factory in zip(models, references, factories):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference)


@pytest.mark.parametrize("kind,packs_per_task", [("fwd", 1), ("bwd", 1), ("bwd", 4)],
                         ids=["during-a-forward", "during-a-backward", "inside-a-section"])
def test_an_embedded_worker_killed_mid_step_costs_only_that_step(
    kind: str, packs_per_task: int, tmp_path: Path, no_leaks: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from harmony.progress import ProgressLine

    monkeypatch.setattr("harmony.api.display", ProgressLine)
    marker = str(tmp_path / "killed")
    models = [swapped_model(marker, kind, calls=5), deep_mlp(depth=2, seed=3)]
    references = clones(models)
    batches = regression_batches(samples=16 * STEPS, batch=16)
    started = time.monotonic()
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=sgd, microbatches=2,
                           devices=["cpu", "cpu"], device_memory=24_000, progress=True, fuse=False,
                           packs_per_task=packs_per_task)
    assert time.monotonic() - started < 120
    assert Path(marker).read_text().startswith(kind), "the worker was not killed where the test meant"
    check_against_plain(models, references, batches, [sgd, sgd])
    lost = [event for event in result.events if event["event"] == "worker lost"]
    assert len(lost) == 1 and 0 in lost[0]["jobs redone"] and lost[0]["suspects"] == [0]
    assert result.stats.steps == [STEPS, STEPS] and not result.failed
    shown = re.findall(r"harmony: (cpu-\d)'s worker was lost [\d.]+ s into the run, busy with (model 0\b[^,;]*)"
                       r"; redoing (.*?)\x1b", capsys.readouterr().err)
    assert len(shown) == 1 and shown[0][0] == lost[0]["device"], "written once, as it happened"
    assert shown[0][2].startswith(f"{shown[0][1]} on "), shown


@pytest.mark.parametrize("where", ["in-backward", "beside-the-device", "on-the-device", "clipped", "clipped-vdp"])
def test_a_worker_killed_during_an_update_leaves_the_weights_it_was_writing_intact(
    where: str, tmp_path: Path, no_leaks: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The dying update writes garbage into the weights it steps: the host slot it would publish, or, on the device,
    the cached weights, which die with the worker; the update runs again from the version before it. Clipped, the
    update run again scales the step's gradients by the norm its first attempt's step computed, as before; with
    vDP's micro-batch groups, it sums them again rather than step the sum its first attempt scaled in place."""
    clipped = where.startswith("clipped")
    overlap = where in ("beside-the-device", "clipped", "clipped-vdp")
    update_on = "device" if where == "on-the-device" else "host"
    marker = str(tmp_path / "killed")
    killing = lambda p: KillingSGD(p, marker, calls=7, lr=0.05, momentum=0.9)  # noqa: E731
    models = [deep_mlp(seed=1), deep_mlp(seed=2)]
    references = clones(models)
    batches = regression_batches(samples=16 * STEPS, batch=16)
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=[killing, sgd],
                           microbatches=2, devices=["cpu", "cpu"], device_memory=24_000, progress=False, fuse=False,
                           overlap_update=None if clipped else overlap, update_on=update_on,
                           clip_grad_norm=0.05 if clipped else None, mode="vdp" if where == "clipped-vdp" else "auto")
    assert Path(marker).read_text() == "update"
    assert all(job.overlap == overlap and job.device_update == (update_on == "device") for job in result.plan.jobs)
    assert all(job.groups == (2 if where == "clipped-vdp" else 1) for job in result.plan.jobs)
    if clipped:
        for model, reference in zip(models, references):
            _, norms = train_plain_scheduled(reference, batches, sgd, clip=0.05)
            assert min(norms) > 0.05, "every step is clipped"
            assert_same_weights(model, reference)
    else:
        check_against_plain(models, references, batches, [sgd, sgd])
    lost = [event for event in result.events if event["event"] == "worker lost"]
    assert len(lost) == 1 and 0 in lost[0]["suspects"], "the job whose update died is a suspect, on any thread"
    logged = [record.getMessage() for record in caplog.records if "worker was lost" in record.getMessage()]
    assert len(logged) == 1 and logged[0].startswith(f"harmony: {lost[0]['device']}'s worker was lost "), (
        "without a display (progress=False), the log says it as it happens")


class MarkReadingSGD(torch.optim.SGD):
    """SGD that, in a host update (an upd task), appends to record how many host updates of job its worker has
    marked running (runtime.counters), as a driver would read them if the worker died then."""

    def __init__(self, params: object, record: str, job: int, **options: object) -> None:
        super().__init__(params, **options)  # type: ignore[arg-type]
        self.record = record
        self.job = job

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        key = on_worker_task()
        if key is not None and key.startswith("upd"):
            from harmony.runtime.counters import NAMES
            from harmony.runtime.worker import RUNS

            (context,) = RUNS.values()
            with open(self.record, "a") as handle:
                handle.write(f"{context.counters.shared[len(NAMES) + self.job].item()}\n")
        super().step()


def test_a_host_update_is_marked_on_its_worker_while_it_runs(tmp_path: Path, no_leaks: None) -> None:
    """What lets a lost worker's death count against a job whose update ran beside the device (tasks.binding)."""
    record = str(tmp_path / "marks")
    models = [deep_mlp(seed=1), deep_mlp(seed=2)]
    factories = [lambda p: MarkReadingSGD(p, record, 0, lr=0.05, momentum=0.9), sgd]
    harmony.train(models, regression_batches(samples=16 * 3, batch=16), loss_fn=nn.functional.mse_loss,
                  optimizer=factories, microbatches=2, devices=["cpu", "cpu"], device_memory=24_000, progress=False,
                  fuse=False, overlap_update=True)
    marks = Path(record).read_text().split()
    assert len(marks) >= 3 and all(int(mark) >= 1 for mark in marks), marks


def test_a_homed_model_killed_in_the_middle_of_a_multi_step_task_takes_up_from_its_last_task(
    tmp_path: Path, no_leaks: None
) -> None:
    marker = str(tmp_path / "killed")
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), Killer(marker, "bwd", calls=10), nn.Linear(32, 4))
    references = clones([model])
    batches = regression_batches(samples=16 * 24, batch=16)
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=adam, devices=["cpu"],
                           steps_per_task=4, progress=False)
    assert result.homes == {0: "cpu-0"} and result.stats.steps_per_task == [4]
    assert os.path.exists(marker), "the span's worker was not killed"
    losses = train_plain(references[0], batches, nn.functional.mse_loss, adam)
    assert_same_weights(model, references[0])
    assert result.history[0] == pytest.approx(losses, rel=1e-5)
    assert [event["event"] for event in result.events] == ["worker lost", "worker joined"]


def dask_environment() -> dict[str, str]:
    """The environment of a test's dask processes: they import this module as pytest does, to unpickle its tasks."""
    tests = str(Path(__file__).parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), tests,
                                                                      os.environ.get("PYTHONPATH")]))}


def dask_worker(address: str, name: str, nanny: bool) -> subprocess.Popen:
    """A dask worker process of one thread on loopback, joining the scheduler at address."""
    return subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1", "--name",
                             name, "--host", "127.0.0.1", "--no-dashboard", "--nanny" if nanny else "--no-nanny"],
                            env=dask_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def users_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A dask scheduler and dask worker processes on loopback, (nanny, workers) as the test asks, all of them
    joined: with a nanny a killed worker is restarted, without one it stays dead."""
    nanny, workers = request.param
    port = 8900 + os.getpid() % 50
    address = f"tcp://127.0.0.1:{port}"
    processes = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                   "--port", str(port), "--no-dashboard", "--dashboard-address", "127.0.0.1:0"],
                                  env=dask_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    processes += [dask_worker(address, f"cpu-{index}", nanny) for index in range(workers)]
    try:
        from distributed import Client

        with Client(address) as client:
            client.wait_for_workers(workers, timeout=60)  # all of them: a run's devices are those there when it starts
        yield address
    finally:
        stop(processes)


@pytest.mark.parametrize("users_cluster", [(True, 2), (False, 5)], ids=["nanny", "no-nanny"], indirect=True)
def test_users_workers_killed_in_a_forward_a_backward_an_update_and_a_span_cost_only_that_work(
    users_cluster: str, tmp_path: Path
) -> None:
    from distributed import Client

    with Client(users_cluster) as client:
        client.wait_for_workers(2, timeout=60)
        workers = len(client.scheduler_info()["workers"])
    markers = {kind: str(tmp_path / f"killed-{kind}") for kind in ("fwd", "bwd", "update", "span")}
    # Kills a few steps apart (a step calls a Killer twice, once per micro-batch; an optimizer once per pack, 12)
    killing = lambda p: KillingSGD(p, markers["update"], calls=12 * 5, lr=0.05, momentum=0.9)  # noqa: E731
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    models = [
        swapped_model(markers["fwd"], "fwd", calls=2 * 2),
        swapped_model(markers["bwd"], "bwd", calls=2 * 8, seed=1),
        deep_mlp(seed=2),
        nn.Sequential(nn.Linear(32, 8), nn.Tanh(), Killer(markers["span"], "bwd", calls=2 * 10), nn.Linear(8, 4)),
    ]
    references = clones(models)
    batches = regression_batches(samples=16 * 12, batch=16)
    started = time.monotonic()
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=[sgd, sgd, killing, adam],
                           cluster=users_cluster, device_memory=32_000, microbatches=2, steps_per_task=4,
                           packs_per_task=1, progress=False, fuse=False)
    assert time.monotonic() - started < 240
    assert Path(markers["fwd"]).read_text().startswith("fwd") and Path(markers["bwd"]).read_text().startswith("bwd")
    assert Path(markers["update"]).read_text() == "update" and Path(markers["span"]).exists()
    assert 3 in result.homes and not result.failed
    check_against_plain(models, references, batches, [sgd, sgd, sgd, adam])
    assert [event["event"] for event in result.events].count("worker lost") == 4
    if workers == 5:
        assert [event["event"] for event in result.events].count("worker joined") == 0
    assert not harmony_files()


class Lingering(nn.Module):
    """An identity layer that, the first time it runs in a forward of micro-batch group 0 at step 1 (vDP: on the
    group's device), kills every other worker whose pid is in pids (the file's lines: its job's group 1 runs there, so
    the job's span runs again as a new attempt) and waits until its own task is cancelled (the driver dropped it);
    it then writes "dropped" into record, and "called again" for each later call in that task."""

    def __init__(self, pids: str, record: str) -> None:
        super().__init__()
        self.pids = pids
        self.record = record

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from harmony.tasks.graph import key_attempt, parse_key

        key = on_worker_task()
        parsed = parse_key(key) if key is not None else None
        if parsed is None or (parsed[0].kind, parsed[0].span, parsed[0].group, key_attempt(key)) != ("fwd", 1, 0, 0):
            return x
        if os.path.exists(self.record):
            with open(self.record, "a") as handle:
                handle.write("called again\n")
            return x
        for pid in map(int, Path(self.pids).read_text().split()):
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
        worker = get_worker()
        deadline = time.monotonic() + 60
        while worker.state.tasks[key].state != "cancelled" and time.monotonic() < deadline:
            time.sleep(0.01)
        Path(self.record).write_text(f"{worker.state.tasks[key].state}\n")
        return x


@pytest.mark.parametrize("users_cluster", [(False, 2)], ids=["two-workers-no-nanny"], indirect=True)
def test_a_dropped_attempt_still_running_stops_at_its_next_microbatch(users_cluster: str, tmp_path: Path) -> None:
    """A worker lost makes its jobs' open spans run again; a task of the earlier attempt that is running elsewhere is
    dropped (Dask lets it run on): it stops at its next micro-batch, and the job equals plain PyTorch."""
    from distributed import Client

    with Client(users_cluster) as client:
        pids = client.run(os.getpid)
    (tmp_path / "pids").write_text("\n".join(map(str, pids.values())))
    record = tmp_path / "record"
    layers = list(deep_mlp(seed=4))
    model = nn.Sequential(*layers[:2], Lingering(str(tmp_path / "pids"), str(record)), *layers[2:])
    reference = clones([model])
    batches = regression_batches(samples=16 * STEPS, batch=16)
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=sgd, cluster=users_cluster,
                           device_memory=24_000, microbatches=4, mode="vdp", packs_per_task=1, progress=False,
                           fuse=False)
    assert result.plan.jobs[0].groups == 2 and result.plan.jobs[0].home is None
    assert record.read_text() == "cancelled\n", "the task went on past its cancellation, or was never cancelled"
    check_against_plain([model], reference, batches, [sgd])
    assert [event["event"] for event in result.events] == ["worker lost"]


@pytest.mark.parametrize("users_cluster", [(False, 1)], ids=["one-worker-no-nanny"], indirect=True)
def test_a_run_whose_every_device_is_gone_for_good_fails_with_a_clear_error_and_leaves_nothing(
    users_cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distributed import Client

    from harmony.runtime import driver

    with Client(users_cluster) as client:
        client.wait_for_workers(1, timeout=60)
    monkeypatch.setattr(driver, "DEVICE_TIMEOUT", 2.0)
    marker = str(tmp_path / "killed")
    batches = regression_batches(samples=16 * STEPS, batch=16)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="every device's worker has been lost for 2 s"):
        harmony.train(swapped_model(marker, "bwd", calls=2), batches, loss_fn=nn.functional.mse_loss, optimizer=sgd,
                      cluster=users_cluster, device_memory=24_000, microbatches=2, progress=False)
    assert os.path.exists(marker) and time.monotonic() - started < 60
    assert not harmony_files()


@pytest.mark.parametrize("users_cluster", [(False, 2)], ids=["two-workers-no-nanny"], indirect=True)
def test_a_worker_that_joins_after_the_run_chose_its_devices_gets_no_part_in_it(
    users_cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harmony import api

    chosen = api.external_devices
    monkeypatch.setattr(api, "external_devices", lambda *args: chosen(*args)[:1])  # cpu-1 "joined" after the choice
    model = deep_mlp(seed=3)
    reference = clones([model])[0]
    batches = regression_batches(samples=16 * STEPS, batch=16)
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=sgd, cluster=users_cluster,
                           device_memory=24_000, microbatches=2, progress=False)
    assert list(result.stats.schedule) == list(result.plan.devices) == ["cpu-0"] and not result.failed
    check_against_plain([model], [reference], batches, [sgd])
    assert not harmony_files()


def diverging_losses(model: nn.Module, batches: list, factory: object) -> tuple[int, nn.Module]:
    """The first step at which plain PyTorch's loss is not finite, and the model as it was before that step."""
    import copy

    optimizer = factory(model.parameters())  # type: ignore[operator]
    for step, (x, y) in enumerate(batches):
        before = copy.deepcopy(model)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if not torch.isfinite(loss):
            return step, before
        loss.backward()
        optimizer.step()
    raise AssertionError("the plain loop never diverged")


@pytest.mark.parametrize("budget", [None, 30_000], ids=["homed", "swapped"])
def test_a_diverging_model_stops_with_its_last_finite_weights_and_the_others_go_on(
    budget: int | None, no_leaks: None, capfd: pytest.CaptureFixture[str]
) -> None:
    blowing_up = lambda p: torch.optim.SGD(p, lr=1e4)  # noqa: E731
    models = [deep_mlp(seed=1), deep_mlp(seed=2), deep_mlp(seed=3)]
    references = clones(models)
    batches = regression_batches(samples=16 * 12, batch=16)
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=[sgd, blowing_up, sgd],
                           device_memory=budget, devices=["cpu", "cpu"], progress=False, fuse=False)
    step, before = diverging_losses(references[1], batches, blowing_up)
    assert list(result.failed) == [1] and result.failed[1]["step"] == step
    assert "loss became" in str(result.failed[1]["reason"])
    assert_same_weights(models[1], before)
    assert len(result.history[1]) == step and all(torch.isfinite(torch.tensor(result.history[1])))
    for index in (0, 2):
        train_plain(references[index], batches, nn.functional.mse_loss, sgd)
        assert_same_weights(models[index], references[index])
    assert result.stats.steps == [12, step, 12]
    assert any(event["event"] == "job failed" for event in result.events)
    assert "Compute Failed" not in capfd.readouterr().err, "the workers' logs report an expected event as an error"


def test_a_homed_step_checks_each_members_first_loss_that_is_not_finite_among_its_microbatches() -> None:
    from harmony.runtime.divergence import first_not_finite

    inf, nan = float("inf"), float("nan")
    seen = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([inf, 5.0, nan]), torch.tensor([nan, 6.0, 7.0])]
    picked = first_not_finite(seen)
    assert picked[0].item() == inf and picked[1].item() == 6.0 and torch.isnan(picked[2])
    assert torch.equal(first_not_finite(seen[:1]), seen[0])


@pytest.mark.parametrize("budget,update_on,microbatches", [
    (None, "auto", 1), (None, "auto", 4), (150_000, "host", 1), (150_000, "device", 1)],
    ids=["homed", "homed-in-micro-batches", "swapped", "swapped-updated-on-the-device"])
def test_a_diverging_member_of_a_fused_array_stops_while_the_others_train_on(
    budget: int | None, update_on: str, microbatches: int, no_leaks: None
) -> None:
    rates = [0.05, 1e20, 0.02]  # in float64 the second one's loss grows steadily (no chaos) until it overflows
    factories = [lambda p, lr=lr: torch.optim.SGD(p, lr=lr) for lr in rates]
    models = [deep_mlp(depth=3, seed=s).double() for s in range(3)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * 12, batch=16)]
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, devices=["cpu"],
                           device_memory=budget, fuse=True, progress=False, update_on=update_on,
                           microbatches=microbatches)
    assert result.arrays == [[0, 1, 2]] and bool(result.homes) == (budget is None)
    assert result.plan.jobs[0].device_update == (update_on == "device")
    step, before = diverging_losses(references[1], batches, factories[1])
    assert list(result.failed) == [1] and result.failed[1]["step"] == step
    assert_same_weights(models[1], before)
    assert len(result.history[1]) == step
    for index in (0, 2):
        train_plain(references[index], batches, nn.functional.mse_loss, factories[index])
        assert_same_weights(models[index], references[index])
        assert len(result.history[index]) == 12


CHECKPOINTED = """
import os, sys, time, torch
from torch import nn
import harmony

batches = [0]
def collate(samples):
    batches[0] += 1
    if batches[0] > int(os.environ.get("STALL_AFTER", 10**9)):  # the run to be killed stops here, mid-run
        time.sleep(3600)
    return torch.utils.data.default_collate(samples)

torch.manual_seed(0)
models = [nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)) for _ in range(3)]
x = torch.randn(640, 8)
y = x.sum(dim=1, keepdim=True)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True,
                                     collate_fn=collate)
factories = [lambda p, lr=lr: torch.optim.Adam(p, lr=lr) for lr in (1e-3, 3e-3, 1e-2)]
result = harmony.train(models, loader, loss_fn=nn.functional.mse_loss, optimizer=factories, epochs={epochs},
                       devices=["cpu", "cpu"], device_memory={budget}, progress=False, fuse={fuse},
                       checkpoint_dir={directory!r}, checkpoint_every=8, resume={resume}, **{extra})
torch.save({{"models": [m.state_dict() for m in models], "history": result.history,
            "grad_norms": result.grad_norms}}, {out!r})
print("DONE")
"""


def run_script(path: Path, source: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    path.write_text(source)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(),
                                                                             os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(path)], cwd=path.parent, env=environment, capture_output=True,
                          text=True, timeout=timeout)


FP16 = {"precision": "fp16", "grad_scaler": {"init_scale": 2.0**24, "growth_interval": 3}}


class Code(str):
    """Source text that a script's arguments (formatted with repr) hold as code."""

    def __repr__(self) -> str:
        return str(self)


WARMUP = Code("lambda step: min(1.0, (step + 1) / 10) * 0.97 ** step")
SCHEDULED = {"lr_schedule": WARMUP, "clip_grad_norm": 0.5}


@pytest.mark.usefixtures("cold_start")
@pytest.mark.parametrize("fuse,extra", [(True, {}), (False, {**FP16, **SCHEDULED})],
                         ids=["fused", "swapped-fp16-scheduled-clipped"])
def test_a_killed_driver_leaves_nothing_and_its_run_resumes_to_the_uninterrupted_result(
    fuse: bool, extra: dict, tmp_path: Path
) -> None:
    from tests.conftest import started_by, worker_processes, zygotes

    budget = 6_000 if not fuse else None
    whole = run_script(tmp_path / "whole.py", CHECKPOINTED.format(
        epochs=2, budget=budget, fuse=fuse, directory=str(tmp_path / "whole"), resume=False, out=str(tmp_path / "a"),
        extra=extra))
    assert whole.returncode == 0, whole.stderr
    script = tmp_path / "killed.py"
    script.write_text(CHECKPOINTED.format(epochs=2, budget=budget, fuse=fuse, directory=str(tmp_path / "ckpt"),
                                          resume=True, out=str(tmp_path / "b"), extra=extra))
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(),
                                                                             os.environ.get("PYTHONPATH")])),
                   "STALL_AFTER": "50"}
    before_files = set(harmony_files())
    driver = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=environment,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not list((tmp_path / "ckpt").glob("job-*/latest")):
            time.sleep(0.05)
        assert list((tmp_path / "ckpt").glob("job-*/latest")), "no checkpoint was written"
        time.sleep(0.5)  # on to its loader's stall at step 50, with its workers' files written
        steps = [int(latest.read_text().removeprefix("v")) for latest in (tmp_path / "ckpt").glob("job-*/latest")]
        assert max(steps) < 80, "the run must be killed before it ends"
        workers = started_by(driver.pid, worker_processes())
        assert len(workers) == 2, "its two device workers run"
        workers += started_by(driver.pid, zygotes())
    finally:
        driver.kill()
        driver.wait()
    killed_at = time.monotonic()
    while time.monotonic() - killed_at < 10 and (set(harmony_files()) - before_files or
                                                  any(p.is_running() for p in workers)):
        time.sleep(0.1)
    left = set(harmony_files()) - before_files
    assert not left, f"the killed driver's shared memory stayed: {described(left)}"
    assert not [p for p in workers if p.is_running() and p.status() != "zombie"], "its workers stayed"
    resumed = run_script(script, script.read_text())
    assert resumed.returncode == 0, resumed.stderr
    expected, got = torch.load(tmp_path / "a"), torch.load(tmp_path / "b")
    assert len(got["history"]) == len(expected["history"])
    for want_losses, have_losses in zip(expected["history"], got["history"]):
        assert have_losses == pytest.approx(want_losses, rel=1e-6)
    for want_norms, have_norms in zip(expected["grad_norms"], got["grad_norms"], strict=True):
        assert len(have_norms) == (80 if "clip_grad_norm" in extra else 0), "the checkpoint kept them all"
        assert have_norms == pytest.approx(want_norms, rel=1e-5, nan_ok=True)  # fp16's skipped steps: not finite
    for want, have in zip(expected["models"], got["models"]):
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=1e-5, atol=1e-7)
    plain = torch.load(tmp_path / "ckpt" / "model-0.pt")
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model.load_state_dict(plain["model"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(plain["optimizer"])
    assert plain["step"] == 80 and len(plain["history"]) == 80
    if "lr_schedule" in extra:  # the plain optimizer's learning rate is the one the next step would use
        factor = eval(WARMUP)(80)
        assert [group["lr"] for group in plain["optimizer"]["param_groups"]] == [1e-3 * factor]
    if "precision" in extra:  # fp16: the scaler skipped steps (their updates and the optimizer's count), and says so
        scaler = torch.amp.GradScaler("cpu")
        scaler.load_state_dict(plain["scaler"])
        skipped = 80 - int(optimizer.state[next(iter(model.parameters()))]["step"])
        assert skipped > 0 and scaler.get_scale() < FP16["grad_scaler"]["init_scale"]
        assert plain["scaler"] == torch.load(tmp_path / "whole" / "model-0.pt")["scaler"]
        return
    assert int(optimizer.state[next(iter(model.parameters()))]["step"]) == 80, "plain optimizer state dict"


def test_a_checkpoint_with_a_pack_without_weights_resumes(tmp_path: Path, no_leaks: None) -> None:
    """A budget that leaves an activation alone in its pack writes that pack's weights as an empty file, which a
    resume reads back as no bytes (it failed to, before). It resumes with threads of its own: they are not part of
    the run's identity."""
    batches = regression_batches(samples=512, batch=256)
    settings = {"loss_fn": nn.functional.mse_loss, "optimizer": sgd, "devices": ["cpu"], "device_memory": 40_000,
                "microbatches": 5, "checkpoint_dir": tmp_path, "checkpoint_every": 1, "progress": False}
    trained = deep_mlp()
    harmony.train(trained, batches, **settings)
    assert [path.stat().st_size for path in tmp_path.glob("job-0/v2/p*-weights.bin")].count(0) > 0, "an empty pack"
    resumed = deep_mlp()
    result = harmony.train(resumed, batches, resume=True, threads=1, **settings)
    assert result.stats.steps == [2]
    assert_same_weights(resumed, trained, rtol=0, atol=0)


def test_resuming_with_other_arguments_is_refused(tmp_path: Path, no_leaks: None) -> None:
    batches = regression_batches(samples=64, batch=16)
    harmony.train(deep_mlp(depth=2), batches, loss_fn=nn.functional.mse_loss, optimizer=sgd, progress=False,
                  checkpoint_dir=tmp_path)
    with pytest.raises(harmony.InputError, match="another run"):
        harmony.train(deep_mlp(depth=3), batches, loss_fn=nn.functional.mse_loss, optimizer=sgd, progress=False,
                      checkpoint_dir=tmp_path, resume=True)
    with pytest.raises(harmony.InputError, match="resume=True"):
        harmony.train(deep_mlp(depth=2), batches, loss_fn=nn.functional.mse_loss, optimizer=sgd, progress=False,
                      checkpoint_dir=tmp_path)
    with pytest.raises(harmony.InputError, match="need a checkpoint_dir"):
        harmony.train(deep_mlp(depth=2), batches, loss_fn=nn.functional.mse_loss, optimizer=sgd, progress=False,
                      resume=True)


def test_a_checkpoint_of_a_model_tied_across_packs_holds_plain_pytorchs_optimizer_state(
    tmp_path: Path, no_leaks: None
) -> None:
    """The pack that borrows the tied weight steps nothing for it: the checkpoint's plain optimizer state is read
    pack by pack as each pack's optimizer was built, and equals a plain loop's, the tied weight's included."""
    model = TiedEnds().double()
    reference = clones([model])[0]
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=adam, devices=["cpu"],
                           device_memory=60_000, progress=False, checkpoint_dir=tmp_path, checkpoint_every=4)
    assert any(pack.borrowed for pack in result.packings[0].packs), "the tie must span packs"
    optimizer = adam(reference.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    saved = torch.load(tmp_path / "model-0.pt")
    restored = TiedEnds().double()
    restored.load_state_dict(saved["model"])
    loaded = adam(restored.parameters())
    loaded.load_state_dict(saved["optimizer"])
    for ours, theirs in zip(restored.parameters(), reference.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(loaded.state[ours][key], optimizer.state[theirs][key], rtol=0, atol=1e-12)


@pytest.mark.parametrize("budget", [None, 200_000], ids=["homed", "swapped"])
def test_a_fused_arrays_checkpoint_holds_each_members_own_optimizer_state(tmp_path: Path, budget: int | None
                                                                          ) -> None:
    """Each member's file holds the state its own Adam would after a plain loop: its step count and moments, out of
    the stacked optimizer's (a count per member, its moments' rows)."""
    models = [deep_mlp(seed=seed).double() for seed in range(3)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    factories = [lambda p, lr=lr: torch.optim.Adam(p, lr=lr) for lr in (1e-3, 3e-3, 1e-2)]
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, devices=["cpu"],
                           device_memory=budget, resident=budget is None, fuse=True, progress=False,
                           checkpoint_dir=tmp_path, checkpoint_every=4)
    assert result.arrays == [[0, 1, 2]]
    assert (len(result.packings[0].packs) > 1) == (budget is not None)
    for index, (reference, factory) in enumerate(zip(references, factories)):
        optimizer = factory(reference.parameters())
        for x, y in batches:
            optimizer.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            optimizer.step()
        saved = torch.load(tmp_path / f"model-{index}.pt")
        restored = deep_mlp(seed=index).double()
        restored.load_state_dict(saved["model"])
        loaded = factory(restored.parameters())
        loaded.load_state_dict(saved["optimizer"])
        for ours, theirs in zip(restored.parameters(), reference.parameters()):
            assert float(loaded.state[ours]["step"]) == float(optimizer.state[theirs]["step"]) == len(batches)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(loaded.state[ours][key], optimizer.state[theirs][key], rtol=0, atol=1e-12)


def swept(within: float = 10.0) -> bool:
    """Whether no file of Harmony's is left within `within` seconds: a killed driver's workers remove its files
    once they see it gone (runtime.orphans.watch_parent), which on a loaded 2-core machine has taken over 2 s."""
    started = time.monotonic()
    while harmony_files() and time.monotonic() - started < within:
        time.sleep(0.1)
    return not harmony_files()


INTERRUPTED_WRITE = """
import os, signal, torch
from torch import nn
import harmony

calls = {{"n": 0}}
real_save = torch.save
def dying_save(obj, path, *args, **kwargs):
    calls["n"] += 1
    if {die} and calls["n"] == 4:  # the fourth checkpoint the run writes: die half-way through it
        with open({marker!r}, "w") as handle:
            handle.write(str(path))
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, path, *args, **kwargs)
torch.save = dying_save

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
x = torch.randn(160, 8)
batches = [(x[i:i + 16], x[i:i + 16].sum(1, keepdim=True)) for i in range(0, 160, 16)]
harmony.train([model, nn.Sequential(nn.Linear(8, 1))], batches, loss_fn=nn.functional.mse_loss,
              optimizer=lambda p: torch.optim.SGD(p, lr=0.01), devices=["cpu"], progress=False, fuse=False,
              steps_per_task=1, checkpoint_dir={directory!r}, checkpoint_every=2, resume={resume})
"""


@pytest.mark.usefixtures("cold_start")
def test_a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one_whole(tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    done = run_script(tmp_path / "interrupted.py", INTERRUPTED_WRITE.format(marker=str(marker), die=True, resume=False,
                                                                           directory=str(tmp_path / "ckpt")))
    assert done.returncode == -signal.SIGKILL and marker.exists()
    interrupted = Path(marker.read_text())  # job-<j>/.v<step>.<pid>.tmp/model-<j>.pt
    job = int(interrupted.parent.parent.name.removeprefix("job-"))
    step = int(interrupted.parent.name.split(".")[1].removeprefix("v"))
    latest = (tmp_path / "ckpt" / f"job-{job}" / "latest").read_text()
    assert latest == f"v{step - 2}", "the checkpoint being written replaced the previous one"
    for model in (0, 1):
        saved = torch.load(tmp_path / "ckpt" / f"model-{model}.pt")
        written = int((tmp_path / "ckpt" / f"job-{model}" / "latest").read_text().removeprefix("v"))
        assert saved["step"] == written and len(saved["history"]) == written
        assert (tmp_path / "ckpt" / f"job-{model}" / f"v{written}" / "checkpoint.msgpack").exists()
    assert swept(), f"the killed run's files stayed: {described(harmony_files())}"
    assert interrupted.parent.exists(), "the scratch of the killed write"
    resumed = run_script(tmp_path / "resumed.py", INTERRUPTED_WRITE.format(marker=str(marker), die=False, resume=True,
                                                                         directory=str(tmp_path / "ckpt")))
    assert resumed.returncode == 0, resumed.stderr
    assert not [path.name for path in (tmp_path / "ckpt").rglob("*.tmp")], "the resumed run removes its scratch"
    for model in (0, 1):
        assert torch.load(tmp_path / "ckpt" / f"model-{model}.pt")["step"] == 10


KILLED_AFTER_LATEST = """
import os, signal, torch
from torch import nn
import harmony
import harmony.runtime.checkpoint as checkpoint

real_replace = checkpoint.replace_file
def dying_replace(path, data):
    real_replace(path, data)
    if {die} and path.name == "latest" and data == b"v10":  # the run's last checkpoint: die before its links
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.replace_file = dying_replace

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
x = torch.randn(160, 8)
batches = [(x[i:i + 16], x[i:i + 16].sum(1, keepdim=True)) for i in range(0, 160, 16)]
result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                       devices=["cpu"], progress=False, steps_per_task=1, checkpoint_dir={directory!r},
                       checkpoint_every=2, resume=True)
torch.save({{"model": model.state_dict(), "history": result.history[0]}}, {out!r})
"""


@pytest.mark.usefixtures("cold_start")
def test_a_driver_killed_after_its_last_checkpoints_latest_is_resumed_to_links_at_that_checkpoint(
    tmp_path: Path
) -> None:
    """Killed after replacing latest and before pointing the model links at it: the links still name the
    checkpoint before (kept so far), and the resumed run, with nothing left to train, points them at latest."""
    directory, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    killed = run_script(tmp_path / "killed.py", KILLED_AFTER_LATEST.format(die=True, directory=directory, out=out))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    job = tmp_path / "ckpt" / "job-0"
    assert (job / "latest").read_text() == "v10"
    assert torch.load(tmp_path / "ckpt" / "model-0.pt")["step"] < 10, "the kill must come before the links"
    resumed = run_script(tmp_path / "resumed.py", KILLED_AFTER_LATEST.format(die=False, directory=directory, out=out))
    assert resumed.returncode == 0, resumed.stderr
    saved, trained = torch.load(tmp_path / "ckpt" / "model-0.pt"), torch.load(out)
    assert saved["step"] == 10 and saved["history"] == trained["history"] and len(trained["history"]) == 10
    for name, value in trained["model"].items():
        assert torch.equal(saved["model"][name], value)
    assert sorted(path.name for path in job.glob("v*")) == ["v10"]
    assert swept(), f"the killed run's files stayed: {described(harmony_files())}"
