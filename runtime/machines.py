"""Machines: the device workers that share one host store, and how the driver reaches a store it cannot map.

Two workers are on one machine when they map the same shared memory, whatever their host names say: a worker's
machine is its kernel's boot id and the device number of its shared-memory directory (two containers on one
kernel have /dev/shm mounts of their own, hence devices of their own). The driver is on a machine when its own
identity is that machine's; it may be on none.

A machine the driver is on keeps its files in the driver's HostStore, as a single machine always has. Another
machine's store is a ``RemoteStore``: its files are made and read on the machine by its *keeper* (its first
worker, through Dask tasks), and the driver holds a private scratch copy (a 0700 temporary directory, never
/dev/shm) of the files it writes or reads, moving them with ``push`` and ``pull``: model state goes to the
machine once at the start and comes home at checkpoints and at the end, and a step's batch reaches the machine
once, written by a keeper task into a recycled batch file that every task there maps (``RemoteBatches``).
Batches to a machine's store this way cost one copy into the keeper per step; scattering them through Dask
instead costs one copy into every worker that reads them (benchmarks/machines.py measures both).
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed import Client, Future, fire_and_forget

from harmony.runtime.hoststore import PREFIX, HostStore, identity
from harmony.runtime.shipping import BatchFiles, ShippedTensors

STORE_DIRECTORY = "/dev/shm"  # where a machine the driver is not on keeps its files


@dataclass(frozen=True)
class Machine:
    """A machine of the run: its identity ("" for the driver's), its devices (by name) in device order, and its
    keeper's address."""

    identity: str
    devices: tuple[str, ...]
    keeper: str

    @property
    def local(self) -> bool:
        """Whether the driver is on this machine (and maps its store itself)."""
        return self.identity == ""


def group_machines(identities: dict[str, str], addresses: dict[str, str]) -> list[Machine]:
    """The machines of the devices: identities maps each device's name to its machine, in device order;
    addresses each device's worker address."""
    machines = []
    for found in dict.fromkeys(identities.values()):
        devices = tuple(name for name, machine in identities.items() if machine == found)
        machines.append(Machine(found, devices, addresses[devices[0]]))
    return machines


class Keeper:
    """A run's files on the keeper's machine, as its keeper worker serves them to the driver."""

    def __init__(self, run: str, directory: str) -> None:
        self.store = HostStore(run, directory)
        self.batches = BatchFiles(self.store)


KEEPERS: dict[str, Keeper] = {}


def keeper(run: str, directory: str) -> Keeper:
    if run not in KEEPERS:
        KEEPERS[run] = Keeper(run, directory)
    return KEEPERS[run]


def write_files(run: str, directory: str, files: dict[str, bytes]) -> int:
    """On a keeper: make each file (private, its bytes allocated) with these bytes; returns the bytes written."""
    store = keeper(run, directory).store
    for name, data in files.items():
        store.forget(name)
        store.write_bytes(name, data)  # a new file: pushed only where no task of the run maps it yet
    return sum(len(data) for data in files.values())


def read_files(run: str, directory: str, prefixes: tuple[str, ...]) -> dict[str, bytes]:
    """On a keeper: the bytes of the run's files whose names start with one of prefixes (batch files excepted)."""
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
    """On a keeper: value packed into one of the run's batch files on this machine (see shipping)."""
    batches = keeper(run, directory).batches
    return batches.ship_steps(value) if stacked else batches.ship(value)


def release_batch(run: str, directory: str, value: Any) -> None:
    """On a keeper: a batch file no task reads any more is free again."""
    keeper(run, directory).batches.release(value)


def remove_run(run: str, directory: str) -> int:
    """On any worker: remove the run's files on its machine and forget its keeper state; returns how many."""
    held = KEEPERS.pop(run, None)
    if held is not None:
        held.store.close()
    return HostStore(run, directory).unlink_all()


def on_keeper(client: Client, machine: Machine, function: Any, *args: Any, key: str) -> Future:
    """function(*args) as a task on machine's keeper (never moved elsewhere, never cached)."""
    return client.submit(function, *args, key=f"{key}-{secrets.token_hex(4)}", workers=[machine.keeper],
                         allow_other_workers=False, pure=False, priority=100)


class RemoteStore(HostStore):
    """A machine's host store seen from a driver on another machine: a private scratch copy of the files the
    driver writes or reads, moved to and from the machine's store by its keeper."""

    def __init__(self, run: str, machine: Machine, client: Client, directory: str = STORE_DIRECTORY) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="harmony-"))  # 0700: the user's alone
        super().__init__(run, self.scratch)
        self.machine = machine
        self.client = client
        self.remote_directory = directory
        self.bytes_pushed = 0
        self.bytes_pulled = 0

    def push(self, names: Iterable[str]) -> None:
        """Make these files on the machine as the scratch copy has them."""
        files = {name: self.path(name).read_bytes() for name in names}
        if files:
            future = on_keeper(self.client, self.machine, write_files, self.run, self.remote_directory, files,
                               key="push")
            self.bytes_pushed += future.result()

    def push_all(self) -> None:
        self.push(path.name[len(f"{PREFIX}{self.run}-"):] for path in self.scratch.glob(f"{PREFIX}{self.run}-*"))

    def pull(self, prefixes: tuple[str, ...] = ("",)) -> None:
        """Bring the machine's files whose names start with one of prefixes into the scratch copy."""
        future = on_keeper(self.client, self.machine, read_files, self.run, self.remote_directory, prefixes,
                           key="pull")
        for name, data in future.result().items():
            self.bytes_pulled += len(data)
            if not self.exists(name) or self.path(name).stat().st_size != max(len(data), 1):
                self.forget(name)
                self.create(name, len(data))
            self.attach(name, len(data)).numpy()[:] = memoryview(data)

    def unlink_all(self) -> int:
        removed = super().unlink_all()
        shutil.rmtree(self.scratch, ignore_errors=True)
        return removed


class RemoteBatches:
    """A machine's batch files, filled by its keeper: ship and ship_steps give a future of the ShippedTensors that
    the machine's tasks unpack (a small Dask edge), release frees the file once no task reads it."""

    def __init__(self, run: str, machine: Machine, client: Client, directory: str = STORE_DIRECTORY) -> None:
        self.run = run
        self.machine = machine
        self.client = client
        self.directory = directory
        self.shipped: set[str] = set()

    def ship(self, value: Any) -> Future:
        return self._ship(value, False)

    def ship_steps(self, steps: list[Any]) -> Future:
        return self._ship(steps, True)

    def _ship(self, value: Any, stacked: bool) -> Future:
        future = on_keeper(self.client, self.machine, ship_batch, self.run, self.directory, value, stacked,
                           key="ship")
        self.shipped.add(future.key)
        return future

    def release(self, value: Any) -> None:
        if isinstance(value, Future) and value.key in self.shipped:
            self.shipped.discard(value.key)
            fire_and_forget(on_keeper(self.client, self.machine, release_batch, self.run, self.directory, value,
                                      key="release"))
        elif isinstance(value, ShippedTensors):
            raise TypeError("a local batch was given to a remote machine's batches")


def worker_identity() -> str:
    """On a worker (through client.run): its machine."""
    return identity()
