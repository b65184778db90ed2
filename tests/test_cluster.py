"""Clusters: the user's (threads checked, worker names kept, a nanny's workers) and the embedded one's settings."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import dask
import psutil
import pytest
import torch
from distributed import Client, LocalCluster
from torch import nn

import harmony
from tests.conftest import (
    assert_same_weights,
    deep_mlp,
    harmony_files,
    regression_batches,
    train_plain,
)


def test_training_on_a_users_cluster(no_leaks: None) -> None:
    models = [deep_mlp(depth=3, seed=s) for s in range(2)]
    references = [copy.deepcopy(m) for m in models]
    batches = regression_batches(samples=48, batch=12)
    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        result = harmony.train(
            models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=3,
            cluster=client, device_memory="30kB", progress=False,
        )
        assert client.status == "running", "harmony must not close a client it was given"
        assert len(result.stats.peak_device_bytes) == 2
    for model, reference in zip(models, references):
        losses = train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference)
    assert result.history[1] == pytest.approx(losses, rel=1e-5)
    assert not harmony_files()


def test_a_users_cluster_with_several_threads_per_worker_is_refused_before_work_starts(no_leaks: None) -> None:
    model = deep_mlp(depth=3)
    before = copy.deepcopy(model)
    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        with pytest.raises(harmony.InputError, match=r"\(2 threads\).*--nthreads 1"):
            harmony.train(model, regression_batches(samples=24, batch=12), loss_fn=nn.functional.mse_loss,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), cluster=client, progress=False)
        assert client.status == "running"
        assert not client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.tasks)), "no task was sent"
    assert_same_weights(model, before)


def test_fused_resident_arrays_on_a_users_cluster_use_its_worker_names(no_leaks: None) -> None:
    models = [deep_mlp(depth=3, seed=s) for s in range(3)]
    references = [copy.deepcopy(m) for m in models]
    batches = regression_batches(samples=12 * 10, batch=12)
    factories = [functools.partial(torch.optim.Adam, lr=lr) for lr in (1e-3, 3e-3, 1e-2)]
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        names = {str(info["name"]) for info in client.scheduler_info()["workers"].values()}
        result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories,
                               fuse=True, cluster=client, progress=False)
        assert client.status == "running"
    assert result.arrays == [[0, 1, 2]]
    assert set(result.homes) == {0, 1, 2} and set(result.homes.values()) <= names
    assert set(result.stats.peak_device_bytes) == names
    for model, reference, factory, history in zip(models, references, factories, result.history):
        losses = train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, atol=1e-6)
        assert history == pytest.approx(losses, rel=1e-5)


def test_a_nanny_started_users_cluster_trains_and_its_workers_keep_freed_memory(no_leaks: None) -> None:
    """Workers in their own processes, as `dask worker` starts them: the nanny gives them
    MALLOC_TRIM_THRESHOLD_=65536, under which every tensor over 128 KiB is a fresh mmap; a run's setup undoes it."""
    model = deep_mlp(depth=3)
    reference = copy.deepcopy(model)
    batches = regression_batches(samples=48, batch=12)
    factory = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731

    def faults_per_mebibyte_tensor() -> float:
        import resource

        torch.empty(2**20, dtype=torch.uint8).fill_(1)  # the heap grows once to hold the block
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(40):
            torch.empty(2**20, dtype=torch.uint8).fill_(1)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 40

    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        [environment] = client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values()
        assert environment is not None, "the nanny's malloc setting is what this test is about"
        result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, cluster=client,
                               progress=False)
        [faults] = client.run(faults_per_mebibyte_tensor).values()
    assert faults < 10, f"a freed 1 MiB block is reused, not mapped afresh ({faults} page faults per tensor)"
    losses = train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert_same_weights(model, reference)
    assert result.history[0] == pytest.approx(losses, rel=1e-5)


