"""Exports read from another process's device memory: the claim slots' transitions, the protocol between a
producer and reader processes on CPU (host-store files standing in for device memory, counting each send's
reference as torch's IPC counter does), and CUDA IPC handles between two processes of one GPU."""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from harmony.runtime.hoststore import HostStore, dtype_name, torch_dtype
from harmony.runtime.ipc import (
    Exports,
    Handle,
    InvalidTransition,
    Readers,
    Reading,
    Slot,
    SlotTable,
    State,
    Ticket,
    claimed,
    copied,
    settled,
    spilled,
    withdrawn,
)
from harmony.runtime.shipping import StaleBatch

SENDS = 16  # the slots a test's table has, and the counts it keeps


def living(pid: int) -> bool:
    return True


def dead(pid: int) -> bool:
    return False


def test_a_reader_claims_an_exported_slot_reads_a_spilled_one_from_its_file_and_a_withdrawn_one_is_stale() -> None:
    exported = Slot(State.EXPORTED, 0, 3)
    assert claimed(exported, 3, 77) == (Slot(State.CLAIMED, 77, 3), Reading.DEVICE)
    assert claimed(exported, 2, 77) == (exported, Reading.STALE), "a ticket of an earlier use of the slot"
    assert claimed(Slot(State.SPILLED, 0, 3), 3, 77)[1] == Reading.FILE
    assert claimed(Slot(State.WITHDRAWN, 0, 3), 3, 77)[1] == Reading.STALE
    assert claimed(Slot(State.FREE, 0, 3), 3, 77)[1] == Reading.STALE
    with pytest.raises(InvalidTransition):
        claimed(Slot(State.CLAIMED, 5, 3), 3, 77)
    assert copied(Slot(State.CLAIMED, 77, 3), 77) == Slot(State.DONE, 0, 3)
    with pytest.raises(InvalidTransition):
        copied(Slot(State.CLAIMED, 5, 3), 77)


def test_the_producer_spills_and_withdraws_only_unclaimed_slots_and_gives_back_what_no_reader_will() -> None:
    exported, claim = Slot(State.EXPORTED, 0, 1), Slot(State.CLAIMED, 77, 1)
    assert spilled(exported, living) == (Slot(State.SPILLED, 0, 1), True)
    assert spilled(claim, living) == (claim, False), "a live claim is waited for"
    assert spilled(claim, dead) == (Slot(State.DONE, 0, 1), True), "a dead claimer never gives its count back"
    assert spilled(Slot(State.DONE, 0, 1), living) == (Slot(State.DONE, 0, 1), False)
    assert withdrawn(exported, living) == (Slot(State.WITHDRAWN, 0, 1), True)
    assert withdrawn(claim, living) == (claim, False)
    assert withdrawn(claim, dead) == (Slot(State.WITHDRAWN, 0, 1), True)
    for given in (State.SPILLED, State.DONE, State.WITHDRAWN):
        assert withdrawn(Slot(given, 0, 1), living) == (Slot(State.WITHDRAWN, 0, 1), False)
    with pytest.raises(InvalidTransition):
        withdrawn(Slot(State.FREE, 0, 1), living)
    assert [settled(Slot(state, 0, 1)) for state in State] == [False, False, False, True, True, True]


class Memory:
    """A stand-in for device memory that another process can map: each tensor a host-store file, and a counts
    file holding each send's reference count as torch's IPC counter does (1 when shared, given back once, by
    the reader after its copy or by the producer)."""

    def __init__(self, store: HostStore) -> None:
        self.store = store
        self.names: dict[int, str] = {}
        self.counts = store.create("counts", SENDS * 8).view(torch.int64)
        self.sent = 0

    def tensor(self, values: torch.Tensor) -> torch.Tensor:
        name = f"device-{len(self.names)}"
        tensor = self.store.create(name, values.nbytes).view(values.dtype).view(values.shape)
        tensor.copy_(values)
        self.names[tensor.data_ptr()] = name
        return tensor

    def share(self, tensor: torch.Tensor) -> Handle:
        send = self.sent
        self.sent += 1
        self.counts[send] += 1
        return Handle((self.names[tensor.data_ptr()], dtype_name(tensor.dtype), tuple(tensor.shape), send))

    def give_back(self, handle: Handle) -> None:
        self.counts[handle.arguments[3]] -= 1


