"""The memory model every user of a device's bytes shares: the cache, the simulator's replay and the binder."""

from __future__ import annotations

import pytest

from harmony.tasks.memory import BudgetExceeded, DeviceMemory, StaleInUse


def test_weights_are_copied_once_per_version_and_a_stale_copy_is_dropped() -> None:
    memory = DeviceMemory("d", 1000)
    assert memory.load("p0", 0, 400) == (True, [])
    assert memory.load("p0", 0, 400) == (False, []), "cached at that version: no copy"
    assert memory.holds("p0", 0) and not memory.holds("p0", 1)
    assert memory.load("p0", 1, 400) == (True, []), "another version: the stale copy goes, a new one comes"
    assert memory.used == 400 and list(memory.entries) == ["p0"]
    memory.validate()


def test_reserving_evicts_least_recently_used_entries_that_nothing_pins() -> None:
    memory = DeviceMemory("d", 1000)
    for key in ("a", "b", "c"):
        memory.load(key, 0, 300)
    memory.load("a", 0, 300)  # a is the most recently used now
    memory.pin("b")
    assert memory.reserve(200, "activations") == ["c"], "b is pinned, a recently used: c goes"
    assert memory.used == 800 and memory.peak == 900
    memory.release(200)
    memory.unpin("b")
    assert memory.reserve(600, "activations") == ["b"]
    memory.release(600)
    memory.validate()


def test_nothing_ever_goes_over_budget() -> None:
    memory = DeviceMemory("d", 1000)
    memory.load("a", 0, 600)
    memory.pin("a")
    with pytest.raises(BudgetExceeded, match="needs 500 bytes but 600 of its 1,000-byte budget") as raised:
        memory.reserve(500, "activations")
    assert (raised.value.need, raised.value.held, raised.value.budget) == (500, 600, 1000)
    assert memory.used == 600 and memory.peak == 600
    memory.load("b", 0, 300)
    assert memory.fits(400) and not memory.fits(401), "b may be evicted, a may not"
    assert memory.used == 900, "asking reserves nothing"


def test_weights_in_use_or_arriving_are_never_replaced_by_another_version() -> None:
    memory = DeviceMemory("d", 1000)
    memory.load("a", 0, 100)
    memory.pin("a")
    with pytest.raises(StaleInUse, match="version 0 are in use"):
        memory.load("a", 1, 100)
    memory.unpin("a")
    assert memory.prefetch("b", 0, 100, keep_free=0) == (True, [])
    with pytest.raises(StaleInUse):
        memory.load("b", 1, 100)
    memory.hold("a")
    assert memory.reserve(800, "state") == [], "held and arriving entries stay"
    with pytest.raises(BudgetExceeded):
        memory.reserve(1, "one byte more")


def test_a_prefetch_never_takes_the_room_the_running_task_still_needs() -> None:
    memory = DeviceMemory("d", 1000)
    memory.load("a", 0, 300)
    memory.pin("a")
    assert memory.prefetch("b", 0, 500, keep_free=300) == (False, []), "would leave less than keep_free"
    assert memory.prefetch("b", 0, 400, keep_free=300) == (True, [])
    assert memory.prefetch("b", 0, 400, keep_free=0) == (False, []), "already cached"
    memory.arrived("b")
    memory.unpin("a")
    assert memory.prefetch("c", 0, 600, keep_free=0) == (True, ["a"])
    memory.validate()


def test_a_boundary_is_kept_only_where_it_fits_and_only_for_its_consumer() -> None:
    memory = DeviceMemory("d", 1000)
    memory.load("w", 0, 500)
    assert memory.room_for(500) and memory.room_for(300, keep_free=200) and not memory.room_for(300, keep_free=201)
    assert not memory.keep(("boundary", "t", 0), "t", 600, keep_free=0), "it would evict weights"
    assert not memory.keep(("boundary", "t", 0), "t", 300, keep_free=300), "it would take the task's room"
    assert memory.keep(("boundary", "t", 0), "t", 300, keep_free=0)
    assert memory.keep(("boundary", "u", 0), "u", 100, keep_free=0)
    assert memory.drop_boundaries("t") == [("boundary", "u", 0)]
    assert memory.claim(("boundary", "u", 0)) is None
    assert memory.claim(("boundary", "t", 0)) == 300 and memory.used == 500
    assert memory.claim("w") is None, "weights are not a boundary"
    memory.validate()


