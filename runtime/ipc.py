"""Device results that a process on another GPU of the same machine copies straight from the producer's device
memory (CUDA IPC handles), and the claim slots that say who may still read them.

Not yet used by the worker: runtime.peer still sends a GPU's results through page-locked host files. How it is
to be wired in (the export charged to the producer's budget, spilled to the host only while unclaimed) is
docs/architecture.md's "GPU to GPU"; tests/test_ipc.py's CUDA tests must pass on a GPU first.

An export is one tree of CUDA tensors, sent to any number of readers. Each send takes a slot of the producer's
slot table, a host-store file every process of the machine maps; a slot changes state under a lock (the
producer's threads share a threading lock, other processes an fcntl lock on the slot's bytes), by the pure
functions below:

    EXPORTED --reader claims--> CLAIMED --reader copied--> DONE
    EXPORTED --producer spills (the host file written first)--> SPILLED
    EXPORTED | SPILLED | DONE --producer withdraws (the key is released)--> WITHDRAWN --> FREE (taken again)

A reader reserves room for its copy before it claims, so a claimed slot waits on nothing the producer holds: the
producer spills only unclaimed slots and waits for claimed ones, which end within one copy (a claim whose process
died counts as done). torch's IPC reference counter keeps the producer's block allocated until each send's count
is given back: by the reader when it drops the tensor it opened, or by the producer (``give_back``) for a send
whose handles were never opened (spilled, withdrawn, or its reader died), so no block waits in torch's limbo for a
reader that never comes. (A reader that dies after dropping its tensor and before marking its slot done has its
count given back twice; torch's counter is unsigned, so that block stays in limbo until the producer's process
ends: the window is one Python statement.) A slot's generation changes each time it is taken, so a ticket for an
earlier export of the same slot reads as stale.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor
from torch.utils._pytree import tree_map

from harmony.runtime.hoststore import HostStore
from harmony.runtime.shipping import BatchFiles, ShippedTensors, StaleBatch

RECORD = 3  # int64s a slot takes: state, claimer's pid, generation
PATIENCE = 60.0  # seconds a producer waits for claimed slots to be done before it calls the claim lost


class State(IntEnum):
    FREE = 0
    EXPORTED = 1
    CLAIMED = 2
    DONE = 3
    SPILLED = 4
    WITHDRAWN = 5


class Reading(Enum):
    """Where a reader that claimed a slot reads the export from."""

    DEVICE = "device"  # the producer's device memory, through the handles
    FILE = "file"  # the host file the producer spilled it into
    STALE = "stale"  # nowhere: the producer withdrew it (its key was released) or took the slot again


class Slot(NamedTuple):
    state: State
    pid: int  # the claimer's
    generation: int


class InvalidTransition(RuntimeError):
    """A slot asked to change in a way the protocol never does: a bug, not a race."""


def claimed(slot: Slot, generation: int, pid: int) -> tuple[Slot, Reading]:
    """A reader (process pid) claims the send that took slot at generation."""
    if slot.generation != generation or slot.state in (State.WITHDRAWN, State.FREE):
        return slot, Reading.STALE
    if slot.state == State.EXPORTED:
        return Slot(State.CLAIMED, pid, generation), Reading.DEVICE
    if slot.state == State.SPILLED:
        return slot, Reading.FILE
    raise InvalidTransition(f"a slot {slot.state.name} was claimed again: each send takes a slot of its own")


def copied(slot: Slot, pid: int) -> Slot:
    """The claimer's copy is complete and it dropped the tensors it opened."""
    if slot.state != State.CLAIMED or slot.pid != pid:
        raise InvalidTransition(f"a slot {slot.state.name} (claimed by {slot.pid}) was marked copied by {pid}")
    return Slot(State.DONE, 0, slot.generation)


def spilled(slot: Slot, alive: Callable[[int], bool]) -> tuple[Slot, bool]:
    """The producer has written the export into its host file and wants its device memory: the slot after, and
    whether the producer gives back the send's reference count (no reader will)."""
    if slot.state == State.EXPORTED:
        return Slot(State.SPILLED, 0, slot.generation), True
    if slot.state == State.CLAIMED and not alive(slot.pid):
        return Slot(State.DONE, 0, slot.generation), True
    return slot, False


def withdrawn(slot: Slot, alive: Callable[[int], bool]) -> tuple[Slot, bool]:
    """The export's key was released (no reader is to come): the slot after (still CLAIMED while a live reader
    copies), and whether the producer gives back the send's reference count."""
    if slot.state == State.CLAIMED:
        if alive(slot.pid):
            return slot, False
        return Slot(State.WITHDRAWN, 0, slot.generation), True
    if slot.state == State.FREE:
        raise InvalidTransition("a free slot was withdrawn")
    return Slot(State.WITHDRAWN, 0, slot.generation), slot.state == State.EXPORTED


