"""Benchmark: a 16-model sweep on one machine and on two stand-in machines of one device each, and the ways to get a
step's batch to a machine.

A stand-in machine is a group of plain ``dask worker`` processes in a mount namespace of its own with a private
/dev/shm (``unshare --mount`` + tmpfs, as root): nothing passes between machines through shared memory, so every
byte that reaches one goes through Dask. The driver (this process) is on no machine of the two-machine cluster. On
this box the machines share its cores, so the speed-up means nothing; what is compared is the tasks, the bytes
moved between machines per step (model state out and home, batches in; measured by the driver) and the driver's
CPU per step, next to the simulator's prediction for 1, 2 and 4 real machines of one device each
(``harmony.plan(..., machines=k)``).

The batch ways, on one stand-in machine of two workers, each of which reads every batch (as the tasks of a
step on two devices do): scattered through Dask to one worker (Dask copies it to the other when its task asks),
or written by a task into the machine's store (runtime.machines: the tasks map the file). A loader run on the
machine itself would move nothing, but a loader is the user's Python object in the driver: it cannot run there.

    python -m benchmarks.machines [--quick]
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import torch
from distributed import Client
from torch import nn

import harmony
from benchmarks.models import mlp, regression
from benchmarks.report import arguments, report
from harmony.runtime.hoststore import HostStore
from harmony.runtime.machines import STORE_DIRECTORY, release_batch, ship_batch
from harmony.runtime.measure import this_machine
from harmony.runtime.shipping import unship

MODELS = 16
STEPS = 30
BATCH = 64
WIDTH = 64
SHM = "mount -t tmpfs -o size=1g,mode=1777 tmpfs /dev/shm"
BATCH_SIZES = (64 * 1024, 4 * 1024 * 1024)
ROUNDS = 20


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}


@contextmanager
def cluster(machines: list[int], isolated: bool) -> Iterator[str]:
    """A dask scheduler and workers on loopback: machines[k] workers on machine k, each machine in a namespace of
    its own when isolated (else all on this machine, beside the driver)."""
    port = 9100 + os.getpid() % 100
    address = f"tcp://127.0.0.1:{port}"
    processes = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                   "--port", str(port), "--no-dashboard"], env=environment(),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)]
    for machine, count in enumerate(machines):
        workers = " & ".join(
            f"{sys.executable} -m distributed.cli.dask_worker {address} --nthreads 1 --name m{machine}-{index} "
            "--host 127.0.0.1 --no-dashboard --no-nanny" for index in range(count))
        command = f"{SHM} && {workers} & wait" if isolated else f"{workers} & wait"
        launcher = ["unshare", "--mount", "sh", "-c", command] if isolated else ["sh", "-c", command]
        processes.append(subprocess.Popen(launcher, env=environment(), stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
    try:
        with Client(address, timeout=60) as client:
            client.wait_for_workers(sum(machines), timeout=120)
        yield address
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)  # a worker whose scheduler went first would retry for a while
            process.wait()


def sweep() -> tuple[list[nn.Module], list, list[Any]]:
    """16 MLPs, a learning-rate grid, each on its own loader (so none fuse: 16 jobs to place)."""
    base = mlp(WIDTH, 2, outputs=4)
    rates = [1e-3 * 1.2**index for index in range(MODELS)]
    loaders = [regression(STEPS, BATCH, WIDTH, outputs=4, seed=index) for index in range(MODELS)]
    return [copy.deepcopy(base) for _ in rates], loaders, [lambda p, lr=rate: torch.optim.SGD(p, lr=lr)
                                                            for rate in rates]


def train_on(way: str, machines: list[int], isolated: bool) -> dict[str, Any]:
    models, loaders, factories = sweep()
    with cluster(machines, isolated) as address:
        me = psutil.Process()
        cpu = me.cpu_times()
        started = time.perf_counter()
        result = harmony.train(models, loaders, loss_fn=nn.functional.mse_loss, optimizer=factories,
                               cluster=address, progress=False)
        wall = time.perf_counter() - started
        used = me.cpu_times()
    driver_cpu = (used.user - cpu.user) + (used.system - cpu.system)
    moved = result.stats.bytes_machines
    return {
        "way": way,
        "devices": sum(machines),
        "jobs": len(result.arrays),
        "tasks": result.stats.tasks,
        "wall s": wall,
        "state out KiB/step": moved.get("state", 0) / STEPS / 1024,
        "batches KiB/step": moved.get("batches", 0) / STEPS / 1024,
        "home KiB/step": moved.get("home", 0) / STEPS / 1024,
        "driver CPU ms/step": driver_cpu / STEPS * 1e3,
    }


def predicted(machines: int) -> float:
    """The simulator's seconds for the sweep on that many machines of one device each, with this box's speeds."""
    models, loaders, factories = sweep()
    forecast = harmony.plan(models, loaders, nn.functional.mse_loss, factories, devices=1, machines=machines,
                            device_memory="1GB", hardware=this_machine())
    return forecast.total_seconds


def read(run: str, shipped: Any) -> float:
    """On a worker: a batch written into the machine's store, read from its file."""
    tensor = unship(shipped, HostStore(run, STORE_DIRECTORY))
    return float(tensor.sum())


