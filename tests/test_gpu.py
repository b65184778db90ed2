"""The CUDA device path: pinned host store, copy stream and events (a slowed copy never read early), accounting
against torch.cuda.memory_allocated, exactness and budget with sections, updates beside the device, stashed
activations, bf16 (its weights copied in as bf16), dropout's streams and a pruned swapped array's rows; skipped
without a GPU."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import harmony
from harmony.runtime.cache import DeviceCache
from harmony.runtime.counters import BLOCK_BYTES, Counters
from harmony.runtime.hoststore import HostStore
from tests.conftest import (
    assert_same_weights,
    clones,
    cross_device_reads,
    deep_mlp,
    regression_batches,
    stashing_and_recomputing,
    stop,
    train_plain,
    train_plain_scheduled,
    train_plain_seeded,
)
from tests.test_pruning import check_pruned_array

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def pinned_store():
    store = HostStore("gputest", pin=True)
    yield store
    store.close()
    store.unlink_all()


def test_a_gpu_host_store_pins_its_mappings_until_it_closes(pinned_store: HostStore) -> None:
    weights = pinned_store.create("w", 1 << 20)
    assert pinned_store.pinned("w") and weights.is_pinned()
    assert not HostStore("gputest").attach("w", 1 << 20).is_pinned(), "a store for a CPU device pins nothing"
    pinned_store.close()
    assert not pinned_store.pinned("w") and not weights.is_pinned()


def test_prefetch_copies_on_the_copy_stream_and_the_compute_stream_waits_for_it(pinned_store: HostStore) -> None:
    device = torch.device("cuda:0")
    cache = DeviceCache("cuda-0", device, 1 << 30, Counters(pinned_store.create("counters", BLOCK_BYTES)))
    nbytes = 256 << 20
    host = pinned_store.create("w", nbytes)
    host.copy_(torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8))
    expected = int(host.to(torch.int64).sum())
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        busy = busy @ busy / 64
    assert cache.prefetch("p0", 0, host, keep_free=0)
    with cache.weights("p0", 0, host) as device_bytes:
        entry = cache.tensors["p0"]
        assert entry.done is not None, "a CUDA copy ends with an event"
        assert cache.engine.stream is not None and cache.engine.stream != torch.cuda.current_stream(device)
        assert int(device_bytes.to(torch.int64).sum()) == expected
    cache.counters.publish()
    assert cache.counters.read()["prefetched"] == nbytes
    cache.clear()


def test_cuda_device_matches_plain_pytorch_while_swapping_with_prefetch(no_leaks: None) -> None:
    models = [deep_mlp(seed=s) for s in range(2)]
    references = clones(models)
    batches = regression_batches(samples=64, batch=16)
    factory = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=4,
                           devices=["cuda:0"], device_memory=24_000, fuse=False, progress=False)
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, rtol=1e-4, atol=1e-6)
    assert max(result.stats.peak_device_bytes.values()) <= 24_000
    assert set(result.stats.reserved_device_bytes) == {"cuda-0"} and result.stats.reserved_device_bytes["cuda-0"] > 0
    assert result.stats.bytes_prefetched > 0, "weights were swapped in without the copy stream"
    assert result.stats.bytes_ahead > 0, "values crossed on the compute stream"


def test_values_copied_ahead_and_sent_behind_on_cuda_give_the_same_weights(no_leaks: None) -> None:
    """On a GPU prefetch=True copies micro-batch values on the inward and outward streams: float64 weights the same bit
    for bit as prefetch="weights", which copies them on the compute stream, and plain PyTorch's within 1e-9. With one
    pack a task every output and input gradient leaves behind the compute (a task of several packs hands its values
    on inside it and sends only those it does not keep: tests/test_exactness.py)."""
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    trained = []
    for prefetch in (True, "weights"):
        model = deep_mlp(seed=3).double()
        result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=4,
                               devices=["cuda:0"], device_memory=64_000, resident=False, fuse=False,
                               packs_per_task=1, stash=False, prefetch=prefetch, progress=False)
        assert max(result.stats.peak_device_bytes.values()) <= 64_000
        stats = result.stats
        assert (stats.bytes_ahead > 0) == (prefetch is True)
        sent = stats.bytes_out["activations"] if prefetch is True else 0
        assert stats.bytes_out["activations"] > 0 and stats.bytes_behind == sent, (stats.bytes_behind, stats.bytes_out)
        trained.append(model)
    for a, b in zip(trained[0].parameters(), trained[1].parameters()):
        assert torch.equal(a, b)
    reference = deep_mlp(seed=3).double()
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert_same_weights(trained[0], reference, rtol=1e-9, atol=1e-12)


def test_a_value_copied_ahead_or_sent_behind_is_never_read_before_its_copy_ends(pinned_store: HostStore) -> None:
    """The inward and then the outward stream are held up by a GPU sleep: the compute stream must wait for the copy in,
    and arrived() for the copy out, so that what is read is the value, not what the reused memory held."""
    device = torch.device("cuda:0")
    nbytes = 64 << 20
    stale = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    del stale
    cache = DeviceCache("cuda-0", device, 1 << 30, Counters(pinned_store.create("counters", BLOCK_BYTES)), ahead=True)
    host = pinned_store.create("x", nbytes)
    host.copy_(torch.arange(nbytes, dtype=torch.int64).remainder(251).add(1).to(torch.uint8))
    expected = int(host.to(torch.int64).sum())
    with torch.cuda.stream(cache.engine.stream):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles ahead of the copy in
    assert cache.ahead("x", host, "activations") == nbytes
    assert int(cache.take("x").to(torch.int64).sum()) == expected
    value = torch.arange(nbytes // 8, dtype=torch.int64, device=device)
    with torch.cuda.stream(cache.engine.outward):
        torch.cuda._sleep(2_000_000_000)  # and ahead of the copy out
    with cache.scratch(2 * nbytes, "activations") as reserved:
        sent = cache.send(value, "activations", reserved)
    (copied,) = cache.arrived([sent])
    assert copied.device.type == "cpu" and torch.equal(copied, value.cpu())
    assert cache.memory.used == 0, "the send's bytes are given back once it is on the host"
    cache.clear()


def test_a_value_handed_on_and_sent_behind_is_copied_in_only_after_its_copy_out_ends(pinned_store: HostStore) -> None:
    """A value handed on inside a task and not kept goes out on the outward stream, held up by a GPU sleep: its
    consumer's copy in, on the compute stream (copy_in) or the copy stream (ahead), must wait for it on the GPU."""
    from harmony.runtime.cache import Transit

    device = torch.device("cuda:0")
    nbytes = 64 << 20
    cache = DeviceCache("cuda-0", device, 3 * nbytes, Counters(pinned_store.create("counters", BLOCK_BYTES)),
                        ahead=True)
    for read in ("copy_in", "ahead"):
        value = torch.arange(nbytes // 8, dtype=torch.int64, device=device)
        with torch.cuda.stream(cache.engine.outward):
            torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles ahead of the copy out
        spilled = cache.hand_on("next pack", 0, value, keep_free=2 * nbytes)  # no room to keep it and one each way
        assert isinstance(spilled.value, Transit)
        if read == "copy_in":
            copied = cache.copy_in(spilled, "activations")
        else:
            assert cache.ahead("x", spilled, "activations") == nbytes
            copied = cache.take("x")
        assert torch.equal(copied, value), read
        del copied, spilled
        cache.clear()


def test_a_reservation_takes_a_sends_room_without_the_host_waiting_and_reuses_its_memory_after_the_copy(
    pinned_store: HostStore,
) -> None:
    """The outward stream is held up by a GPU sleep: a reservation that needs the send's room returns while its copy
    is still waiting (the compute stream, not the host, waits for it), the next allocation reuses the send's memory
    (the budget's bytes are reused, not added to), and what is written there does not reach the host copy."""
    device = torch.device("cuda:0")
    nbytes = 64 << 20
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # no other free block of the size: the send's is the one to be reused
    before = torch.cuda.memory_allocated(device)
    cache = DeviceCache("cuda-0", device, 2 * nbytes, Counters(pinned_store.create("counters", BLOCK_BYTES)),
                        ahead=True)
    value = torch.arange(nbytes // 8, dtype=torch.int64, device=device)
    address, expected = value.data_ptr(), value.cpu()
    with torch.cuda.stream(cache.engine.outward):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles ahead of the copy out
    with cache.scratch(2 * nbytes, "activations") as reserved:
        sent = cache.send(value, "activations", reserved)
    del value
    with cache.scratch(2 * nbytes, "the next micro-batch"):
        assert not sent.events[0].query(), "the host did not wait for the copy out"
        reused = torch.full((nbytes // 8,), -1, dtype=torch.int64, device=device)
        assert reused.data_ptr() == address, "the send's memory is reused"
        assert torch.cuda.memory_allocated(device) - before <= cache.memory.used
    (copied,) = cache.arrived([sent])
    assert torch.equal(copied, expected), "written over only after its copy out"
    del reused
    cache.clear()


def test_a_value_kept_while_its_send_is_held_up_is_changed_in_place_only_after_its_copy_out(
    pinned_store: HostStore,
) -> None:
    """The outward stream is held up by a GPU sleep: a value kept for its consumer and sent behind at once is claimed
    and changed in place (a first layer such as ReLU(inplace=True)), and its host copy must still be the value."""
    device = torch.device("cuda:0")
    nbytes = 64 << 20
    cache = DeviceCache("cuda-0", device, 4 * nbytes, Counters(pinned_store.create("counters", BLOCK_BYTES)),
                        ahead=True)
    value = torch.arange(nbytes // 8, dtype=torch.int64, device=device)
    expected = value.cpu()
    with torch.cuda.stream(cache.engine.outward):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles ahead of the copy out
    with cache.scratch(2 * nbytes, "activations") as reserved:
        sent = cache.send(value, "activations", reserved)
    assert cache.keep("next pack", 0, value, sent=sent)
    cache.claim("next pack", 0).mul_(2)
    (copied,) = cache.arrived([sent])
    assert torch.equal(copied, expected), "the kept value was changed before its copy out read it"
    assert torch.equal(value.cpu(), expected * 2)
    cache.clear()


def test_a_fused_array_on_cuda_matches_plain_pytorch(no_leaks: None) -> None:
    models = [deep_mlp(seed=s) for s in range(4)]
    references = clones(models)
    batches = regression_batches(samples=64, batch=16)
    rates = [1e-3, 3e-3, 1e-2, 3e-2]
    factories = [lambda p, lr=lr: torch.optim.SGD(p, lr=lr, momentum=0.9) for lr in rates]
    harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, devices=["cuda:0"],
                  fuse=True, progress=False)
    for model, reference, factory in zip(models, references, factories):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, rtol=1e-4, atol=1e-6)


def test_a_fused_array_stepped_by_cudas_fused_adamw_matches_plain_pytorch(no_leaks: None) -> None:
    """Each member of a homed array steps by torch's fused AdamW kernel over its rows of the stacks
    (runtime.array_optimizer), its own learning rate; in float64, where Adam does not turn rounding noise on near-zero
    gradients into steps of the learning rate's size."""
    models = [deep_mlp(seed=s).double() for s in range(4)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    factories = [lambda p, lr=lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.01) for lr in (1e-3, 3e-3, 1e-2, 3e-2)]
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories,
                           devices=["cuda:0"], fuse=True, progress=False)
    assert result.arrays == [[0, 1, 2, 3]]
    for model, reference, factory in zip(models, references, factories):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)


def test_a_pruned_swapped_array_on_cuda_computes_its_members_still_training_as_plain_pytorch(
    tmp_path: Path, no_leaks: None
) -> None:
    check_pruned_array(homed=False, norm=True, devices=["cuda:0"], tmp_path=tmp_path)


def test_a_slowed_copy_is_never_read_before_it_arrives(pinned_store: HostStore) -> None:
    """The copy stream is held up by a GPU sleep before the prefetch is enqueued: the compute stream must wait for the
    copy's event, so the weights it reads are the host's, not what the reused block held before."""
    device = torch.device("cuda:0")
    nbytes = 64 << 20
    stale = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    del stale  # the block the prefetch will most likely be given, full of zeros
    cache = DeviceCache("cuda-0", device, 1 << 30, Counters(pinned_store.create("counters", BLOCK_BYTES)))
    host = pinned_store.create("w", nbytes)
    host.copy_(torch.arange(nbytes, dtype=torch.int64).remainder(251).add(1).to(torch.uint8))
    expected = int(host.to(torch.int64).sum())
    with torch.cuda.stream(cache.engine.stream):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles on the copy stream, ahead of the copy
    assert cache.prefetch("p0", 0, host, keep_free=0)
    with cache.weights("p0", 0, host) as device_bytes:
        assert int(device_bytes.to(torch.int64).sum()) == expected
    cache.clear()


def test_accounted_bytes_agree_with_torch_cuda_memory_allocated(pinned_store: HostStore) -> None:
    device = torch.device("cuda:0")
    torch.cuda.synchronize(device)
    cache = DeviceCache("cuda-0", device, 3 << 20, Counters(pinned_store.create("counters", BLOCK_BYTES)))
    before = torch.cuda.memory_allocated(device)
    hosts = [pinned_store.create(f"w{index}", 1 << 20) for index in range(2)]
    for index, host in enumerate(hosts):
        with cache.weights(f"p{index}", 0, host):
            assert torch.cuda.memory_allocated(device) - before == cache.memory.used == (index + 1) << 20
    buffer = cache.allocate(512 << 10, "gradients")
    assert torch.cuda.memory_allocated(device) - before == cache.memory.used == (5 << 19)
    del buffer
    cache.clear()


@pytest.mark.parametrize("packs_per_task,overlap", [(1, True), (4, False), (4, True)],
                         ids=["updates-beside", "sections", "sections-and-updates-beside"])
def test_sections_and_overlapped_updates_on_cuda_match_plain_pytorch(
    packs_per_task: int, overlap: bool, no_leaks: None
) -> None:
    models = [deep_mlp(seed=s).double() for s in range(2)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                           devices=["cuda:0"], device_memory=48_000, fuse=False, progress=False,
                           packs_per_task=packs_per_task, overlap_update=overlap)
    assert all(job.overlap == overlap and job.home is None for job in result.plan.jobs)
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
    assert max(result.stats.peak_device_bytes.values()) <= 48_000


def test_stashed_activations_on_cuda_equal_recomputing_and_plain_pytorch(no_leaks: None) -> None:
    """A GPU's stash: its saved weights found again in the next copy, its bytes within the budget; bit for bit a
    recomputing run's weights and, in float64, plain PyTorch's."""
    models = [deep_mlp(depth=8, seed=3).double()]
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    reference = clones(models)[0]
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    runs = stashing_and_recomputing(models[0], batches, factory, reference, ["cuda:0"], 150_000)
    assert runs[True][1].stats.stashed > 0 and runs[False][1].stats.stashed == 0


def test_dropout_masks_on_cuda_do_not_depend_on_the_plan(steady_pilot: None, no_leaks: None) -> None:
    """The CUDA generator seeded per drawing layer (runtime.seeding): homed, and swapped in two different cuts, a
    dropout model on cuda:0 gives, in float64, the weights of the plain loop on cuda:0 seeded the same way."""
    def dropout_mlp() -> nn.Sequential:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64), nn.Tanh(),
                             nn.Dropout(0.3), nn.Linear(64, 4)).double()

    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=48, batch=12)]
    sgd = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    reference = dropout_mlp().cuda()
    train_plain_seeded(reference, [(x.cuda(), y.cuda()) for x, y in batches], sgd(reference.parameters()), 0, (2, 5),
                       microbatches=4, device="cuda:0")
    expected = copy.deepcopy(reference).cpu()
    for kwargs, cuts in (({"mode": "free"}, [0]), ({"device_memory": 106_000, "resident": False}, [0, 3, 4]),
                         ({"device_memory": 115_000, "resident": False}, [0, 3, 6])):
        model = dropout_mlp()
        result = harmony.train(model, batches, nn.functional.mse_loss, sgd, microbatches=4, devices=["cuda:0"],
                               progress=False, **kwargs)
        assert [pack.first for pack in result.plan.jobs[0].packing.packs] == cuts
        assert_same_weights(model, expected, rtol=1e-9, atol=1e-12)


