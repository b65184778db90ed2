"""Runtime pieces without a cluster: host store, device cache accounting, pack optimizer, serialization."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import platform
import signal
import subprocess
import sys
import threading
import types
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import pytest
import torch
from distributed import Reschedule
from distributed.protocol import deserialize, serialize
from torch import nn
from torch.utils._pytree import tree_flatten

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.bodies import check_resident_order
from harmony.runtime.cache import DeviceCache
from harmony.runtime.counters import BLOCK_BYTES, Counters
from harmony.runtime.data import LoaderFeed, SharedFeed
from harmony.runtime.devices import build_specs, cpu_count, threads_per_device
from harmony.runtime.driver import Driver
from harmony.runtime.files import grads_name, weights_name
from harmony.runtime.handoff import LocalResult, LostResult
from harmony.runtime.hoststore import HostStore, tensors_at
from harmony.runtime.interrupt import raise_if_interrupted, watching_interrupts
from harmony.runtime.optimizer import PackOptimizer
from harmony.runtime.shipping import BatchFiles, ShippedTensors, StackedSteps, StaleBatch, unship
from harmony.runtime.skeleton import dump_skeleton, load_skeleton
from harmony.runtime.spec import PackRuntime
from harmony.runtime.stream import CopyEngine
from harmony.tasks.binding import BindingState
from harmony.tasks.layout import TensorSpec, lay_out
from harmony.tasks.memory import BudgetExceeded
from tests.conftest import native_threads, torch_threads
from tests.test_binding import job


@pytest.fixture
def store():
    host = HostStore("unittest")
    yield host
    host.unlink_all()


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


def test_host_store_buffers_are_shared_between_mappings(store: HostStore) -> None:
    a = store.create("x", 16)
    other = HostStore("unittest").attach("x", 16)
    a[3] = 9
    assert other[3] == 9
    assert store.unlink_all() == 1
    assert not store.path("x").exists()


def test_a_closed_host_store_creates_no_file(store: HostStore) -> None:
    """What a worker's store does once its run is torn down: a late task fails instead of leaving a file."""
    late = HostStore("unittest")
    late.create("kept", 8)
    late.close()
    for touch in (lambda: late.create("new", 8), lambda: late.attach("kept", 8), lambda: late.write_bytes("m", b"")):
        with pytest.raises(RuntimeError, match="closed"):
            touch()
    assert sorted(path.name for path in late.directory.glob("harmony-unittest-*")) == ["harmony-unittest-kept"]


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
    assert list(cache.residents) == ["p1", "p2"]
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


def _pack_runtime(module: nn.Module) -> PackRuntime:
    weights = lay_out([TensorSpec(n, "float32", tuple(p.shape)) for n, p in module.named_parameters()])
    return PackRuntime(dump_skeleton(module), weights, weights, weights.nbytes, 0)


@pytest.mark.parametrize(
    "factory",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.Adam(p, lr=0.01),
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
        lambda p: torch.optim.Adagrad(p, lr=0.1),
    ],
)
def test_pack_optimizer_state_lives_in_the_store_and_survives_a_rebuild(store: HostStore, factory) -> None:
    module = nn.Sequential(nn.Linear(3, 2))
    reference = copy.deepcopy(module)
    runtime = _pack_runtime(module)
    host_w = store.create(weights_name(0, 0), runtime.weights.nbytes)
    host_g = store.create(grads_name(0, 0), runtime.grads.nbytes)
    for name, view in tensors_at(host_w, runtime.weights).items():
        view.copy_(dict(module.named_parameters())[name].detach())
    ref_opt = factory(reference.parameters())
    torch.manual_seed(0)
    for step in range(4):
        grads = [torch.randn_like(p) for p in reference.parameters()]
        for p, g in zip(reference.parameters(), grads):
            p.grad = g.clone()
        ref_opt.step()
        for view, g in zip(tensors_at(host_g, runtime.grads).values(), grads):
            view.copy_(g)
        optimizer = PackOptimizer(factory, store, 0, 0, runtime)
        assert optimizer.last_step == step - 1
        optimizer.step(step)
    for (name, p) in reference.named_parameters():
        torch.testing.assert_close(tensors_at(host_w, runtime.weights)[name], p.detach(), rtol=1e-6, atol=1e-7)


