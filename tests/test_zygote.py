"""The zygote: CPU device workers forked from one process that imported what they need, each set up as a worker
started on its own would be; ended with the driver's cluster, and replaced where it dies."""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import sys
import threading
import time

import psutil
import torch
from torch import nn

import harmony
from harmony.runtime import cluster
from harmony.runtime.zygote import Forked
from tests.conftest import assert_same_weights, deep_mlp, live_workers, regression_batches, train_plain, zygotes


def trained_as_plain(devices: list[str], seed: int = 0, dashboard_address: str = ":8787") -> harmony.TrainResult:
    """A small model trained on devices (the dashboard on dashboard_address) and checked against plain PyTorch."""
    model = deep_mlp(depth=2, seed=seed)
    reference = copy.deepcopy(model)
    batches = regression_batches(samples=32, batch=8)
    factory = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    result = harmony.train(model, batches, nn.functional.mse_loss, factory, devices=devices, progress=False,
                           dashboard_address=dashboard_address)
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert_same_weights(model, reference)
    return result


def workers() -> dict[str, str]:
    assert cluster.WARM is not None
    return cluster.WARM[1].workers


def ask(function: object) -> dict[str, object]:
    """function's answer on each device worker of the warm cluster, by device name."""
    assert cluster.WARM is not None
    answers = cluster.WARM[1].client.run(function)
    return {name: answers[address] for name, address in workers().items()}


def _setting() -> dict[str, object]:
    import dask

    return {"pid": os.getpid(), "parent": os.getppid(), "session": os.getsid(0), "cwd": os.getcwd(),
            "path": list(sys.path), "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"), "driver": os.environ.get("HARMONY_DRIVER_PID"),
            "tick": dask.config.get("distributed.admin.tick.interval")}


def test_cpu_device_workers_are_forked_from_one_zygote_each_set_up_as_a_started_worker(no_leaks: None) -> None:
    from harmony.runtime.devices import build_specs

    trained_as_plain(["cpu", "cpu"])
    [zygote] = zygotes()
    assert zygote.ppid() == os.getpid(), "the driver started it"
    settings = ask(_setting)
    threads = build_specs(["cpu", "cpu"], None)[0].threads
    for name, setting in settings.items():
        process = psutil.Process(int(setting["pid"]))  # type: ignore[arg-type]
        assert process.name() == "harmony-device" and setting["parent"] == zygote.pid, name
        assert setting["session"] == setting["pid"], "a session of its own: a terminal's Ctrl-C reaches the driver"
        assert setting["driver"] == str(zygote.pid), "its watchdog follows the zygote, which follows the driver"
        assert setting["cwd"] == os.getcwd()
        assert {path for path in sys.path if path} <= set(setting["path"]), "the driver's sys.path"  # type: ignore[arg-type]
        assert setting["threads"] == threads and setting["omp"] == str(threads), "the device's share of the cores"
        assert setting["tick"] == cluster.SAMPLING["distributed.admin.tick.interval"], "dask's config from its env"
    assert {process.pid for process in live_workers()} == {setting["pid"] for setting in settings.values()}


def test_a_killed_worker_and_a_killed_zygote_are_forked_and_started_again(no_leaks: None) -> None:
    """A forked worker that dies is forked again; a zygote that dies takes its workers with it (each ends once its
    parent is gone), and they start again from a new zygote; every run equals plain PyTorch."""
    trained_as_plain(["cpu", "cpu"])
    [zygote] = zygotes()
    before = ask(os.getpid)
    os.kill(int(before["cpu-1"]), signal.SIGKILL)  # type: ignore[arg-type]
    trained_as_plain(["cpu", "cpu"], seed=1)
    after = ask(os.getpid)
    assert after["cpu-0"] == before["cpu-0"] and after["cpu-1"] != before["cpu-1"]
    assert psutil.Process(int(after["cpu-1"])).ppid() == zygote.pid, "forked again"  # type: ignore[arg-type]
    zygote.kill()
    psutil.wait_procs([psutil.Process(int(pid)) for pid in after.values()], timeout=30)  # type: ignore[arg-type]
    trained_as_plain(["cpu", "cpu"], seed=2)
    [replacement] = zygotes()
    assert replacement.pid != zygote.pid
    assert all(psutil.Process(int(pid)).ppid() == replacement.pid  # type: ignore[arg-type]
               for pid in ask(os.getpid).values())


def test_a_cluster_started_again_forks_its_workers_from_the_same_zygote(no_leaks: None) -> None:
    """Another dashboard address needs another scheduler: the warm cluster is closed, the zygote stays and forks the
    new one's workers."""
    trained_as_plain(["cpu"], dashboard_address=":0")
    [zygote] = zygotes()
    before = ask(os.getpid)
    trained_as_plain(["cpu"], seed=1, dashboard_address="127.0.0.1:0")
    after = ask(os.getpid)
    assert zygotes() == [zygote] and after["cpu-0"] != before["cpu-0"]
    assert psutil.Process(int(after["cpu-0"])).ppid() == zygote.pid  # type: ignore[arg-type]


def test_shutdown_ends_the_zygote_and_the_next_call_starts_another(no_leaks: None) -> None:
    trained_as_plain(["cpu"])
    assert len(zygotes()) == 1
    harmony.shutdown()
    assert not zygotes() and not live_workers()
    trained_as_plain(["cpu"])
    assert len(zygotes()) == 1


def test_a_forked_process_is_awaited_until_its_end_is_reported_from_another_thread() -> None:
    forked = Forked(os.getpid())

    async def waited() -> int:
        threading.Timer(0.05, forked.ended, args=(-signal.SIGKILL,)).start()
        return await asyncio.wait_for(forked.wait(), timeout=10)

    started = time.monotonic()
    assert asyncio.run(waited()) == -signal.SIGKILL and time.monotonic() - started < 10
    assert asyncio.run(forked.wait()) == -signal.SIGKILL, "an ended process answers at once"
    forked.ended(0)
    assert forked.returncode == -signal.SIGKILL, "its first end is its end"
    forked.terminate()  # ended: no signal goes to the pid (here this very process)
