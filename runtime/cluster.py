"""The Dask cluster a run uses: an embedded one (one worker process per device) or the user's.

Embedded device workers are started as plain subprocesses (``python -m distributed.cli.dask_spec``)
rather than through multiprocessing, so they never re-import the user's ``__main__``: a script that
calls harmony.train at top level with no ``if __name__ == "__main__"`` guard works, and so does a
notebook. The workers inherit the driver's sys.path, so classes from the user's modules unpickle.
The scheduler (and its dashboard) runs in the driver's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from collections import Counter
from dataclasses import dataclass, field

import dask
import torch
from distributed import Client, Scheduler
from distributed.deploy.spec import ProcessInterface, SpecCluster

from harmony.runtime.devices import DeviceSpec, capacity, cpu_count, threads_per_device

WORKER_START_TIMEOUT = 120


class DeviceWorkerProcess(ProcessInterface):
    """One Dask worker, one thread, in its own process, named after the device it drives."""

    def __init__(self, scheduler: str, name: str, threads: int = 1) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.name = name
        self.threads = threads
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        spec = {
            "cls": "distributed.Worker",
            "opts": {
                "name": self.name,
                "nthreads": 1,
                "memory_limit": 0,
                "death_timeout": 60,
                "preload": ["harmony.runtime.warmup"],
            },
        }
        paths = [path for path in sys.path if path and os.path.isdir(path)]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(paths),
            "OMP_NUM_THREADS": str(self.threads),
            "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
            "DASK_LOGGING__DISTRIBUTED": os.environ.get("DASK_LOGGING__DISTRIBUTED", "warning"),
        }
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "distributed.cli.dask_spec",
            self.scheduler,
            "--spec",
            json.dumps(spec),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
        )
        await super().start()

    async def close(self) -> None:
        process = self.process
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout=10)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
        self.process = None
        await super().close()


@dataclass
class ClusterHandle:
    """The client a run talks through, and what the run owns and must close."""

    client: Client
    cluster: SpecCluster | None = None
    owns_client: bool = False
    workers: dict[str, str] = field(default_factory=dict)

    @property
    def embedded(self) -> bool:
        """Whether the workers are this run's own (started by start_embedded), to be stopped when it ends."""
        return self.cluster is not None

    @property
    def dashboard_link(self) -> str | None:
        try:
            return self.client.dashboard_link
        except Exception:
            return None

    def close(self) -> None:
        if self.owns_client:
            with contextlib.suppress(Exception):
                self.client.close()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.close()


def start_embedded(devices: list[DeviceSpec], dashboard_address: str = ":8787") -> ClusterHandle:
    """A scheduler in this process and one worker process per device; returns once all workers joined."""
    workers = {
        device.name: {"cls": DeviceWorkerProcess, "options": {"threads": device.threads}} for device in devices
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": dashboard_address}}
    with dask.config.set({"distributed.scheduler.active-memory-manager.start": False}):  # see runtime.handoff
        cluster = SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR, name="harmony")
    handle = ClusterHandle(client=Client(cluster), cluster=cluster, owns_client=True)
    try:
        handle.client.wait_for_workers(len(devices), timeout=WORKER_START_TIMEOUT)
        handle.workers = worker_addresses(handle.client)
    except BaseException:
        handle.close()
        raise
    return handle


def connect(cluster: str | Client) -> ClusterHandle:
    """A handle on the user's cluster: a scheduler address or a Client; the run closes neither cluster."""
    if isinstance(cluster, Client):
        handle = ClusterHandle(client=cluster)
    else:
        handle = ClusterHandle(client=Client(cluster), owns_client=True)
    handle.workers = worker_addresses(handle.client)
    return handle


def worker_addresses(client: Client) -> dict[str, str]:
    """Worker name -> address, for every worker the scheduler knows."""
    return {str(info["name"]): address for address, info in client.scheduler_info()["workers"].items()}


def worker_threads(handle: ClusterHandle) -> dict[str, int]:
    """Worker name -> how many tasks it runs at once (the threads of its task pool)."""
    return {str(info["name"]): int(info["nthreads"]) for info in handle.client.scheduler_info()["workers"].values()}


def _probe_device() -> tuple[str, int, int, str]:
    """On a worker: the device it drives (its first visible GPU, else the CPU), that device's bytes, and the
    CPU threads and host name of its machine."""
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    return device, capacity(device, 1), cpu_count(), socket.gethostname()


def external_devices(handle: ClusterHandle, budget: int | None) -> list[DeviceSpec]:
    """Every worker of a user's cluster is one device: its first visible GPU if it has one, else its CPU; the
    workers on one machine share its CPU threads evenly."""
    found = handle.client.run(_probe_device)
    by_address = {address: name for name, address in handle.workers.items()}
    per_host = Counter(host for _, _, _, host in found.values())
    devices = []
    for address, (device, limit, cpus, host) in sorted(found.items(), key=lambda item: by_address[item[0]]):
        threads = threads_per_device(cpus, per_host[host])
        devices.append(DeviceSpec(by_address[address], device, budget if budget is not None else limit, threads))
    return devices
