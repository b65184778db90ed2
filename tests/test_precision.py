"""Mixed precision: precision="bf16" trains as a plain loop under torch.autocast(bfloat16) does, for swapped,
homed and fused models; precision="fp16" as one under autocast(float16) with torch.amp.GradScaler, skipped steps
and the scale's history included; weights and optimizer state stay float32."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import harmony
from harmony.errors import InputError
from harmony.runtime.halving import unhalved
from tests.conftest import deep_mlp, regression_batches, train_plain_scaled

MICROBATCHES = 2


def adam(parameters: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(parameters, lr=1e-3)  # type: ignore[arg-type]


def plain(model: nn.Module, batches: list, microbatches: int, autocast: bool) -> nn.Module:
    """The plain loop: gradients accumulated over micro-batches, forward and loss under autocast when asked."""
    optimizer = adam(model.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = nn.functional.mse_loss(model(xs), ys) * (len(xs) / len(x))
            loss.backward()
        optimizer.step()
    return model


def distance(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("case", ["swapped", "homed", "fused"])
def test_bf16_trains_as_a_plain_loop_under_autocast(case: str, no_leaks: None) -> None:
    models = [deep_mlp(seed=seed) for seed in range(3 if case == "fused" else 1)]
    batches = regression_batches(samples=16 * 6, batch=16)
    references = [copy.deepcopy(model) for model in models]
    budget = 24_000 if case == "swapped" else None  # under half the model
    mode = {"mode": "vpp"} if case == "homed" else {}  # vdp homes nothing, and may be predicted as fast here
    result = harmony.train(models, batches, nn.functional.mse_loss, adam, microbatches=MICROBATCHES, devices=2,
                           device_memory=budget, fuse=case == "fused", precision="bf16", progress=False, **mode)
    if case == "swapped":
        assert len(result.packings[0].packs) > 1 and not result.homes
        assert all(result.plan.jobs[0].halved(pack) for pack in range(len(result.packings[0].packs))), \
            "every linear's device copy is bfloat16"
    if case == "homed":
        assert result.homes
    if case == "fused":
        assert result.arrays == [[0, 1, 2]]
    for model, reference in zip(models, references):
        assert all(p.dtype == torch.float32 for p in model.parameters()), "master weights stay float32"
        micro = plain(copy.deepcopy(reference), batches, MICROBATCHES, autocast=True)
        whole = plain(copy.deepcopy(reference), batches, 1, autocast=True)
        full = plain(copy.deepcopy(reference), batches, MICROBATCHES, autocast=False)
        noise = distance(micro, whole)  # plain PyTorch's own micro-batching difference under the same autocast
        assert noise > 0
        assert distance(model, micro) <= noise, (distance(model, micro), noise)
        assert distance(model, full) > 10 * distance(model, micro), "it computed in bfloat16, not float32"


SCALER = {"init_scale": 2.0**24, "growth_interval": 3}  # overflows first, then backs off and grows again


def plain_scaled(model: nn.Module, batches: list, microbatches: int) -> tuple[nn.Module, torch.amp.GradScaler, int]:
    """The plain fp16 loop with Adam: the model, its scaler and the steps the scaler skipped."""
    scaler, skipped, _ = train_plain_scaled(model, batches, adam, microbatches, SCALER)
    return model, scaler, skipped


@pytest.mark.parametrize("case", ["swapped", "sections", "vdp", "homed"])
def test_fp16_trains_as_a_plain_loop_with_a_grad_scaler(case: str, tmp_path, no_leaks: None) -> None:
    """Every pack of a swapped model skips the steps whose gradients (any pack's) overflow, the scale backs off and
    grows as torch.amp.GradScaler's, and the weights are a plain fp16 loop's within its own micro-batching noise;
    the checkpoint holds the plain scaler's state."""
    model = deep_mlp(seed=0)
    reference = copy.deepcopy(model)
    batches = regression_batches(samples=16 * 12, batch=16)
    options = {"swapped": {"device_memory": 24_000, "packs_per_task": 1},
               "sections": {"device_memory": 24_000, "packs_per_task": 4},
               "vdp": {"device_memory": 24_000, "devices": 2, "mode": "vdp", "packs_per_task": 1},
               "homed": {}}[case]
    result = harmony.train(model, batches, nn.functional.mse_loss, adam, microbatches=MICROBATCHES,
                           precision="fp16", grad_scaler=SCALER, checkpoint_dir=tmp_path, progress=False,
                           **{"devices": 1, **options})
    job = result.plan.jobs[0]
    assert (job.home is not None) == (case == "homed") and job.scaled
    if case != "homed":
        assert job.overlap and len(result.packings[0].packs) > 2
    if case == "vdp":
        assert job.groups == 2
    micro, scaler, skipped = plain_scaled(copy.deepcopy(reference), batches, MICROBATCHES)
    whole, _, _ = plain_scaled(copy.deepcopy(reference), batches, 1)
    assert skipped >= 2, "the scale overflowed and backed off"
    assert scaler.get_scale() > SCALER["init_scale"] / 2**skipped, "and grew again"
    saved = torch.load(tmp_path / "model-0.pt", weights_only=False)
    assert saved["scaler"] == scaler.state_dict()
    noise = distance(micro, whole)
    assert noise > 0
    assert distance(model, micro) <= noise, (distance(model, micro), noise)
    full = plain(copy.deepcopy(reference), batches, MICROBATCHES, autocast=False)
    assert distance(model, full) > 10 * distance(model, micro), "it computed in float16, not float32"


def test_unknown_precisions_and_misplaced_scaler_arguments_are_refused_before_work_starts() -> None:
    layer, data = nn.Linear(4, 1), [(torch.randn(4, 4), torch.randn(4, 1))]
    for arguments, message in (({"precision": "int8"}, "is not a precision"),
                               ({"grad_scaler": {"init_scale": 8.0}}, "is for precision='fp16'"),
                               ({"precision": "fp16", "grad_scaler": {"scale": 8.0}}, "GradScaler's arguments"),
                               ({"precision": "fp16", "grad_scaler": {"growth_interval": 2.5}}, "positive int"),
                               ({"precision": "fp16", "overlap_update": False}, "leave overlap_update")):
        with pytest.raises(InputError, match=message):
            harmony.train(layer, data, nn.functional.mse_loss, adam, progress=False, **arguments)


def mixed(seed: int = 0) -> nn.Sequential:
    """Linear weights that are halved beside batch norms, a layer norm and dropout that are not."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(5):
        layers += [nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Dropout(0.2), nn.Tanh()]
    return nn.Sequential(*layers, nn.LayerNorm(32), nn.Linear(32, 4))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_weights_copied_in_halved_train_bit_for_bit_as_float32_copies_under_autocast(
    precision: str, monkeypatch: pytest.MonkeyPatch, no_leaks: None, steady_pilot: None
) -> None:
    """A swapped model whose linear weights are copied to the devices in autocast's dtype (from the host's mirror of
    them) ends with the weights, running statistics and validation losses of the same run copying float32 weights
    in (which autocast then casts), bit for bit, with dropout, in sections of packs, in fewer packs (cut for the
    halved copies), and within the budget; every copy of a pack's weights takes at most 0.6 of its float32 bytes.
    (How many copies each run makes depends on where and when its tasks ran, so the two runs' totals are not
    compared.)"""
    batches = regression_batches(samples=16 * 6, batch=16)
    budget = 30_000
    forecast = str(harmony.plan(mixed(), batches, nn.functional.mse_loss, adam, microbatches=MICROBATCHES, devices=2,
                                device_memory=budget, precision=precision))
    assert f"of them copied in as {precision} (half the bytes)" in forecast, forecast
    runs = {}
    halved_names = []
    for halving in (True, False):
        if not halving:
            monkeypatch.setattr("harmony.runtime.pilot.casts", unhalved)
        model = mixed()
        result = harmony.train(model, batches, nn.functional.mse_loss, adam, microbatches=MICROBATCHES, devices=2,
                               device_memory=budget, precision=precision, packs_per_task=2, mode="free",
                               val_loaders=batches[:2],
                               eval_every=3, progress=False,
                               **({"grad_scaler": {"init_scale": 2.0**8}} if precision == "fp16" else {}))
        runs[halving] = (model, result)
        job = result.plan.jobs[0]
        halved_names += [name for pack in range(len(result.packings[0].packs)) for name in job.halved(pack)]
        assert len(result.packings[0].packs) > 3 and not result.homes and job.sections
        assert max(result.stats.peak_device_bytes.values()) <= budget
    (halved, with_halves), (plain_copies, without) = runs[True], runs[False]
    assert len(with_halves.packings[0].packs) < len(without.packings[0].packs)
    assert len(halved_names) == 12, "the six linears' weights and biases, no norm's"
    for ours, theirs in zip(halved.state_dict().values(), plain_copies.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs)
    assert with_halves.val_history == without.val_history
    assert without.stats.bytes_halved == 0
    copied, halved_bytes = with_halves.stats.bytes_in["weights"], with_halves.stats.bytes_halved
    assert halved_bytes > 0 and copied <= 0.6 * (copied + halved_bytes), "the float32 bytes would be copied + halved"


def test_an_exported_gpt2_trains_in_bf16_with_its_linear_weights_copied_in_halved(no_leaks: None) -> None:
    """A Hugging Face GPT-2 that only torch.export can cut (its dtype checks of .to() calls dropped: under autocast
    its logits come in bfloat16) trains under a third of its size in bf16, its blocks' Conv1D weights copied in as
    bfloat16 and its tied embedding not, as a plain autocast loop does within that loop's own micro-batching noise."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=12, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (4 * 8, 16), generator=torch.Generator().manual_seed(3))
    batches = [{"input_ids": ids[i : i + 8], "labels": ids[i : i + 8]} for i in range(0, len(ids), 8)]
    size = sum(p.numel() * p.element_size() for p in model.parameters())

    def sgd(parameters: object) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=0.1)  # type: ignore[arg-type]

    result = harmony.train(model, batches, None, sgd, microbatches=4, devices=2, device_memory=size // 3,
                           precision="bf16", progress=False)
    job = result.plan.jobs[0]
    halved = [name for pack in range(len(result.packings[0].packs)) for name in job.halved(pack)]
    assert len(halved) == 12 * 4 * 2, "every block's four Conv1D weights and biases"
    assert max(result.stats.peak_device_bytes.values()) <= size // 3
    assert model.lm_head.weight is model.transformer.wte.weight

    def plain_loop(microbatches: int) -> nn.Module:
        trained = copy.deepcopy(reference)
        optimizer = sgd(trained.parameters())
        for batch in batches:
            optimizer.zero_grad()
            for part in zip(batch["input_ids"].chunk(microbatches), batch["labels"].chunk(microbatches)):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = trained(input_ids=part[0], labels=part[1], use_cache=False).loss / microbatches
                loss.backward()
            optimizer.step()
        return trained

    micro, whole = plain_loop(4), plain_loop(1)
    noise = distance(micro, whole)
    assert 0 < distance(model, micro) <= 3 * noise, (distance(model, micro), noise)