def opener(store: HostStore) -> tuple[Callable[[Handle], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """A reader's open_handle and copy for Memory's handles: copy gives the opened send's count back after the
    copy, as a CUDA reader's dropped tensor does."""
    counts = store.attach("counts", SENDS * 8).view(torch.int64)
    sends: list[int] = []

    def open_handle(handle: Handle) -> torch.Tensor:
        name, dtype, shape, send = handle.arguments
        sends.append(send)
        nbytes = math.prod(shape) * torch_dtype(dtype).itemsize
        return store.attach(name, nbytes).view(torch_dtype(dtype)).view(shape)

    def copy(source: torch.Tensor) -> torch.Tensor:
        made = source.clone()
        if sends:
            counts[sends.pop()] -= 1
        return made

    return open_handle, copy


def read_in_another_process(run: str, directory: str, ticket: Ticket, pause: float, marker: str | None,
                            finish: bool = True) -> list[torch.Tensor] | str:
    """A reader process: receives ticket (pausing inside its copy for pause seconds, then writing marker); the
    tree it read, or the error's class name. Without finish it claims the slot and exits at once."""
    store = HostStore(run, directory)
    readers = Readers(store)
    if not finish:
        table = SlotTable(store, ticket.table, ticket.size)
        table.change(ticket.index, lambda slot: claimed(slot, ticket.generation, os.getpid()))
        os._exit(0)
    open_handle, copy = opener(store)

    def slowed(source: torch.Tensor) -> torch.Tensor:
        time.sleep(pause)
        if marker is not None:
            Path(marker).write_text("copied")
        return copy(source)

    try:
        return readers.receive(ticket, slowed, open_handle)
    except StaleBatch as error:
        return type(error).__name__
    finally:
        readers.close()
        store.close()


@pytest.fixture
def spawn() -> multiprocessing.context.SpawnContext:
    return multiprocessing.get_context("spawn")


def exports(store: HostStore, memory: Memory, size: int = SENDS) -> Exports:
    return Exports(store, "peer-0-", size, share=memory.share, give_back=memory.give_back)


def test_a_reader_process_copies_an_export_from_the_producers_memory_and_every_send_is_given_back_once(
    store: HostStore, spawn: multiprocessing.context.SpawnContext,
) -> None:
    memory = Memory(store)
    tree = [memory.tensor(torch.randn(4, 8)), (memory.tensor(torch.arange(5)), None, 3)]
    producer = exports(store, memory)
    read, unread = producer.send("fwd-a", tree), producer.send("fwd-a", tree)
    assert read is not None and unread is not None and read.index != unread.index
    with spawn.Pool(1) as pool:
        got = pool.apply(read_in_another_process, (store.run, str(store.directory), read, 0.0, None))
    assert isinstance(got, list)
    torch.testing.assert_close(got[0], tree[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1][0], tree[1][0], rtol=0, atol=0)
    assert got[1][1:] == (None, 3)
    assert producer.table.read(read.index).state == State.DONE
    assert producer.table.read(unread.index).state == State.EXPORTED
    producer.release("fwd-a")
    assert memory.counts[: memory.sent].tolist() == [0] * 4, "the reader gave its two back, the producer the rest"
    assert [producer.table.read(index).state for index in (read.index, unread.index)] == [State.FREE] * 2
    producer.close()


def test_a_spilled_export_is_read_from_its_host_file_and_a_released_one_is_stale_even_after_its_slot_is_reused(
    store: HostStore, spawn: multiprocessing.context.SpawnContext,
) -> None:
    memory = Memory(store)
    tree = {"x": memory.tensor(torch.randn(3, 5)), "y": memory.tensor(torch.randn(7).to(torch.bfloat16))}
    producer = exports(store, memory, size=1)
    ticket = producer.send("bwd-a", tree)
    assert ticket is not None and producer.send("bwd-b", tree) is None, "every slot taken: the caller sends bytes"
    device = producer.spill("bwd-a")
    assert device is tree and producer.send("bwd-a", tree) is None, "a spilled export is not sent again"
    assert memory.counts[0] == 0, "the producer gave back the count of the send nobody claimed"
    with spawn.Pool(1) as pool:
        got = pool.apply(read_in_another_process, (store.run, str(store.directory), ticket, 0.0, None))
        assert got["x"].device.type == "cpu" and not got["x"].requires_grad
        torch.testing.assert_close(got["x"], tree["x"], rtol=0, atol=0)
        torch.testing.assert_close(got["y"], tree["y"], rtol=0, atol=0)
        producer.release("bwd-a")
        assert pool.apply(read_in_another_process, (store.run, str(store.directory), ticket, 0.0, None)) == \
            "StaleBatch"
        again = producer.send("bwd-c", [memory.tensor(torch.ones(2))])
        assert again is not None and again.index == ticket.index and again.generation == ticket.generation + 1
        assert pool.apply(read_in_another_process, (store.run, str(store.directory), ticket, 0.0, None)) == \
            "StaleBatch"
    producer.close()
    assert memory.counts[: memory.sent].tolist() == [0] * memory.sent


def test_the_producer_waits_for_a_claimed_copy_before_its_memory_goes_and_not_for_a_dead_claimer(
    store: HostStore, spawn: multiprocessing.context.SpawnContext, tmp_path: Path,
) -> None:
    memory = Memory(store)
    tree = [memory.tensor(torch.randn(64))]
    producer = exports(store, memory)
    ticket = producer.send("fwd-a", tree)
    marker = tmp_path / "copied"
    with spawn.Pool(1) as pool:
        reading = pool.apply_async(read_in_another_process,
                                   (store.run, str(store.directory), ticket, 1.0, str(marker)))
        deadline = time.monotonic() + 60
        while producer.table.read(ticket.index).state != State.CLAIMED:
            assert time.monotonic() < deadline, "the reader never claimed its slot"
            time.sleep(0.01)
        producer.spill("fwd-a")
        assert marker.exists(), "spill returned while the reader was still copying"
        torch.testing.assert_close(reading.get(timeout=60)[0], tree[0], rtol=0, atol=0)
    producer.release("fwd-a")

    lost = producer.send("fwd-b", tree)
    child = spawn.Process(target=read_in_another_process,
                          args=(store.run, str(store.directory), lost, 0.0, None, False))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert producer.table.read(lost.index) == Slot(State.CLAIMED, child.pid, lost.generation)
    started = time.monotonic()
    producer.release("fwd-b", patience=30)
    assert time.monotonic() - started < 30
    assert memory.counts[: memory.sent].tolist() == [0, 0], "the dead claimer's count was given back for it"
    producer.close()


def test_a_claim_that_is_never_copied_ends_the_producers_wait_with_an_error_that_names_it(store: HostStore) -> None:
    memory = Memory(store)
    producer = exports(store, memory)
    ticket = producer.send("fwd-a", [memory.tensor(torch.randn(4))])
    producer.table.change(ticket.index, lambda slot: claimed(slot, ticket.generation, os.getpid()))
    with pytest.raises(TimeoutError, match=f"process {os.getpid()} claimed slot {ticket.index}"):
        producer.spill("fwd-a", patience=0.2)
    producer.table.close()


def test_readers_racing_the_producers_spill_each_read_the_export_whole_from_one_place(
    store: HostStore, spawn: multiprocessing.context.SpawnContext,
) -> None:
    memory = Memory(store)
    producer = exports(store, memory)
    with spawn.Pool(2) as pool:
        for round in range(6):
            tree = [memory.tensor(torch.randn(1 << 12))]
            tickets = [producer.send(f"fwd-{round}", tree) for _ in range(2)]
            readings = [pool.apply_async(read_in_another_process,
                                         (store.run, str(store.directory), ticket, 0.01 * round, None))
                        for ticket in tickets]
            time.sleep(0.02 * round)
            producer.spill(f"fwd-{round}")
            for reading in readings:
                torch.testing.assert_close(reading.get(timeout=60)[0], tree[0], rtol=0, atol=0)
            producer.release(f"fwd-{round}")
            if memory.sent >= SENDS - 2:
                break
    assert memory.counts[: memory.sent].tolist() == [0] * memory.sent
    producer.close()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def read_on_the_gpu(run: str, directory: str, ticket: Ticket) -> list[torch.Tensor]:
    """A reader process of the same GPU: each tensor copied into its own memory on a stream of its own."""
    store = HostStore(run, directory)
    readers = Readers(store)
    stream = torch.cuda.Stream()

    def copy(source: torch.Tensor) -> torch.Tensor:
        made = source.clone()
        stream.synchronize()
        return made

    try:
        with torch.cuda.stream(stream):
            tree = readers.receive(ticket, copy)
        return [tensor.cpu() for tensor in tree]
    finally:
        readers.close()
        store.close()


@pytest.fixture
def gpu_producer(store: HostStore) -> Iterator[tuple[Exports, int]]:
    """A producer of this process's GPU, and the device memory allocated before it exported anything."""
    torch.cuda.synchronize()
    producer = Exports(store, "peer-0-", SENDS)
    yield producer, torch.cuda.memory_allocated()
    producer.close()


@cuda
def test_cuda_a_reader_process_copies_an_export_written_late_only_after_it_is_written_and_memory_is_freed(
    store: HostStore, spawn: multiprocessing.context.SpawnContext, gpu_producer: tuple[Exports, int],
) -> None:
    producer, baseline = gpu_producer
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # about a second: the values come long after the handle is sent
        tree = [torch.full((1 << 20,), 7.0, device="cuda"), torch.arange(1000, device="cuda")]
    torch.cuda.current_stream().wait_stream(side)  # share's event is recorded on the current stream
    read, unread = producer.send("fwd-a", tree), producer.send("fwd-a", tree)
    with spawn.Pool(1) as pool:
        got = pool.apply(read_on_the_gpu, (store.run, str(store.directory), read))
    assert torch.equal(got[0], torch.full((1 << 20,), 7.0)), "the reader read before the producer wrote"
    assert torch.equal(got[1], torch.arange(1000))
    assert unread is not None
    producer.release("fwd-a")
    del tree
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() == baseline, "a send's block waits in torch's limbo"


@cuda
def test_cuda_a_spilled_export_is_read_from_its_host_file_and_its_device_memory_is_freed(
    store: HostStore, spawn: multiprocessing.context.SpawnContext, gpu_producer: tuple[Exports, int],
) -> None:
    producer, baseline = gpu_producer
    tree = [torch.randn(1 << 16, device="cuda")]
    expected = tree[0].cpu()
    ticket = producer.send("fwd-a", tree)
    del tree
    producer.spill("fwd-a")
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() == baseline
    with spawn.Pool(1) as pool:
        got = pool.apply(read_on_the_gpu, (store.run, str(store.directory), ticket))
    assert torch.equal(got[0], expected)
