"""Quickstart: a small hyperparameter grid trained at once on two CPU devices with a tight memory budget.

The data is generated here: points on two interleaved spirals, labelled by spiral. Six MLPs (two
optimizers x three learning rates) train concurrently. The three models of each optimizer class may be fused
into an array (one stacked computation for all three), cut into layer packs where an array does not fit the
300 kB budget; Harmony runs whichever its simulator predicts fastest, and the last lines say which and why.

    python examples/quickstart.py [--report run.png] [--prune]

Each model is evaluated on held-out points every 16 steps and at the end (loss and accuracy); the best one is
printed, and --report writes the run's page (curves, table, device timeline). --prune stops the worse half of the
models still training at every evaluation within the run (successive halving: 6 -> 3 -> 2 -> 1).
"""

import argparse
import math
import time

import torch
from torch import nn

import harmony


def spirals(samples: int, noise: float = 0.15, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (samples,), generator=generator)
    radius = torch.rand(samples, generator=generator) * 3 + 0.25
    angle = radius * 2.2 + labels * math.pi
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    return points + noise * torch.randn(samples, 2, generator=generator), labels


def mlp(width: int = 64, depth: int = 4) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(2, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 2))


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=1) == target).float().mean()


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--report", default=None, help="write the run's report page here (.png or .html)")
parser.add_argument("--prune", action="store_true", help="successive halving at every evaluation within the run")
options = parser.parse_args()

torch.manual_seed(0)
x, y = spirals(2048)
val_x, val_y = spirals(512, seed=1)
batches = [(x[i : i + 128], y[i : i + 128]) for i in range(0, len(x), 128)]
validation = [(val_x[i : i + 256], val_y[i : i + 256]) for i in range(0, len(val_x), 256)]
grid = [("SGD+momentum", lr, lambda p, lr=lr: torch.optim.SGD(p, lr=lr, momentum=0.9)) for lr in (0.02, 0.05, 0.1)]
grid += [("Adam", lr, lambda p, lr=lr: torch.optim.Adam(p, lr=lr)) for lr in (1e-3, 3e-3, 1e-2)]
models = [mlp() for _ in grid]

started = time.perf_counter()
result = harmony.train(
    models,
    batches,
    loss_fn=nn.functional.cross_entropy,
    optimizer=[factory for _, _, factory in grid],
    epochs=4,
    microbatches=4,
    devices=["cpu", "cpu"],
    device_memory="300kB",
    val_loaders=validation,
    eval_every=16,
    metrics=accuracy,
    names=[f"{name} lr={lr:g}" for name, lr, _ in grid],
    prune="halving" if options.prune else None,
)
elapsed = time.perf_counter() - started

print(f"\ntrained {len(models)} models in {elapsed:.1f}s (mode {result.mode})")
print(f"dashboard was at {result.dashboard_link}")
print(f"{'model':<22}{'job':>6}{'packs':>6}{'steps':>6}{'first loss':>11}{'last loss':>10}{'val loss':>10}"
      f"{'val accuracy':>14}")
for index, losses in enumerate(result.history):
    job, packs = result.job_of(index), len(result.packing_of(index).packs)
    _, val_loss = result.val_history[index][-1]
    _, figures = result.val_metrics[index][-1]
    print(f"{result.name(index):<22}{job:>6}{packs:>6}{result.stats.steps[index]:>6}{losses[0]:>11.4f}"
          f"{losses[-1]:>10.4f}{val_loss:>10.4f}{figures['accuracy']:>14.1%}")
best = result.best()
print(f"best: {best.name} (validation loss {best.val_loss:.4f}, accuracy {best.metrics['accuracy']:.1%})")
for choice in result.fusion:  # one choice per group of models that could fuse: here, per optimizer class
    print(choice.explain(f"MLP ({grid[choice.members[0]][0]})"))
stats = result.stats
print(
    f"\npeak device bytes {stats.peak_device_bytes} (budget 300kB each); weights swapped in "
    f"{stats.bytes_in['weights']:,} B, gradients out {stats.bytes_out['grads']:,} B over {sum(stats.steps)} steps"
)
if options.report:
    print(f"report written to {result.report(options.report)}")
