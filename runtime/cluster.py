"""The Dask cluster a run uses: an embedded one (one worker process per device) or the user's.

Embedded device workers are started as plain subprocesses (``python -m distributed.cli.dask_spec``)
rather than through multiprocessing, so they never re-import the user's ``__main__``: a script that
calls harmony.train at top level with no ``if __name__ == "__main__"`` guard works, and so does a
notebook. The workers inherit the driver's sys.path, so classes from the user's modules unpickle.
The scheduler (and its dashboard) runs in the driver's process.

An embedded cluster stays up after a run that ended well, warm for the next call in the process (a notebook's
re-run cell starts no process). A call with other devices takes it as it is where it can: the workers of devices it
names again are kept (a CPU device's told its new share of threads), the others closed, and only the missing ones
started. It is closed by ``shutdown()`` (harmony.shutdown), at interpreter exit, when a call needs another
scheduler (another dashboard address or host), and after a run that failed or was interrupted.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import dask
import torch
from distributed import Client, Scheduler
from distributed.deploy.cluster import Cluster
from distributed.deploy.spec import ProcessInterface, SpecCluster

from harmony.runtime.devices import DeviceSpec, capacity, cpu_count, threads_per_device
from harmony.runtime.hoststore import identity
from harmony.runtime.orphans import driver_environment
from harmony.runtime.zygote import Forked, Zygote

WORKER_START_TIMEOUT = 120
LOOPBACK = "127.0.0.1"
RESTARTS = 5
RESTART_DELAY = 0.5

logger = logging.getLogger("harmony")

SAMPLING = {
    "distributed.admin.tick.interval": "1s",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.worker.profile.interval": "50ms",
}
"""How often an embedded cluster's scheduler and workers wake to watch themselves (distributed's defaults: every
20 ms to time the event loop, 500 ms to read the system's counters, 10 ms to sample the running task's stack).
On a machine whose cores all compute, those wake-ups take cores from the compute threads (docs/performance.md,
"The embedded cluster's sampling"); the dashboard's profile and system pages are coarser for it. A value the
user configured is kept."""


def quiet_sampling() -> dict[str, str]:
    """SAMPLING, with the values the user configured in this process where they differ from distributed's
    defaults (for the scheduler here and for the workers, which do not see this process's configuration)."""
    defaults = dask.config.merge(*dask.config.defaults)
    sampling = {}
    for key, value in SAMPLING.items():
        configured = dask.config.get(key)
        sampling[key] = value if configured == dask.config.get(key, config=defaults) else str(configured)
    return sampling


def config_environment(config: dict[str, str]) -> dict[str, str]:
    """config as the DASK_* environment variables that set it in a process Dask starts in."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): value for key, value in config.items()}


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def thread_environment(threads: int) -> dict[str, str]:
    """The thread counts of every CPU pool torch may use (OpenMP, and MKL or OpenBLAS under it), all the device's:
    distributed's nanny writes its one-thread values into its own process's environment when it starts a worker,
    so a driver that started a nanny cluster before would pass them on to every device worker it starts."""
    return dict.fromkeys(THREAD_VARIABLES, str(threads))


ZYGOTE: Zygote | None = None  # the warm zygote CPU device workers are forked from (runtime.zygote)
FORKING = threading.Lock()


def worker_environment(threads: int, config: dict[str, str]) -> dict[str, str]:
    """A device worker's environment: the driver's, its sys.path, threads for torch's pools and config as DASK_*."""
    paths = [path for path in sys.path if path and os.path.isdir(path)]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        **thread_environment(threads),
        "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
        "DASK_LOGGING__DISTRIBUTED": os.environ.get("DASK_LOGGING__DISTRIBUTED", "warning"),
        **config_environment(config),
        **driver_environment(),
    }


def zygote(env: dict[str, str]) -> Zygote | None:
    """The zygote to fork a worker from (started with env where there is none, or it has ended); None where
    workers cannot be forked here (not Linux)."""
    global ZYGOTE
    if not sys.platform.startswith("linux"):
        return None
    with FORKING:
        if ZYGOTE is None or not ZYGOTE.alive:
            if ZYGOTE is not None:
                ZYGOTE.close()
            ZYGOTE = Zygote(env)
        return ZYGOTE


def close_zygote() -> None:
    global ZYGOTE
    with FORKING:
        if ZYGOTE is not None:
            ZYGOTE.close()
            ZYGOTE = None