def test_updates_on_the_gpu_match_plain_pytorch_and_leave_the_gradients_there(no_leaks: None) -> None:
    """update_on="device": Adam steps each swapped pack on the GPU (torch's CUDA kernels), its state copied in and
    out of the pinned host store; in float64 within plain PyTorch's reassociation, under the budget, and no gradient
    byte leaves the GPU."""
    models = [deep_mlp(seed=s).double() for s in range(2)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                           devices=["cuda:0"], device_memory=64_000, fuse=False, progress=False, update_on="device")
    assert all(job.device_update and job.home is None for job in result.plan.jobs)
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
    assert max(result.stats.peak_device_bytes.values()) <= 64_000
    assert result.stats.bytes_out["grads"] == 0 and result.stats.bytes_in["state"] > 0


def test_a_plan_for_gpus_predicts_with_their_measured_speed_and_link() -> None:
    """The pilot times layers on the CPU: the GPU's speed against it and its link from pinned memory are measured
    (runtime.measure.accelerator_speed) and the plan predicts with them."""
    from harmony.runtime.measure import accelerator_speed

    speed = accelerator_speed()
    assert speed is not None and speed[0] > 0 and speed[1] > 0
    forecast = harmony.plan(deep_mlp(seed=0), regression_batches(samples=64, batch=16), devices=["cuda:0"],
                            device_memory=48_000)
    assert forecast.hardware.name.endswith("its GPUs") and forecast.hardware.compute_scale != 1.0


