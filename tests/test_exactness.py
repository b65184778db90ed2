"""End to end through harmony.train: same weights and losses as plain PyTorch, within the device budget."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import harmony
from tests.conftest import (
    FlattenedTokens,
    ResidualNet,
    assert_same_weights,
    clones,
    deep_mlp,
    param_bytes,
    regression_batches,
    torch_threads,
    train_plain,
    train_plain_seeded,
)

FACTORIES = [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.99)),
    lambda p: torch.optim.AdamW(p, lr=2e-3, weight_decay=0.1),
]
STEPS = 8
MICROBATCHES = 4
BUDGET = 24_000


def three_models() -> list[nn.Module]:
    return [deep_mlp(seed=seed) for seed in range(3)]


def test_the_budget_is_under_half_a_model() -> None:
    assert param_bytes(deep_mlp()) / 2 > BUDGET


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["1-device", "2-devices"])
def test_shared_loader_matches_plain_pytorch(devices: list[str], no_leaks: None) -> None:
    models = three_models()
    references = clones(models)
    batches = regression_batches(samples=16 * STEPS, batch=16)
    result = harmony.train(
        models,
        batches,
        loss_fn=nn.functional.mse_loss,
        optimizer=FACTORIES,
        microbatches=MICROBATCHES,
        devices=devices,
        device_memory=BUDGET,
        progress=False,
    )
    assert result.stats.steps == [STEPS] * 3
    assert all(len(packing.packs) > 2 for packing in result.packings)
    for index, (reference, factory) in enumerate(zip(references, FACTORIES)):
        losses = train_plain(reference, batches, nn.functional.mse_loss, factory)
        assert result.models[index] is models[index]
        assert_same_weights(models[index], reference)
        torch.testing.assert_close(torch.tensor(result.history[index]), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    assert set(result.stats.peak_device_bytes) == {f"cpu-{i}" for i in range(len(devices))}
    for device, peak in result.stats.peak_device_bytes.items():
        assert 0 < peak <= BUDGET, f"{device} peaked at {peak} bytes over its {BUDGET}-byte budget"
    assert result.stats.reserved_device_bytes == {}, "a CPU device's memory is its accounting's alone"
    assert result.dashboard_link and result.dashboard_link.startswith("http")


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["1-device", "2-devices"])
def test_per_model_loaders_match_plain_pytorch(devices: list[str], no_leaks: None) -> None:
    models = three_models()
    references = clones(models)
    loaders = []
    for seed in range(3):
        batches = regression_batches(samples=16 * STEPS // 2, batch=16, seed=10 + seed)
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        generator = torch.Generator().manual_seed(seed)
        loaders.append(DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=generator))
    result = harmony.train(
        models,
        loaders,
        loss_fn=nn.functional.mse_loss,
        optimizer=FACTORIES,
        steps=STEPS,
        microbatches=MICROBATCHES,
        devices=devices,
        device_memory=BUDGET,
        progress=False,
    )
    assert result.stats.steps == [STEPS] * 3
    for index, (reference, factory) in enumerate(zip(references, FACTORIES)):
        loaders[index].generator.manual_seed(index)
        losses = train_plain(reference, list(loaders[index]) + list(loaders[index]), nn.functional.mse_loss, factory)
        assert_same_weights(models[index], reference)
        torch.testing.assert_close(torch.tensor(result.history[index]), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    for peak in result.stats.peak_device_bytes.values():
        assert 0 < peak <= BUDGET


class DoublesItsInputInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


def test_a_model_that_writes_its_input_in_place_reads_each_batch_as_loaded(no_leaks: None) -> None:
    """Batch files are recycled and mapped shared by the workers: the model must get a copy. Swapped, pack 0's
    input is read twice a step (fwd, then bwd's recompute), so a write through to the file would show."""
    model = nn.Sequential(DoublesItsInputInPlace(), *deep_mlp())
    reference = clones([model])[0]
    batches = regression_batches(samples=16 * STEPS, batch=16)
    loaded = [(x.clone(), y.clone()) for x, y in batches]
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=FACTORIES[0],
                           microbatches=2, devices=["cpu"], device_memory=BUDGET, progress=False)
    assert len(result.packings[0].packs) > 2
    for (x, y), (x_loaded, y_loaded) in zip(batches, loaded):
        assert torch.equal(x, x_loaded) and torch.equal(y, y_loaded), "Harmony never writes the user's batches"
    losses = train_plain(reference, [(x.clone(), y.clone()) for x, y in loaded], nn.functional.mse_loss, FACTORIES[0])
    assert_same_weights(model, reference)
    torch.testing.assert_close(torch.tensor(result.history[0]), torch.tensor(losses), rtol=1e-5, atol=1e-7)


