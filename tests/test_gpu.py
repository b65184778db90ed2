"""The CUDA device path: pinned host store, copy stream and events, exactness and budget; skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import harmony
from harmony.runtime.cache import DeviceCache
from harmony.runtime.counters import BLOCK_BYTES, Counters
from harmony.runtime.hoststore import HostStore
from tests.conftest import assert_same_weights, clones, deep_mlp, regression_batches, train_plain

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
    assert result.stats.bytes_prefetched > 0, "weights were swapped in without the copy stream"


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
