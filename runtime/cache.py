"""A device's memory: cached pack weights, kept boundary values and reservations, under a byte budget.

Every byte that enters or leaves the device goes through copy_in / copy_out / weights / prefetch, which count
it. What the device holds is accounted by tasks.memory (its rules: least recently used eviction of what no
running task pins, stale versions dropped, boundaries kept only where they fit); this module keeps the tensors
beside that accounting and moves the bytes.

Copies between host and device can be held to a simulated link (runtime.link: one copy at a time each way),
so that on CPU devices one can see whether swapping hides behind compute. Prefetches of weights run on the
device's copy engine (stream.py: a thread for CPU devices, a copy stream and events on CUDA) while the compute
thread works. Over a link, a micro-batch's values come in ahead of it and its outputs go out behind it (ahead,
send) without the compute thread waiting: on CUDA on the engine's streams, on a CPU device made at once and
ready when the simulated link has carried them (Transit).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from harmony.runtime.counters import Counters
from harmony.runtime.link import IN, OUT, Link, until
from harmony.runtime.serial_copy import copy_small
from harmony.runtime.stream import CopyEngine
from harmony.tasks.memory import BudgetExceeded, DeviceMemory


@dataclass(frozen=True)
class Part:
    """The part of a fused array's pack weights a task reads (runtime.rows): the members whose rows it computes, the
    byte ranges that hold them and what every member reads (a copy in moves those alone), and rows, the ranges of
    some members' rows alone (what a copy made for other members lacks)."""

    members: frozenset[int]
    spans: tuple[tuple[int, int], ...]
    rows: Callable[[list[int]], tuple[tuple[int, int], ...]]


@dataclass
class CachedWeights:
    """A pack's weights on the device: their bytes, when their copy has arrived (or failed), and the members whose
    rows it holds where it was copied in part (None: every byte; see Part)."""

    buffer: torch.Tensor
    arrived: threading.Event = field(default_factory=threading.Event)
    done: torch.cuda.Event | None = None
    failed: BaseException | None = None
    members: frozenset[int] | None = None

    def holds(self, part: Part | None) -> bool:
        """Whether it holds what a task reading part (None: all of it) reads."""
        return self.members is None or (part is not None and part.members <= self.members)


@dataclass
class Reservation:
    """Bytes a running block holds (scratch): what it still gives back when it ends (a stash takes part of it)."""

    nbytes: int


@dataclass
class Stashed:
    """A stash as the cache holds it: the value, the weights key of the pack whose backward reads it, its step."""

    value: Any
    needs: Any
    step: int


class Taken:
    """Stashes taken back together for one task (DeviceCache.unstash_all): each stays charged until its backward
    is done (use), those never used until the task's block ends."""

    def __init__(self, release: Any, stashes: dict[Any, tuple[Any, int]]) -> None:
        self._release = release
        self.stashes = stashes

    def __contains__(self, key: Any) -> bool:
        return key in self.stashes

    @contextmanager
    def use(self, key: Any) -> Iterator[tuple[Any, int]]:
        """The stash kept under key and its bytes, charged until the block ends."""
        value, nbytes = self.stashes.pop(key)
        try:
            yield value, nbytes
        finally:
            del value
            self._release(nbytes)

    def release(self) -> None:
        while self.stashes:
            _, nbytes = self.stashes.popitem()[1]
            self._release(nbytes)


class Spilled:
    """A boundary value handed on to a later pack of the running task (DeviceCache.hand_on), in place of its host
    copy: value is that copy, made only where the value was not kept on the device or was evicted before its
    consumer claimed it (None while it is kept)."""

    def __init__(self) -> None:
        self.value: Any = None


@dataclass(eq=False)
class Transit:
    """A copy between host and device that the compute thread did not wait for (DeviceCache.ahead, send): value is
    the copy, there once its events have completed (CUDA) or, on a CPU device, once the simulated link has carried
    it (at, on perf_counter's clock); a send's device bytes (nbytes) stay charged until then, or on CUDA until the
    compute stream is made to wait for its copy (DeviceCache._give_back). sources: a CUDA send's device tensors,
    held until one of the two (runtime.stream.CopyEngine.copy_out)."""

    value: Any
    events: list[torch.cuda.Event | None] = field(default_factory=list)
    at: float = 0.0
    nbytes: int = 0
    sources: list[torch.Tensor] | None = None


def _landed(transit: Transit) -> bool:
    return time.perf_counter() >= transit.at and all(done is None or done.query() for done in transit.events)


