"""Benchmark: fused members' attention, folded into one call against vmap's loop over the members.

One transformer block per member (Hugging Face GPT-2's, attention through ``scaled_dot_product_attention``; random
init from a config), forward and backward on the members' own activations, three ways in the same run:
  plain loop     - each member's block in turn, as a plain PyTorch sweep runs them;
  array, looped  - the members' blocks as one ArrayLayer whose attention vmap loops over (torch has no batching
                   rule for the attention kernels: what fused arrays did before runtime.attention);
  array, folded  - the same ArrayLayer with the members folded into attention's batch (runtime.attention).
Each row: the median seconds of a forward and backward over REPEATS, min-max beside, and the ratio to the plain
loop. The array ways must give the same values bit for bit (checked each run).

    python -m benchmarks.attention [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from benchmarks.report import arguments, report
from harmony.runtime.array import ArrayLayer

REPEATS = 15
WARMUP = 2


def blocks(count: int, width: int, heads: int, context: int, device: str) -> list[nn.Module]:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_layer=1, n_embd=width, n_head=heads, n_positions=context, vocab_size=64, use_cache=False,
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    return [_Block(GPT2Model(config).h[0]).to(device) for _ in range(count)]


class _Block(nn.Module):
    """A GPT-2 block as a layer of a chain: hidden states in, hidden states out."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def seconds(step: callable, device: str) -> list[float]:
    times = []
    for _ in range(WARMUP + REPEATS):
        started = time.perf_counter()
        step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times[WARMUP:])


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))


def measure(count: int, width: int, heads: int, context: int, batch: int, device: str) -> list[dict]:
    """The rows of one shape: each way's median seconds of a forward and backward."""
    members = blocks(count, width, heads, context, device)
    x = torch.randn(count, batch, context, width, device=device)
    upstream = torch.randn_like(x)
    outputs = {}

    def plain() -> None:
        for member, own, grad in zip(members, x, upstream):
            member(own).backward(grad)

    def fused(array: ArrayLayer, way: str) -> None:
        out = array(x)
        out.backward(upstream)
        outputs[way] = out.detach()

    ways = {"plain loop": plain}
    for way, attends in (("array, looped", False), ("array, folded", None)):
        array = ArrayLayer(members, shared_input=False)
        array.attends = attends
        ways[way] = lambda array=array, way=way: fused(array, way)
    shape = f"{count} x {width} wide, {heads} heads, {batch} x {context} tokens"
    rows = []
    for way, step in ways.items():
        times = seconds(step, device)
        median = statistics.median(times)
        rows.append({"members x shape": shape, "way": way, "median s": median,
                     "range": f"{times[0]:.4f}-{times[-1]:.4f}", "/ plain loop": rows[0]["median s"] / median
                     if rows else 1.0})
        print(f"{shape}, {way}: {median * 1e3:.2f} ms", flush=True)
    if not torch.equal(outputs["array, looped"], outputs["array, folded"]):
        raise SystemExit(f"{shape}: the folded array's output differs from the looped one's")
    return rows


def main() -> None:
    args = arguments(__doc__.splitlines()[0], options)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    if device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU")
    shapes = [(4, 64, 4, 32, 4)] if args.quick else [
        (4, 256, 4, 128, 4), (4, 256, 4, 512, 2), (16, 256, 4, 128, 4), (16, 768, 12, 128, 4)]
    rows = [row for shape in shapes for row in measure(*shape, device)]
    name = torch.cuda.get_device_name(0) if device != "cpu" else f"CPU, {torch.get_num_threads()} threads"
    report("attention", f"GPT-2 blocks of fused members, forward and backward, on {name}", rows, args.out,
           notes="median s: a forward and backward of every member's block; / plain loop: its speed-up over the "
           "plain loop (above 1 is faster)")


if __name__ == "__main__":
    main()