def dropout_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64), nn.Tanh(),
                         nn.Dropout(0.3), nn.Linear(64, 4))


def test_dropout_draws_from_each_models_own_stream_as_documented(no_leaks: None) -> None:
    """Each (model, layer, step, micro-batch) draws its dropout masks from a stream seeded by those four alone
    (runtime.seeding), wherever and whenever its task runs: a plain loop that seeds the same way gives the same
    weights. The pilot found the two dropout layers of the chain as the ones that draw."""
    models = [dropout_mlp(0), dropout_mlp(1)]
    references = clones(models)
    batches = regression_batches(samples=48, batch=12)
    sgd = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    result = harmony.train(models, batches, nn.functional.mse_loss, sgd, microbatches=2, devices=["cpu", "cpu"],
                           fuse=False, mode="free", progress=False)
    assert all(len(packing.packs) == 1 for packing in result.packings)
    for index, reference in enumerate(references):
        drawing = result.packing_of(index).packs[0].drawing
        assert drawing == (2, 5)
        train_plain_seeded(reference, batches, sgd(reference.parameters()), result.job_of(index), drawing, 2)
        assert_same_weights(models[index], reference)


def test_dropout_masks_do_not_depend_on_the_plan(steady_pilot: None, no_leaks: None) -> None:
    """Where the chain is cut into packs, homed or swapped, one device or two, one micro-batch group or two (vDP):
    the plan follows the pilot's measured times, which differ from run to run, and the masks must not. In float64,
    each run gives the weights of the plain loop that seeds as runtime.seeding says, within 1e-9. The pilot's
    timings are pinned so that the budgets below cut the chain three ways."""
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=48, batch=12)]
    sgd = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    swapped = {"resident": False, "mode": "vpp"}
    for name, devices, kwargs, cuts in (
            ("homed", ["cpu"], {"mode": "free"}, [0]),
            ("three packs", ["cpu"], {"device_memory": 106_000, **swapped}, [0, 3, 4]),
            ("three other packs", ["cpu"], {"device_memory": 115_000, **swapped}, [0, 3, 6]),
            ("two packs on two devices", ["cpu", "cpu"], {"device_memory": 125_000, **swapped}, [0, 3]),
            ("two micro-batch groups", ["cpu", "cpu"], {"mode": "vdp"}, [0])):
        model = dropout_mlp(3).double()
        reference = clones([model])[0]
        result = harmony.train(model, batches, nn.functional.mse_loss, sgd, microbatches=4, devices=devices,
                               progress=False, **kwargs)
        job = result.plan.jobs[0]
        assert [pack.first for pack in job.packing.packs] == cuts, name
        assert ((job.home is not None), job.groups) == (name == "homed", 2 if "groups" in name else 1), name
        train_plain_seeded(reference, batches, sgd(reference.parameters()), 0, (2, 5), microbatches=4)
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("packs_per_task", [1, 5, 64], ids=["one-pack", "five-packs", "every-pack"])
def test_tasks_of_several_packs_give_plain_pytorchs_weights_within_the_budget(
    packs_per_task: int, no_leaks: None
) -> None:
    """A task may run several consecutive packs, swapping them in one after the other: in float64 with Adam on two
    devices, 2 micro-batches, the weights are plain PyTorch's within 1e-9, each device's peak within its budget, and
    a step has one fwd and one bwd task per section (the last has none of its own fwd)."""
    models = [deep_mlp(seed=seed).double() for seed in range(2)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * STEPS, batch=16)]
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    budget = 2 * BUDGET
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=adam, microbatches=2,
                           devices=["cpu", "cpu"], device_memory=budget, fuse=False, packs_per_task=packs_per_task,
                           progress=False)
    for job, packing in zip(result.plan.jobs, result.packings):
        assert len(packing.packs) > 5 and job.home is None
        assert job.section_count == -(-len(packing.packs) // packs_per_task)
    keys = [key for keys in result.stats.schedule.values() for key in keys]
    for model, job in enumerate(result.plan.jobs):
        for kind, count in (("fwd", job.section_count - 1), ("bwd", job.section_count)):
            assert sum(key.startswith(f"{kind}-m{model}-") for key in keys) == count * STEPS
    for device, peak in result.stats.peak_device_bytes.items():
        assert 0 < peak <= budget, f"{device} peaked at {peak:,} bytes over its {budget:,}-byte budget"
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, adam)
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)


