"""Results read by another device of the machine from the producer's file: the serializer that exports them, the
outbox that recycles the files, and two CPU devices exchanging activations that way in a run."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest
import torch
from dask.sizeof import sizeof
from distributed.protocol import deserialize, serialize
from torch import nn

import harmony
from harmony.runtime.cache import tree_nbytes
from harmony.runtime.hoststore import HostStore, shm_directory
from harmony.runtime.peer import Exported, Outbox, PeerResult, received_bytes, take
from harmony.runtime.shipping import StaleBatch
from tests.conftest import assert_same_weights, clones, deep_mlp, regression_batches, train_plain

MACHINE = "boot/1"


def sent(value: Exported) -> PeerResult:
    """value as another worker receives it through Dask's comms."""
    header, frames = serialize(value, serializers=("dask", "pickle"))
    received = deserialize(header, frames)
    assert isinstance(received, PeerResult)
    return received


def test_a_sent_result_carries_its_file_and_the_reader_maps_the_same_tensors(store: HostStore) -> None:
    tree = [torch.randn(4, 8), (torch.arange(5), torch.randn(2, 3, dtype=torch.bfloat16))]
    exported = Exported(tree, "fwd-m0-p1-s0-a", Outbox(store, 0), MACHINE, direct=True)
    header, frames = serialize(exported, serializers=("dask", "pickle"))
    assert sum(len(memoryview(frame)) for frame in frames) < 2_000, "the file's name and layout, not the bytes"
    received = deserialize(header, frames)
    reader = HostStore(store.run, store.directory)
    back = take(received, reader, MACHINE)
    assert tree_nbytes(back) == sizeof(exported) == 4 * 8 * 4 + 5 * 8 + 2 * 3 * 2
    assert torch.equal(back[0], tree[0]) and torch.equal(back[1][0], tree[1][0])
    assert torch.equal(back[1][1], tree[1][1]) and back[1][1].dtype == torch.bfloat16
    assert take(exported, store, MACHINE) is tree, "a reader on the producer's worker takes the tree itself"
    with pytest.raises(RuntimeError, match="exported on machine boot/1 was read on boot/2"):
        take(received, reader, "boot/2")


def test_pickled_outside_dask_serializers_the_tree_travels_whole(store: HostStore) -> None:
    tree = [torch.randn(3, 3)]
    outbox = Outbox(store, 0)
    back = pickle.loads(pickle.dumps(Exported(tree, "bwd-m0-p1-s0-a", outbox, MACHINE, direct=True)))
    assert torch.equal(back[0], tree[0])
    assert outbox.held == {} and outbox.files.created == 0, "nothing was exported"


def test_without_room_for_a_file_the_tensors_travel_through_dask_s_comms(store: HostStore) -> None:
    full = HostStore(store.run, store.directory, budget=1_000)  # the run's host_memory, or a full /dev/shm
    outbox = Outbox(full, 0)
    tree = [torch.randn(16, 32), torch.arange(3)]
    header, frames = serialize(Exported(tree, "fwd-m0-p0-s0-a", outbox, MACHINE, direct=True),
                               serializers=("dask", "pickle"))
    back = deserialize(header, frames)
    assert isinstance(back, list) and torch.equal(back[0], tree[0]) and torch.equal(back[1], tree[1])
    assert outbox.held == {} and not list(full.directory.glob(f"*{outbox.files.prefix}*")), "no file was left"
    assert received_bytes([back], [back], (True,), direct=True) == (0, 16 * 32 * 4 + 3 * 8)


def test_a_result_sent_twice_shares_one_file_and_a_released_file_holds_the_next_result(store: HostStore) -> None:
    outbox = Outbox(store, 0)
    first = Exported([torch.ones(64)], "fwd-m0-p0-s0-a", outbox, MACHINE, direct=True)
    once, twice = sent(first), sent(first)
    assert once.shipped == twice.shipped and outbox.files.created == 1
    outbox.release("bwd-m9-p9-s9-a")  # a key that exported nothing
    assert list(outbox.held) == ["fwd-m0-p0-s0-a"]
    outbox.release("fwd-m0-p0-s0-a")
    second = sent(Exported([torch.zeros(64)], "fwd-m0-p0-s1-a", outbox, MACHINE, direct=True))
    assert second.shipped.name == once.shipped.name and outbox.files.created == 1, "the released file is reused"
    assert torch.equal(take(second, store, MACHINE)[0], torch.zeros(64))
    with pytest.raises(StaleBatch, match="now holds another batch"):
        take(once, store, MACHINE)
    outbox.release_all()
    assert outbox.held == {}


def test_bytes_from_a_cpu_device_to_a_cpu_device_are_peer_to_peer_and_any_other_crossing_remote(
    store: HostStore,
) -> None:
    outbox = Outbox(store, 0)
    cpu = sent(Exported([torch.ones(10)], "fwd-m0-p0-s0-a", outbox, MACHINE, direct=True))
    gpu = sent(Exported([torch.ones(20)], "fwd-m1-p0-s0-a", outbox, MACHINE, direct=False))
    comms = [torch.ones(30)]  # a result that came through Dask's comms
    local = Exported([torch.ones(40)], "fwd-m2-p0-s0-a", outbox, MACHINE, direct=True)  # read on its own worker
    inprocess = Exported([torch.ones(60)], "fwd-m3-p0-s0-a", outbox, MACHINE, direct=True)  # workers of one process
    values = [cpu, gpu, comms, local, inprocess, torch.ones(50)]
    trees = [take(value, store, MACHINE) for value in values]
    peers = (True, True, True, False, True, False)
    assert received_bytes(values, trees, peers, direct=True) == (40, 80 + 120 + 240)
    assert received_bytes(values, trees, peers, direct=False) == (0, 40 + 80 + 120 + 240)


def peer_files() -> set[Path]:
    return set(shm_directory().glob("harmony-*-peer-*"))


def test_two_cpu_devices_exchange_results_through_recycled_files(no_leaks: None) -> None:
    models = [deep_mlp(seed=s).double() for s in range(2)]  # float64: Adam over 24 steps, compared exactly
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * 24, batch=16)]
    factory = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    seen: set[Path] = set()
    done = threading.Event()

    def watch() -> None:  # the files are removed only when the run ends: every one made shows here
        while not done.wait(0.002):
            seen.update(peer_files())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                               devices=["cpu", "cpu"], device_memory=60_000, mode="vpp", progress=False)
    finally:
        done.set()
        watcher.join()
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference)
    stats = result.stats
    results = stats.bytes_p2p // (16 * 32 * 8)  # each a batch's activations or their gradient: 16 by 32 doubles
    assert results >= 2 * 24 * 2, "each step of each model crosses devices forward and back"
    assert stats.bytes_remote == 0
    assert seen, "results crossed through files"
    assert len(seen) * 4 <= results, "a file is written again once its result's readers have finished"
    assert not peer_files()
