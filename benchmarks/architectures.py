"""Check: the architectures people train, trained by Harmony against plain PyTorch's loop.

Each model is built from a small config (random init) in float64, or float32 where a kernel has no float64 one
(a Mixtral's grouped matrix product), and takes three SGD steps: swapped in packs on two CPU devices under about
a third of its bytes (or what its largest layer needs, where that is more), and with --fused two of it (the second
scaled by 0.9) fused in one array on one device, homed and swapped in packs. Beside them, plain PyTorch's loop on
one thread and on two, and for the array, plain PyTorch's own way of computing models side by side:
torch.func.vmap over their stacked weights (torch.func.stack_module_state), one thread.

Harmony's CPU workers compute on one thread each, so the swapped way is compared with the one-thread loop, whose
own difference between one and two threads is the noise. An array's batched kernels sum in another order than one
model's: its members are compared with the loop (shown) and judged against vmap's stacked step. A way passes where
its largest weight difference is within three times the noise, or within 64 units of rounding of the largest
weight. Convolution nets with batch norm on tiny batches amplify rounding a thousandfold in a few steps (1 /
sqrt(var + eps) of a channel of small variance), which is why the loop's own differences reach 1e-13 there. Not a
timing: what it measures is whether the weights are plain PyTorch's. Dropout and stochastic depth are off (Harmony
draws its masks from each model's own streams, checked in tests/test_exactness.py).

    python -m benchmarks.architectures [--quick] [--only t5,opt] [--fused]
"""

from __future__ import annotations

import argparse
import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import harmony
from benchmarks.report import arguments, report

VOCAB = 64
STEPS = 3
RATE = 1e-3  # SGD's learning rate, in the loop, in Harmony and in the stacked step by hand
QUICK = ("llama", "opt", "mixtral", "t5", "resnet", "convnext")

Batches = list[Any]


def tokens(extra: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None, labels: bool = True) -> Batches:
    """Three batches of 2 sequences of 6 token ids, with labels (the ids) and whatever extra adds."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (STEPS * 2, 6), generator=generator)
    batches = []
    for i in range(0, STEPS * 2, 2):
        batch = {"input_ids": ids[i : i + 2]}
        if labels:
            batch["labels"] = ids[i : i + 2].clone()
        if extra is not None:
            batch.update(extra(ids[i : i + 2]))
        batches.append(batch)
    return batches


def padded(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """An attention mask with the first sequence's last two tokens padded, and labels that ignore them."""
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"attention_mask": mask, "labels": labels}