def test_inside_a_section_a_gradient_handed_on_and_kept_never_crosses_the_link(no_leaks: None) -> None:
    """A pack's input gradient for the pack before it in the same task stays on the device, copied out only where it
    is not kept or is evicted (DeviceCache.hand_on). With room for every boundary, the whole pass as one task copies
    out the inputs of packs 1 to P-2 that its forward took from the device and its backward reads again (P-2
    boundaries a micro-batch), where one pack a task copies out every output and every input gradient (2(P-1)); the
    weights are the same bit for bit, and plain PyTorch's within 1e-9."""
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * STEPS, batch=16)]
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    trained, copied = [], []
    for packs_per_task in (1, 64):
        model = deep_mlp(seed=4).double()
        result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=adam, microbatches=2,
                               devices=["cpu"], device_memory=3 * BUDGET, resident=False, fuse=False,
                               packs_per_task=packs_per_task, stash=False, progress=False)
        assert len(result.packings[0].packs) > 5 and result.plan.jobs[0].section_count == (
            len(result.packings[0].packs) if packs_per_task == 1 else 1)
        trained.append(model)
        copied.append(result.stats.bytes_out["activations"])
        packs = len(result.packings[0].packs)
    boundary = STEPS * 2 * 8 * 32 * 8  # every step's 2 micro-batches of 8 samples, 32 float64 values each
    assert copied == [2 * (packs - 1) * boundary, (packs - 2) * boundary], copied
    for a, b in zip(trained[0].parameters(), trained[1].parameters()):
        assert torch.equal(a, b)
    reference = deep_mlp(seed=4).double()
    train_plain(reference, batches, nn.functional.mse_loss, adam)
    assert_same_weights(trained[1], reference, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("packs_per_task", [1, 64], ids=["one-pack", "whole-pass"])
def test_values_copied_ahead_and_sent_behind_over_a_link_give_the_same_weights(packs_per_task: int,
                                                                               no_leaks: None) -> None:
    """Over a simulated link, prefetch=True copies each micro-batch's values in while the one before it computes and
    its outputs out while the next one computes (DeviceCache.ahead, send), where prefetch="weights" copies them as
    they are read. Float64, Adam, 4 micro-batches: the weights are the same bit for bit and plain PyTorch's within
    1e-9, the device stays within its budget; not all that comes in came ahead (a first micro-batch's values, the
    model's inputs among them, come in as it starts); with one pack a task (stash off) every output and input
    gradient goes out behind, with the whole pass as one task (stash on) a value handed on to the next pack leaves
    only where it is not kept, behind the compute, and the inputs its backward reads again are copied out at once,
    before the forward that may change them."""
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * STEPS, batch=16)]
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    trained, stats = [], []
    for prefetch in (True, "weights"):
        model = deep_mlp(seed=5).double()
        result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=adam, microbatches=4,
                               devices=["cpu"], device_memory=3 * BUDGET, resident=False, fuse=False,
                               packs_per_task=packs_per_task, stash=packs_per_task > 1, link_bandwidth="2GB/s",
                               prefetch=prefetch, progress=False)
        assert len(result.packings[0].packs) > 5
        trained.append(model)
        stats.append(result.stats)
        assert max(result.stats.peak_device_bytes.values()) <= 3 * BUDGET
    ahead, weights_only = stats
    came_in = ahead.bytes_in["activations"] + ahead.bytes_in["inputs"]
    assert 0 < ahead.bytes_ahead < came_in, (ahead.bytes_ahead, came_in)
    if packs_per_task == 1:
        assert ahead.bytes_behind == ahead.bytes_out["activations"] > 0
    else:
        assert 0 < ahead.bytes_behind < ahead.bytes_out["activations"]
    assert weights_only.bytes_ahead == weights_only.bytes_behind == 0
    for a, b in zip(trained[0].parameters(), trained[1].parameters()):
        assert torch.equal(a, b)
    reference = deep_mlp(seed=5).double()
    train_plain(reference, batches, nn.functional.mse_loss, adam)
    assert_same_weights(trained[0], reference, rtol=1e-9, atol=1e-12)


