"""The device cache: every byte counted, weights cached by version, prefetches, kept boundaries, the budget."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.cache import DeviceCache, Part
from harmony.runtime.counters import BLOCK_BYTES, Counters
from harmony.runtime.hoststore import HostStore
from harmony.runtime.stream import CopyEngine
from harmony.tasks.memory import BudgetExceeded


class PublishingCounters(Counters):
    """Counters that publish on every change, so tests can read the shared block at any point."""

    def add(self, name: str, amount: int) -> None:
        super().add(name, amount)
        self.publish()

    def raise_to(self, name: str, value: int) -> None:
        super().raise_to(name, value)
        self.publish()


def make_cache(store: HostStore, budget: int) -> DeviceCache:
    counters = PublishingCounters(store.create("counters", BLOCK_BYTES))
    return DeviceCache("cpu-0", torch.device("cpu"), budget, counters)


def test_cache_counts_every_byte_and_keeps_resident_weights(store: HostStore) -> None:
    cache = make_cache(store, budget=1000)
    host = store.create("w", 400)
    with cache.weights("p0", 0, host) as device_bytes:
        assert device_bytes.numel() == 400
    with cache.weights("p0", 0, host):
        pass
    assert cache.counters.read()["in_weights"] == 400
    with cache.weights("p0", 1, host):
        pass
    assert cache.counters.read()["in_weights"] == 800
    assert cache.used == 400


def test_cache_evicts_least_recently_used_and_tracks_the_peak(store: HostStore) -> None:
    cache = make_cache(store, budget=1000)
    hosts = [store.create(f"w{i}", 400) for i in range(3)]
    for i, host in enumerate(hosts):
        with cache.weights(f"p{i}", 0, host):
            pass
    assert list(cache.cached) == ["p1", "p2"]
    assert cache.counters.read()["peak"] == 800
    with cache.scratch(600, "activations"):
        assert cache.used <= 1000
    assert cache.counters.read()["peak"] <= 1000


def test_cache_refuses_to_exceed_its_budget(store: HostStore) -> None:
    cache = make_cache(store, budget=1000)
    host = store.create("w", 600)
    with (
        cache.weights("p0", 0, host),
        pytest.raises(BudgetExceeded, match="needs 500 bytes"),
        cache.scratch(500, "activations"),
    ):
        pass
    assert cache.used == 600


def test_copies_are_counted_by_kind(store: HostStore) -> None:
    cache = make_cache(store, budget=1000)
    x = torch.zeros(4, 8)
    y = cache.copy_in(x, "activations")
    assert y.data_ptr() != x.data_ptr()
    cache.copy_out({"a": y, "b": [y]}, "activations")
    counts = cache.counters.read()
    assert counts["in_activations"] == 128 and counts["out_activations"] == 256


def test_cache_never_hands_out_stale_weights_that_are_in_use(store: HostStore) -> None:
    cache = make_cache(store, budget=1000)
    host = store.create("w", 100)
    with (
        cache.weights("p0", 0, host),
        pytest.raises(RuntimeError, match="version 0 are in use"),
        cache.weights("p0", 1, host),
    ):
        pass


def test_prefetched_weights_are_used_without_a_second_copy(store: HostStore) -> None:
    cache = make_cache(store, budget=1000)
    host = store.create("w", 300)
    host.fill_(7)
    assert cache.prefetch("p0", 0, host, keep_free=200)
    with cache.weights("p0", 0, host) as device_bytes:
        assert int(device_bytes[0]) == 7
    counts = cache.counters.read()
    assert counts["in_weights"] == counts["prefetched"] == 300
    assert not cache.prefetch("p1", 0, store.create("big", 900), keep_free=200)
    cache.clear()


def test_weights_copied_in_part_move_their_ranges_alone_and_a_task_that_reads_more_gets_the_rest(
    store: HostStore,
) -> None:
    """A fused array's task computing some members copies their rows in alone (runtime.rows); a later task of the
    same version reading more members (an evaluation) copies the rows it lacks, one reading all of it everything,
    and one reading fewer nothing. A prefetch copies the part its task reads. Here three members' rows of 100
    bytes, then 100 bytes every member reads."""
    cache = make_cache(store, budget=1000)
    host = store.create("w", 400)
    host.copy_(torch.arange(400) % 251)

    def rows(members: list[int]) -> tuple[tuple[int, int], ...]:
        return tuple((100 * member, 100 * member + 100) for member in members)

    first = Part(frozenset({0}), ((0, 100), (300, 400)), rows)
    wider = Part(frozenset({0, 1}), ((0, 200), (300, 400)), rows)
    moved = [200, 200, 300, 300, 700, 700]
    for part, total in zip([first, first, wider, first, None, wider], moved):
        with cache.weights("p0", 0, host, part) as device_bytes:
            for start, stop in ((0, 400),) if part is None else part.spans:
                assert torch.equal(device_bytes[start:stop], host[start:stop])
        assert cache.counters.read()["in_weights"] == total
    assert cache.used == 400, "the device holds and charges the whole pack"
    assert cache.prefetch("p1", 0, host, keep_free=0, part=first)
    with cache.weights("p1", 0, host, first) as device_bytes:
        assert torch.equal(device_bytes[:100], host[:100]) and torch.equal(device_bytes[300:], host[300:])
    assert cache.counters.read()["in_weights"] == 700 + 200 and cache.counters.read()["prefetched"] == 200
    grads = store.create("g", 400)
    cache.write_back(host, grads, "grads", ((100, 150), (390, 400)))
    assert torch.equal(grads[100:150], host[100:150]) and torch.equal(grads[390:], host[390:])
    assert int(grads[:100].count_nonzero()) == int(grads[150:390].count_nonzero()) == 0
    assert cache.counters.read()["out_grads"] == 60
    cache.clear()


def test_weights_copied_from_a_halved_mirror_and_the_rest_are_laid_in_order_and_their_halved_bytes_counted(
    store: HostStore,
) -> None:
    cache = make_cache(store, budget=1000)
    mirror, rest = store.create("mirror", 100), store.create("rest", 60)
    mirror.fill_(1)
    rest.fill_(2)
    with cache.weights("p0", 0, (mirror, rest)) as device_bytes:
        assert device_bytes.tolist() == [1] * 100 + [2] * 60
    assert cache.prefetch("p1", 0, (mirror, rest), keep_free=0)
    with cache.weights("p1", 0, (mirror, rest)):
        pass
    with cache.weights("p2", 0, rest):
        pass
    counts = cache.counters.read()
    assert (counts["in_weights"], counts["halved"], counts["prefetched"]) == (380, 200, 160)
    cache.clear()


def test_a_failed_prefetch_raises_in_the_task_that_waits_for_it(store: HostStore) -> None:
    cache = make_cache(store, budget=1000)
    host = store.create("w", 300)

    def broken_copy(target: torch.Tensor, source: torch.Tensor) -> None:
        raise OSError("link down")

    cache.engine.copy = broken_copy  # type: ignore[method-assign]
    assert cache.prefetch("p0", 0, host, keep_free=0)
    with pytest.raises(RuntimeError, match="copying the weights of p0 in failed"), cache.weights("p0", 0, host):
        pass
    assert cache.used == 0 and "p0" not in cache.cached
    cache.clear()


class EventRecordingEngine(CopyEngine):
    """A copy engine that ends each copy with a token, as a CUDA engine ends it with an event, and logs waits."""

    def __init__(self) -> None:
        super().__init__("cpu-0", torch.device("cpu"))
        self.log: list[str] = []

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> Any:
        target.copy_(source)
        self.log.append(f"copy {len(self.log)}")
        return self.log[-1]

    def wait(self, done: Any, tensor: torch.Tensor | None = None) -> None:
        self.log.append(f"wait {done}")


def test_weights_are_read_only_after_the_stream_waits_for_their_copy(store: HostStore) -> None:
    cache = make_cache(store, budget=1000)
    cache.engine = engine = EventRecordingEngine()
    host = store.create("w", 300)
    assert cache.prefetch("p0", 0, host, keep_free=0)
    with cache.weights("p0", 0, host):
        assert engine.log == ["copy 0", "wait copy 0"], "a prefetched pack is read before its copy has ended"
    with cache.weights("p1", 0, store.create("v", 200)):
        assert engine.log[2:] == ["copy 2", "wait copy 2"], "a pack copied on demand is read before it arrived"
        cache.reload("p1", store.create("v", 200))
        assert engine.log[4:] == ["copy 4", "wait copy 4"], "a reloaded pack is read before it arrived"
    cache.clear()


def test_a_kept_boundary_goes_to_its_consumer_only_and_never_takes_room_from_weights(store: HostStore) -> None:
    cache = make_cache(store, budget=1000)
    value = torch.arange(50, dtype=torch.float32)  # 200 bytes
    assert cache.keep("next", 0, value)
    assert cache.used == 200 and cache.counters.read()["peak"] == 200
    cache.drop_boundaries("next")
    assert cache.claim("other", 0) is None
    assert cache.claim("next", 0) is value and cache.used == 0
    assert cache.counters.read()["kept"] == 200
    assert cache.keep("next", 1, value)
    cache.drop_boundaries("another task")
    assert cache.used == 0 and cache.claim("next", 1) is None
    with cache.weights("p0", 0, store.create("w", 900)):
        assert not cache.keep("next", 0, value), "kept a boundary by going over budget"
    assert not cache.keep("next", 0, value), "kept a boundary by evicting resident weights"
    cache.drop("p0")
    prefetched = store.create("u", 500)
    copied = cache.counters.values["in_weights"]
    assert cache.prefetch("p2", 0, prefetched, keep_free=300)
    assert not cache.keep("next", 0, value, keep_free=400), "kept a boundary in the room the task still reserves"
    with cache.scratch(400, "the next micro-batch's workspace"):
        assert "p2" in cache.cached, "the prefetched weights were pushed out"
    with cache.weights("p2", 0, prefetched):
        assert cache.counters.values["in_weights"] == copied + 500, "the prefetched weights were copied in twice"
    cache.drop("p2")
    assert cache.keep("next", 0, value)
    with cache.weights("p1", 0, store.create("v", 900)):
        assert cache.claim("next", 0) is None, "a kept boundary was not evicted for weights"
    cache.clear()


def test_a_reservation_that_needs_a_prefetchs_room_waits_for_its_copy_instead_of_failing(store: HostStore) -> None:
    counters = PublishingCounters(store.create("counters", BLOCK_BYTES))
    cache = DeviceCache("cpu-0", torch.device("cpu"), 1000, counters, link_bandwidth=4000.0)  # 600 B: 0.15 s
    host = torch.zeros(600, dtype=torch.uint8)
    assert cache.prefetch(("m", 0), 0, host, keep_free=300)
    assert cache.memory.entries[("m", 0)].arriving
    with cache.scratch(700, "activations"):  # fits only once the prefetched weights may be evicted
        assert ("m", 0) not in cache.memory.entries
    assert cache.memory.used == 0
    cache.clear()


def test_a_reservation_waits_for_a_prefetch_to_land_rather_than_evict_a_stash(store: HostStore) -> None:
    counters = PublishingCounters(store.create("counters", BLOCK_BYTES))
    cache = DeviceCache("cpu-0", torch.device("cpu"), 1000, counters, link_bandwidth=4000.0)  # 600 B: 0.15 s
    with cache.scratch(200, "activations of pack 0") as reserved:
        assert cache.stash(("stash", 0), "p0", 0, object(), 200, reserved, keep_free=0)
    assert cache.prefetch(("m", 1), 0, torch.zeros(600, dtype=torch.uint8), keep_free=0)
    with cache.scratch(300, "activations"):  # the stash's room, or the prefetched weights' once they have landed
        assert ("stash", 0) in cache.cached and ("m", 1) not in cache.cached
    assert cache.missed == {}
    cache.clear()


def test_a_stash_takes_part_of_its_reservation_and_its_bytes_stay_charged_while_its_backward_runs(
    store: HostStore,
) -> None:
    cache = make_cache(store, budget=1000)
    stash = object()
    with cache.scratch(400, "activations of pack 0") as reserved:
        assert cache.stash(("stash", 0), "p0", 3, stash, 150, reserved, keep_free=0)
        assert reserved.nbytes == 250 and cache.used == 400
    assert cache.used == 150 and ("stash", 0) in cache.cached
    with cache.unstash(("stash", 1)) as missing:
        assert missing is None
    with cache.unstash(("stash", 0)) as found:
        assert found == (stash, 150)
        assert cache.used == 150 and ("stash", 0) not in cache.cached
        with cache.weights("p1", 0, store.create("w", 850)):
            assert cache.used == 1000, "a taken stash is not evicted"
    assert cache.used == 850 and cache.missed == {}, "a stash taken by its backward is no loss"
    cache.clear()


def test_a_refused_or_evicted_stash_is_recorded_against_its_pack(store: HostStore) -> None:
    cache = make_cache(store, budget=1000)
    with cache.weights("w", 0, store.create("w", 600)), cache.scratch(300, "activations of pack 0") as reserved:
        assert not cache.stash(("stash", 0), "p0", 4, object(), 100, reserved, keep_free=400)
        assert not cache.stash(("stash", 2), "p0", 4, object(), 100, reserved, keep_free=400)
        assert cache.missed == {"p0": (4, 1)}, "one step lost"
        assert cache.stash(("stash", 1), "p1", 5, object(), 100, reserved, keep_free=0)
    assert cache.missed == {"p0": (4, 1)}
    with cache.sparing("p1"), cache.scratch(350, "gradients of pack 1"):
        assert ("stash", 1) in cache.cached and "w" not in cache.cached, "weights go before the running pack's stash"
    with cache.scratch(950, "activations"):
        assert ("stash", 1) not in cache.cached
    assert cache.missed == {"p0": (4, 1), "p1": (5, 1)}, "evicted before its backward"
    with cache.scratch(300, "activations of pack 0") as reserved:
        assert not cache.stash(("stash", 3), "p0", 12, object(), 100, reserved, keep_free=901)
        assert cache.missed["p0"] == (12, 2), "a second step lost in a row"
        assert cache.stash(("stash", 4), "p0", 12, object(), 100, reserved, keep_free=0)
    with cache.unstash(("stash", 4)) as found:
        assert found is not None
    assert cache.missed == {"p1": (5, 1)}, "a stash that reached its backward ends the pack's losing streak"
    cache.clear()


def test_stashes_taken_together_are_each_released_when_used_and_the_rest_when_the_block_ends(
    store: HostStore,
) -> None:
    cache = make_cache(store, budget=1000)
    for index in range(3):
        with cache.scratch(100, "activations") as reserved:
            assert cache.stash(("stash", index), f"p{index}", 0, f"value {index}", 100, reserved, keep_free=0)
    with cache.unstash_all([("stash", 0), ("stash", 9)], room=0) as none:
        assert none is None and len(cache.cached) == 3, "all or nothing"
    with cache.unstash_all([("stash", 0), ("stash", 1)], room=801) as none:
        assert none is None, "700 free, 100 of another stash to evict"
    with cache.unstash_all([("stash", 0), ("stash", 1)], room=800) as taken:
        assert taken is not None and ("stash", 0) in taken and ("stash", 2) not in taken
        assert cache.used == 300 and list(cache.cached) == [("stash", 2)]
        with cache.scratch(800, "gradients"):
            assert cache.used == 1000 and not cache.cached, "the taken stashes stay, the other one is evicted"
        with taken.use(("stash", 1)) as found:
            assert found == ("value 1", 100)
        assert cache.used == 100, "used and released; the unused one stays charged"
    assert cache.used == 0
    cache.clear()


def test_a_value_handed_on_inside_a_task_crosses_the_link_only_if_it_is_not_kept_or_is_evicted(
    store: HostStore,
) -> None:
    from harmony.runtime.cache import Spilled

    cache = make_cache(store, budget=1000)
    value = torch.arange(50, dtype=torch.float32)  # 200 bytes
    kept = cache.hand_on("next pack", 0, value)
    assert kept.value is None and cache.counters.read()["out_activations"] == 0, "kept: no host copy"
    assert cache.claim("next pack", 0) is value and kept.value is None
    evicted = cache.hand_on("next pack", 1, value.clone())
    with cache.scratch(900, "activations"):  # needs the kept value's room
        assert cache.claim("next pack", 1) is None
    assert torch.equal(evicted.value, value) and cache.counters.read()["out_activations"] == 200
    assert torch.equal(cache.copy_in(evicted, "activations"), value), "its consumer reads the copy made at eviction"
    with cache.scratch(900, "activations"):
        refused = cache.hand_on("next pack", 2, value)  # no room: copied out at once
    assert torch.equal(refused.value, value) and cache.counters.read()["out_activations"] == 400
    with pytest.raises(RuntimeError, match="neither kept nor copied out"):
        cache.copy_in(Spilled(), "activations")


def make_linked_cache(store: HostStore, budget: int, bandwidth: float) -> DeviceCache:
    counters = PublishingCounters(store.create("counters", BLOCK_BYTES))
    return DeviceCache("cpu-0", torch.device("cpu"), budget, counters, link_bandwidth=bandwidth, ahead=True)


def test_a_value_copied_ahead_is_charged_until_taken_and_never_read_before_the_link_carried_it(
    store: HostStore,
) -> None:
    cache = make_linked_cache(store, budget=1000, bandwidth=10_000)  # 200 bytes take 20 ms
    value = torch.arange(50, dtype=torch.float32)
    started = time.perf_counter()
    assert cache.ahead("k", value, "activations") == 200 and cache.used == 200
    copy = cache.take("k")
    assert time.perf_counter() - started >= 0.02, "read before the link carried it"
    assert torch.equal(copy, value) and copy.data_ptr() != value.data_ptr()
    counts = cache.counters.read()
    assert cache.used == 0 and counts["in_activations"] == counts["ahead"] == 200
    assert cache.take("k") is None, "taken once"
    assert cache.ahead("untaken", value, "activations") == 200
    cache.drop_boundaries("the next task")
    assert cache.used == 0 and cache.take("untaken") is None
    with cache.scratch(900, "activations"):
        assert cache.ahead("no room", value, "inputs") == 0 and cache.used == 900
    unlinked = DeviceCache("cpu-1", torch.device("cpu"), 1000, cache.counters, ahead=True)
    assert unlinked.ahead("k", value, "inputs") == 0, "a CPU device without a link copies as it reads"
    cache.clear()


def test_a_sent_output_stays_charged_until_it_reaches_the_host_and_a_reservation_waits_for_it(
    store: HostStore,
) -> None:
    cache = make_linked_cache(store, budget=1000, bandwidth=10_000)
    value = torch.arange(50, dtype=torch.float32)
    started = time.perf_counter()
    with cache.scratch(400, "activations") as reserved:
        sent = cache.send(value, "activations", reserved)
        assert reserved.nbytes == 200, "its bytes leave the reservation"
    assert cache.used == 200, "still on its way out"
    (host,) = cache.arrived([sent])
    assert time.perf_counter() - started >= 0.02, "handed over before the link carried it"
    counts = cache.counters.read()
    assert torch.equal(host, value) and cache.used == 0 and counts["out_activations"] == counts["behind"] == 200
    with cache.scratch(400, "activations") as reserved:
        landing = cache.send(value, "activations", reserved).at
    before, asked = cache.counters.read(), time.perf_counter()
    with cache.scratch(1000, "the next micro-batch"):  # needs the send's room: waits for it to land
        assert cache.used == 1000
    waited = {name: cache.counters.read()[name] - before[name] for name in ("room_ns", "wait_ns")}
    assert waited["room_ns"] >= (landing - asked) * 1e9 > 0, "the wait for room is counted"
    assert waited["wait_ns"] == waited["room_ns"], "and is part of the task's waits"
    with cache.scratch(400, "activations") as reserved:
        sent = cache.send(value, "activations", reserved)
    assert cache.keep("next", 0, value, sent=sent) and cache.used == 200, "the kept value takes the send's charge"
    cache.arrived([sent])
    assert cache.used == 200 and cache.claim("next", 0) is value
    with cache.scratch(100, "activations") as reserved:
        assert isinstance(cache.send(value, "activations", reserved), torch.Tensor), "not in the reservation: now"
    cache.clear()


class Pending:
    """A copy's event that has not completed (as a CUDA event held up on its stream); the host must not wait on it."""

    def __init__(self) -> None:
        self.completed = False

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        assert self.completed, "the host waited for a copy out"