def test_skeleton_carries_structure_without_weights() -> None:
    module = nn.Sequential(nn.Linear(1000, 1000), nn.BatchNorm1d(1000))
    data = dump_skeleton(module)
    assert len(data) < 20_000
    skeleton = load_skeleton(data)
    assert skeleton[0].weight.device.type == "meta"
    params = {k: v.detach() for k, v in module.state_dict().items()}
    x = torch.randn(4, 1000)
    out = torch.func.functional_call(skeleton, params, (x,))
    torch.testing.assert_close(out, module(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_tensors_round_trip_through_dask_serialization(dtype: torch.dtype) -> None:
    tensor = (torch.arange(12).reshape(3, 4) * 3).to(dtype)
    header, frames = serialize(tensor)
    back = deserialize(header, frames)
    assert back.dtype == dtype and torch.equal(back, tensor)
    sliced = tensor[1:]
    assert torch.equal(deserialize(*serialize(sliced)), sliced)


class Labeled(NamedTuple):
    features: torch.Tensor
    labels: list[Any]


def test_shipped_batches_travel_as_a_file_name_and_come_back_exactly(store: HostStore) -> None:
    tree = [
        (torch.randn(3, 5), {"ids": torch.arange(7), "mask": torch.tensor([True, False, True])}),
        Labeled(torch.randn(4, 2), [torch.arange(4), None]),  # a container pytree walks, not shipping itself
        (torch.randn(2, 2, dtype=torch.bfloat16), torch.empty(0, 4), "label", 3),
        (torch.randn(5, 3).t(), torch.randn(6, 4)[2:4], torch.randn(3, dtype=torch.complex64).conj()),
    ]
    files = BatchFiles(store)
    shipped = files.ship(tree)
    assert isinstance(shipped, ShippedTensors) and store.path(shipped.name).exists()
    assert files.ship([1.0, 0.5]) == [1.0, 0.5] and unship([1.0], store) == [1.0]
    assert files.created == 1, "a value without tensors needs no file"
    assert len(pickle.dumps(shipped)) < 2_000, "the task carries the file's name, not the bytes"
    reader = HostStore(store.run, store.directory)
    back = unship(pickle.loads(pickle.dumps(shipped)), reader)
    assert back[0][1]["mask"].dtype == torch.bool and back[2][2:] == ("label", 3)
    assert type(back[1]) is Labeled and back[1].labels[1] is None
    for original, copied in zip(tree_flatten(tree)[0], tree_flatten(back)[0]):
        if isinstance(original, torch.Tensor):
            assert copied.dtype == original.dtype and torch.equal(copied, original.resolve_conj())
    reader.close()


def test_a_span_of_steps_of_one_layout_ships_stacked_and_reads_back_step_by_step(store: HostStore) -> None:
    def step(index: int) -> list[Any]:
        generator = torch.Generator().manual_seed(index)
        return [
            (torch.randn(3, 5, generator=generator), {"ids": torch.arange(7) + index, "tag": "same"}),
            Labeled(torch.randn(4, 2, dtype=torch.bfloat16, generator=generator), [torch.randn(5, 3).t(), None]),
        ]

    steps = [step(index) for index in range(200)]
    files = BatchFiles(store)
    shipped = files.ship_steps(steps)
    assert isinstance(shipped, ShippedTensors) and shipped.stacked_steps == 200
    assert len(pickle.dumps(shipped)) < 1_500, "one step's structure travels, whatever the span's length"
    assert len(pickle.dumps(files.ship(steps))) > 20 * len(pickle.dumps(shipped)), "against a slot per tensor"
    reader = HostStore(store.run, store.directory)
    back = unship(pickle.loads(pickle.dumps(shipped)), reader)
    assert isinstance(back, StackedSteps) and len(back) == 200
    for original, copied in zip(steps, back, strict=True):
        assert type(copied[1]) is Labeled and copied[1].labels[1] is None and copied[0][1]["tag"] == "same"
        for expected, got in zip(tree_flatten(original)[0], tree_flatten(copied)[0], strict=True):
            if isinstance(expected, torch.Tensor):
                assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
    assert torch.equal(back[-1][0][0], steps[199][0][0]) and len(back[10:13]) == 3
    with pytest.raises(IndexError):
        back[200]
    reader.close()


@pytest.mark.parametrize(
    "last",
    [
        [torch.randn(2, 5)],  # a short last batch
        [torch.randn(3, 5).double()],  # another dtype
        [torch.randn(3, 5), torch.randn(3, 5)],  # another structure
        ([torch.randn(3, 5)],),  # another container
        [torch.randn(3, 5, requires_grad=True)],  # a tensor autograd tracks
    ],
    ids=["shape", "dtype", "structure", "container", "requires-grad"],
)
def test_a_span_whose_steps_differ_in_layout_ships_step_by_step_and_reads_back_exactly(
    store: HostStore, last: Any
) -> None:
    steps = [[torch.randn(3, 5)] for _ in range(3)] + [last]
    files = BatchFiles(store)
    shipped = files.ship_steps(steps)
    assert isinstance(shipped, ShippedTensors) and shipped.stacked_steps == 0
    back = unship(shipped, store)
    assert len(back) == 4 and type(back[3]) is type(last)
    for original, copied in zip(tree_flatten(steps)[0], tree_flatten(back)[0], strict=True):
        assert torch.equal(copied, original.detach()) and copied.requires_grad == original.requires_grad
    assert files.ship_steps([[1.0], [2.0]]) == [[1.0], [2.0]], "steps without tensors need no file"
    files.release(shipped)
    again = files.ship_steps([[torch.ones(3, 5)], [torch.zeros(3, 5)]])
    assert again.name == shipped.name and again.stacked_steps == 2, "stacked spans reuse the released files"
    with pytest.raises(StaleBatch, match="another batch"):
        unship(shipped, store)


def test_batch_files_are_reused_once_released_and_spares_are_bounded(store: HostStore) -> None:
    files = BatchFiles(store, spare=2)
    reader = HostStore(store.run, store.directory)
    first = files.ship([torch.full((100,), 1.0)])
    held = files.ship([torch.full((100,), 2.0)])
    assert first.name != held.name and files.created == 2, "a file still read is never handed out again"
    files.release(first)
    again = files.ship([torch.full((100,), 3.0)])
    assert again.name == first.name and files.created == 2, "a released file of the right size is reused"
    assert torch.equal(unship(again, reader)[0], torch.full((100,), 3.0))
    assert torch.equal(unship(held, reader)[0], torch.full((100,), 2.0))
    big = files.ship([torch.zeros(5000)])
    assert big.capacity >= 20_000 and files.created == 3, "a value larger than every free file gets a new one"
    for value in (again, held, big):
        files.release(value)
    assert [capacity for capacity, _ in files.free] == [4096, big.capacity], "spares: the largest SPARE kept"
    assert sum(store.path(value.name).exists() for value in (again, held)) == 1, "one small spare removed"
    small = files.ship([torch.ones(10)])
    assert small.capacity == 4096 and files.created == 3, "the smallest free file that holds a value is taken"
    assert torch.equal(unship(small, reader)[0], torch.ones(10)), "a reused file's mapping shows the new batch"
    stale = again if small.name == again.name else held
    with pytest.raises(StaleBatch, match="another batch"):
        unship(stale, reader)  # a task run again after its batch's file was reused
    reader.close()


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


def test_a_failed_prefetch_raises_in_the_task_that_waits_for_it(store: HostStore) -> None:
    cache = make_cache(store, budget=1000)
    host = store.create("w", 300)

    def broken_copy(target: torch.Tensor, source: torch.Tensor) -> None:
        raise OSError("link down")

    cache.engine.copy = broken_copy  # type: ignore[method-assign]
    assert cache.prefetch("p0", 0, host, keep_free=0)
    with pytest.raises(RuntimeError, match="copying the weights of p0 in failed"), cache.weights("p0", 0, host):
        pass
    assert cache.used == 0 and "p0" not in cache.residents
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

    def wait(self, done: Any) -> None:
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
        assert "p2" in cache.residents, "the prefetched weights were pushed out"
    with cache.weights("p2", 0, prefetched):
        assert cache.counters.values["in_weights"] == copied + 500, "the prefetched weights were copied in twice"
    cache.drop("p2")
    assert cache.keep("next", 0, value)
    with cache.weights("p1", 0, store.create("v", 900)):
        assert cache.claim("next", 0) is None, "a kept boundary was not evicted for weights"
    cache.clear()


def test_every_device_worker_gets_an_even_share_of_the_cpu_threads() -> None:
    """GPU workers too: they step optimizers on the host store, which one thread made the bottleneck."""
    specs = build_specs(["cpu", "cuda:0"], budget=1_000_000)
    assert [spec.threads for spec in specs] == [threads_per_device(cpu_count(), 2)] * 2
    assert threads_per_device(16, 1) == 16 and threads_per_device(16, 3) == 5 and threads_per_device(2, 4) == 1


class RecordingClient:
    """Stands in for a Dask client: records what the driver submits, runs nothing."""

    def __init__(self) -> None:
        self.submitted: list[tuple[str, dict[str, Any]]] = []

    def submit(self, function: Any, *args: Any, key: str, **options: Any) -> Any:
        self.submitted.append((key, options))
        return types.SimpleNamespace(key=key)


def test_a_resident_models_next_task_is_queued_on_its_worker_with_no_scheduler_edge(store: HostStore) -> None:
    batches = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(12)]
    feed = SharedFeed(LoaderFeed(batches, iter(batches[1:]), batches[0], epochs=1, steps=None), readers=1)
    homed = job(1024, steps=6, step_seconds=0.01, depth=2, home="cpu-0")
    state = BindingState([homed], {"cpu-0": 1 << 20}, homes={0: "cpu-0"})
    client = RecordingClient()
    driver = Driver(client, "run", store, state, [feed], {"cpu-0": "tcp://worker"}, microbatches=1)  # type: ignore[arg-type]
    driver._carry_out(state.start())
    keys = [key for key, _ in client.submitted]
    assert keys == ["bwd-m0-p0-s0-run", "bwd-m0-p0-s1-run"], "both open spans go to the worker at once"
    assert [(options["first"], options["steps"]) for _, options in client.submitted] == [(0, 2), (2, 2)]
    assert [options["after"] for _, options in client.submitted] == [[], [LocalResult("bwd-m0-p0-s0-run")]], (
        "the worker orders them, not the scheduler: the second checks that the first ran"
    )
    assert [options["priority"] for _, options in client.submitted] == [0, -1], "the first bound runs first"
    driver.cancel()


def test_a_resident_task_must_start_where_its_model_is() -> None:
    check_resident_order(next_step=4, first=4, model=0)
    for first in (2, 6):
        with pytest.raises(RuntimeError, match="skipped or applied twice"):
            check_resident_order(next_step=4, first=first, model=0)


def test_a_local_result_is_read_from_the_worker_or_the_reader_comes_back_later(monkeypatch: pytest.MonkeyPatch) -> None:
    states = {"done": "memory", "moved": "released", "queued": "ready", "failed": "error"}
    worker = types.SimpleNamespace(
        data={"done": [torch.ones(2)]},
        state=types.SimpleNamespace(tasks={key: types.SimpleNamespace(state=s) for key, s in states.items()}),
    )
    monkeypatch.setattr(handoff, "get_worker", lambda: worker)
    monkeypatch.setattr(handoff, "_fetch", lambda key: f"fetched {key}")
    finished = handoff.FinishedKeys(capacity=2)
    finished.add("done")
    finished.add("moved")
    early: Counter[str] = Counter()
    assert handoff.receive("plain", finished, early) == "plain"
    assert handoff.receive(LocalResult("done"), finished, early) is worker.data["done"]
    assert handoff.receive(LocalResult("moved"), finished, early) == "fetched moved", "its copy here was dropped"
    handoff.wait_for(LocalResult("moved"), finished, early)
    for key in ("queued", "not-arrived"):
        with pytest.raises(Reschedule):
            handoff.receive(LocalResult(key), finished, early)
        with pytest.raises(Reschedule):
            handoff.wait_for(LocalResult(key), finished, early)
    with pytest.raises(LostResult, match="failed"):
        handoff.wait_for(LocalResult("failed"), finished, early)
    finished.add("later")
    assert "done" not in finished and "moved" in finished and len(finished) == 2, "the oldest key goes"
    handoff.wait_for(LocalResult("done"), finished, early)  # its result is still in the worker's memory
    early["not-arrived"] = handoff.MAX_EARLY_STARTS
    with pytest.raises(LostResult, match="never ran"):
        handoff.receive(LocalResult("not-arrived"), finished, early)


FAULTS_PER_ALLOCATION = '''
import resource, torch
torch.set_num_threads(1)
from harmony.runtime.allocator import keep_freed_memory
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        torch.empty(2**20, dtype=torch.uint8).fill_(1)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 40
faults()
before = faults()
applied = keep_freed_memory()
faults()  # the heap grows once to hold the block
print(before, applied, faults())
'''


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc thresholds are glibc's")
def test_a_device_worker_reuses_freed_tensor_memory_even_under_the_nannys_malloc_setting() -> None:
    environment = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"}  # what Dask's nanny gives its workers
    output = subprocess.run([sys.executable, "-c", FAULTS_PER_ALLOCATION], env=environment, capture_output=True,
                            text=True, check=True).stdout.split()
    before, applied, after = float(output[0]), output[1], float(output[2])
    assert before > 200, f"a fresh mmap per 1 MiB tensor faults on each of its 256 pages (got {before})"
    assert applied == "True" and after < 10, f"after keep_freed_memory a freed block is reused ({after} faults)"


def test_a_spans_losses_land_in_their_steps_rows_across_loss_blocks() -> None:
    """A multi-step task writes its steps' per-member losses together; a span that crosses a block boundary
    fills the end of one block and the start of the next."""
    from harmony.runtime.bodies import _record_losses
    from harmony.runtime.files import LOSS_BLOCK, losses_name

    members, first, count = 3, LOSS_BLOCK - 2, 5
    blocks: dict[str, torch.Tensor] = {}

    def attach(name: str, nbytes: int) -> torch.Tensor:
        return blocks.setdefault(name, torch.zeros(nbytes, dtype=torch.uint8))

    ctx = types.SimpleNamespace(store=types.SimpleNamespace(attach=attach),
                                spec=types.SimpleNamespace(models=[None, types.SimpleNamespace(members=members)]))
    totals = torch.arange(count * members, dtype=torch.float64).reshape(count, members) + 1
    _record_losses(ctx, 1, first, 0, totals)  # type: ignore[arg-type]
    rows = {name: block.view(torch.float64).view(LOSS_BLOCK, members) for name, block in blocks.items()}
    assert sorted(rows) == sorted([losses_name(1, 0), losses_name(1, 1)])
    torch.testing.assert_close(rows[losses_name(1, 0)][-2:], totals[:2])
    torch.testing.assert_close(rows[losses_name(1, 1)][:3], totals[2:])
    assert rows[losses_name(1, 0)][:-2].abs().sum() == 0 and rows[losses_name(1, 1)][3:].abs().sum() == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_that_python_swallows_is_raised_again_by_the_driver_loop() -> None:
    def interrupted_while_collecting(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            signal.raise_signal(signal.SIGINT)  # its KeyboardInterrupt is raised in here and dropped

    with watching_interrupts():
        gc.callbacks.append(interrupted_while_collecting)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(interrupted_while_collecting)
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
        raise_if_interrupted()  # raised once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_handler_of_the_users_is_kept() -> None:
    calls: list[int] = []

    def users_handler(signum: int, frame: object) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGINT, users_handler)
    try:
        with watching_interrupts():
            signal.raise_signal(signal.SIGINT)
            raise_if_interrupted()  # the user's handler took it: nothing recorded
        assert calls == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is users_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_cpu_copy_engine_never_starts_an_openmp_team_beside_the_compute_threads() -> None:
    """A large torch copy on a thread leaves that thread a team of OpenMP pool threads for its life, which
    makes the compute thread's pool sleep between operators (serial_copy); the engine's copies make none."""
    source = torch.arange(1 << 22, dtype=torch.int32).view(torch.uint8)
    by_torch, by_engine = torch.empty_like(source), torch.empty_like(source)
    with torch_threads(2), ThreadPoolExecutor(max_workers=1) as pool:
        before = native_threads()
        pool.submit(by_torch.copy_, source).result()
        assert native_threads() - before, "control: a thread's large torch copy starts pool threads"
    engine = CopyEngine("cpu-t", torch.device("cpu"))
    copied = threading.Event()
    with torch_threads(2):
        before = native_threads()
        engine.submit(engine.copy, by_engine, source)
        engine.submit(copied.set)
        assert copied.wait(30)
        assert not native_threads() - before, "the copy engine's thread started OpenMP pool threads"
    engine.shutdown()
    assert torch.equal(by_engine, source) and torch.equal(by_torch, source)