def _land(transit: Transit) -> None:
    """Block the calling thread until transit's copy is there."""
    until(transit.at)
    for done in transit.events:
        if done is not None:
            done.synchronize()


def boundary_key(consumer: Any, microbatch: int) -> tuple[str, Any, int]:
    """Where a boundary value for consumer's micro-batch is kept in the cache."""
    return ("boundary", consumer, microbatch)



Source = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # a pack's host weight bytes, or (halved mirror, the rest)


def source_bytes(source: Source) -> int:
    return source.numel() if isinstance(source, torch.Tensor) else sum(part.numel() for part in source)


def map_tensors(function: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """tree with function applied to each of its tensors (a tensor alone, the common case, without pytree's walk,
    which costs more than the copy's own call: several a micro-batch)."""
    if isinstance(tree, torch.Tensor):
        return function(tree)
    return tree_map(lambda leaf: function(leaf) if isinstance(leaf, torch.Tensor) else leaf, tree)


def tree_nbytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):  # the common case, without pytree's walk (several a micro-batch)
        return tree.nbytes
    return sum(leaf.nbytes for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))


class DeviceCache:
    """Budgeted, accounted memory of one device (the rules: tasks.memory), with a copy engine for prefetches.

    memory keeps the accounting; tensors holds what each of its entries is on the device (CachedWeights for
    weights, the value itself for a kept boundary). Both change together, under one lock: the compute thread
    and the copy engine's thread use the cache at once.
    """

    def __init__(
        self, name: str, device: torch.device, budget: int, counters: Counters, link_bandwidth: float | None = None,
        ahead: bool = False,
    ) -> None:
        self.name = name
        self.device = device
        self.memory = DeviceMemory(name, budget)
        self.tensors: dict[Any, Any] = {}
        self.spills: dict[Any, Spilled] = {}  # kept boundary values whose host copy is made only if evicted
        self.sends: dict[Any, Transit] = {}  # kept boundary values whose send to the host may still read them
        self.counters = counters
        self.link = Link(link_bandwidth) if link_bandwidth else None
        self._lock = threading.RLock()
        self._sending: list[Transit] = []  # sends on their way to the host, their device bytes still charged
        self._prefetching = 0  # prefetched weight copies until marked arrived: while none, no entry is arriving
        self.engine = CopyEngine(name, device)
        self.copies_ahead = ahead and (device.type == "cuda" or self.link is not None)  # on a CPU device without a
        # link a copy is a memmove the compute thread makes as fast itself: nothing to hide
        self._unsettled = False
        self.missed: dict[Any, tuple[int, int]] = {}  # a pack -> (the last step whose stash for it was lost, how
        # many steps in a row lost one since one last reached its backward): see stash.worth_stashing

    @property
    def budget(self) -> int:
        return self.memory.budget

    @property
    def used(self) -> int:
        return self.memory.used

    @property
    def cached(self) -> list[Any]:
        """The keys of what the device holds, least recently used first."""
        return list(self.memory.entries)

    def _forget(self, keys: list[Any]) -> None:
        """Drop the tensors of entries the accounting evicted; an evicted stash is a loss for its pack, an evicted
        value handed on inside a task is copied out first (its consumer reads that copy), and an evicted kept value
        whose send may still read it is let go only once the compute stream waits for that copy (as _give_back)."""
        for key in keys:
            value = self.tensors.pop(key, None)
            spilled = self.spills.pop(key, None)
            sent = self.sends.pop(key, None)
            if sent is not None and sent.sources is not None:
                self._ordered_after(sent)
            if spilled is not None and value is not None:
                spilled.value = self.copy_out(value, "activations")
            if isinstance(value, Stashed):
                self._lost(value.needs, value.step)

    def _lost(self, needs: Any, step: int) -> None:
        """A stash for pack needs made at step was refused or evicted before its backward."""
        last, streak = self.missed.get(needs, (-1, 0))
        self.missed[needs] = (step, streak if last == step else streak + 1)

    def _charge(self, nbytes: int, what: str) -> None:
        """Reserve nbytes, evicting what it may; weights still arriving (a prefetch in flight) cannot be evicted
        until their copy lands, so a reservation that needs their room waits for them first, and so does one that
        would otherwise evict a stash (weights go before stashes, once they have landed); one that does not fit
        while sends are on their way out waits for the oldest to give its bytes back."""
        while True:
            self._release_sent()
            with self._lock:
                arriving = [self.tensors[key] for key, entry in self.memory.entries.items()
                            if entry.arriving and isinstance(self.tensors.get(key), CachedWeights)
                            ] if self._prefetching else []  # a scan of every entry, at every charge otherwise
                try:
                    self._forget(self.memory.reserve(nbytes, what, stashes=not arriving))
                    self.counters.raise_to("peak", self.memory.used)
                    return
                except BudgetExceeded as error:
                    sending = self._sending[0] if self._sending else None
                    if not arriving and sending is None:
                        error.add_note(self.memory.describe())
                        raise
            started = time.perf_counter_ns()
            if not arriving:  # a send gives its bytes back once it is there, or once the compute stream waits for it
                self._give_back(sending)
            else:
                for entry in arriving:
                    entry.arrived.wait()
            self._waited_for_room(started)

    def _waited_for_room(self, started: int) -> None:
        """Count the compute thread's wait, since started, for the room a reservation needed (a send landing,
        weights arriving): as room_ns, and as wait_ns, the task's time waiting for copies."""
        waited = time.perf_counter_ns() - started
        self.counters.add("room_ns", waited)
        self.counters.add("wait_ns", waited)

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.memory.release(nbytes)

    def drop(self, key: Any) -> None:
        with self._lock:
            self.memory.drop(key)
            self.tensors.pop(key, None)
            self.spills.pop(key, None)
            self.sends.pop(key, None)

    def clear(self) -> None:
        self.engine.shutdown()
        for transit in self._sending:
            _land(transit)
        self._release_sent()
        with self._lock:
            for key in list(self.memory.entries):
                self.drop(key)

    def _over_link(self, nbytes: int, started: float, direction: str) -> None:
        """Hold a copy to the simulated link (runtime.link): one at a time each way, at its bandwidth."""
        if self.link is not None:
            self.link.carry(nbytes, direction, started)

    def _entry(self, host: Source, part: Part | None) -> CachedWeights:
        """A device buffer for host's weights, to hold part's members once copied (every member's without part)."""
        return CachedWeights(self.engine.empty(source_bytes(host), torch.uint8),
                             members=None if part is None else part.members)

    def _copy_weights(self, key: Any, entry: CachedWeights, host: Source, prefetched: bool = False,
                      spans: tuple[tuple[int, int], ...] | None = None) -> None:
        """Copy host weight bytes (a buffer, or parts laid one after another; of a buffer, the byte ranges spans
        alone where given) into entry over the link, count them, and mark them arrived.

        On CUDA the copy is only enqueued: entry.done marks its end for the stream that reads the weights.
        A copy that fails marks the entry arrived with its error, so that a task waiting for it raises.
        """
        started = time.perf_counter()
        nbytes = source_bytes(host) if spans is None else sum(stop - start for start, stop in spans)
        try:
            if spans is not None:
                assert isinstance(host, torch.Tensor), "a part is copied from one buffer"
                pieces = [(start, host[start:stop]) for start, stop in spans]
            else:
                parts = (host,) if isinstance(host, torch.Tensor) else host
                pieces = list(zip(accumulate((part.numel() for part in parts), initial=0), parts))
            for offset, piece in pieces:
                entry.done = self.engine.copy(entry.buffer[offset : offset + piece.numel()], piece)
            self._over_link(nbytes, started, IN)
            self.counters.add("in_weights", nbytes)
            if not isinstance(host, torch.Tensor):
                self.counters.add("halved", host[0].numel())
            if prefetched:
                self.counters.add("prefetched", nbytes)
        except BaseException as error:
            entry.failed = error
            raise
        finally:
            with self._lock:
                if self.tensors.get(key) is entry:
                    self.memory.arrived(key)
                self._prefetching -= prefetched
            entry.arrived.set()

    def _wait_arrived(self, key: Any, entry: CachedWeights) -> None:
        """Block until entry's copy was issued, and order the current stream after it."""
        entry.arrived.wait()
        if entry.failed is not None:
            with self._lock:
                if self.tensors.get(key) is entry:
                    self.memory.unpin(key)
                    self.drop(key)
            raise RuntimeError(f"device {self.name}: copying the weights of {key} in failed") from entry.failed
        self.engine.wait(entry.done, entry.buffer)

    def hold(self, key: Any) -> None:
        """Keep a cached entry for the rest of the run: a homed model's master copy of its weights."""
        with self._lock:
            self.memory.hold(key)

    def allocate(self, nbytes: int, what: str) -> torch.Tensor:
        """Device bytes charged to the budget for the rest of the run (a homed model's gradients)."""
        self._charge(nbytes, what)
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def charge(self, nbytes: int, what: str) -> None:
        """Account nbytes held for the rest of the run (a homed model's optimizer state)."""
        self._charge(nbytes, what)

    def set_version(self, key: Any, version: int) -> None:
        """The cached weights now hold version: they were updated on the device."""
        with self._lock:
            self.memory.set_version(key, version)

    def reload(self, key: Any, host: Source) -> None:
        """Copy cached weights in again: what swapping per micro-batch costs (a baseline)."""
        with self._lock:
            entry = self.tensors[key]
        self._copy_weights(key, entry, host)
        entry.members = None
        self._wait_arrived(key, entry)

    def _complete(self, key: Any, entry: CachedWeights, host: Source, part: Part | None) -> None:
        """Copy in what a task reading part (None: all of it) reads that entry, copied in part for another task of
        the same version (or a prefetch), left out: the rows of the members it lacks (what every member reads it
        holds already), or everything."""
        assert entry.members is not None
        started = time.perf_counter_ns()
        missing = None if part is None else part.rows(sorted(part.members - entry.members))
        self._copy_weights(key, entry, host, spans=missing)
        entry.members = None if part is None else entry.members | part.members
        self._wait_arrived(key, entry)
        self.counters.add("wait_ns", time.perf_counter_ns() - started)

    def fits(self, nbytes: int) -> bool:
        """Whether a reservation of nbytes would fit now (evicting what it may)."""
        with self._lock:
            return self.memory.fits(nbytes)

    @contextmanager
    def scratch(self, nbytes: int, what: str) -> Iterator[Reservation]:
        """Reserve nbytes for the duration of the block (activations, gradient buffers)."""
        self._charge(nbytes, what)
        reservation = Reservation(nbytes)
        try:
            yield reservation
        finally:
            self._release(reservation.nbytes)

    def stash(self, key: Any, needs: Any, step: int, value: Any, nbytes: int, reservation: Reservation,
              keep_free: int) -> bool:
        """Keep value (nbytes of the block's reservation: activations made under it at step) on the device for the
        backward of the pack whose weights key is needs, if the block's next reservation of keep_free bytes still
        fits beside it (tasks.memory). Returns whether it was kept; a stash refused, or evicted later, is recorded
        in missed, until one for the pack reaches its backward."""
        with self._lock:
            self.drop(key)  # a forward run again (its task retried here) replaces its stash
            if not self.memory.stash(key, needs, nbytes, reservation.nbytes, keep_free):
                self._lost(needs, step)
                return False
            reservation.nbytes -= nbytes
            self.tensors[key] = Stashed(value, needs, step)
        return True

    @contextmanager
    def unstash(self, key: Any) -> Iterator[tuple[Any, int] | None]:
        """The stash kept under key and its bytes, charged until the block ends (the backward that frees them runs
        in it), or None if it is not here (never kept, or evicted)."""
        with self._lock:
            nbytes = self.memory.unstash(key)
            if nbytes is None:
                stashed = None
            else:
                stashed = self.tensors.pop(key)
                self.missed.pop(stashed.needs, None)
        if stashed is None:
            yield None
            return
        try:
            yield stashed.value, nbytes
        finally:
            del stashed
            self._release(nbytes)

    @contextmanager
    def unstash_all(self, keys: list[Any], room: int) -> Iterator[Taken | None]:
        """The stashes kept under keys, all taken at once and charged until each is used or the block ends, if
        every one is here and room bytes can still be had beside them (tasks.memory.DeviceMemory.unstash_all);
        else None, and nothing is taken."""
        with self._lock:
            sizes = self.memory.unstash_all(keys, room)
            stashes = {key: (self._taken(key), nbytes) for key, nbytes in (sizes or {}).items()}
        if sizes is None:
            yield None
            return
        taken = Taken(self._release, stashes)
        del stashes
        try:
            yield taken
        finally:
            taken.release()

    def _taken(self, key: Any) -> Any:
        """A stash's value, out of the tensors (the caller holds the lock): its pack's losses end here."""
        stashed = self.tensors.pop(key)
        self.missed.pop(stashed.needs, None)
        return stashed.value

    @contextmanager
    def sparing(self, needs: Any) -> Iterator[None]:
        """Within the block, evict the stashes of the pack whose weights key is needs only when nothing else can go
        (its backward runs)."""
        with self._lock:
            self.memory.spared = needs
        try:
            yield
        finally:
            with self._lock:
                self.memory.spared = None

    @contextmanager
    def weights(self, key: Any, version: int, host: Source, part: Part | None = None) -> Iterator[torch.Tensor]:
        """The pack's weight bytes on the device at version, copied in from host unless already there; with part,
        only those the task reads are copied and may be read (the device holds and charges the whole pack).

        A prefetch of the same weights still in flight is waited for rather than repeated.
        """
        with self._lock:
            copy, evicted = self.memory.load(key, version, source_bytes(host))
            self._forget(evicted)
            self.counters.raise_to("peak", self.memory.used)
            if copy:
                self.tensors[key] = self._entry(host, part)
            entry = self.tensors[key]
            self.memory.pin(key)
        try:
            started = time.perf_counter_ns()
            if copy:
                self._copy_weights(key, entry, host, spans=None if part is None else part.spans)
            self._wait_arrived(key, entry)
            self.counters.add("wait_ns", time.perf_counter_ns() - started)
            if not entry.holds(part):
                self._complete(key, entry, host, part)
            yield entry.buffer
        finally:
            with self._lock:
                if self.tensors.get(key) is entry:
                    self.memory.unpin(key)

    def prefetch(self, key: Any, version: int, host: Source, keep_free: int, part: Part | None = None) -> bool:
        """Start copying a pack's weights (of them, part where given) in on the copy engine, if they fit beside
        keep_free bytes.

        keep_free is what the running task will still reserve; a prefetch never takes that room and
        never evicts weights a task holds. Returns whether a copy was started.
        """
        with self._lock:
            admitted, evicted = self.memory.prefetch(key, version, source_bytes(host), keep_free)
            self._forget(evicted)
            if not admitted:
                return False
            self.counters.raise_to("peak", self.memory.used)
            entry = self.tensors[key] = self._entry(host, part)
            self._prefetching += 1
        self.engine.submit(self._copy_weights, key, entry, host, True, None if part is None else part.spans)
        return True

    def keep(self, consumer: Any, microbatch: int, value: Any, keep_free: int = 0, sent: Any = None) -> bool:
        """Keep a boundary value on the device for consumer, if it fits beside keep_free bytes without evicting.

        keep_free is what the running task will still reserve (the next micro-batch's workspace): a value
        kept in that room would push out what the cache holds when the reservation comes, weights
        prefetched for the next task first, and they would be copied in again. It stays evictable (its
        host copy exists), least recently used first like weights, and any task other than consumer drops
        it when it starts (drop_boundaries). Returns whether it was kept. Where sent is value's send to the host
        (a Transit still charging value's bytes), the kept value takes that charge over instead of adding its own,
        and its consumer's kernels are ordered after that copy (claim): they may change it in place.
        """
        key = boundary_key(consumer, microbatch)
        with self._lock:
            taken_over = sent.nbytes if isinstance(sent, Transit) and sent in self._sending else 0
            self.memory.release(taken_over)
            if not self.memory.keep(key, consumer, tree_nbytes(value), keep_free):
                self._forget(self.memory.reserve(taken_over, "a send"))  # the send keeps its charge (it fit just now)
                return False
            if taken_over:
                sent.nbytes = 0
            if isinstance(sent, Transit) and sent.events:
                self.sends[key] = sent
            self.tensors[key] = value
            self.counters.raise_to("peak", self.memory.used)
        return True

    def hand_on(self, consumer: Any, microbatch: int, value: Any, keep_free: int = 0, incoming: int = 1) -> Spilled:
        """value for consumer, a later pack of the running task: kept on the device where it fits (as keep), its
        host copy made only if it is evicted before consumer claims it, or at once where it is not kept. A kept
        value that reached its consumer never crossed the link.

        Where copies run ahead of compute, a value is kept only where 1 + incoming more of its size would still fit
        beside keep_free: room for one value going out and the running pack's next micro-batch's values coming in
        at once (the link carries both ways; a forward reads one, its input, a recomputed backward two, its input
        and its upstream gradient; kept in that room, the value would leave them to come in on the compute stream),
        in which the values not kept are sent behind the compute (send), each charged until it is there, and their
        consumer copies them in ahead. A value finding that room taken by sends waits for the oldest to land; one
        finding no room at all (a pass whose first values already fill it) is copied out at once."""
        spilled = Spilled()
        nbytes = tree_nbytes(value)
        slot = nbytes if self.copies_ahead else 0
        self._release_sent()
        with self._lock:  # no eviction between the keep and its spill's record
            if self.keep(consumer, microbatch, value, keep_free + (1 + incoming) * slot):
                self.spills[boundary_key(consumer, microbatch)] = spilled
                return spilled
        while slot:
            with self._lock:
                if self.memory.room_for(nbytes, keep_free):
                    self._forget(self.memory.reserve(nbytes, "a send"))  # nothing is evicted
                    spilled.value = self._behind(value, "activations", nbytes)
                    return spilled
                sending = self._sending[0] if self._sending else None
            if sending is None:
                break
            started = time.perf_counter_ns()
            self._give_back(sending)
            self._waited_for_room(started)
        spilled.value = self.copy_out(value, "activations")
        return spilled

    def ahead(self, key: Any, tree: Any, kind: str, reservation: Reservation | None = None) -> int:
        """Start copying tree (a host value the running pack reads at a later micro-batch, counted as bytes_in[kind])
        onto the device without waiting for it, in room that reservation (a running forward's workspace, which holds
        no gradients) leaves, else where evicting cached weights makes the room (tasks.memory.DeviceMemory.ahead:
        never a stash or a kept value, nor weights prefetched and not read yet): the compute thread goes on, and
        take(key) gets the copy once it is there. Its bytes are charged from now until taken (the micro-batch's
        workspace holds them then), and it is never evicted; one left untaken is dropped as the next task starts
        (drop_boundaries). Returns the bytes charged: 0 where no copy was started.

        On CUDA the copy is enqueued on the copy stream; on a CPU device it is made at once and is there when the
        simulated link has carried it."""
        sent = None
        if isinstance(tree, Spilled):  # handed on inside the task: on the device still, or spilled to the host
            tree = tree.value
        if isinstance(tree, Transit):  # sent behind the compute: copied in after it lands
            sent, tree = tree, tree.value
        nbytes = tree_nbytes(tree)
        if not self.copies_ahead or not nbytes:
            return 0
        with self._lock:
            spare = reservation is not None and reservation.nbytes >= nbytes and key not in self.memory.entries
            if spare:
                reservation.nbytes -= nbytes
                self.memory.release(nbytes)
            admitted, evicted = self.memory.ahead(key, nbytes, kept=self._copied_ahead_if_evicted)
            assert admitted or not spare, "the reservation's bytes were there"
            self._forget(evicted)
            if not admitted:
                return 0
            self.counters.raise_to("peak", self.memory.used)
            started = max(time.perf_counter(), sent.at if sent is not None else 0.0)
            events: list[torch.cuda.Event | None] = []
            if sent is not None:
                self.engine.after(sent.events)

            def copy(leaf: torch.Tensor) -> torch.Tensor:
                if self.device.type == "cpu":  # made now: the simulated link's transfer is what take waits for
                    return leaf.clone()
                target = self.engine.empty(leaf.shape, leaf.dtype)
                events.append(self.engine.copy(target, leaf))
                return target

            value = map_tensors(copy, tree)
            at = self.link.schedule(nbytes, IN, started) if self.link is not None else 0.0
            self.tensors[key] = Transit(value, events, at)
        self.counters.add(f"in_{kind}", nbytes)
        self.counters.add("ahead", nbytes)
        return nbytes

    def _copied_ahead_if_evicted(self, key: Any) -> bool:
        """Whether a kept value's consumer would copy it in ahead itself were it evicted: all but a consumer's first
        micro-batch's, and none handed on inside the running task (evicted, it is copied out first)."""
        return key[-1] > 0 and key not in self.spills

    def take(self, key: Any) -> Any | None:
        """The value ahead(key) copied in, once it is there (on CUDA: the compute stream waits for it, the host does
        not), or None if no copy was started. Its bytes are given back: the micro-batch's workspace holds them."""
        if not self.copies_ahead:  # called for every micro-batch's values
            return None
        with self._lock:
            transit = self.tensors.pop(key, None)
            if transit is None:
                return None
            self.memory.drop(key)
        started = time.perf_counter_ns()
        if transit.events:
            leaves = [leaf for leaf in tree_leaves(transit.value) if isinstance(leaf, torch.Tensor)]
            for done, leaf in zip(transit.events, leaves):
                self.engine.wait(done, leaf)
        else:
            until(transit.at)
        self.counters.add("wait_ns", time.perf_counter_ns() - started)
        return transit.value

    def send(self, tree: Any, kind: str, reservation: Reservation) -> Any:
        """A host copy of tree (a micro-batch's output on the device, made under reservation, counted as
        bytes_out[kind]) that the compute thread does not wait for: a Transit, which arrived() turns into the copy
        once it is there. tree's bytes leave the reservation for a charge of their own until then. Where copies do
        not run ahead of compute, or the reservation does not hold them, the copy is made now (copy_out).

        On CUDA the copy is enqueued on the outward stream, into page-locked memory; on a CPU device it is made at
        once and is there when the simulated link has carried it."""
        nbytes = tree_nbytes(tree)
        if not self.copies_ahead or nbytes > reservation.nbytes:
            return self.copy_out(tree, kind)
        with self._lock:
            reservation.nbytes -= nbytes
        return self._behind(tree, kind, nbytes)

    def _behind(self, tree: Any, kind: str, nbytes: int) -> Transit:
        """Start tree's host copy behind the compute: a Transit charging nbytes (already reserved) until it lands."""
        started = time.perf_counter()
        events: list[torch.cuda.Event | None] = []
        sources: list[torch.Tensor] = []

        def copy(leaf: torch.Tensor) -> torch.Tensor:  # on a CPU device made now: arrived waits for the simulated link
            host, done = self.engine.send(leaf.detach())
            if done is not None:
                sources.append(leaf.detach())
                events.append(done)
            return host

        value = map_tensors(copy, tree)
        at = self.link.schedule(nbytes, OUT, started) if self.link is not None else 0.0
        transit = Transit(value, events, at, nbytes, sources or None)
        with self._lock:
            self._sending.append(transit)
        self.counters.add(f"out_{kind}", nbytes)
        self.counters.add("behind", nbytes)
        return transit

    def arrived(self, values: list[Any]) -> list[Any]:
        """values with every send among them replaced by its host copy, once it is there."""
        started = time.perf_counter_ns()
        landed = []
        for value in values:
            if isinstance(value, Transit):
                _land(value)
                value = value.value
            landed.append(value)
        self.counters.add("wait_ns", time.perf_counter_ns() - started)
        self._release_sent()
        return landed

    def _release_sent(self) -> None:
        """Give back the device bytes of sends that have reached the host."""
        if not self._sending:  # called for every charge
            return
        with self._lock:
            for transit in [transit for transit in self._sending if _landed(transit)]:
                self._sending.remove(transit)
                self.memory.release(transit.nbytes)
                transit.sources = None

    def _give_back(self, transit: Transit) -> None:
        """Give back a send's device bytes for a reservation that needs them. On CUDA the host does not wait: the
        compute stream waits for the copy out on the GPU, and then the send lets its device tensors go, so that the
        caching allocator hands their memory only to kernels queued after the copy (the bytes are reused, never
        added to). Elsewhere (a CPU device, or a simulated link's transfer still under way) the host waits for it
        to land."""
        if transit.sources is None or time.perf_counter() < transit.at:
            _land(transit)
            self._release_sent()
            return
        self._ordered_after(transit)
        with self._lock:
            if transit in self._sending:
                self._sending.remove(transit)
                self.memory.release(transit.nbytes)

    def _ordered_after(self, transit: Transit) -> None:
        """Make the compute stream wait for a CUDA send's copy out, then let its device tensors go: their memory is
        reused only by kernels queued after that copy."""
        for done in transit.events:
            self.engine.wait(done)
        transit.sources = None

    def holds(self, key: Any) -> bool:
        """Whether the device holds an entry under key (a stash, say)."""
        with self._lock:
            return key in self.memory.entries

    def kept(self, consumer: Any, microbatch: int) -> bool:
        """Whether a boundary value is kept for consumer's micro-batch (claim would take it)."""
        return self.holds(boundary_key(consumer, microbatch))

    def claim(self, consumer: Any, microbatch: int) -> Any | None:
        """The boundary value kept for consumer's micro-batch (now the task's own), or None if it is not here. Where
        its send to the host may still be reading it (CUDA), the compute stream waits for that copy first."""
        key = boundary_key(consumer, microbatch)
        with self._lock:
            nbytes = self.memory.claim(key)
            if nbytes is None:
                return None
            self.counters.add("kept", nbytes)
            self.spills.pop(key, None)
            sent = self.sends.pop(key, None)
            value = self.tensors.pop(key)
        for done in sent.events if sent is not None else ():
            self.engine.wait(done)
        return value

    def drop_boundaries(self, running: Any) -> None:
        """Drop every kept boundary value that is not for the task now starting."""
        with self._lock:
            self._forget(self.memory.drop_boundaries(running))

    def zeros(self, nbytes: int) -> torch.Tensor:
        """nbytes of zeroed device memory (a gradient buffer). On a CPU device they are filled as float64 words: a
        fill of more than 32k elements wakes the pool's threads, which for a small pack costs more than the fill."""
        if self.device.type != "cpu":
            return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        return torch.zeros(-(-nbytes // 8), dtype=torch.float64).view(torch.uint8)[:nbytes]

    def copy_in(self, tree: Any, kind: str) -> Any:
        """A device copy of every tensor in tree, counted as bytes_in[kind].

        On CUDA the copy is enqueued on the compute stream (asynchronous from page-locked host memory, which
        copy_out gives and a pinned store's batch files are), so the kernels that read it are ordered after it
        without the host waiting; settle() waits for it before the task ends and its source may be rewritten.
        """
        if isinstance(tree, Spilled):  # handed on inside the task, and not kept until its consumer claimed it
            if tree.value is None:
                raise RuntimeError(f"device {self.name}: a value handed on in a task was neither kept nor copied out")
            tree = tree.value
        started = time.perf_counter()
        asynchronous = self.device.type == "cuda"
        if isinstance(tree, Transit):  # sent behind the compute: the compute stream copies it in once it is there
            started = max(started, tree.at)
            for done in tree.events:
                self.engine.wait(done)
            tree = tree.value

        def copy(leaf: torch.Tensor) -> torch.Tensor:
            return leaf.to(self.device, copy=True, non_blocking=True) if asynchronous else leaf.clone()

        nbytes, copied = tree_nbytes(tree), map_tensors(copy, tree)
        self._over_link(nbytes, started, IN)
        self.counters.add(f"in_{kind}", nbytes)
        self.counters.add("wait_ns", round((time.perf_counter() - started) * 1e9))
        self._unsettled = self._unsettled or asynchronous
        return copied

    def copy_out(self, tree: Any, kind: str) -> Any:
        """A host copy of every tensor in tree, counted as bytes_out[kind].

        On CUDA the copy goes into page-locked memory from PyTorch's caching host allocator and is only
        enqueued: the host bytes are valid once settle() has run, which the task does before it returns them.
        """
        started = time.perf_counter()
        nbytes, copied = tree_nbytes(tree), map_tensors(self._host_copy, tree)
        self._over_link(nbytes, started, OUT)
        self.counters.add(f"out_{kind}", nbytes)
        self.counters.add("wait_ns", round((time.perf_counter() - started) * 1e9))
        return copied

    def _host_copy(self, leaf: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return leaf.detach().to("cpu", copy=True)
        host = torch.empty(leaf.shape, dtype=leaf.dtype, pin_memory=True)
        host.copy_(leaf.detach(), non_blocking=True)
        self._unsettled = True
        return host

    def reserved(self) -> int:
        """The most device memory the process has held at once since its run began (CUDA's caching allocator's
        peak reserved bytes: what the budget's accounting stands for, fragments and blocks waiting for reuse
        included); 0 on a CPU device, whose memory is the accounting's alone."""
        return torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else 0

    def settle(self) -> None:
        """Wait until the copies enqueued on the compute stream (copy_out's to the host, copy_in's from it) have
        completed (CUDA only)."""
        if self._unsettled:
            self._unsettled = False
            torch.cuda.current_stream(self.device).synchronize()

    def write_back(self, device_bytes: torch.Tensor, host: torch.Tensor, kind: str,
                   spans: tuple[tuple[int, int], ...] | None = None) -> None:
        """Copy device bytes (of them, the byte ranges spans where given) into a host store buffer, counted as
        bytes_out[kind]."""
        started = time.perf_counter()
        nbytes = 0
        for start, stop in spans if spans is not None else ((0, device_bytes.numel()),):
            if self.device.type == "cpu":
                copy_small(host[start:stop], device_bytes[start:stop])
            else:
                host[start:stop].copy_(device_bytes[start:stop])
            nbytes += stop - start
        self._over_link(nbytes, started, OUT)
        self.counters.add(f"out_{kind}", nbytes)
