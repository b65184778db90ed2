"""A swapped pack's update on the host store: applied once, by version, into the other slot, its state kept there."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.files import Versions, grads_name, slot_bytes, versions_name, weights_name, weights_slot
from harmony.runtime.hoststore import HostStore, tensors_at
from harmony.runtime.optimizer import PackOptimizer, update
from harmony.runtime.optimstate import OptimizerState
from harmony.runtime.skeleton import dump_skeleton
from harmony.runtime.spec import PackRuntime
from harmony.tasks.layout import TensorSpec, lay_out


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
def test_a_packs_updates_alternate_slots_keep_their_state_in_the_store_and_apply_once(
    store: HostStore, factory
) -> None:
    """Each step as another worker would take it up (a fresh optimizer), each update written into the other slot
    and published by version; an update run again (its worker died after it) changes nothing."""
    module = nn.Sequential(nn.Linear(3, 2))
    reference = copy.deepcopy(module)
    runtime = _pack_runtime(module)
    mapped = store.create(weights_name(0, 0), 2 * slot_bytes(runtime.weights.nbytes))
    host_g = store.create(grads_name(0, 0), runtime.grads.nbytes)
    versions = Versions(store.create(versions_name(0), 8))
    for slot in (0, 1):
        for name, view in tensors_at(weights_slot(mapped, slot, runtime.weights.nbytes), runtime.weights).items():
            view.copy_(dict(module.named_parameters())[name].detach())
    ref_opt = factory(reference.parameters())
    torch.manual_seed(0)

    def weights(slot: int) -> torch.Tensor:
        return weights_slot(mapped, slot, runtime.weights.nbytes)

    def optimizer(slot: int) -> PackOptimizer:
        return PackOptimizer(factory, weights(slot), host_g, runtime, OptimizerState(store, 0, 0))

    for step in range(4):
        grads = [torch.randn_like(p) for p in reference.parameters()]
        for p, g in zip(reference.parameters(), grads):
            p.grad = g.clone()
        ref_opt.step()
        for view, g in zip(tensors_at(host_g, runtime.grads).values(), grads):
            view.copy_(g)
        assert update(runtime, versions, 0, step, weights, optimizer, [])
        assert not update(runtime, versions, 0, step, weights, optimizer, []), "applied twice"
        assert versions.current(0) == (step + 1, (step + 1) % 2)
    _, slot = versions.current(0)
    for (name, p) in reference.named_parameters():
        torch.testing.assert_close(tensors_at(weights(slot), runtime.weights)[name], p.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="came before"):
        update(runtime, versions, 0, 6, weights, optimizer, [])


def test_a_task_writes_what_it_computed_for_a_step_only_before_its_update_and_from_files_still_its_own(
    store: HostStore,
) -> None:
    """What a fwd or bwd task writes into the host store for a step (gradients, running statistics, losses) is
    written under the pack's lock while the pack is at that step's version; a task that read a file given another use
    since (an earlier attempt of a span run again, its inputs released under it) writes nothing and fails."""
    import types

    from harmony.runtime.shipping import BatchFiles, StaleBatch
    from harmony.runtime.worker import RunContext

    store.create(weights_name(0, 0), 64)
    versions = Versions(store.create(versions_name(0), 8))
    versions.publish(0, 3, 1)
    files = BatchFiles(store)
    read = files.ship([torch.ones(4)])
    task = types.SimpleNamespace(store=store, files=[read], versions=lambda model: versions)
    with RunContext.writing(task, 0, 0, 3) as current:  # type: ignore[arg-type]
        assert current
    with RunContext.writing(task, 0, 0, 2) as current:  # type: ignore[arg-type]
        assert not current, "the update of step 2 is applied: a step run again writes none of it"
    files.release(read)
    files.ship([torch.zeros(4)])
    with pytest.raises(StaleBatch), RunContext.writing(task, 0, 0, 3):  # type: ignore[arg-type]
        pytest.fail("a task whose input file was given another use wrote into the host store")


def test_host_updates_use_the_fused_cpu_kernel_unless_the_factory_chose_an_implementation() -> None:
    from harmony.runtime.optimizer import fused_on_host

    def built(factory: object) -> torch.optim.Optimizer:
        optimizer = factory([nn.Parameter(torch.randn(3))])  # type: ignore[operator]
        fused_on_host(optimizer)
        return optimizer

    assert built(lambda p: torch.optim.Adam(p, lr=0.1)).param_groups[0]["fused"] is True
    assert built(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)).param_groups[0]["fused"] is True
    assert built(lambda p: torch.optim.Adam(p, lr=0.1, foreach=False)).param_groups[0]["fused"] is None
    assert built(lambda p: torch.optim.Adam(p, lr=0.1, fused=False)).param_groups[0]["fused"] is False
    assert "fused" not in built(lambda p: torch.optim.RMSprop(p, lr=0.1)).param_groups[0]


def assert_alike(trained: nn.Module, same: nn.Module, reference: nn.Module) -> None:
    """trained equals same bit for bit, and plain PyTorch's reference in float64 up to reassociation."""
    for (name, a), b, c in zip(trained.state_dict().items(), same.state_dict().values(),
                               reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def _batchnormed_mlp(seed: int) -> nn.Sequential:
    """A 12-layer MLP with batch norm in it (running statistics written beside the updates); the layer before it
    has no bias, whose gradient would be rounding noise that Adam turns into lr-sized steps."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for index in range(6):
        layers += [nn.Linear(32, 32, bias=index != 2), nn.BatchNorm1d(32) if index == 2 else nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(32, 4)).double()


def test_overlapped_updates_give_the_weights_of_updates_in_backward_and_of_plain_pytorch(no_leaks: None) -> None:
    """Updates beside the device (upd tasks on a host thread) equal updates in bwd bit for bit, and plain PyTorch
    in float64 (whole batches: batch norm's statistics are per micro-batch); the run has upd tasks only when
    overlapped."""
    import harmony
    from tests.conftest import regression_batches, train_plain

    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * 6, batch=16)]
    trained = {}
    for overlap in (True, False):
        models = [_batchnormed_mlp(seed) for seed in range(2)]
        result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory,
                               devices=["cpu", "cpu"], device_memory=60_000, progress=False, fuse=False,
                               overlap_update=overlap)
        assert all(len(packing.packs) > 2 and job.overlap == overlap
                   for packing, job in zip(result.packings, result.plan.jobs))
        keys = [key for keys in result.stats.schedule.values() for key in keys]
        assert any(key.startswith("upd-") for key in keys) == overlap
        for device, peak in result.stats.peak_device_bytes.items():
            assert peak <= 60_000, f"{device} peaked at {peak:,} bytes"
        trained[overlap] = models
    for seed, (beside, inline) in enumerate(zip(trained[True], trained[False])):
        reference = _batchnormed_mlp(seed)
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_alike(beside, inline, reference)


class Signal(nn.Module):
    """An identity layer that, run with gradients on (a bwd task's recompute), leaves a file behind."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            open(self.path, "a").close()
        return x


class WaitingSGD(torch.optim.SGD):
    """SGD whose steps of the model's last layer wait for a Signal's file: they finish only if the backward of an
    earlier pack runs while they wait (an update that blocked its device would wait out WAIT seconds and fail)."""

    WAIT = 60.0

    def __init__(self, params: object, path: str) -> None:
        super().__init__(params, lr=0.05)  # type: ignore[arg-type]
        self.path = path

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        import os
        import time

        last = any(tuple(p.shape) == (4, 32) for group in self.param_groups for p in group["params"])
        deadline = time.monotonic() + self.WAIT
        while last and not os.path.exists(self.path):
            if time.monotonic() > deadline:
                raise RuntimeError("the update waited for a backward that never ran: it blocked its device")
            time.sleep(0.01)
        super().step()


def test_an_overlapped_update_runs_while_its_device_goes_on_with_the_backward_of_earlier_packs(
    tmp_path, no_leaks: None
) -> None:
    """The last pack's update waits until the device has run an earlier pack's backward: only an update beside the
    device's task thread lets that happen (in the bwd task it would wait for itself)."""
    import harmony
    from tests.conftest import deep_mlp, regression_batches, train_plain

    signal = str(tmp_path / "backward-ran")
    layers = list(deep_mlp(seed=0))
    model = nn.Sequential(*layers[:2], Signal(signal), *layers[2:])
    reference = copy.deepcopy(model)
    factory = lambda p: WaitingSGD(p, signal)  # noqa: E731
    batches = regression_batches(samples=16 * 3, batch=16)
    result = harmony.train([model], batches, loss_fn=nn.functional.mse_loss, optimizer=factory, devices=["cpu"],
                           device_memory=24_000, progress=False, overlap_update=True)
    assert len(result.packings[0].packs) > 2 and not result.failed
    train_plain(reference, batches, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.05))
    for a, b in zip(model.state_dict().values(), reference.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_updates_on_the_device_give_the_weights_of_host_updates_and_of_plain_pytorch(no_leaks: None) -> None:
    """update_on="device": every swapped pack's bwd steps Adam on its device, with the host store's kernel on a CPU
    device, so the weights equal host updates' bit for bit, and plain PyTorch's in float64. The link carries the
    state in (from the second step) and out, and the weights out instead of the gradients; the budget holds."""
    import harmony
    from tests.conftest import regression_batches, train_plain

    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    steps = 6
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * steps, batch=16)]
    trained, stats = {}, {}
    for update_on in ("device", "host"):
        models = [_batchnormed_mlp(seed) for seed in range(2)]
        result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factory,
                               devices=["cpu", "cpu"], device_memory=60_000, progress=False, fuse=False,
                               update_on=update_on, overlap_update=False)
        assert all(len(packing.packs) > 2 and job.device_update == (update_on == "device")
                   for packing, job in zip(result.packings, result.plan.jobs))
        for device, peak in result.stats.peak_device_bytes.items():
            assert peak <= 60_000, f"{device} peaked at {peak:,} bytes"
        trained[update_on], stats[update_on] = models, result.stats
    trainable = sum(pack.grad_bytes for packing in result.packings for pack in packing.packs)
    assert stats["host"].bytes_out["grads"] == steps * trainable and stats["host"].bytes_out["weights"] == 0
    assert stats["device"].bytes_out["grads"] == 0 and stats["device"].bytes_out["weights"] == steps * trainable
    assert stats["device"].bytes_in["state"] == (steps - 1) * 2 * trainable, "Adam's two moments, from step 2"
    assert stats["device"].bytes_out["state"] == steps * 2 * trainable
    assert stats["host"].bytes_in["state"] == stats["host"].bytes_out["state"] == 0
    for seed, (there, here) in enumerate(zip(trained["device"], trained["host"])):
        reference = _batchnormed_mlp(seed)
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_alike(there, here, reference)