def settled(slot: Slot) -> bool:
    """Whether the producer no longer needs its device memory for this send."""
    return slot.state in (State.DONE, State.SPILLED, State.WITHDRAWN)


def alive(pid: int) -> bool:
    """Whether process pid exists (on this machine: its workers share one pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SlotTable:
    """A producer's slots, in a host-store file that the readers of its machine attach to by name."""

    def __init__(self, store: HostStore, name: str, size: int, create: bool = False) -> None:
        self.name = name
        self.size = size
        nbytes = size * RECORD * 8
        mapped = store.create(name, nbytes) if create else store.attach(name, nbytes)
        self.records = mapped.view(torch.int64).view(size, RECORD)
        self._descriptor = os.open(store.path(name), os.O_RDWR)
        self._lock = threading.Lock()
        self._next = 0

    def read(self, index: int) -> Slot:
        state, pid, generation = self.records[index].tolist()
        return Slot(State(state), pid, generation)

    def change(self, index: int, change: Callable[[Slot], tuple[Slot, Any]]) -> Any:
        """Apply change to slot index under both locks; returns change's second value."""
        offset = index * RECORD * 8
        with self._lock:
            fcntl.lockf(self._descriptor, fcntl.LOCK_EX, RECORD * 8, offset)
            try:
                after, result = change(self.read(index))
                self.records[index] = torch.tensor([int(after.state), after.pid, after.generation])
            finally:
                fcntl.lockf(self._descriptor, fcntl.LOCK_UN, RECORD * 8, offset)
        return result

    def take(self) -> tuple[int, int] | None:
        """A free slot made EXPORTED at a new generation, as (index, generation); None when every slot is in use.
        Only the producer takes and frees slots: it looks from the slot after the last one it took."""
        def fresh(slot: Slot) -> tuple[Slot, int | None]:
            if slot.state != State.FREE:
                return slot, None
            return Slot(State.EXPORTED, 0, slot.generation + 1), slot.generation + 1

        for index in [(self._next + offset) % self.size for offset in range(self.size)]:
            generation = self.change(index, fresh)
            if generation is not None:
                self._next = index + 1
                return index, generation
        return None

    def free(self, index: int) -> None:
        """A withdrawn slot may be taken again."""
        def release(slot: Slot) -> tuple[Slot, None]:
            if slot.state != State.WITHDRAWN:
                raise InvalidTransition(f"a slot {slot.state.name} was freed before it was withdrawn")
            return Slot(State.FREE, 0, slot.generation), None
        self.change(index, release)

    def close(self) -> None:
        os.close(self._descriptor)


@dataclass(frozen=True)
class Handle:
    """One CUDA tensor as another process opens it: torch's IPC arguments (torch.multiprocessing.reductions)."""

    arguments: tuple

    @property
    def device(self) -> int:
        return self.arguments[6]


def share(tensor: torch.Tensor) -> Handle:
    """A handle of tensor's device memory, for one reader. torch records an event on the current stream of the
    tensor's device, which the reader's stream waits for before it reads: make that stream wait for the work that
    wrote the tensor first. The send's reference count is the reader's to give back (or give_back's)."""
    _, arguments = reduce_tensor(tensor.detach())
    return Handle(tuple(arguments))


def opened(handle: Handle) -> torch.Tensor:
    """The producer's tensor in this process; its current stream (of the handle's device) waits for the producer's
    event first. Drop it as soon as its copy is made: its memory is the producer's until then."""
    return rebuild_cuda_tensor(*handle.arguments)


def give_back(handle: Handle) -> None:
    """Give back a send's reference count that its reader will never give back (it never opened the handle)."""
    arguments = handle.arguments
    torch.UntypedStorage._release_ipc_counter(arguments[11], arguments[12], device=handle.device)


@dataclass(frozen=True)
class Ticket:
    """What a reader receives for one send of an export: its slot and the export's tree of handles, and the host
    file it is spilled into if the producer needs the room."""

    table: str
    size: int
    index: int
    generation: int
    handles: Any
    file: ShippedTensors


@dataclass
class Export:
    """One exported tree on the producer: the slots its sends took, and its host file."""

    tree: Any
    file: ShippedTensors
    sends: list[tuple[int, Any]] = field(default_factory=list)  # (slot index, tree of handles)
    spilled: bool = False