def test_an_embedded_cluster_samples_itself_less_often_but_keeps_what_the_user_configured(no_leaks: None) -> None:
    """Its scheduler and workers time their event loops, read system counters and sample stacks at
    runtime.cluster.SAMPLING's rates (wake-ups that take CPU from the compute threads), except where the user
    set a value; calibration on it measures a task's CPU time besides its latency."""
    import dask

    from harmony.runtime.calibrate import measured_hardware
    from harmony.runtime.cluster import SAMPLING, start_embedded
    from harmony.runtime.devices import DeviceSpec

    def milliseconds(value: str) -> float:
        return dask.utils.parse_timedelta(value) * 1e3

    def worker_intervals(dask_worker: object) -> dict[str, float]:
        callbacks = dask_worker.periodic_callbacks  # type: ignore[attr-defined]
        return {name: callbacks[name].callback_time for name in ("tick", "profile", "monitor")}

    with dask.config.set({"distributed.admin.tick.interval": "100ms"}):
        handle = start_embedded([DeviceSpec("cpu-0", "cpu", 2**26, 1)], dashboard_address=":0")
    try:
        [intervals] = handle.client.run(worker_intervals).values()
        scheduler = handle.client.run_on_scheduler(
            lambda dask_scheduler: {name: dask_scheduler.periodic_callbacks[name].callback_time
                                    for name in ("tick", "monitor")})
        cpu_devices = measured_hardware(handle.client, handle.workers, cpu_compute=True)
        gpu_devices = measured_hardware(handle.client, handle.workers, cpu_compute=False)
    finally:
        handle.close()
    assert cpu_devices.task_overhead > 0 and cpu_devices.task_cpu > 0, "a task's latency and CPU time are measured"
    assert gpu_devices.task_cpu == 0, "the CPU a task takes counts only where the devices compute on the cores"
    assert cpu_devices.edge_seconds == cpu_devices.task_overhead, "one worker: no edge between two, its chain's"
    assert intervals["tick"] == scheduler["tick"] == 100, "the user's tick interval is kept"
    assert intervals["profile"] == milliseconds(SAMPLING["distributed.worker.profile.interval"])
    expected_monitor = milliseconds(SAMPLING["distributed.admin.system-monitor.interval"])
    assert intervals["monitor"] == scheduler["monitor"] == expected_monitor
    assert expected_monitor > milliseconds(dask.config.get("distributed.admin.system-monitor.interval")), (
        "less often than distributed's default")


def test_calibration_on_two_device_workers_times_a_result_passed_between_them(no_leaks: None) -> None:
    """A chain alternating between the two workers, each task a Dask dependency of the next, against one that stays
    on a worker and hands results over there: the first pays the scheduler's edge and the fetch each task."""
    from harmony.runtime.calibrate import task_cost
    from harmony.runtime.cluster import start_embedded
    from harmony.runtime.devices import DeviceSpec

    handle = start_embedded([DeviceSpec("cpu-0", "cpu", 2**26, 1), DeviceSpec("cpu-1", "cpu", 2**26, 1)],
                            dashboard_address=":0")
    try:
        latency, _, edge = task_cost(handle.client, handle.workers)
        _, _, alone = task_cost(handle.client, {"cpu-0": handle.workers["cpu-0"]})
    finally:
        handle.close()
    assert edge > latency > 0
    assert alone == 0.0


def listening(pids: set[int]) -> set[str]:
    """The addresses processes pids listen on."""
    import psutil

    found = set()
    for pid in pids:
        try:
            connections = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        found |= {connection.laddr.ip for connection in connections if connection.status == psutil.CONN_LISTEN}
    return found


def test_an_embedded_run_listens_on_loopback_alone(no_leaks: None) -> None:
    """Scheduler, workers and dashboard: nobody beyond this machine can reach them (and run code as the user)."""
    import threading

    import psutil

    seen: set[str] = set()
    pids: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        me = psutil.Process()
        while not done.is_set():
            family = {me.pid} | {child.pid for child in me.children(recursive=True)}
            pids.update(family)
            seen.update(listening(family))
            done.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = harmony.train(deep_mlp(depth=3), regression_batches(samples=96, batch=8), nn.functional.mse_loss,
                               functools.partial(torch.optim.SGD, lr=0.05), devices=["cpu", "cpu"],
                               progress=False, steps_per_task=1)
    finally:
        done.set()
        watcher.join()
    assert len(pids) >= 3, "the driver and both workers were watched"
    assert seen and seen <= {"127.0.0.1"}, f"listening on {sorted(seen)}"
    assert result.dashboard_link is not None and result.dashboard_link.startswith("http://127.0.0.1:")


def test_a_tls_cluster_on_loopback_trains_with_a_budget_per_worker_and_equals_plain_pytorch(no_leaks: None) -> None:
    from distributed.security import Security

    models = [deep_mlp(depth=3, seed=s) for s in range(2)]
    references = [copy.deepcopy(m) for m in models]
    batches = regression_batches(samples=48, batch=12)
    factory = functools.partial(torch.optim.SGD, lr=0.05)
    security = Security.temporary()
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=":0",
                     security=security, protocol="tls://") as cluster,
        Client(cluster, security=security) as client,
    ):
        assert client.scheduler.address.startswith("tls://127.0.0.1")
        names = sorted(str(info["name"]) for info in client.scheduler_info()["workers"].values())
        result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, cluster=client,
                               device_memory={names[0]: "24KB", names[1]: 40_000}, progress=False, fuse=False)
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference)
    assert result.plan.devices == {names[0]: 24_000, names[1]: 40_000}