def test_bf16_on_cuda_trains_as_a_plain_loop_under_cuda_autocast(no_leaks: None) -> None:
    model = deep_mlp(seed=0)
    reference = clones([model])[0].cuda()
    batches = regression_batches(samples=16 * 6, batch=16)
    factory = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    result = harmony.train(model, batches, nn.functional.mse_loss, factory, microbatches=2, devices=["cuda:0"],
                           device_memory=24_000, precision="bf16", progress=False)
    packs = range(len(result.packings[0].packs))
    assert len(packs) > 1 and all(result.plan.jobs[0].halved(pack) for pack in packs), "linears copied in as bf16"

    def plain(network: nn.Module, microbatches: int) -> nn.Module:
        optimizer = factory(network.parameters())
        for x, y in batches:
            optimizer.zero_grad()
            for xs, ys in zip(x.cuda().chunk(microbatches), y.cuda().chunk(microbatches)):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = nn.functional.mse_loss(network(xs), ys) * (len(xs) / len(x))
                loss.backward()
            optimizer.step()
        return network.cpu()

    micro, whole = plain(copy.deepcopy(reference), 2), plain(copy.deepcopy(reference), 1)
    noise = max((p - q).abs().max().item() for p, q in zip(micro.parameters(), whole.parameters()))
    difference = max((p - q).abs().max().item() for p, q in zip(model.parameters(), micro.parameters()))
    assert noise > 0 and difference <= 3 * noise, (difference, noise)