def images(size: int = 64) -> Batches:
    """Three batches of 8 images in 4 classes."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS * 8, 3, size, size, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 4, (STEPS * 8,), generator=generator)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, STEPS * 8, 8)]


def no_dropout(config: Any) -> Any:
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout",
                 "activation_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout_rate",
                 "classifier_dropout", "hidden_dropout", "seq_classif_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    return config


def cases() -> dict[str, tuple[Callable[[], nn.Module], Batches, Callable[..., torch.Tensor] | None]]:
    """Per name: a builder of the model, its batches, and its loss_fn (None: the model's own loss)."""
    import torchvision.models as vision
    import transformers

    def hf(cls: type, config: Any, dtype: torch.dtype = torch.float64, checkpointed: bool = False
           ) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            torch.manual_seed(0)
            model = cls(no_dropout(config)).to(dtype)
            if checkpointed:
                model.gradient_checkpointing_enable()
            return model
        return build

    def tv(fn: Callable[..., nn.Module], **options: Any) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            torch.manual_seed(0)
            model = fn(num_classes=4, **options).double()
            for module in model.modules():
                if type(module).__name__ == "StochasticDepth":
                    module.p = 0.0
            return model
        return build

    small = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 3,
             "num_attention_heads": 2, "max_position_embeddings": 32}
    decoder = {**small, "num_key_value_heads": 1}
    ce = nn.functional.cross_entropy
    t = transformers
    return {
        "llama": (hf(t.LlamaForCausalLM, t.LlamaConfig(**decoder)), tokens(padded, labels=False), None),
        "llama-checkpointed": (hf(t.LlamaForCausalLM, t.LlamaConfig(**decoder), checkpointed=True), tokens(), None),
        "mistral": (hf(t.MistralForCausalLM, t.MistralConfig(**decoder, head_dim=8)), tokens(), None),
        "qwen2": (hf(t.Qwen2ForCausalLM, t.Qwen2Config(**decoder)), tokens(), None),
        "gemma": (hf(t.GemmaForCausalLM, t.GemmaConfig(**decoder, head_dim=8)), tokens(), None),
        "phi3": (hf(t.Phi3ForCausalLM, t.Phi3Config(**decoder, pad_token_id=0)), tokens(), None),
        "mixtral": (hf(t.MixtralForCausalLM, t.MixtralConfig(**{**decoder, "num_hidden_layers": 8}, head_dim=8,
                                                             num_local_experts=4, num_experts_per_tok=2),
                       dtype=torch.float32), tokens(), None),
        "opt": (hf(t.OPTForCausalLM, t.OPTConfig(vocab_size=VOCAB, hidden_size=16, ffn_dim=32, num_hidden_layers=3,
                                                 num_attention_heads=2, max_position_embeddings=32,
                                                 word_embed_proj_dim=16)), tokens(), None),
        "gpt-neox": (hf(t.GPTNeoXForCausalLM, t.GPTNeoXConfig(**small)), tokens(), None),
        "gpt2-checkpointed": (hf(t.GPT2LMHeadModel, t.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=3, n_head=2,
                                                                 n_positions=32), checkpointed=True), tokens(), None),
        "t5": (hf(t.T5ForConditionalGeneration, t.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32,
                                                           num_layers=3, num_decoder_layers=3, num_heads=2,
                                                           decoder_start_token_id=0, pad_token_id=0)),
               tokens(padded, labels=False), None),
        "bart": (hf(t.BartForConditionalGeneration, t.BartConfig(
            vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)), tokens(), None),
        "bert": (hf(t.BertForMaskedLM, t.BertConfig(**small)),
                 tokens(lambda ids: {**padded(ids), "token_type_ids": (torch.arange(6) >= 3).long().expand_as(ids)},
                        labels=False), None),
        "roberta": (hf(t.RobertaForMaskedLM, t.RobertaConfig(**{**small, "max_position_embeddings": 40})),
                    tokens(), None),
        "albert": (hf(t.AlbertForMaskedLM, t.AlbertConfig(**small, embedding_size=8)), tokens(), None),
        "distilbert": (hf(t.DistilBertForSequenceClassification, t.DistilBertConfig(
            vocab_size=VOCAB, dim=16, hidden_dim=32, n_layers=3, n_heads=2, max_position_embeddings=32,
            num_labels=3)), tokens(lambda ids: {"labels": ids[:, 0] % 3}, labels=False), None),
        "vit": (hf(t.ViTForImageClassification, t.ViTConfig(image_size=16, patch_size=4, hidden_size=32,
                                                            intermediate_size=64, num_hidden_layers=6,
                                                            num_attention_heads=2, num_labels=4)),
                [{"pixel_values": x, "labels": y} for x, y in images(16)], None),
        "resnet": (tv(vision.resnet18), images(), ce),
        "convnext": (tv(vision.convnext_tiny), images(), ce),
        "efficientnet": (tv(vision.efficientnet_b0, dropout=0.0), images(), ce),
        "mobilenet-v3": (tv(vision.mobilenet_v3_small, dropout=0.0), images(), ce),
        "densenet": (tv(vision.densenet121), images(), ce),
        "swin": (tv(vision.swin_t, dropout=0.0), images(), ce),
        "regnet": (tv(vision.regnet_y_400mf), images(), ce),
        "shufflenet": (tv(vision.shufflenet_v2_x0_5), images(), ce),
        "mnasnet": (tv(vision.mnasnet0_5, dropout=0.0), images(), ce),
    }


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=RATE)


@contextmanager
def threads(count: int) -> Iterator[None]:
    """torch computing on count threads within the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plain(model: nn.Module, batches: Batches, loss_fn: Callable[..., torch.Tensor] | None, count: int) -> None:
    """Plain PyTorch's loop, on count threads."""
    with threads(count):
        optimizer = sgd(model.parameters())
        for batch in batches:
            optimizer.zero_grad()
            loss = model(**batch).loss if isinstance(batch, dict) else loss_fn(model(batch[0]), batch[1])
            loss.backward()
            optimizer.step()