class DeviceWorkerProcess(ProcessInterface):
    """One Dask worker, one thread, in its own process, named after the device it drives: forked from the zygote
    where fork (a CPU device's), else started as a process of its own."""

    def __init__(self, scheduler: str, name: str, threads: int = 1, config: dict[str, str] | None = None,
                 host: str = LOOPBACK, fork: bool = False) -> None:
        super().__init__()
        self.host = host
        self.scheduler = scheduler
        self.name = name
        self.threads = threads
        self.config = config or {}
        self.fork = fork
        self.process: asyncio.subprocess.Process | Forked | None = None
        self.closing = False
        self.restarts = 0
        self.watch: asyncio.Task[None] | None = None
        self.launching: asyncio.Future[asyncio.subprocess.Process | Forked] | None = None

    async def start(self) -> None:
        await self.launch()
        self.watch = asyncio.ensure_future(self.restart_when_lost())
        await super().start()

    async def restart_when_lost(self) -> None:
        """Start the worker again when its process dies (as Dask's nanny would): the device comes back under its
        name and takes up its work. A worker that keeps dying is left dead after RESTARTS restarts."""
        while self.process is not None and self.restarts < RESTARTS:
            await self.process.wait()
            if self.closing:
                return
            self.restarts += 1
            logger.warning("harmony: device worker %s ended (exit code %s); starting it again",
                           self.name, self.process.returncode)
            await asyncio.sleep(RESTART_DELAY)
            if self.closing:
                return
            await self.launch()

    @property
    def gone(self) -> bool:
        """Whether the worker died and will not be started again: its restarts are used up and no process of it
        runs."""
        return self.restarts >= RESTARTS and (self.process is None or self.process.returncode is not None)

    async def launch(self) -> None:
        """Start the worker's process. A cancel (the cluster closing while a lost worker starts again) does not cut
        the start short: the process it starts anyway is close's to end (self.launching), not left to wait out its
        death timeout."""
        self.launching = asyncio.ensure_future(self._started())
        self.process = await asyncio.shield(self.launching)

    async def _started(self) -> asyncio.subprocess.Process | Forked:
        spec = {
            "cls": "distributed.Worker",
            "opts": {
                "name": self.name,
                "nthreads": 1,
                "memory_limit": 0,
                "death_timeout": 60,
                "preload": ["harmony.runtime.warmup"],
                "host": self.host,
                "dashboard": False,
            },
        }
        env = worker_environment(self.threads, self.config)
        args = [self.scheduler, "--spec", json.dumps(spec)]
        forking = zygote(env) if self.fork else None
        forked = None if forking is None else await forking.fork(args, env, self.threads)
        return forked or await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "distributed.cli.dask_spec",
            *args,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # outside the terminal's process group: Ctrl-C reaches the driver alone
        )

    async def close(self) -> None:
        self.closing = True
        if self.watch is not None:
            self.watch.cancel()
        if self.launching is not None:
            with contextlib.suppress(Exception):
                self.process = await self.launching
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


class DeviceCluster(SpecCluster):
    """The embedded cluster: a SpecCluster whose workers start themselves again (DeviceWorkerProcess). SpecCluster
    closes and forgets a worker the scheduler lost that has not come back within
    distributed.deploy.lost-worker-timeout (15 s), which would lose for good a device whose restart takes longer (a
    GPU worker's start on a busy machine can); here a worker is forgotten only when it is gone for good."""

    def _update_worker_status(self, op: str, msg: Any) -> None:
        Cluster._update_worker_status(self, op, msg)


@dataclass
class ClusterHandle:
    """The client a run talks through, and what the run owns and must close."""

    client: Client
    cluster: DeviceCluster | None = None
    owns_client: bool = False
    workers: dict[str, str] = field(default_factory=dict)
    warm: bool = False

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

    def finish(self, clean: bool) -> None:
        """The run on this cluster is over: a warm embedded cluster stays up after a clean end once its workers run
        nothing of the run's (else it is closed: a failed or interrupted run leaves no worker that may still be in
        one of its tasks); any other embedded cluster is closed; a user's is left alone."""
        if self.cluster is None:
            return
        if self.warm and clean and _idle(self.client):
            return
        self.close()

    def gone(self) -> list[str]:
        """The devices whose embedded worker died for good (DeviceWorkerProcess.gone)."""
        workers = self.cluster.workers if self.cluster is not None else {}
        return sorted(name for name, worker in workers.items()
                      if isinstance(worker, DeviceWorkerProcess) and worker.gone)

    def close(self) -> None:
        global WARM
        if WARM is not None and WARM[1] is self:
            WARM = None
        if self.cluster is not None:  # first: a client closed before its scheduler is reported to a closed comm
            with contextlib.suppress(Exception):
                self.cluster.close()
        if self.owns_client:
            with contextlib.suppress(Exception):
                self.client.close()


