"""A grid of small GPT-style language models (learning rates x sizes), trained at once under a budget smaller than
the largest model, then judged on held-out text.

The corpus is the Python standard library's own source, read in sorted file order (found through sysconfig): a
character-level (byte) language model learns to continue Python. The first 90% is for training, the rest for
validation. Each model trains with AdamW on a linear warm-up and a cosine decay of its learning rate, its gradients
clipped at a norm of 1, as GPTs are trained. Each model is a chain (embeddings, blocks, head), so Harmony cuts the
larger ones into packs of blocks that fit the device budget and swaps them through the host store; the models of one
size share their data and architecture, so they train as a fused array where one fits the budget and pays.

    python examples/gpt_sweep.py            # a few minutes on 2 cores
    python examples/gpt_sweep.py --smoke    # seconds: what CI runs
"""

import argparse
import functools
import math
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

import harmony


def corpus(characters: int) -> torch.Tensor:
    """The first `characters` bytes of the standard library's Python files, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= characters:
            break
    return torch.tensor(list(b"".join(chunks)[:characters]), dtype=torch.long)


class Embeddings(nn.Module):
    """Token and position embeddings of a window of bytes."""

    def __init__(self, width: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(256, width)
        self.positions = nn.Embedding(context, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """A pre-norm transformer block with causal self-attention; its residual stays inside it."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


def gpt(width: int, depth: int, context: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [Block(width, heads=4) for _ in range(depth)]
    return nn.Sequential(Embeddings(width, context), *blocks, nn.LayerNorm(width), nn.Linear(width, 256))


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))


def windows(data: torch.Tensor, context: int, batch: int, steps: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """steps batches of random windows (inputs, next bytes)."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - context - 1, (steps, batch), generator=generator)
    offsets = torch.arange(context)
    return [(data[row[:, None] + offsets], data[row[:, None] + offsets + 1]) for row in starts]


def warmup_cosine(step: int, warmup: int, steps: int) -> float:
    """The factor of the learning rate at step: linear from 0 over warmup steps, then a cosine down to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny corpus and few steps (seconds)")
    options = parser.parse_args()
    context, batch = (32, 8) if options.smoke else (64, 16)
    steps = 12 if options.smoke else 300
    data = corpus(60_000 if options.smoke else 600_000)
    split = int(0.9 * len(data))
    train, valid = data[:split], data[split:]
    sizes = [(32, 2), (64, 4)] if options.smoke else [(64, 2), (128, 6)]
    rates = [1e-3, 3e-3] if options.smoke else [3e-4, 1e-3, 3e-3]
    grid = [(width, depth, rate) for width, depth in sizes for rate in rates]
    models = [gpt(width, depth, context, seed=index) for index, (width, depth, _) in enumerate(grid)]
    largest = max(parameter_bytes(model) for model in models)
    budget = 2 * largest  # half the largest model's weights, gradients and AdamW state (and less than its
    # activations besides): it trains in packs
    batches = windows(train, context, batch, steps, seed=0)

    started = time.perf_counter()
    result = harmony.train(models, batches, loss_fn=next_byte_loss,
                           optimizer=[lambda p, lr=rate: torch.optim.AdamW(p, lr=lr) for _, _, rate in grid],
                           lr_schedule=functools.partial(warmup_cosine, warmup=steps // 10, steps=steps),
                           clip_grad_norm=1.0,
                           devices=["cpu", "cpu"], device_memory=budget, progress=not options.smoke)
    elapsed = time.perf_counter() - started

    held_out = windows(valid, context, 32, 4 if options.smoke else 16, seed=1)
    print(f"\n{len(models)} models, {steps} steps each, in {elapsed:.1f}s; device budget {budget:,} bytes "
          f"(largest model {largest:,} bytes of weights)")
    print(f"{'width':>6}{'blocks':>7}{'lr':>8}{'packs':>6}{'array':>7}{'train loss':>12}{'valid loss':>12}"
          f"{'bits/byte':>10}")
    scores = []
    with torch.no_grad():
        for index, ((width, depth, rate), model) in enumerate(zip(grid, result.models)):
            model.eval()
            loss = sum(next_byte_loss(model(x), y).item() for x, y in held_out) / len(held_out)
            scores.append(loss)
            packs = len(result.packings[result.job_of(index)].packs)
            array = len(result.arrays[result.job_of(index)])
            print(f"{width:>6}{depth:>7}{rate:>8.0e}{packs:>6}{array:>7}{result.history[index][-1]:>12.3f}"
                  f"{loss:>12.3f}{loss / math.log(2):>10.2f}")
    best = min(range(len(grid)), key=scores.__getitem__)
    width, depth, rate = grid[best]
    print(f"best: width {width}, {depth} blocks, lr {rate:.0e}: validation loss {scores[best]:.3f}")


if __name__ == "__main__":
    main()