def test_tasks_of_several_packs_draw_the_dropout_masks_and_keep_the_statistics_of_one_pack_tasks(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropout masks are drawn per pack and batch norm's running statistics written per pack, so sections change
    nothing: the weights and buffers equal those of one pack per task, bit for bit, on a device of one thread (one
    of several may choose one thread for short tasks and all for long ones, runtime.threads, and batch norm's sums
    round by the threads that make them)."""
    monkeypatch.setattr("harmony.runtime.devices.threads_per_device", lambda cpus, devices: 1)
    def model() -> nn.Sequential:
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64),
                             nn.Tanh(), nn.Dropout(0.3), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 4))

    batches = regression_batches(samples=48, batch=12)
    trained = []
    for packs_per_task in (1, 2, 5):  # a section in the middle; the whole pass (its first forward in bwd)
        network = model()
        result = harmony.train(network, batches, nn.functional.mse_loss, FACTORIES[1], microbatches=2,
                               devices=["cpu"], device_memory=75_000, packs_per_task=packs_per_task, progress=False)
        assert len(result.packings[0].packs) == 5
        trained.append(network)
    for other in trained[1:]:
        for (name, a), b in zip(trained[0].state_dict().items(), other.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_compiled_packs_give_plain_pytorchs_weights_and_their_recompute_draws_the_same_dropout_masks(
    no_leaks: None
) -> None:
    """compile=True runs each pack through torch.compile: in float64 a swapped model equals plain PyTorch within 1e-9,
    and one with dropout equals its eager run (a recompute drawing other masks than its forward, as it did when
    inductor's settings were its module's config, which a task's thread does not see, would be far off)."""
    def dropped(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 32), nn.Tanh(),
                             nn.Dropout(0.3), nn.Linear(32, 4)).double()

    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=48, batch=12)]
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    trained = {}
    for compiled in (True, False):
        models = [deep_mlp(depth=4, seed=0).double(), dropped(1)]
        references = clones(models)
        result = harmony.train(models, batches, nn.functional.mse_loss, adam, microbatches=2, devices=["cpu"],
                               device_memory=50_000, packs_per_task=1, resident=False, fuse=False, compile=compiled,
                               progress=False)
        assert [len(packing.packs) for packing in result.packings] == [4, 3]  # dropout's masks count: 3 packs
        trained[compiled] = models
    train_plain(references[0], batches, nn.functional.mse_loss, adam)
    assert_same_weights(trained[True][0], references[0], rtol=1e-9, atol=1e-12)
    assert_same_weights(trained[True][1], trained[False][1], rtol=1e-9, atol=1e-12)
    assert not bitwise_equal(trained[True][0], trained[False][0]), "compiled kernels round otherwise: it ran compiled"


def test_a_compiled_homed_model_draws_plain_pytorchs_dropout_masks(no_leaks: None) -> None:
    """compile=True on a model homed on its device (one pack, its whole state there): in float64 with dropout, the
    weights of a plain loop that seeds each micro-batch as documented, within 1e-9 (inductor's own generator, which a
    compile in a task's thread used when its setting was the module's config, draws other masks: far off)."""
    model = dropout_mlp(0).double()
    reference = clones([model])[0]
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=48, batch=12)]
    sgd = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    result = harmony.train(model, batches, nn.functional.mse_loss, sgd, microbatches=2, devices=["cpu"],
                           compile=True, progress=False)
    assert result.homes and len(result.packings[0].packs) == 1
    train_plain_seeded(reference, batches, sgd(reference.parameters()), 0, (2, 5), microbatches=2)
    assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
    assert not bitwise_equal(model, reference), "compiled kernels round otherwise: the model ran compiled"


def test_a_compiled_fused_array_gives_plain_pytorchs_weights_and_validation_losses(no_leaks: None) -> None:
    """compile=True with fusion: two models fused into one array, swapped in packs, compiled (training, recompute
    and evaluation variants), in float64: each member's weights and validation losses are a plain loop's within
    1e-9, and differ from it bit for bit (the kernels ran compiled)."""
    models = [deep_mlp(depth=3, seed=seed).double() for seed in (0, 1)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=48, batch=12)]
    adam = lambda p: torch.optim.Adam(p, lr=1e-2)  # noqa: E731
    result = harmony.train(models, batches, nn.functional.mse_loss, adam, microbatches=2, devices=["cpu"],
                           device_memory=120_000, fuse=True, resident=False, compile=True, val_loaders=batches[:2],
                           progress=False)
    assert [job.members for job in result.plan.jobs] == [(0, 1)] and len(result.packings[0].packs) > 1
    for model, reference, history in zip(models, references, result.val_history, strict=True):
        train_plain(reference, batches, nn.functional.mse_loss, adam)
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
        assert not bitwise_equal(model, reference), "compiled kernels round otherwise: the array ran compiled"
        with torch.no_grad():
            plain = sum(nn.functional.mse_loss(reference(x), y).item() * len(x) for x, y in batches[:2]) / 24
        torch.testing.assert_close(history[-1][1], plain, rtol=1e-9, atol=0)