def touch(tensor: torch.Tensor) -> float:
    """On a worker: a batch that Dask brought."""
    return float(tensor.sum())


def batch_ways(quick: bool) -> list[dict[str, Any]]:
    """Seconds per batch for both ways, each batch read by both workers of one stand-in machine."""
    rows = []
    rounds = 5 if quick else ROUNDS
    with cluster([2], isolated=True) as address, Client(address) as client:
        workers = sorted(client.scheduler_info()["workers"])
        client.run(importlib.import_module, "harmony.runtime.serialization")  # Harmony's tensor serializers
        run = "bench0machines"
        for nbytes in BATCH_SIZES:
            batch = torch.randn(nbytes // 4)
            for way in ("scattered", "written into the store", "scattered to one, written into the store"):
                if way != "scattered":  # the machine's first file for this size is made once, as in a run
                    first = client.submit(ship_batch, run, STORE_DIRECTORY, batch, False, workers=[workers[0]],
                                          pure=False)
                    client.submit(release_batch, run, STORE_DIRECTORY, first, workers=[workers[0]],
                                  pure=False).result()
                started = time.perf_counter()
                for _ in range(rounds):
                    if way == "scattered":
                        value = client.scatter(batch, workers=[workers[0]], hash=False)
                        reads = [client.submit(touch, value, workers=[w], pure=False) for w in workers]
                    elif way.startswith("scattered to one"):
                        sent = client.scatter(batch, workers=[workers[0]], hash=False, direct=True)
                        value = client.submit(ship_batch, run, STORE_DIRECTORY, sent, False, workers=[workers[0]],
                                              pure=False)
                        reads = [client.submit(read, run, value, workers=[w], pure=False) for w in workers]
                    else:
                        value = client.submit(ship_batch, run, STORE_DIRECTORY, batch, False, workers=[workers[0]],
                                              pure=False)
                        reads = [client.submit(read, run, value, workers=[w], pure=False) for w in workers]
                    client.gather(reads)
                    if way != "scattered":  # the file goes back to the machine's free files, as a run recycles it
                        client.submit(release_batch, run, STORE_DIRECTORY, value, workers=[workers[0]],
                                      pure=False).result()
                    del value, reads
                seconds = (time.perf_counter() - started) / rounds
                copies = len(workers) if way == "scattered" else 1
                rows.append({"batch KiB": nbytes // 1024, "way": way, "ms per batch": seconds * 1e3,
                             "copies into the machine": copies})
        client.run(lambda: HostStore(run, STORE_DIRECTORY).unlink_all())
    return rows


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    logging.getLogger("harmony").setLevel(logging.WARNING)
    global STEPS
    if args.quick:
        STEPS = 8
    train_on("warm-up", [1], isolated=False)  # the first run in a process pays torch's and Dask's imports
    rows = [
        train_on("1 machine, 1 device", [1], isolated=False),
        train_on("1 machine, 2 devices", [2], isolated=False),
        train_on("2 stand-in machines x 1 device", [1, 1], isolated=True),
    ]
    forecasts = {machines: predicted(machines) for machines in (1, 2, 4)}
    for row in rows:
        print(f"{row['way']}: {row['wall s']:.1f}s", flush=True)
    notes = "predicted (simulator, this box's speeds, 1 device per machine): " + ", ".join(
        f"{machines} machine{'s' if machines > 1 else ''} {seconds:.2f} s" for machines, seconds in forecasts.items())
    batches = batch_ways(args.quick)
    report("machines", f"A sweep of {MODELS} MLPs ({STEPS} steps) on 1 machine and on 2 stand-in machines", rows,
           args.out, notes=notes, raw={"predicted seconds by machines": forecasts, "batch ways": batches})
    report("machines_batches", "A step's batch into a machine whose two workers both read it", batches, None)


if __name__ == "__main__":
    main()