def test_a_users_cluster_on_ucx_trains_a_model_across_its_workers_and_equals_plain_pytorch(no_leaks: None) -> None:
    """Dask's UCX comms (distributed-ucxx, where installed: its RAPIDS pin of dask keeps it out of the test extra)
    carry the run: a scheduler at ucxx://, two worker processes, a model cut over both whose values pass between
    them."""
    pytest.importorskip("distributed_ucxx")
    models = [deep_mlp(depth=8, seed=s) for s in range(2)]
    references = [copy.deepcopy(m) for m in models]
    batches = regression_batches(samples=48, batch=12)
    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                     protocol="ucxx") as cluster,
        Client(cluster) as client,
    ):
        assert client.scheduler.address.startswith("ucxx://")
        result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=3,
                               cluster=client, device_memory="25kB", packs_per_task=1, progress=False)
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference)
    assert result.stats.bytes_p2p + result.stats.bytes_remote > 0, "no value passed between the workers"


@pytest.mark.usefixtures("cold_start")  # it counts the calibrations of a cluster it starts
def test_the_embedded_cluster_stays_warm_between_calls_and_follows_their_devices_until_a_failure_or_shutdown(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    """A second call with the same devices runs on the same worker processes, without measuring the task cost
    again, and equals plain PyTorch; a call with fewer devices keeps the workers of those it names, computing with
    their new share of the cores, and closes the others; one with more starts only the missing ones; a run that fails
    leaves none; harmony.shutdown() closes the warm one."""
    from harmony.runtime import calibrate, cluster
    from harmony.runtime.devices import build_specs
    from tests.conftest import ThreadsSeen, live_workers, worker_processes

    measured = []
    task_cost = calibrate.task_cost
    monkeypatch.setattr(calibrate, "task_cost", lambda *args: measured.append(1) or task_cost(*args))
    sgd = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    batches = regression_batches(samples=32, batch=8)

    def call(devices: list[str], model: nn.Module | None = None) -> harmony.TrainResult:
        return harmony.train(model or deep_mlp(depth=2), batches, nn.functional.mse_loss, sgd, devices=devices,
                             dashboard_address=":0", progress=False)

    def pids() -> dict[str, int]:
        """Device name -> its worker's process id; every device worker alive is one of them."""
        assert cluster.WARM is not None
        handle = cluster.WARM[1]
        by_address = handle.client.run(os.getpid)
        named = {name: by_address[address] for name, address in handle.workers.items()}
        assert sorted(process.pid for process in live_workers()) == sorted(named.values())
        return named

    def trained_as_plain(devices: list[str], seed: int) -> nn.Sequential:
        """A model led by a ThreadsSeen trained on devices, checked against plain PyTorch."""
        model = nn.Sequential(ThreadsSeen(), *deep_mlp(depth=2, seed=seed))
        reference = copy.deepcopy(model)
        call(devices, model)
        train_plain(reference, batches, nn.functional.mse_loss, sgd)
        assert_same_weights(model[1:], reference[1:])
        return model

    call(["cpu", "cpu"])
    first = pids()
    assert sorted(first) == ["cpu-0", "cpu-1"]
    trained_as_plain(["cpu", "cpu"], seed=5)
    assert pids() == first, "the same workers"
    assert len(measured) == 1, "the task cost is measured once per cluster"
    share = build_specs(["cpu"], None)[0].threads
    alone = trained_as_plain(["cpu"], seed=6)
    assert pids() == {"cpu-0": first["cpu-0"]}, "fewer devices: the worker of cpu-0 kept, cpu-1's closed"
    assert int(alone[0].most) == share, "the kept worker computes with the whole machine's share of the cores"
    assert cluster.WARM is not None
    assert list(cluster.WARM[1].client.run(torch.get_num_threads).values()) == [share]
    assert len(measured) == 2, "other workers: the task cost measured on them"
    trained_as_plain(["cpu", "cpu"], seed=7)
    again = pids()
    assert again["cpu-0"] == first["cpu-0"] and again["cpu-1"] not in first.values(), "only cpu-1 started"
    assert len(measured) == 2, "these devices' workers of this cluster: measured before"
    halves = build_specs(["cpu", "cpu"], None)[0].threads
    assert list(cluster.WARM[1].client.run(torch.get_num_threads).values()) == [halves, halves]

    def broken(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.isnan().any():
            raise ValueError("a loss that fails")
        return nn.functional.mse_loss(output, target)

    marked = [*batches[:-1], (batches[-1][0], torch.full_like(batches[-1][1], float("nan")))]
    with pytest.raises(harmony.ModelError, match="a loss that fails"):
        harmony.train(deep_mlp(depth=2), marked, broken, sgd, devices=["cpu"], dashboard_address=":0",
                      progress=False)
    assert not live_workers(), (
        "a failed run leaves no worker that may still be in one of its tasks")
    call(["cpu"])
    assert len(worker_processes()) == 1
    harmony.shutdown()
    assert not live_workers()


def test_a_warm_cluster_whose_worker_died_for_good_is_replaced_without_waiting_for_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, no_leaks: None
) -> None:
    """A device worker that dies is started again, RESTARTS times over the cluster's life (faults across a notebook's
    calls add up), however long after distributed.deploy.lost-worker-timeout it comes back (a plain SpecCluster
    would close and forget it then); one that died after its last restart never comes back, so the next call
    replaces the warm cluster at once instead of waiting WORKER_START_TIMEOUT for it."""
    from harmony.runtime import cluster

    sgd = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    batches = regression_batches(samples=32, batch=8)

    def call() -> None:
        harmony.train(deep_mlp(depth=2), batches, nn.functional.mse_loss, sgd, devices=["cpu"], dashboard_address=":0",
                      progress=False)

    call()
    assert cluster.WARM is not None
    handle = cluster.WARM[1]
    assert handle.cluster is not None
    worker = handle.cluster.workers["cpu-0"]
    worker.restarts = cluster.RESTARTS - 1

    def until(condition: Callable[[], object]) -> object:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if answer := condition():
                    return answer
            time.sleep(0.05)
        raise AssertionError("the embedded cluster did not get there in a minute")

    first = until(lambda: next(iter(handle.client.run(os.getpid).values())))
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "100ms"}):  # shorter than any restart
        os.kill(first, signal.SIGKILL)
        until(lambda: worker.restarts == cluster.RESTARTS)  # started again: its last restart
        second = until(lambda: next(pid for pid in handle.client.run(os.getpid).values() if pid != first))
    assert handle.cluster.workers["cpu-0"] is worker and not handle.gone()
    os.kill(second, signal.SIGKILL)
    until(handle.gone)  # its process ended after its last restart
    assert handle.gone() == ["cpu-0"]

    def waiting(*args: object, **kwargs: object) -> None:
        raise AssertionError("the call waited for a worker that will not come back")

    monkeypatch.setattr(handle.client, "wait_for_workers", waiting)
    with caplog.at_level(logging.INFO, logger="harmony"):
        call()
    assert "the warm cluster lost cpu-0 for good" in caplog.text
    assert cluster.WARM is not None and cluster.WARM[1] is not handle