WARM: tuple[tuple[object, ...], ClusterHandle] | None = None  # the warm embedded cluster and the devices it has
IDLE_TIMEOUT = 10.0


def _executing(dask_worker: Any) -> int:
    return len(dask_worker.state.executing)


def _idle(client: Client) -> bool:
    """Whether no worker runs a task now (waiting up to IDLE_TIMEOUT for the ones that do)."""
    deadline = time.monotonic() + IDLE_TIMEOUT
    while time.monotonic() < deadline:
        try:
            if not any(client.run(_executing).values()):
                return True
        except Exception:
            return False
        time.sleep(0.05)
    return False


STARTING = threading.RLock()  # held while the warm cluster is started, reused or closed


def embedded(devices: list[DeviceSpec], dashboard_address: str = ":8787", host: str = LOOPBACK) -> ClusterHandle:
    """The embedded cluster for these devices: the warm one when it has them (every worker up again, under new
    addresses where one was restarted), else a new one, kept warm after the run (the warm one closed first). One
    at a time: a call's start in the background may still be going when the next call (or shutdown) comes."""
    with STARTING:
        return _embedded(devices, dashboard_address, host)


def _rejoined(handle: ClusterHandle, count: int) -> bool:
    """Whether the warm cluster has count workers again, every one of them answering (those that died restarted;
    one that died a moment ago may still be listed by the scheduler): False as soon as one of them is gone for
    good, TimeoutError after WORKER_START_TIMEOUT."""
    deadline = time.monotonic() + WORKER_START_TIMEOUT
    while not handle.gone():
        try:
            handle.client.wait_for_workers(count, timeout=1)
            answers = handle.client.run(os.getpid, on_error="return")
            if len(answers) == count and not any(isinstance(answer, BaseException) for answer in answers.values()):
                return True
            time.sleep(0.05)
        except TimeoutError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the warm cluster's {count} workers did not all answer in {WORKER_START_TIMEOUT} s")
    return False


def _embedded(devices: list[DeviceSpec], dashboard_address: str, host: str) -> ClusterHandle:
    global WARM
    key = (dashboard_address, host)
    if WARM is not None:
        known, handle = WARM
        if known == key and handle.cluster is not None:
            try:
                if _rejoined(handle, len(handle.cluster.worker_spec)):
                    _resized(handle, devices)
                    return handle
                logger.info("harmony: the warm cluster lost %s for good; starting another", ", ".join(handle.gone()))
            except Exception as error:
                logger.info("harmony: the warm cluster cannot be reused (%s); starting another", error)
        handle.close()  # the zygote stays: the next cluster's workers fork from it
    handle = start_embedded(devices, dashboard_address, host)
    handle.warm = True
    WARM = (key, handle)
    return handle


def compute_with(threads: int) -> None:
    """On a device worker kept for a call whose devices share the cores otherwise: compute with threads from now on,
    as a worker started for that call would (torch's pools are sized at its first parallel region, after which
    torch.set_num_threads sets them; the environment is for what the worker starts)."""
    os.environ.update(thread_environment(threads))
    torch.set_num_threads(threads)


def _resized(handle: ClusterHandle, devices: list[DeviceSpec]) -> None:
    """Make the warm cluster's workers the devices': keep those it has, each with the device's threads, close the
    ones the call does not name and start the missing ones (SpecCluster's own correction of its workers to its
    spec), then wait for those to join. Raises where they do not within WORKER_START_TIMEOUT."""
    cluster = handle.cluster
    assert cluster is not None
    wanted = {device.name: device for device in devices}
    addresses = worker_addresses(handle.client)
    for name, worker in cluster.workers.items():
        device = wanted.get(name)
        if device is None or not isinstance(worker, DeviceWorkerProcess) or worker.threads == device.threads:
            continue
        handle.client.run(compute_with, device.threads, workers=[addresses[name]])
        worker.threads = cluster.worker_spec[name]["options"]["threads"] = device.threads  # and when it restarts
    if set(cluster.worker_spec) == set(wanted):
        handle.workers = addresses
        return
    options = next(iter(cluster.worker_spec.values()))["options"]
    for name in set(cluster.worker_spec) - set(wanted):
        del cluster.worker_spec[name]
    for name, device in wanted.items():
        if name not in cluster.worker_spec:
            cluster.worker_spec[name] = {"cls": DeviceWorkerProcess, "options": {
                **options, "threads": device.threads, "fork": device.kind == "cpu"}}
    cluster.sync(cluster._correct_state)
    deadline = time.monotonic() + WORKER_START_TIMEOUT
    while set(joined := worker_addresses(handle.client, attempts=1)) != set(wanted):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{', '.join(sorted(set(wanted) - set(joined)))} did not join in "
                               f"{WORKER_START_TIMEOUT} s")
        if handle.gone():
            raise RuntimeError(f"{', '.join(handle.gone())} did not start")
        time.sleep(0.05)
    handle.workers = joined