def test_a_fused_array_and_a_model_tied_across_packs_update_on_their_device_as_plain_pytorch(
    no_leaks: None
) -> None:
    """The pack that borrows a tied weight still sends that weight's gradient to its lender's pack, which steps it on
    its device; an array's stacked optimizer steps there too. Both against plain PyTorch in float64."""
    import harmony
    from tests.conftest import TiedEnds, assert_same_weights, clones, deep_mlp, regression_batches, train_plain

    rates = [1e-3, 3e-3, 1e-2]
    factories = [lambda p, lr=lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.1) for lr in rates]
    momentum = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * 5, batch=16)]
    members = [deep_mlp(depth=4, seed=seed).double() for seed in range(3)]
    tied = TiedEnds().double()
    references = clones([*members, tied])
    fused = harmony.train(members, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, devices=["cpu"],
                          device_memory=150_000, fuse=True, progress=False, update_on="device")
    alone = harmony.train(tied, batches, loss_fn=nn.functional.mse_loss, optimizer=momentum, devices=["cpu"],
                          device_memory=60_000, progress=False, update_on="device")
    assert fused.arrays == [[0, 1, 2]] and not fused.homes and not alone.homes
    assert fused.plan.jobs[0].device_update and alone.plan.jobs[0].device_update
    assert len(fused.packings[0].packs) > 1
    assert any(pack.borrowed for pack in alone.packings[0].packs), "the tie must span packs"
    assert alone.stats.bytes_out["grads"] > 0 and fused.stats.bytes_out["grads"] == 0
    for model, reference, factory in zip([*members, tied], references, [*factories, momentum]):
        train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
    assert tied.last.weight is tied.first.weight


