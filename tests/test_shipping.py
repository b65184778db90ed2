"""Batches shipped through recycled host-store files: what goes in comes back, step by step or stacked."""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils._pytree import tree_flatten

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.hoststore import HostStore
from harmony.runtime.shipping import BatchFiles, ShippedTensors, StackedSteps, StaleBatch, unship


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
    with pytest.raises(StaleBatch, match="another batch"):
        stale.check(reader)  # a task that read it before the reuse learns it before it writes what it computed
    small.check(reader)
    reader.close()


def test_a_reserved_file_holds_its_layout_until_filled_and_reads_back_as_host_tensors(store: HostStore) -> None:
    files = BatchFiles(store)
    reader = HostStore(store.run, store.directory)
    value = {"x": torch.randn(3, 4, requires_grad=True), "rest": [torch.arange(6).to(torch.bfloat16), None, 2]}
    reserved = files.reserve(value)
    assert torch.count_nonzero(reserved.unpack(reader)["x"]) == 0, "reserved: laid out, not written"
    files.fill(reserved, value)
    back = reserved.unpack(reader)
    assert not back["x"].requires_grad and back["x"].device.type == "cpu"
    assert torch.equal(back["x"], value["x"].detach())
    assert torch.equal(back["rest"][0], value["rest"][0]) and back["rest"][1:] == [None, 2]
    files.release(reserved)
    files.ship([torch.ones(1)])
    with pytest.raises(StaleBatch):
        files.fill(reserved, value)  # the file has another use: never written over
    reader.close()