def test_a_worker_forked_again_while_its_cluster_closes_is_closed_with_it(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    """A device worker that died is forked again; a cluster closed while that fork is under way (a call that needs
    another cluster, the zygote staying) ends the process forked for it too, rather than leave it to wait out its
    death timeout for a scheduler that is gone."""
    from harmony.runtime import cluster
    from harmony.runtime.zygote import Zygote

    sgd = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    harmony.train(deep_mlp(depth=2), regression_batches(samples=32, batch=8), nn.functional.mse_loss, sgd,
                  devices=["cpu"], progress=False)
    assert cluster.WARM is not None and cluster.ZYGOTE is not None
    handle = cluster.WARM[1]
    zygote = psutil.Process(cluster.ZYGOTE.process.pid)
    forked = threading.Event()
    fork = Zygote.fork

    async def held(self: Zygote, *args: object) -> object:
        child = await fork(self, *args)  # type: ignore[arg-type]
        forked.set()
        await asyncio.sleep(2)  # forked, not yet the worker's process: the cluster closes now
        return child

    monkeypatch.setattr(Zygote, "fork", held)
    [first] = handle.client.run(os.getpid).values()
    os.kill(first, signal.SIGKILL)
    assert forked.wait(60), "the worker was not forked again"
    handle.close()
    _, alive = psutil.wait_procs(zygote.children(), timeout=10)
    assert not alive, f"the zygote's children outlived their cluster: {[process.pid for process in alive]}"


def test_worker_names_are_asked_again_when_the_clients_answer_lists_none() -> None:
    """A sync client's scheduler_info() falls back on a cached identity without workers when its fresh query
    fails: worker_addresses asks again (a run once found none right after wait_for_workers), a bounded number of
    times; calibration with no worker says so instead of failing on an empty max()."""
    from harmony.runtime.calibrate import task_cost
    from harmony.runtime.cluster import worker_addresses

    class Answers:
        def __init__(self, empty: int) -> None:
            self.empty = empty
            self.asked = 0

        def scheduler_info(self) -> dict:
            self.asked += 1
            if self.asked <= self.empty:
                return {"workers": {}}
            return {"workers": {"tcp://127.0.0.1:1": {"name": "cpu-0"}}}

    late = Answers(empty=2)
    assert worker_addresses(late) == {"cpu-0": "tcp://127.0.0.1:1"} and late.asked == 3  # type: ignore[arg-type]
    never = Answers(empty=10**6)
    assert worker_addresses(never, attempts=3) == {} and never.asked == 3  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no device worker is connected"):
        task_cost(never, {})  # type: ignore[arg-type]