class OrderedEngine(CopyEngine):
    """A CPU device's engine that orders its copies out by events, as CUDA's streams do: the events it sends with and
    those the compute stream was made to wait for are recorded."""

    def __init__(self) -> None:
        super().__init__("cpu-0", torch.device("cpu"))
        self.sent: list[Pending] = []
        self.waited: list[Pending] = []

    def send(self, source: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.sent.append(Pending())
        return source.clone(), self.sent[-1]

    def wait(self, done: Any, tensor: torch.Tensor | None = None) -> None:
        self.waited.append(done)


def test_where_streams_order_the_copies_a_reservation_takes_a_sends_room_without_the_host_waiting(
    store: HostStore,
) -> None:
    """On CUDA a reservation that needs a send's room makes the compute stream wait for its copy out instead of the
    host (which kept the host from running ahead of the GPU: a sync for every micro-batch a swapped pass sends), and
    the send lets its device tensors go only then, so that their memory is reused after the copy, on the GPU."""
    cache = make_cache(store, budget=1000)
    cache.engine, cache.copies_ahead = OrderedEngine(), True
    value = torch.arange(50, dtype=torch.float32)
    with cache.scratch(400, "activations") as reserved:
        sent = cache.send(value, "activations", reserved)
    assert sent.sources is not None and sent.sources[0].data_ptr() == value.data_ptr(), "held while the copy runs"
    assert cache.used == 200
    with cache.scratch(1000, "the next micro-batch"):
        assert cache.used == 1000
        assert cache.engine.waited == cache.engine.sent, "the compute stream waits for the copy out, not the host"
        assert sent.sources is None, "and the send lets its device tensors go after that wait"
    assert cache.counters.read()["out_activations"] == 200
    cache.engine.sent[0].completed = True
    (host,) = cache.arrived([sent])
    assert torch.equal(host, value) and cache.used == 0
    cache.clear()
    cache = make_cache(store, budget=2000)
    cache.engine, cache.copies_ahead = OrderedEngine(), True
    values = [torch.arange(100, dtype=torch.float32) + index for index in range(3)]  # 400 bytes each
    with cache.scratch(200, "activations"):
        handed = [cache.hand_on("next pack", index, value, keep_free=700) for index, value in enumerate(values)]
        assert [spilled.value.sources is None for spilled in handed] == [True, False, False], "each sent behind"
        assert cache.engine.waited == cache.engine.sent[:1], "the third found the room taken: the first's given back"
        assert cache.used == 1000
    for pending in cache.engine.sent:
        pending.completed = True
    for spilled, value in zip(handed, values):
        assert torch.equal(cache.copy_in(spilled, "activations"), value)
    cache.clear()


def test_a_value_kept_while_its_send_is_on_its_way_is_claimed_after_the_compute_stream_waits_for_that_copy(
    store: HostStore,
) -> None:
    """A value sent behind and kept for its consumer is the same device memory the copy out reads: the consumer's
    kernels (a pack whose first layer works in place, such as ReLU(inplace=True)) must be ordered after that copy,
    or the host copy its backward recomputes from would hold what they wrote."""
    cache = make_cache(store, budget=1000)
    cache.engine, cache.copies_ahead = OrderedEngine(), True
    value = torch.arange(50, dtype=torch.float32)
    with cache.scratch(400, "activations") as reserved:
        sent = cache.send(value, "activations", reserved)
    assert cache.keep("next pack", 0, value, sent=sent)
    assert cache.engine.waited == []
    assert cache.claim("next pack", 0) is value
    assert cache.engine.waited == cache.engine.sent, "claimed after the compute stream waits for its copy out"
    cache.engine.sent[0].completed = True
    cache.arrived([sent])
    with cache.scratch(400, "activations") as reserved:
        sent = cache.send(value, "activations", reserved)
    assert cache.keep("next pack", 1, value, sent=sent)
    cache.drop_boundaries("another pack")
    assert cache.engine.waited == cache.engine.sent and sent.sources is None, "dropped: reused after its copy out"
    assert cache.keep("next pack", 1, value)
    assert cache.claim("next pack", 1) is value and len(cache.engine.waited) == 2, "a value kept again has no send"
    cache.engine.sent[1].completed = True
    cache.clear()


def test_a_gradient_handed_on_in_a_recomputed_backward_leaves_room_for_both_values_of_the_next_micro_batch(
    store: HostStore,
) -> None:
    """A recomputed backward reads two values a micro-batch (its input and its upstream gradient): the gradient it
    hands on is kept only where both can come in ahead beside it and its send, else it is sent behind, and then
    both do come in ahead. Kept in room for one, it would have left the upstream gradient to come in on the compute
    thread (the H100 profile of 2026-11-28: a copy on the compute stream for nearly every backward micro-batch)."""
    from harmony.runtime.cache import Transit

    value = torch.arange(50, dtype=torch.float32)  # 200 bytes
    forward = make_linked_cache(store, budget=1200, bandwidth=10_000)
    assert forward.hand_on("next pack", 0, value, keep_free=500).value is None, "200 + 200 out + 200 in + 500 fit"
    backward = make_linked_cache(store, budget=1200, bandwidth=10_000)
    sent = backward.hand_on("next pack", 0, value, keep_free=500, incoming=2)
    assert isinstance(sent.value, Transit) and backward.used == 200, "200 + 200 out + 400 in + 500 do not fit"
    assert backward.ahead("input", value.clone(), "activations") == 200
    assert backward.ahead("upstream", value.clone(), "activations") == 200
    with backward.scratch(500, "the next micro-batch"):
        assert backward.used == 1100
    assert torch.equal(backward.take("upstream"), value) and torch.equal(backward.take("input"), value)
    forward.clear()
    backward.clear()


def test_values_handed_on_over_a_link_leave_room_to_be_sent_behind_and_are_read_only_once_they_landed(
    store: HostStore,
) -> None:
    from harmony.runtime.cache import Transit

    cache = make_linked_cache(store, budget=1200, bandwidth=10_000)  # 200 bytes take 20 ms each way
    value = torch.arange(50, dtype=torch.float32)
    first = cache.hand_on("next pack", 0, value, keep_free=500)
    assert first.value is None and cache.used == 200, "kept: it, room for one out and one in, and keep_free fit"
    started = time.perf_counter()
    second = cache.hand_on("next pack", 1, value.clone(), keep_free=500)
    assert isinstance(second.value, Transit) and cache.used == 400, "no room for two beside it: sent behind"
    third = cache.hand_on("next pack", 2, value.clone(), keep_free=500)
    assert isinstance(third.value, Transit) and cache.used == 600, "sent in the room for one coming in"
    assert time.perf_counter() - started < 0.02, "the compute thread did not wait for the link"
    fourth = cache.hand_on("next pack", 3, value.clone() + 1, keep_free=500)
    assert time.perf_counter() - started >= 0.02, "the room was taken: it waited for the second send to land"
    assert isinstance(fourth.value, Transit) and cache.used == 600
    counts = cache.counters.read()
    assert counts["behind"] == counts["out_activations"] == 600
    assert counts["room_ns"] == counts["wait_ns"] > 0, "that wait is counted as one for room"
    assert torch.equal(cache.copy_in(fourth, "activations"), value + 1)
    assert time.perf_counter() - started >= 0.08, "copied in before its send landed (three sends out, then in)"
    with cache.scratch(10, "the next micro-batch"):
        assert cache.used == 210, "landed sends give their bytes back"
    assert cache.ahead("ahead", second, "activations") == 200
    assert torch.equal(cache.take("ahead"), value)
    with cache.scratch(600, "activations"):
        refused = cache.hand_on("next pack", 4, value, keep_free=300)  # no room at all: copied out at once
    assert isinstance(refused.value, torch.Tensor) and cache.counters.read()["behind"] == 600
    unlinked = make_cache(store, budget=1000)
    assert unlinked.hand_on("next pack", 0, value, keep_free=800).value is None, "without copies ahead, no room left"
    cache.clear()
    unlinked.clear()