def test_a_dask_cuda_cluster_is_a_users_cluster_with_one_device_per_gpu(tmp_path) -> None:
    """`dask cuda worker` starts one worker per GPU, each seeing its own GPU as cuda:0: Harmony takes each worker as
    one CUDA device and trains on them as plain PyTorch would."""
    import os
    import subprocess
    import sys

    from distributed import Client

    pytest.importorskip("dask_cuda")
    port = 8950 + os.getpid() % 40
    address = f"tcp://127.0.0.1:{port}"
    processes = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                   "--port", str(port), "--dashboard-address", "127.0.0.1:0"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    processes.append(subprocess.Popen(["dask", "cuda", "worker", address, "--host", "127.0.0.1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        gpus = torch.cuda.device_count()
        with Client(address) as client:
            client.wait_for_workers(gpus, timeout=120)
        models = [deep_mlp(seed=s) for s in range(2)]
        references = clones(models)
        batches = regression_batches(samples=64, batch=16)
        factory = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
        result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, cluster=address,
                               device_memory=24_000, microbatches=2, fuse=False, progress=False)
        assert len(result.stats.peak_device_bytes) == gpus
        assert max(result.stats.peak_device_bytes.values()) <= 24_000
        for model, reference in zip(models, references):
            train_plain(reference, batches, nn.functional.mse_loss, factory)
            assert_same_weights(model, reference, rtol=1e-4, atol=1e-6)
    finally:
        stop(processes)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_pass_results_through_the_producers_page_locked_file(no_leaks: None) -> None:
    models = [deep_mlp(seed=s).double() for s in range(2)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    factory = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                           devices=["cuda:0", "cuda:1"], device_memory=60_000, mode="vpp", progress=False)
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference)
    stats = result.stats
    reads = cross_device_reads(stats.schedule)
    assert reads and stats.bytes_remote == reads * 16 * 32 * 8
    assert stats.bytes_p2p == 0, "a GPU's result crosses through its page-locked host copy, not peer to peer"


def test_a_gpu_workers_export_from_another_thread_pins_its_file_for_its_own_gpu(pinned_store: HostStore) -> None:
    import threading

    from harmony.runtime.peer import Outbox

    device = torch.device(f"cuda:{torch.cuda.device_count() - 1}")
    outbox = Outbox(pinned_store, 0, device)
    shipped = []
    thread = threading.Thread(target=lambda: shipped.append(outbox.export("fwd-m0-p0-s0-a", [torch.ones(256)])))
    thread.start()
    thread.join()
    assert pinned_store.pinned(shipped[0].name)
    assert torch.equal(shipped[0].unpack(pinned_store)[0].to(device), torch.ones(256, device=device))
    outbox.release_all()


@pytest.mark.parametrize("case", ["swapped", "homed", "fused"])
def test_schedules_and_clipping_on_cuda_match_plain_pytorch(case: str, no_leaks: None) -> None:
    """lr_schedule and clip_grad_norm on a GPU: a swapped model's updates on the host after its whole backward, a
    homed model's and a homed fused array's on the device (norms and coefficients computed there); in float64
    within 1e-9 of plain LambdaLR and clip_grad_norm_, and the recorded norms are those clip_grad_norm_ returned."""
    models = [deep_mlp(seed=s).double() for s in range(2)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    schedule = lambda step: min(1.0, (step + 1) / 2) * 0.8**step  # noqa: E731
    clips = (0.05, 0.2)
    options = {"swapped": {"device_memory": 64_000, "fuse": False}, "homed": {"fuse": False},
               "fused": {"fuse": True}}[case]
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, microbatches=2,
                           devices=["cuda:0"], lr_schedule=schedule, clip_grad_norm=list(clips), progress=False,
                           **options)
    assert all((job.home is None) == (case == "swapped") for job in result.plan.jobs)
    assert (result.arrays == [[0, 1]]) == (case == "fused")
    for index, (model, reference, clip) in enumerate(zip(models, references, clips)):
        _, norms = train_plain_scheduled(reference, batches, factory, 2, clip=clip,
                                         scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                                                                       schedule))
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
        assert result.grad_norms[index] == pytest.approx(norms, rel=1e-9)