class Exports:
    """A producer's exported results, by key: each send takes a slot; spill moves an export to its host file
    (freeing its device memory once every claimed send is copied), and release withdraws it.

    share makes a tensor's handle (the CUDA one above; tests give their own) and give_back returns the count of
    one that was never opened."""

    def __init__(self, store: HostStore, prefix: str, size: int,
                 share: Callable[[torch.Tensor], Handle] = share,
                 give_back: Callable[[Handle], None] = give_back) -> None:
        self.table = SlotTable(store, f"{prefix}slots", size, create=True)
        self.files = BatchFiles(store, prefix=f"{prefix}spill-")
        self.share = share
        self.give_back = give_back
        self.held: dict[str, Export] = {}
        self._lock = threading.Lock()

    def send(self, key: str, tree: Any) -> Ticket | None:
        """A ticket for one more reader of key's tree (exported now if it is not yet); None when no slot is free
        or key's export was spilled (the caller sends the bytes another way)."""
        with self._lock:
            export = self.held.get(key)
            if export is not None and export.spilled:
                return None
            taken = self.table.take()
            if taken is None:
                return None
            if export is None:
                export = self.held[key] = Export(tree, self.files.reserve(tree))
            index, generation = taken
            handles = tree_map(lambda leaf: self.share(leaf) if isinstance(leaf, torch.Tensor) else leaf,
                               export.tree)
            export.sends.append((index, handles))
            return Ticket(self.table.name, self.table.size, index, generation, handles, export.file)

    def spill(self, key: str, patience: float = PATIENCE) -> Any:
        """Write key's export into its host file and let its device memory go: returns the device tree once no
        reader holds a claim on it (the caller drops it), after waiting for claimed sends to be copied."""
        with self._lock:
            export = self.held[key]
            if not export.spilled:
                self.files.fill(export.file, export.tree)
                export.spilled = True
            self._settle(export, spilled, patience)
            tree, export.tree = export.tree, None
            return tree

    def release(self, key: str, patience: float = PATIENCE) -> None:
        """key's result has no reader left: withdraw every send (waiting for claimed ones) and free the slots."""
        with self._lock:
            export = self.held.pop(key, None)
            if export is None:
                return
            self._settle(export, withdrawn, patience)
            for index, _ in export.sends:
                self.table.free(index)
            self.files.release(export.file)

    def _settle(self, export: Export, change: Callable[[Slot, Callable[[int], bool]], tuple[Slot, bool]],
                patience: float) -> None:
        """Apply change (spilled or withdrawn) to every send of export, each pass to all of them (so a send not yet
        claimed is not left to be claimed while another's copy is waited for), until none is claimed; a claimer
        that died counts as done, one still copying after patience seconds is an error."""
        deadline = time.monotonic() + patience
        waiting = list(export.sends)
        while True:
            for index, handles in waiting:
                if self.table.change(index, lambda slot: change(slot, alive)):
                    _give_back_all(handles, self.give_back)
            waiting = [(index, handles) for index, handles in waiting if not settled(self.table.read(index))]
            if not waiting:
                return
            if time.monotonic() > deadline:
                index = waiting[0][0]
                raise TimeoutError(f"process {self.table.read(index).pid} claimed slot {index} of {self.table.name} "
                                   f"and did not copy it within {patience:.0f} s")
            time.sleep(0.001)

    def close(self) -> None:
        for key in list(self.held):
            self.release(key)
        self.table.close()


def _give_back_all(handles: Any, give_back: Callable[[Handle], None]) -> None:
    tree_map(lambda leaf: give_back(leaf) if isinstance(leaf, Handle) else leaf, handles)


class Readers:
    """A reader process's view of its machine's slot tables (attached once each, by name)."""

    def __init__(self, store: HostStore) -> None:
        self.store = store
        self.tables: dict[str, SlotTable] = {}

    def receive(self, ticket: Ticket, copy: Callable[[torch.Tensor], torch.Tensor],
                open_handle: Callable[[Handle], torch.Tensor] = opened) -> Any:
        """The export's tree, each tensor through copy (into this reader's device, in room already reserved:
        claim comes after that). copy must have finished reading its source when it returns (on CUDA: the stream
        it copied on synchronized). StaleBatch when the producer withdrew it."""
        table = self.tables.get(ticket.table)
        if table is None:
            table = self.tables[ticket.table] = SlotTable(self.store, ticket.table, ticket.size)
        pid = os.getpid()
        reading = table.change(ticket.index, lambda slot: claimed(slot, ticket.generation, pid))
        if reading == Reading.STALE:
            raise StaleBatch(f"slot {ticket.index} of {ticket.table} no longer holds the export of generation "
                             f"{ticket.generation}: a task ran again after every reader of its input had finished")
        if reading == Reading.FILE:
            tree = tree_map(lambda leaf: copy(leaf) if isinstance(leaf, torch.Tensor) else leaf,
                            ticket.file.unpack(self.store))
            # a spilled export is withdrawn without waiting for its file's readers (a reader of a released key is a
            # stale attempt): what was copied counts only if the file still holds this export
            ticket.file.check(self.store)
            return tree
        try:  # each opened tensor is dropped once copied, before the slot is marked copied
            tree = tree_map(lambda leaf: copy(open_handle(leaf)) if isinstance(leaf, Handle) else leaf,
                            ticket.handles)
        finally:
            table.change(ticket.index, lambda slot: (copied(slot, pid), None))
        return tree

    def close(self) -> None:
        for table in self.tables.values():
            table.close()
        self.tables.clear()