def largest_difference(model: nn.Module, reference: nn.Module | dict[str, torch.Tensor]) -> float:
    """The largest difference of model's floating-point parameters and buffers from reference's (a module, or its
    tensors by name)."""
    theirs = reference if isinstance(reference, dict) else reference.state_dict()
    return max((tensor - theirs[name]).abs().max().item() for name, tensor in model.state_dict().items()
               if tensor.is_floating_point() and name in theirs)


def largest_weight(model: nn.Module) -> float:
    return max(t.abs().max().item() for t in model.state_dict().values() if t.is_floating_point())


def swapped(build: Callable[[], nn.Module], batches: Batches, loss_fn: Any) -> tuple[nn.Module, int]:
    """The model trained in packs on two devices, and its packs."""
    model = build()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    options = {"devices": ["cpu", "cpu"], "progress": False, "resident": False, "fuse": False}
    try:
        result = harmony.train(model, batches, loss_fn, sgd, device_memory=nbytes // 3, **options)
    except harmony.BudgetTooSmall as error:
        model = build()
        result = harmony.train(model, batches, loss_fn, sgd, device_memory=error.prefetching * 13 // 10, **options)
    return model, len(result.packings[0].packs)


def pair(build: Callable[[], nn.Module]) -> list[nn.Module]:
    """Two of the model, the second's weights scaled by 0.9."""
    models = [build(), build()]
    with torch.no_grad():
        for parameter in models[1].parameters():
            parameter.mul_(0.9)
    return models


def fused(build: Callable[[], nn.Module], batches: Batches, loss_fn: Any) -> list[nn.Module]:
    """The pair trained fused in one array on one device."""
    models = pair(build)
    result = harmony.train(models, batches, loss_fn, sgd, devices=["cpu"], fuse=True, progress=False)
    assert result.arrays == [[0, 1]], result.arrays
    return models


def fused_swapped(build: Callable[[], nn.Module], batches: Batches, loss_fn: Any) -> tuple[list[nn.Module], int]:
    """The pair trained fused in one array swapped in packs on one device, and its packs: under a third of the
    pair's bytes, or twice, four or eight times that where the array does not fit beside its next pack (then
    fuse=True trains them unfused)."""
    nbytes = 2 * sum(p.numel() * p.element_size() for p in build().parameters())
    budget = nbytes // 3
    for _ in range(4):
        models = pair(build)
        try:
            result = harmony.train(models, batches, loss_fn, sgd, devices=["cpu"], device_memory=budget, fuse=True,
                                   resident=False, progress=False)
        except harmony.BudgetTooSmall as error:
            budget = error.prefetching * 13 // 10
            continue
        if result.arrays == [[0, 1]]:
            return models, len(result.packings[0].packs)
        budget *= 2
    raise RuntimeError(f"the pair trained unfused up to a budget of {budget // 2:,} bytes")


def stacked(build: Callable[[], nn.Module], batches: Batches, loss_fn: Any) -> list[dict[str, torch.Tensor]]:
    """The pair trained by torch.func.vmap over their stacked weights and buffers, SGD by hand, on one thread: each
    member's parameters and buffers after the steps."""
    models = pair(build)
    params, buffers = torch.func.stack_module_state(models)
    skeleton = copy.deepcopy(models[0])  # on meta, .to() would untie tied weights

    def loss(weights: dict[str, torch.Tensor], state: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        if isinstance(batch, dict):
            return torch.func.functional_call(skeleton, (weights, state), (), batch).loss
        return loss_fn(torch.func.functional_call(skeleton, (weights, state), (batch[0],)), batch[1])

    with threads(1):
        for batch in batches:
            leaves = {name: tensor.detach().requires_grad_() for name, tensor in params.items()}
            torch.func.vmap(loss, in_dims=(0, 0, None), randomness="different")(leaves, buffers, batch).sum().backward()
            with torch.no_grad():
                params = {name: leaf - RATE * leaf.grad for name, leaf in leaves.items()}
    return [{**{name: tensor[index] for name, tensor in params.items()},
             **{name: tensor[index] for name, tensor in buffers.items()}} for index in range(2)]


def against_loop_and_vmap(members: list[nn.Module], reference: nn.Module, build: Callable[[], nn.Module],
                          batches: Batches, loss_fn: Any) -> tuple[float, float, float]:
    """A fused pair's largest difference from the loop (reference: the first member's) and from torch.func.vmap of
    the stacked pair (nan where vmap refuses the model: one that checkpoints its blocks, which an export's stages
    run as they are, or a mask that needs a gradient, which runtime.attention folds), and the one to judge: vmap's,
    else the loop's."""
    references = [reference, pair(build)[1]]
    plain(references[1], batches, loss_fn, count=1)
    loop = max(largest_difference(m, r) for m, r in zip(members, references))
    try:
        difference = max(largest_difference(m, v) for m, v in zip(members, stacked(build, batches, loss_fn)))
    except RuntimeError:
        difference = float("nan")
    return loop, difference, loop if difference != difference else difference


def verdict(difference: float, noise: float, scale: float, dtype: torch.dtype) -> str:
    return "yes" if difference <= max(3 * noise, 64 * torch.finfo(dtype).eps * scale) else "NO"


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", default="", help="comma-separated names (default: all)")
    parser.add_argument("--fused", action="store_true",
                        help="also train two of each fused in one array, homed and swapped")


def main() -> None:
    args = arguments(__doc__.splitlines()[0], options)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    every = cases()
    names = args.only.split(",") if args.only else list(QUICK if args.quick else every)
    rows = []
    for name in names:
        build, batches, loss_fn = every[name]
        row: dict[str, Any] = {"model": name}
        reference = build()
        dtype = next(reference.parameters()).dtype
        initial = copy.deepcopy(reference)
        plain(reference, batches, loss_fn, count=1)
        other = copy.deepcopy(initial)
        plain(other, batches, loss_fn, count=2)
        noise, scale = largest_difference(reference, other), largest_weight(reference)
        row.update({"dtype": str(dtype).removeprefix("torch."), "moved": largest_difference(reference, initial),
                    "noise": noise})
        try:
            model, packs = swapped(build, batches, loss_fn)
            difference = largest_difference(model, reference)
            row.update({"packs": packs, "swapped": difference, "swapped ok": verdict(difference, noise, scale, dtype)})
        except Exception as error:  # a failure is a row of the table, not the end of the check
            row.update({"packs": 0, "swapped": float("nan"), "swapped ok": f"failed: {type(error).__name__}"})
        if args.fused:
            try:
                loop, difference, judged = against_loop_and_vmap(fused(build, batches, loss_fn), reference, build,
                                                                 batches, loss_fn)
                row.update({"fused vs loop": loop, "fused vs vmap": difference,
                            "fused ok": verdict(judged, noise, scale, dtype)})
            except Exception as error:  # a model fuse=True refuses (harmony.fusing.UNFUSED, Unfusable) says why
                row.update({"fused vs loop": float("nan"), "fused vs vmap": float("nan"),
                            "fused ok": f"failed: {type(error).__name__}: {str(error)[:80]}"})
            try:
                members, packs = fused_swapped(build, batches, loss_fn)
                loop, difference, judged = against_loop_and_vmap(members, reference, build, batches, loss_fn)
                row.update({"array packs": packs, "swapped array vs loop": loop, "swapped array vs vmap": difference,
                            "swapped array ok": verdict(judged, noise, scale, dtype)})
            except Exception as error:
                row.update({"array packs": 0, "swapped array vs loop": float("nan"),
                            "swapped array vs vmap": float("nan"),
                            "swapped array ok": f"failed: {type(error).__name__}: {str(error)[:80]}"})
        print(row, flush=True)
        rows.append(row)
    report("architectures", "Architectures trained by Harmony against plain PyTorch's loop (largest weight "
           "difference after 3 SGD steps)", rows, args.out,
           notes="moved: how far plain PyTorch's 3 steps moved the weights; noise: plain PyTorch on 1 thread against "
                 "2; swapped: Harmony against plain PyTorch on 1 thread; fused vs loop / vmap: the array's members "
                 "against the loop and against torch.func.vmap of the stacked pair; swapped array vs loop / vmap: the "
                 "pair fused and swapped in packs on one device against them (judged against vmap, or the loop where "
                 "vmap refuses the model); ok: within 3x the noise or 64 "
                 "units of rounding of the largest weight")


if __name__ == "__main__":
    main()
