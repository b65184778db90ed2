"""Task results that a task on another device of the same machine reads from the producer's file, not Dask's comms.

A fwd or bwd task's result (the activations or gradients its model's next task reads) stays in its worker's memory
as an ``Exported`` value, and readers on the same worker take its tree from there (runtime.handoff). When Dask
sends it to another worker (the reader runs on another device), the value's serializer does not send the bytes
through Dask's comms: it writes them once into a file of the machine's host store (the worker's ``Outbox``) and
sends the file's name; the reader maps the file (``PeerResult``) and copies the tensors into its own device. Where
the machine's shared memory has no room for another file, the bytes go through Dask's comms as before.

Between CPU devices, whose memory is host memory, the file is the peer-to-peer path: the bytes count as
``bytes_p2p``. A GPU's result is the page-locked host copy its task made, and the reader's GPU copies it in from its
page-locked mapping: through host memory, so ``bytes_remote``, as through Dask's comms, without the socket. GPU to
GPU without the host is runtime.ipc's, not yet wired in (docs/architecture.md, "GPU to GPU").

The export is lazy: a result read only on its own device costs nothing. The file is the producer's until the
scheduler releases the result's key on the producer's worker, which happens after every reader of it has
finished (the driver holds the key until then, and Dask keeps a key while a task that depends on it waits); the
device plugin tells the outbox (``release``), and the file is written again for a later result. A reader that
comes after that (a task run again) finds another result's generation in the file: a StaleBatch error, never
another step's bytes. Models are homed on one machine, so a result never has a reader on another one; a handle
that crosses machines all the same is an error that says so.
"""

from __future__ import annotations

import pickle
import threading
import uuid
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from dask.sizeof import sizeof
from distributed.protocol.serialize import dask_deserialize, dask_serialize, deserialize, serialize

from harmony.runtime.cache import tree_nbytes
from harmony.runtime.hoststore import HostStore, HostStoreFull
from harmony.runtime.shipping import BatchFiles, ShippedTensors


class Outbox:
    """A device worker's files for results that other devices read: each export takes a recycled file
    (BatchFiles under a prefix of this worker's own) and holds it until release(key).

    Exports come from Dask's comm threads and releases from its event loop, while the worker's task thread runs:
    one lock guards the files. A GPU worker's store page-locks a new file for its device, which a comm thread must
    name (its current device is the first GPU, whose context the process would otherwise create).
    """

    def __init__(self, store: HostStore, device_index: int, device: torch.device | None = None) -> None:
        self.files = BatchFiles(store, prefix=f"peer-{device_index}-{uuid.uuid4().hex[:8]}-")
        self.device = device if device is not None and device.type == "cuda" else None
        self.held: dict[str, ShippedTensors] = {}
        self._lock = threading.Lock()

    def export(self, key: str, tree: Any) -> ShippedTensors:
        """tree written into a file held for key (the same file when key's result is sent again)."""
        with self._lock, torch.cuda.device(self.device) if self.device is not None else nullcontext():
            shipped = self.held.get(key)
            if shipped is None:
                shipped = self.held[key] = self.files.ship(tree)
            return shipped

    def release(self, key: str) -> None:
        """key's result has no reader left: its file may hold the next export."""
        with self._lock:
            shipped = self.held.pop(key, None)
            if shipped is not None:
                self.files.release(shipped)

    def release_all(self) -> None:
        with self._lock:
            for shipped in self.held.values():
                self.files.release(shipped)
            self.held.clear()


class Exported:
    """A task's result as its worker holds it: the tree for readers on this worker, exported through outbox when
    Dask sends it to another worker on machine (the identity of its shared memory, runtime.hoststore.identity);
    direct when the producer is a CPU device (its memory is the host's)."""

    __slots__ = ("direct", "key", "machine", "outbox", "tree")

    def __init__(self, tree: Any, key: str, outbox: Outbox, machine: str, direct: bool) -> None:
        self.tree = tree
        self.key = key
        self.outbox = outbox
        self.machine = machine
        self.direct = direct

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        """Pickled (a path that bypasses Dask's serializers), the tree itself travels."""
        return _plain, (self.tree,)


def _plain(tree: Any) -> Any:
    return tree


@dataclass(frozen=True)
class PeerResult:
    """Another device's result on this machine: the file it was exported into."""

    shipped: ShippedTensors
    machine: str
    direct: bool

    def unpack(self, store: HostStore, machine: str) -> Any:
        """The tree, as read-only views of the producer's file (the reader copies them into its device)."""
        if machine != self.machine:
            raise RuntimeError(f"a task's result exported on machine {self.machine} was read on {machine}: results "
                               "of a model's tasks are read on its own machine")
        return self.shipped.unpack(store)


@dask_serialize.register(Exported)
def _serialize(value: Exported) -> tuple[dict, list]:
    """The file's name and layout (a frame: Dask's headers hold only msgpack's types), not the bytes; where the
    machine's shared memory has no room for the file, the tensors themselves, through Dask's comms as before."""
    try:
        shipped = value.outbox.export(value.key, value.tree)
    except HostStoreFull:
        header, frames = serialize(value.tree, serializers=("dask", "pickle"))
        return {"inline": header}, frames
    header = {"machine": value.machine, "direct": value.direct}
    return header, [pickle.dumps(shipped)]


@dask_deserialize.register(Exported)
def _deserialize(header: dict, frames: list) -> Any:
    if "inline" in header:
        return deserialize(header["inline"], frames)
    return PeerResult(pickle.loads(bytes(frames[0])), header["machine"], header["direct"])


@sizeof.register(Exported)
def _sizeof(value: Exported) -> int:
    return tree_nbytes(value.tree)


def take(value: Any, store: HostStore, machine: str) -> Any:
    """The tree a task reads from a result: the exported tree on its own worker, the producer's file on another."""
    if isinstance(value, Exported):
        return value.tree
    if isinstance(value, PeerResult):
        return value.unpack(store, machine)
    return value


def files_read(values: Sequence[Any]) -> list[ShippedTensors]:
    """The host-store files a task's arguments are read from (batches, other devices' results): what it checks
    before it writes anything it computed from them (RunContext.writing)."""
    shipped = [value.shipped if isinstance(value, PeerResult) else value for value in values]
    return [value for value in shipped if isinstance(value, ShippedTensors)]


def received_bytes(values: Sequence[Any], trees: Sequence[Any], peers: Sequence[bool], direct: bool
                   ) -> tuple[int, int]:
    """What a task's arguments brought from other devices: (bytes_p2p, bytes_remote). values are the arguments as
    the task received them, trees what it reads from them (take); peers flags those another device produced;
    direct, whether the reader is a CPU device."""
    p2p = remote = 0
    for value, tree, peer in zip(values, trees, peers):
        if not peer:
            continue
        if isinstance(value, PeerResult) and value.direct and direct:
            p2p += tree_nbytes(tree)
        else:
            remote += tree_nbytes(tree)
    return p2p, remote
