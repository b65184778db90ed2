"""Machines: the device workers that share one host store, and how the driver reaches a store it cannot map.

Two workers are on one machine when they map the same shared memory, whatever their host names say: a worker's
machine is its kernel's boot id and the device number of its shared-memory directory (two containers on one
kernel have /dev/shm mounts of their own, hence devices of their own). The driver is on a machine when its own
identity is that machine's; it may be on none.

A machine the driver is on keeps its files in the driver's HostStore, as a single machine always has. Another
machine's store is a ``RemoteStore``: its files are made and read on the machine by one of its workers (a
``Keeper``, through Dask tasks restricted to the machine's workers), and the driver holds a private scratch copy
(a 0700 temporary directory, never /dev/shm) of the files it writes or reads, moving them with ``push`` and
``pull``: model state goes to the machine once at the start and comes home at checkpoints and at the end.

A step's batch reaches the machine once, written by a task (the batch is its argument) into a recycled batch file
that every task there maps (``RemoteBatches``): one copy into the machine per step, and a task that Dask runs again
on another of the machine's workers if its worker dies. Scattering the batch through Dask instead costs one copy
into every worker that reads it, and the data dies with the worker that holds it; on loopback it is the quicker
(docs/performance.md, "Machines"), across a network it sends a batch once per device. A loader run on the machine
would cost nothing but cannot be had: a loader is the user's object in the driver.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed import Client, Future, fire_and_forget

from harmony.runtime.cache import tree_nbytes
from harmony.runtime.hoststore import PREFIX, HostStore
from harmony.runtime.shipping import BatchFiles, ShippedTensors

STORE_DIRECTORY = "/dev/shm"  # where a machine the driver is not on keeps its files
WAIT_SECONDS = 1.0  # how often a wait on a machine checks that it still has a worker

logger = logging.getLogger("harmony")


class MachineUnreachable(RuntimeError):
    """Every worker of a machine is gone: its store cannot be read or written."""


@dataclass(frozen=True)
class Machine:
    """A machine of the run: its identity ("" for the driver's) and its devices (by name) in device order."""

    identity: str
    devices: tuple[str, ...]

    @property
    def local(self) -> bool:
        """Whether the driver is on this machine (and maps its store itself)."""
        return self.identity == ""


def group_machines(identities: dict[str, str]) -> list[Machine]:
    """The machines of the devices: identities maps each device's name to its machine, in device order."""
    return [Machine(found, tuple(name for name, machine in identities.items() if machine == found))
            for found in dict.fromkeys(identities.values())]


class Keeper:
    """A run's files on a machine the driver is not on, as one of its workers serves them to the driver. Any
    worker of the machine may serve; the batch files each one makes carry its process id, and their generations
    start at random, so that two of them never hand out one file, nor take one's batch for another's."""

    def __init__(self, run: str, directory: str) -> None:
        self.store = HostStore(run, directory)
        self.batches = BatchFiles(self.store, prefix=f"batch-w{os.getpid()}-")
        self.batches.generation = secrets.randbits(40) << 20


KEEPERS: dict[str, Keeper] = {}


def keeper(run: str, directory: str) -> Keeper:
    if run not in KEEPERS:
        KEEPERS[run] = Keeper(run, directory)
    return KEEPERS[run]


def write_files(run: str, directory: str, files: dict[str, bytes], in_place: bool = False) -> int:
    """On a worker of the machine: make each file (private) with these bytes, or with in_place write them over the
    existing file (the pages its processes map are the file's, so they see them); returns the bytes written."""
    store = keeper(run, directory).store
    for name, data in files.items():
        if in_place:
            with open(store.path(name), "r+b") as handle:
                handle.write(data)
        else:
            store.forget(name)
            store.write_bytes(name, data)  # a new file: pushed only where no task of the run maps it yet
    return sum(len(data) for data in files.values())


def read_files(run: str, directory: str, prefixes: tuple[str, ...]) -> dict[str, bytes]:
    """On a worker of the machine: the bytes of the run's files whose names start with one of prefixes (batch
    files excepted)."""
    start = f"{PREFIX}{run}-"
    found = {}
    for path in Path(directory).glob(f"{start}*"):
        name = path.name[len(start):]
        if name.startswith("batch-") or name.endswith(".tmp") or not name.startswith(prefixes):
            continue
        try:
            found[name] = path.read_bytes()
        except FileNotFoundError:
            continue
    return found


def ship_batch(run: str, directory: str, value: Any, stacked: bool) -> Any:
    """On a worker of the machine: value packed into one of the run's batch files on this machine (see shipping)."""
    batches = keeper(run, directory).batches
    return batches.ship_steps(value) if stacked else batches.ship(value)


def release_batch(run: str, directory: str, value: Any) -> None:
    """On a worker of the machine: a batch file no task reads any more is free again."""
    keeper(run, directory).batches.release(value)


def remove_run(run: str, directory: str) -> int:
    """On any worker: remove the run's files on its machine and forget its keeper state; returns how many."""
    held = KEEPERS.pop(run, None)
    if held is not None:
        held.store.close()
    return HostStore(run, directory).unlink_all()


def on_machine(client: Client, addresses: list[str], function: Any, *args: Any, key: str) -> Future:
    """function(*args) as a task on one of a machine's workers (never another machine's; Dask runs it again on
    another of them if the one holding its result dies), never cached."""
    return client.submit(function, *args, key=f"{key}-{secrets.token_hex(4)}", workers=addresses,
                         allow_other_workers=False, pure=False, priority=100)


class RemoteStore(HostStore):
    """A machine's host store seen from a driver on another machine: a private scratch copy of the files the
    driver writes or reads, moved to and from the machine's store by its keeper."""

    def __init__(self, run: str, machine: Machine, client: Client, workers: dict[str, str],
                 directory: str = STORE_DIRECTORY) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="harmony-"))  # 0700: the user's alone
        super().__init__(run, self.scratch)
        self.machine = machine
        self.client = client
        self.workers = workers
        self.remote_directory = directory
        self.bytes_pushed = 0
        self.bytes_pulled = 0

    def addresses(self) -> list[str]:
        """The machine's workers now (workers is the driver's name -> address, kept up to date as they join)."""
        return [self.workers[name] for name in self.machine.devices if name in self.workers]

    def live(self) -> bool:
        """Whether some worker of the machine is connected to the scheduler now."""
        connected = self.client.scheduler_info()["workers"]
        return any(address in connected for address in self.addresses())

    def _wait(self, future: Future) -> Any:
        """future's result, or MachineUnreachable once the machine has no worker left to give it."""
        while True:
            try:
                return future.result(timeout=WAIT_SECONDS)
            except TimeoutError:
                if not self.live():
                    future.release()
                    raise MachineUnreachable(f"every worker of machine {self.machine.identity} "
                                             f"({', '.join(self.machine.devices)}) is gone") from None

    def push(self, names: Iterable[str]) -> None:
        """Make these files on the machine as the scratch copy has them."""
        self._send(names, in_place=False)

    def push_all(self) -> None:
        self.push(path.name[len(f"{PREFIX}{self.run}-"):] for path in self.scratch.glob(f"{PREFIX}{self.run}-*"))

    def overwrite(self, names: Iterable[str]) -> None:
        """Write these files of the scratch copy over the machine's, in place: its workers may map them."""
        self._send(names, in_place=True)

    def _send(self, names: Iterable[str], in_place: bool) -> None:
        files = {name: self.path(name).read_bytes() for name in names}
        if files:
            future = on_machine(self.client, self.addresses(), write_files, self.run, self.remote_directory, files,
                                in_place, key="overwrite" if in_place else "push")
            self.bytes_pushed += self._wait(future)

    def pull(self, prefixes: tuple[str, ...] = ("",)) -> bool:
        """Bring the machine's files whose names start with one of prefixes into the scratch copy; False (the copy
        as it was) when the machine has no worker left."""
        future = on_machine(self.client, self.addresses(), read_files, self.run, self.remote_directory, prefixes,
                            key="pull")
        try:
            files = self._wait(future)
        except MachineUnreachable as error:
            logger.warning("harmony: %s; its files are out of reach", error)
            return False
        for name, data in files.items():
            self.bytes_pulled += len(data)
            if not self.exists(name) or self.path(name).stat().st_size != max(len(data), 1):
                self.forget(name)
                self.create(name, len(data))
            self.attach(name, len(data)).numpy()[:] = memoryview(data)
        return True

    def unlink_all(self) -> int:
        removed = super().unlink_all()
        shutil.rmtree(self.scratch, ignore_errors=True)
        return removed


class RemoteBatches:
    """A machine's batch files, filled by its keeper: ship and ship_steps give a future of the ShippedTensors that
    the machine's tasks unpack (a small Dask edge), release frees the file once no task reads it."""

    def __init__(self, store: RemoteStore) -> None:
        self.store = store
        self.shipped: set[str] = set()
        self.bytes_shipped = 0

    def ship(self, value: Any) -> Future:
        return self._ship(value, False)

    def ship_steps(self, steps: list[Any]) -> Future:
        return self._ship(steps, True)

    def _ship(self, value: Any, stacked: bool) -> Future:
        store = self.store
        future = on_machine(store.client, store.addresses(), ship_batch, store.run, store.remote_directory, value,
                            stacked, key="ship")
        self.bytes_shipped += tree_nbytes(value)
        self.shipped.add(future.key)
        return future

    def release(self, value: Any) -> None:
        if isinstance(value, Future) and value.key in self.shipped:
            self.shipped.discard(value.key)
            store = self.store
            fire_and_forget(on_machine(store.client, store.addresses(), release_batch, store.run,
                                       store.remote_directory, value, key="release"))
        elif isinstance(value, ShippedTensors):
            raise TypeError("a local batch was given to a remote machine's batches")