def test_packs_whose_state_does_not_fit_update_on_the_host_beside_packs_updated_on_the_device(
    no_leaks: None,
) -> None:
    """The wide middle packs' Adam state does not fit beside them; the narrow end packs' does. Those update on the
    device, the others on the host store, in one run: the weights equal an all-host run's bit for bit and plain
    PyTorch's in float64, and only the host-updated packs' gradients leave the device."""
    import harmony
    from tests.conftest import regression_batches, train_plain

    def net() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 96), nn.Tanh(), nn.Linear(96, 32),
                             nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).double()

    factory = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    steps = 4
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * steps, batch=16)]
    trained = {}
    for update_on in ("device", "host"):
        model = net()
        result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, devices=["cpu"],
                               device_memory=100_000, microbatches=4, packs_per_task=1, progress=False,
                               update_on=update_on)
        trained[update_on] = (model, result)
    model, result = trained["device"]
    job, packs = result.plan.jobs[0], result.packings[0].packs
    assert job.home is None and len(packs) == 4 and job.device_updates == (0, 3)
    assert "updates on the device for 2 of its packs" in str(harmony.plan(
        net(), batches, optimizer=factory, devices=["cpu"], device_memory=100_000, microbatches=4, packs_per_task=1,
        update_on="device"))
    assert result.stats.bytes_out["grads"] == steps * (packs[1].grad_bytes + packs[2].grad_bytes)
    assert result.stats.bytes_out["state"] == steps * 2 * (packs[0].grad_bytes + packs[3].grad_bytes)
    assert max(result.stats.peak_device_bytes.values()) <= 100_000
    reference = net()
    train_plain(reference, batches, nn.functional.mse_loss, factory)
    assert_alike(model, trained["host"][0], reference)