def shutdown() -> None:
    """Close the warm embedded cluster (its scheduler, dashboard and device workers), if there is one (waiting for
    one being started), and the zygote its workers were forked from."""
    with STARTING:
        if WARM is not None:
            WARM[1].close()
        close_zygote()


atexit.register(shutdown)


def start_embedded(devices: list[DeviceSpec], dashboard_address: str = ":8787", host: str = LOOPBACK) -> ClusterHandle:
    """A scheduler in this process and one worker process per device; returns once all workers joined. Everything
    listens on host (loopback unless the user asks otherwise); the dashboard on dashboard_address, whose host is
    host when it names none."""
    sampling = quiet_sampling()
    first = next((device for device in devices if device.kind == "cpu"), None)
    if first is not None:  # its imports overlap the scheduler's start, which its first fork would wait for
        zygote(worker_environment(first.threads, sampling))
    workers = {
        device.name: {"cls": DeviceWorkerProcess,
                      "options": {"threads": device.threads, "config": sampling, "host": host,
                                  "fork": device.kind == "cpu"}}
        for device in devices
    }
    if dashboard_address.startswith(":"):
        dashboard_address = f"{host}{dashboard_address}"
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": dashboard_address, "host": host}}
    memory_manager = {"distributed.scheduler.active-memory-manager.start": False}  # see runtime.handoff
    with dask.config.set({**memory_manager, **sampling}):
        cluster = DeviceCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR, name="harmony")
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


def worker_addresses(client: Client, attempts: int = 20) -> dict[str, str]:
    """Worker name -> address, for every worker the scheduler knows. Where the client's answer has none, it is
    asked again (attempts times, 0.1 s apart): a sync client's scheduler_info() falls back on the identity its
    periodic update cached, which lists no workers, when the fresh query fails or the client is not running."""
    def ask() -> dict[str, str]:
        return {str(info["name"]): address for address, info in client.scheduler_info()["workers"].items()}

    workers = ask()
    for _ in range(attempts - 1):
        if workers:
            break
        time.sleep(0.1)
        workers = ask()
    return workers


def worker_threads(handle: ClusterHandle) -> dict[str, int]:
    """Worker name -> how many tasks it runs at once (the threads of its task pool)."""
    return {str(info["name"]): int(info["nthreads"]) for info in handle.client.scheduler_info()["workers"].values()}


def _probe_device() -> tuple[str, int, int, str]:
    """On a worker: the device it drives (its first visible GPU, else the CPU), that device's bytes, and the
    CPU threads and identity of its machine."""
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    return device, capacity(device, 1), cpu_count(), identity()


def external_devices(handle: ClusterHandle, budget: int | dict[str, int] | None, threads: int | None = None
                     ) -> list[DeviceSpec]:
    """Every worker of a user's cluster is one device: its first visible GPU if it has one, else its CPU; the
    workers on one machine share its CPU threads evenly (threads: that many each instead). budget is every device's,
    or per worker name (a worker not named keeps its device's own bytes)."""
    found = handle.client.run(_probe_device)
    by_address = {address: name for name, address in handle.workers.items()}
    per_machine = Counter(machine for _, _, _, machine in found.values())
    here = identity()
    devices = []
    for address, (device, limit, cpus, machine) in sorted(found.items(), key=lambda item: by_address[item[0]]):
        name = by_address[address]
        share = threads or threads_per_device(cpus, per_machine[machine])
        given = budget.get(name) if isinstance(budget, dict) else budget
        devices.append(DeviceSpec(name, device, given if given is not None else limit, share,
                                  machine="" if machine == here else machine))
    return devices