def bitwise_equal(model: nn.Module, other: nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))


def test_a_model_that_is_not_a_chain_trains_in_packs_under_a_third_of_its_size(no_leaks: None) -> None:
    """Traced and cut between its blocks (runtime.stages), under a budget of a third of its parameter bytes, on two
    devices, in float64 with Adam: equal to plain PyTorch within 1e-9, the user's module trained in place."""
    torch.manual_seed(0)
    model = ResidualNet().double()
    reference = clones([model])[0]
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=64, batch=16)]
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    budget = param_bytes(model) // 3
    result = harmony.train(model, batches, nn.functional.mse_loss, adam, devices=["cpu", "cpu"],
                           device_memory=budget, microbatches=2, progress=False)
    assert len(result.packings[0].packs) >= 3
    assert max(result.stats.peak_device_bytes.values()) <= budget
    losses = train_plain(reference, batches, nn.functional.mse_loss, adam)
    assert_same_weights(model, reference, rtol=0, atol=1e-9)
    assert result.history[0] == pytest.approx(losses, abs=1e-9)


def test_a_model_whose_cuts_carry_its_sizes_as_integers_trains_in_packs(no_leaks: None) -> None:
    """A model torch.export cuts (FlattenedTokens: past its first block the batch and length cross every cut as
    integers beside the flattened tokens) is cut there too: more than the two packs its tensor-only cuts allow, on
    two devices. In float64 with Adam its weights and validation losses equal plain PyTorch's within 1e-9."""
    torch.manual_seed(0)
    model = FlattenedTokens(width=64, blocks=6, outputs=4).double()
    reference = clones([model])[0]
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(32, 5, 64, generator=generator, dtype=torch.float64)
    y = torch.randn(32, 5, 4, generator=generator, dtype=torch.float64)
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    budget = 200_000
    assert budget < param_bytes(model)
    result = harmony.train(model, batches, nn.functional.mse_loss, adam, devices=["cpu", "cpu"],
                           device_memory=budget, microbatches=2, resident=False, val_loaders=batches[:2],
                           progress=False)
    assert len(result.packings[0].packs) >= 3
    train_plain(reference, batches, nn.functional.mse_loss, adam)
    assert_same_weights(model, reference, rtol=0, atol=1e-9)
    with torch.no_grad():
        plain = sum(nn.functional.mse_loss(reference(x), y).item() * len(x) for x, y in batches[:2]) / 16
    torch.testing.assert_close(result.val_history[0][-1][1], plain, rtol=1e-9, atol=0)


def test_torchvisions_vit_trains_in_packs_under_a_third_of_its_size(no_leaks: None) -> None:
    """torchvision's VisionTransformer (12 encoder layers) is cut between its encoder layers by tracing; it trains
    on two devices under a third of its parameter bytes, in micro-batches of two images (an attention stage keeps
    its probabilities for its backward: one of more would not fit), and equals plain PyTorch in float64 within
    1e-9."""
    vision = pytest.importorskip("torchvision.models.vision_transformer")
    torch.manual_seed(0)
    model = vision.VisionTransformer(image_size=16, patch_size=4, num_layers=12, num_heads=2, hidden_dim=32,
                                     mlp_dim=64, num_classes=4).double()
    reference = clones([model])[0]
    generator = torch.Generator().manual_seed(3)
    images = torch.randn(32, 3, 16, 16, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 4, (32,), generator=generator)
    batches = [(images[i : i + 8], labels[i : i + 8]) for i in range(0, 32, 8)]
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    budget = param_bytes(model) // 3
    result = harmony.train(model, batches, nn.functional.cross_entropy, adam, devices=["cpu", "cpu"],
                           device_memory=budget, microbatches=4, progress=False)
    assert len(result.packings[0].packs) >= 3
    assert max(result.stats.peak_device_bytes.values()) <= budget
    train_plain(reference, batches, nn.functional.cross_entropy, adam)
    assert_same_weights(model, reference, rtol=0, atol=1e-9)


