"""One device's memory as Harmony accounts it: cached weights, kept boundaries and reservations under a budget.

The rules live here once and serve three users: the runtime's DeviceCache (which keeps the tensors beside this
accounting), the simulator's memory replay (which checks a schedule against budgets) and the binder (which
predicts what a device caches, to bind tasks where their weights are).

- A pack's weights are *cached* at the host-store version they were copied from; asking for another version
  drops the stale copy. An entry is evictable once no running task pins it, it is not held for the run (a homed
  model's weights), and its copy has arrived (a prefetch in flight is not).
- A *boundary* value (a pack's output, or its input's gradient) is kept for the task that reads it next, only
  where it fits without evicting anything; any other task drops it when it starts.
- A *stash* (a micro-batch's activations a pack's backward reads, runtime.stash) is made from part of the
  reservation its forward held, only where the next micro-batch's reservation still fits beside it without
  evicting another stash. Weights and boundaries are evicted before stashes, and stashes oldest first; what loads
  or prefetches a pack's weights, or reserves for a pack's backward, spares that pack's stashes while anything
  else can go.
- *Reservations* (gradients, a micro-batch's activations, a homed model's optimizer state) are bytes charged
  without an entry. Charging evicts least recently used entries and raises BudgetExceeded when that is not
  enough; nothing is ever over budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass


class BudgetExceeded(RuntimeError):
    """A device was asked to hold more bytes than its budget, with nothing left to evict."""

    def __init__(self, device: str, what: str, need: int, held: int, budget: int) -> None:
        self.device, self.what, self.need, self.held, self.budget = device, what, need, held, budget
        super().__init__(
            f"device {device}: {what} needs {need:,} bytes but {held:,} of its {budget:,}-byte budget are held "
            "by running tasks"
        )


class StaleInUse(RuntimeError):
    """Weights were asked for at one version while another version of them is in use or still arriving."""


@dataclass
class Entry:
    """Bytes the device holds under a key: a pack's weights at a version, a boundary value for its consumer, or a
    stash for the backward of the pack whose weights key is needs."""

    nbytes: int
    version: int = -1
    consumer: Hashable | None = None
    needs: Hashable | None = None
    pins: int = 0
    held: bool = False
    arriving: bool = False
    unread: bool = False  # weights a prefetch brought that no task has read yet

    @property
    def evictable(self) -> bool:
        return self.pins == 0 and not self.held and not self.arriving


class DeviceMemory:
    """The accounted bytes of one device: entries in least-recently-used order, plus reserved bytes."""

    def __init__(self, name: str, budget: int) -> None:
        self.name = name
        self.budget = budget
        self.used = 0
        self.peak = 0
        self.entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self.spared: Hashable | None = None  # the weights key of the pack whose backward runs: its stashes stay

    def _victim(self, *spared: Hashable, last_resort: bool = True, stashes: bool = True) -> Hashable | None:
        """What to evict next: the least recently used evictable weights or boundary; else the oldest stash (whose
        backward comes last) that is not of a spared pack (nor of self.spared); else, with last_resort, the oldest
        stash; without stashes, never a stash. A stash saves a forward's compute, where cached weights save a copy
        that a prefetch can hide."""
        spared = (*spared, self.spared)
        passes = [lambda entry: entry.needs is None]
        if stashes:
            passes.append(lambda entry: entry.needs not in spared)
        if stashes and last_resort:
            passes.append(lambda entry: True)
        for wanted in passes:  # lazily: the first pass is the plain least-recently-used walk
            chosen = next((key for key, entry in self.entries.items() if entry.evictable and wanted(entry)), None)
            if chosen is not None:
                return chosen
        return None

    def fits(self, nbytes: int, stashes: bool = True) -> bool:
        """Whether nbytes could be reserved now, evicting what may be evicted (with stashes False, no stash)."""
        over = self.used + nbytes - self.budget
        return over <= 0 or over <= sum(entry.nbytes for entry in self.entries.values()
                                        if entry.evictable and (stashes or entry.needs is None))

    def reserve(self, nbytes: int, what: str, spared: tuple[Hashable, ...] = (), stashes: bool = True
                ) -> list[Hashable]:
        """Charge nbytes, evicting least recently used entries as needed (the stashes of spared packs last; with
        stashes False, no stash: BudgetExceeded instead); returns the evicted keys. Nothing is evicted if the
        charge fails."""
        if not self.fits(nbytes, stashes):
            raise BudgetExceeded(self.name, what, nbytes, self.used, self.budget)
        evicted = []
        while self.used + nbytes > self.budget:
            victim = self._victim(*spared, stashes=stashes)
            if victim is None:
                raise BudgetExceeded(self.name, what, nbytes, self.used, self.budget)
            self.drop(victim)
            evicted.append(victim)
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return evicted

    def describe(self) -> str:
        """What the device holds, for an error: each entry's bytes and why it stays, and the reserved bytes."""
        reasons = []
        for key, entry in self.entries.items():
            why = [name for name, on in (("pinned", entry.pins), ("held", entry.held), ("arriving", entry.arriving))
                   if on]
            reasons.append(f"{key}: {entry.nbytes:,} ({', '.join(why) or 'evictable'})")
        reserved = self.used - sum(entry.nbytes for entry in self.entries.values())
        return f"device {self.name} holds {'; '.join(reasons) or 'no entry'}; reserved {reserved:,} bytes"

    def release(self, nbytes: int) -> None:
        """Give back reserved bytes."""
        self.used -= nbytes

    def drop(self, key: Hashable) -> Entry | None:
        """Forget an entry and its bytes (nothing if there is none)."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used -= entry.nbytes
        return entry

    def holds(self, key: Hashable, version: int) -> bool:
        """Whether key's weights are cached at version."""
        entry = self.entries.get(key)
        return entry is not None and entry.version == version

    def load(self, key: Hashable, version: int, nbytes: int) -> tuple[bool, list[Hashable]]:
        """Make key's weights cached at version and most recently used: whether they must be copied in, and the
        keys evicted for them. A stale copy is dropped first; one in use or arriving is StaleInUse."""
        entry = self.entries.get(key)
        if entry is not None and entry.version != version:
            if entry.pins or entry.held or entry.arriving:
                raise StaleInUse(f"device {self.name}: weights of {key} at version {entry.version} are in use or in "
                                 f"flight while version {version} is asked for")
            self.drop(key)
            entry = None
        evicted: list[Hashable] = []
        copied = entry is None
        if copied:
            evicted = self.reserve(nbytes, f"weights of {key}", spared=(key,))
            self.entries[key] = Entry(nbytes, version)
        self.entries[key].unread = False
        self.entries.move_to_end(key)
        return copied, evicted

    def prefetch(self, key: Hashable, version: int, nbytes: int, keep_free: int) -> tuple[bool, list[Hashable]]:
        """Start caching key's weights ahead of their task, if they fit beside keep_free bytes (what the running
        task will still reserve) by evicting only evictable entries; returns whether they were admitted (marked
        arriving until arrived() is called) and the evicted keys."""
        if key in self.entries:
            return False, []
        evicted = []
        while self.used + nbytes + keep_free > self.budget:
            victim = self._victim(key, last_resort=False)
            if victim is None:
                return False, evicted
            self.drop(victim)
            evicted.append(victim)
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        self.entries[key] = Entry(nbytes, version, arriving=True, unread=True)
        return True, evicted

    def arrived(self, key: Hashable) -> None:
        """A prefetched entry's copy has ended (or failed): it may be evicted again."""
        entry = self.entries.get(key)
        if entry is not None:
            entry.arriving = False

    def pin(self, key: Hashable) -> None:
        """A running task uses key's bytes: it is not evicted until unpinned."""
        self.entries[key].pins += 1

    def unpin(self, key: Hashable) -> None:
        entry = self.entries.get(key)
        if entry is not None:
            entry.pins -= 1

    def hold(self, key: Hashable) -> None:
        """Keep key's entry for the rest of the run (a homed model's weights)."""
        self.entries[key].held = True

    def set_version(self, key: Hashable, version: int) -> None:
        """The cached weights now hold version (they were updated on the device)."""
        self.entries[key].version = version

    def room_for(self, nbytes: int, keep_free: int = 0) -> bool:
        """Whether nbytes fit beside keep_free bytes without evicting anything."""
        return self.used + nbytes + keep_free <= self.budget

    def keep(self, key: Hashable, consumer: Hashable, nbytes: int, keep_free: int) -> bool:
        """Keep a boundary value for consumer if it fits beside keep_free bytes without evicting anything."""
        if not self.room_for(nbytes, keep_free):
            return False
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        self.entries[key] = Entry(nbytes, consumer=consumer)
        return True

    def claim(self, key: Hashable) -> int | None:
        """Take a kept boundary value (its bytes are released): its size, or None if it is not there."""
        entry = self.entries.get(key)
        if entry is None or entry.consumer is None:
            return None
        self.drop(key)
        return entry.nbytes

    def ahead(self, key: Hashable, nbytes: int, kept: Callable[[Hashable], bool] = lambda key: False
              ) -> tuple[bool, list[Hashable]]:
        """Hold nbytes for a value copied in ahead of the micro-batch that reads it, if evicting cached weights (and
        the kept boundary values for which kept says so) makes the room: never a stash (it saves a forward) or
        another kept value (it saves a copy), nor weights a prefetch brought that no task has read yet (the next
        pack's). Returns whether it was admitted (pinned, and dropped as the next task starts unless taken first)
        and the evicted keys; nothing is evicted if it is not."""
        if key in self.entries:
            return False, []
        evicted, freed = [], 0
        if self.used + nbytes > self.budget:  # else nothing is scanned: this runs for every micro-batch's values
            for victim, entry in self.entries.items():
                if self.used + nbytes - freed <= self.budget:
                    break
                if entry.evictable and entry.needs is None and (
                        (entry.consumer is None and not entry.unread) or (entry.consumer is not None and kept(victim))):
                    evicted.append(victim)
                    freed += entry.nbytes
        if self.used + nbytes - freed > self.budget:
            return False, []
        for victim in evicted:
            self.drop(victim)
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        self.entries[key] = Entry(nbytes, consumer=key, pins=1)
        return True, evicted

    def stash(self, key: Hashable, needs: Hashable, nbytes: int, reserved: int, keep_free: int) -> bool:
        """Keep nbytes of a running reservation of reserved bytes (a micro-batch's activations) as a stash for the
        backward of pack needs, if the reservation's holder's next one (keep_free) still fits beside it, evicting
        weights or boundaries but no other stash; the caller's reservation shrinks by nbytes. Returns whether it was
        kept."""
        evictable = sum(entry.nbytes for entry in self.entries.values() if entry.evictable and entry.needs is None)
        if nbytes > reserved or self.used - reserved + nbytes + keep_free > self.budget + evictable:
            return False
        self.entries[key] = Entry(nbytes, needs=needs)
        return True

    def unstash(self, key: Hashable) -> int | None:
        """Take a stash back into a reservation (its bytes stay charged until released): its size, or None if it is
        not there."""
        entry = self.entries.get(key)
        if entry is None or entry.needs is None:
            return None
        del self.entries[key]
        return entry.nbytes

    def unstash_all(self, keys: list[Hashable], room: int) -> dict[Hashable, int] | None:
        """Take several stashes back into a reservation at once (a section's backward, which then recomputes none
        of its packs' inputs), only if every one is here and room bytes can still be had beside them, free or
        evictable: their sizes, or None (nothing taken)."""
        entries = [self.entries.get(key) for key in keys]
        if any(entry is None or entry.needs is None for entry in entries):
            return None
        taken = set(keys)
        evictable = sum(entry.nbytes for key, entry in self.entries.items() if entry.evictable and key not in taken)
        if self.budget - self.used + evictable < room:
            return None
        for key in keys:
            del self.entries[key]
        return {key: entry.nbytes for key, entry in zip(keys, entries) if entry is not None}

    def drop_boundaries(self, *running: Hashable) -> list[Hashable]:
        """Drop every kept boundary value that is not for the task now starting (any of running: a task replayed as
        the one-pack tasks it stands for); returns their keys."""
        stale = [key for key, entry in self.entries.items()
                 if entry.consumer is not None and entry.consumer not in running]
        for key in stale:
            self.drop(key)
        return stale

    def validate(self) -> None:
        """The invariants: never over budget, the peak never below what is used, no negative pins."""
        assert 0 <= self.used <= self.budget, f"{self.name}: {self.used} bytes used of a {self.budget}-byte budget"
        assert self.peak >= self.used, f"{self.name}: peak {self.peak} below the {self.used} bytes used"
        assert sum(entry.nbytes for entry in self.entries.values()) <= self.used, f"{self.name}: entries over used"
        assert all(entry.pins >= 0 for entry in self.entries.values()), f"{self.name}: a negative pin count"