def test_a_stash_is_made_from_its_reservation_only_where_the_next_one_still_fits() -> None:
    memory = DeviceMemory("d", 1000)
    memory.load("w", 0, 500)
    memory.pin("w")
    memory.reserve(300, "activations")
    assert not memory.stash("s0", "p", 400, reserved=300, keep_free=0), "more than the reservation it came from"
    assert not memory.stash("s0", "p", 100, reserved=300, keep_free=401), "the next reservation would not fit"
    assert memory.stash("s0", "p", 100, reserved=300, keep_free=400), "600 held, and the next 400 fit"
    assert memory.used == 800, "the stash's bytes were already charged: nothing new"
    memory.release(200)
    memory.unpin("w")
    memory.reserve(300, "activations")
    assert memory.used == 900
    assert not memory.stash("s1", "p", 100, reserved=300, keep_free=801), "only by evicting another stash"
    assert memory.stash("s1", "p", 100, reserved=300, keep_free=800), "by evicting the weights"
    memory.release(200)
    assert memory.reserve(800, "activations") == ["w"], "weights before stashes"
    memory.release(800)
    assert memory.unstash("nothing") is None, "no such stash"
    assert memory.unstash("s0") == 100 and "s0" not in memory.entries
    assert memory.used == 200, "taken back, its bytes stay charged until released"
    memory.release(100)
    memory.validate()


def test_loads_prefetches_and_a_backward_s_reservations_spare_that_pack_s_stashes() -> None:
    """Least recently used first, except that what a pack's own task needs spares its stashes while anything else
    can go; a prefetch for the pack never evicts them."""
    memory = DeviceMemory("d", 1000)
    memory.reserve(200, "activations")
    assert memory.stash("s-p1", "p1", 200, reserved=200, keep_free=0)
    memory.load("w0", 0, 300)
    memory.reserve(300, "activations")
    assert memory.stash("s-p0", "p0", 300, reserved=300, keep_free=0)
    assert list(memory.entries) == ["s-p1", "w0", "s-p0"] and memory.used == 800
    admitted, evicted = memory.prefetch("p1", 0, 600, keep_free=0)
    assert admitted and evicted == ["w0", "s-p0"], "the prefetched pack's stash stays, older entries go"
    memory.arrived("p1")
    memory.drop("p1")
    assert memory.load("p1", 0, 900) == (True, ["s-p1"]), "its own stash goes last, when nothing else can"
    memory.drop("p1")
    memory.reserve(200, "activations")
    assert memory.stash("s-p1", "p1", 200, reserved=200, keep_free=0)
    memory.load("w0", 0, 300)
    memory.spared = "p1"  # p1's backward runs
    assert memory.reserve(600, "gradients") == ["w0"]
    memory.spared = None
    memory.validate()


def test_a_section_takes_its_stashes_all_at_once_only_if_all_are_here_and_its_room_remains() -> None:
    memory = DeviceMemory("d", 1000)
    for key in ("s1", "s2", "other"):
        memory.reserve(100, "activations")
        assert memory.stash(key, "p", 100, reserved=100, keep_free=0)
    memory.load("w", 0, 300)
    assert memory.used == 600
    assert memory.unstash_all(["s1", "missing"], room=0) is None, "one is not here"
    assert memory.unstash_all(["s1", "s2"], room=801) is None, "400 free, 300 of weights and 100 of stash to evict"
    assert list(memory.entries) == ["s1", "s2", "other", "w"], "nothing taken"
    assert memory.unstash_all(["s1", "s2"], room=800) == {"s1": 100, "s2": 100}
    assert list(memory.entries) == ["other", "w"] and memory.used == 600, "taken: charged until released"
    with pytest.raises(BudgetExceeded):
        memory.reserve(801, "weights")
    assert memory.reserve(800, "weights") == ["w", "other"], "the room is there without the taken stashes"
    memory.release(1000)
    memory.validate()


def test_a_value_copied_ahead_evicts_only_as_many_weights_as_it_needs_least_recently_used_first() -> None:
    memory = DeviceMemory("d", 1000)
    for key in ("oldest", "older", "newest"):
        memory.load(key, 0, 300)
    assert memory.ahead("x", 100) == (True, []), "100 bytes were free"
    assert memory.ahead("y", 200) == (True, ["oldest"]), "one set of weights makes the room"
    assert list(memory.entries) == ["older", "newest", "x", "y"] and memory.used == 900
    memory.validate()


def test_a_value_copied_ahead_evicts_only_weights_already_read_and_is_pinned_until_dropped() -> None:
    memory = DeviceMemory("d", 1000)
    memory.load("read", 0, 200)
    assert memory.keep(("boundary", "t", 0), "t", 200, keep_free=0)
    memory.reserve(200, "activations")
    assert memory.stash("s", "w", 200, reserved=200, keep_free=0)
    assert memory.prefetch("unread", 0, 200, keep_free=0) == (True, [])
    memory.arrived("unread")
    assert memory.ahead("x", 500) == (False, []), "only the weights already read (200 bytes) may go"
    assert "read" in memory.entries, "a refused value evicts nothing"
    assert memory.ahead("x", 300) == (True, ["read"])
    assert memory.ahead("x", 10) == (False, []), "already there"
    assert not memory.entries["x"].evictable
    assert "x" not in memory.reserve(300, "a task") and "x" in memory.entries, "never evicted"
    assert memory.drop_boundaries("t") == ["x"], "dropped as the next task starts, unless taken"
    memory.validate()