def narrow_resnet50(divisor: int = 4, classes: int = 4) -> nn.Module:
    """torchvision's ResNet-50 (Bottleneck, 3-4-6-3 blocks) with every block's width divided by divisor."""
    resnet = pytest.importorskip("torchvision.models.resnet")

    class NarrowResNet50(resnet.ResNet):
        def __init__(self) -> None:
            super().__init__(resnet.Bottleneck, [3, 4, 6, 3], num_classes=classes)
            self.fc = nn.Linear(512 * resnet.Bottleneck.expansion // divisor, classes)

        def _make_layer(self, block: type, planes: int, blocks: int, stride: int = 1,
                        dilate: bool = False) -> nn.Sequential:
            return super()._make_layer(block, planes // divisor, blocks, stride, dilate)

    return NarrowResNet50()


def test_a_resnet50_is_cut_inside_its_largest_bottlenecks_and_trains_under_half_its_size(
    no_leaks: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A layer4 bottleneck and its gradients alone fill half the model's bytes: packs are cut inside it, at
    boundaries that carry the residual beside the branch. On two devices, float64, Adam, batch norm in training
    mode: the weights and running statistics equal plain PyTorch's within 3x what plain PyTorch itself moves between
    one and two threads (Adam turns reassociation on the gradients of a convolution followed by batch norm into
    lr-sized steps), measured here; and within the budget."""
    torch.manual_seed(0)
    model = narrow_resnet50().double()
    generator = torch.Generator().manual_seed(3)
    images = torch.randn(32, 3, 16, 16, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 4, (32,), generator=generator)
    batches = [(images[i : i + 8], labels[i : i + 8]) for i in range(0, 32, 8)]
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    plain = {}
    for threads in (1, 2):
        with torch_threads(threads):
            plain[threads] = clones([model])[0]
            train_plain(plain[threads], batches, nn.functional.cross_entropy, adam)
    noise = max((a - b).abs().max().item() for a, b in zip(plain[1].state_dict().values(),
                                                             plain[2].state_dict().values()))
    budget = param_bytes(model) // 2
    block = sum(t.numel() * t.element_size() for t in [*model.layer4[0].parameters(), *model.layer4[0].buffers()])
    assert 2 * block > budget, "the largest bottleneck with its gradients must not fit the budget whole"
    with caplog.at_level("INFO", logger="harmony"):
        result = harmony.train(model, batches, nn.functional.cross_entropy, adam, devices=["cpu", "cpu"],
                               device_memory=budget, progress=False)
    assert "(inside layer4.0" in caplog.text and "too large for one pack, at their children)" in caplog.text
    assert max(result.stats.peak_device_bytes.values()) <= budget
    for (name, ours), theirs in zip(model.state_dict().items(), plain[1].state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=3 * noise, msg=lambda m, name=name: f"{name}: {m}")


def no_decay_for_vectors(params: object) -> torch.optim.Optimizer:
    """nanoGPT's param groups: weight decay for matrices, none for biases and norms (told apart by dimension)."""
    params = list(params)  # type: ignore[call-overload]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)


@pytest.mark.parametrize("case", ["swapped", "homed", "fused"])
def test_an_optimizer_factorys_param_groups_equal_plain_pytorchs(case: str, no_leaks: None) -> None:
    """The factory is called on each pack's parameters (an array member's slices) in their own shapes, so param
    groups chosen by shape hold the parameters they would in a plain loop: in float64 within 1e-9."""
    models = [deep_mlp(seed=seed).double() for seed in range(2)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * STEPS, batch=16)]
    options = {"swapped": {"resident": False, "device_memory": 2 * BUDGET, "fuse": False},
               "homed": {"fuse": False}, "fused": {"fuse": True, "resident": False}}[case]
    result = harmony.train(models, batches, nn.functional.mse_loss, no_decay_for_vectors, devices=1, progress=False,
                           **options)
    assert (result.arrays == [[0, 1]]) == (case == "fused")
    assert bool(result.homes) == (case == "homed")
    for model, reference in zip(models, references):
        train_plain(reference, batches, nn.functional.mse_loss, no_decay_for_vectors)
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
