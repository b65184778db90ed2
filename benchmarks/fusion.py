"""Fusion benchmark: a 16-model learning-rate sweep of a small MLP and of a small CNN on one shared loader.

Compared in one run, on one CPU device (all cores), on the same data and learning rates:
  plain sequential  - a plain PyTorch loop training each model in turn;
  plain lockstep    - a plain loop stepping all 16 models on each batch;
  hand-fused        - stacked weights run with baddbmm / grouped convolutions, SGD on the stacks (the ceiling);
  hand-fused in a device worker - the same loop run inside a Harmony device worker process, beside the
                      scheduler (what the worker's environment alone costs on this machine);
  harmony fuse=False, harmony fuse=True (one array of all 16), harmony fuse="auto" (the size it chooses).
Harmony's steady state is its time per sweep step from when a fifth of all models' steps are done to when
the last is done (cluster start-up and the first task's warm-up excluded); "end-to-end" is everything
train() does, start-up included, in one fresh run. The plain and hand-fused loops in the driver are measured
REPEATS (3) times and the fastest counts. Harmony fuse=True and fuse="auto" run ROUNDS times each (MLP 10, CNN
5) on one device worker, every run between two runs of the hand-fused loop on that worker, and each run's ratio
to the mean of those two is taken: a small shared machine's speed drifts by tens of percent between minutes, and
a best-of for each way apart would compare different minutes. Single MLP runs still scatter widely (64-152% of
the hand-fused loop over two runs of this benchmark with five rounds, fuse=True and "auto" running the same
plan): its median takes ten rounds. The MLP sweep runs MLP_STEPS (1200) steps, long
enough that its steady state holds several of the multi-step tasks a 2 ms step calls for; the CNN's 50 ms
steps need no more than CNN_STEPS (300). Throughput is samples per second
per model. Goals: auto >= 3x the plain loop (the faster of the two) and >= 90% of the hand-fused ceiling
(median over rounds), in steady state.

    python -m benchmarks.fusion [--quick]
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import harmony
from benchmarks.models import train_sequentially
from benchmarks.report import arguments, report
from harmony.result import steady_seconds
from harmony.runtime.cluster import start_embedded
from harmony.runtime.devices import DeviceSpec, cpu_count
from harmony.runtime.worker import wait_for_warmup

MODELS = 16
BATCH = 32
CLASSES = 10
LEARNING_RATES = [0.01 * (1 + i) / MODELS for i in range(MODELS)]
REPEATS = 3
ROUNDS = {"MLP 3x128": 10, "CNN 2 conv": 5}
MLP_STEPS = 1200
CNN_STEPS = 300
HAND_IN_WORKER = "hand-fused in a device worker"


def small_mlp(seed: int, width: int = 128) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, CLASSES))


def small_cnn(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                         nn.ReLU(), nn.Flatten(), nn.Linear(32 * 8 * 8, CLASSES))


def classification(steps: int, shape: tuple[int, ...], seed: int = 1) -> list:
    """Inputs with labels from a fixed random linear teacher, so the task is learnable."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(steps * BATCH, *shape, generator=generator)
    teacher = torch.randn(x[0].numel(), CLASSES, generator=generator)
    y = (x.flatten(1) @ teacher).argmax(1)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, steps * BATCH, BATCH)]


def sgd(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.SGD(params, lr=lr)


def plain_sequential(models: list[nn.Module], data: list) -> float:
    return train_sequentially(models, LEARNING_RATES, data, nn.functional.cross_entropy)


def plain_lockstep(models: list[nn.Module], data: list) -> float:
    optimizers = [torch.optim.SGD(model.parameters(), lr=lr) for model, lr in zip(models, LEARNING_RATES)]
    started = time.perf_counter()
    for x, y in data:
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return time.perf_counter() - started


def _stack(models: list[nn.Module], index: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.stack([model[index].weight.detach() for model in models]).requires_grad_()
    bias = torch.stack([model[index].bias.detach() for model in models]).requires_grad_()
    return weight, bias


def _fused_sgd_loop(params: list[torch.Tensor], forward: Callable[[torch.Tensor], torch.Tensor], data: list) -> float:
    rates = torch.tensor(LEARNING_RATES)
    columns = [rates.repeat_interleave(p.shape[0] // MODELS).reshape(-1, *[1] * (p.dim() - 1)) for p in params]
    started = time.perf_counter()
    for x, y in data:
        logits = forward(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, CLASSES), y.repeat(MODELS), reduction="sum") / BATCH
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for param, grad, column in zip(params, grads, columns):
                param.sub_(grad * column)
    return time.perf_counter() - started


def hand_fused_mlp(models: list[nn.Module], data: list) -> float:
    stacks = [_stack(models, index) for index in (0, 2, 4)]
    weights = [w.detach().transpose(1, 2).contiguous().requires_grad_() for w, _ in stacks]
    biases = [b.detach().unsqueeze(1).requires_grad_() for _, b in stacks]

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x.expand(MODELS, *x.shape)
        for layer, (weight, bias) in enumerate(zip(weights, biases)):
            h = torch.baddbmm(bias, h, weight)
            if layer < 2:
                h = torch.relu(h)
        return h

    return _fused_sgd_loop([*weights, *biases], forward, data)


def hand_fused_cnn(models: list[nn.Module], data: list) -> float:
    (w1, b1), (w2, b2), (w3, b3) = (_stack(models, index) for index in (0, 2, 5))
    conv1 = w1.detach().reshape(MODELS * 16, 3, 3, 3).requires_grad_()
    conv2 = w2.detach().reshape(MODELS * 32, 16, 3, 3).requires_grad_()
    bias1, bias2 = b1.detach().reshape(-1).requires_grad_(), b2.detach().reshape(-1).requires_grad_()
    linear, bias3 = w3.detach().transpose(1, 2).contiguous().requires_grad_(), b3.detach().unsqueeze(1).requires_grad_()

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(nn.functional.conv2d(x, conv1, bias1, padding=1))
        h = torch.relu(nn.functional.conv2d(h, conv2, bias2, stride=2, padding=1, groups=MODELS))
        h = h.reshape(x.shape[0], MODELS, -1).transpose(0, 1)
        return torch.baddbmm(bias3, h, linear)

    return _fused_sgd_loop([conv1, conv2, bias1, bias2, linear, bias3], forward, data)


def _timed(loop: Callable[[list[nn.Module], list], float], models: list[nn.Module], data: list) -> float:
    torch.set_num_threads(cpu_count())
    return loop(copy.deepcopy(models), data)


def _best_of(loop: Callable[[list[nn.Module], list], float], models: list[nn.Module], data: list) -> float:
    return min(_timed(loop, models, data) for _ in range(REPEATS))


def all_models_steady(step_seconds: list[list[float]], skip: float = 0.2) -> float:
    """Seconds per step of the whole sweep (every model advancing one step) once running: the steady rate of
    all models' steps taken together, times the number of models. A throughput over all models: unfused models
    run their steps in turns, so one model's own rate says little about the sweep's."""
    finished = sorted(time for times in step_seconds for time in times)
    return steady_seconds(finished, skip, "the sweep") * len(step_seconds)


def train_sweep(make: Callable[[int], nn.Module], data: list, fuse: object, cluster: object = None
                ) -> tuple[harmony.TrainResult, float]:
    """Harmony on the sweep (on cluster, else on its own embedded cluster); the result and its wall time."""
    models = [make(seed) for seed in range(MODELS)]
    started = time.perf_counter()
    result = harmony.train(models, data, loss_fn=nn.functional.cross_entropy,
                           optimizer=[sgd(lr) for lr in LEARNING_RATES], devices=None if cluster else ["cpu"],
                           cluster=cluster, fuse=fuse, progress=False)
    return result, time.perf_counter() - started


def _shape(result: harmony.TrainResult, steps: int) -> dict[str, object]:
    return {"arrays": "+".join(str(len(array)) for array in result.arrays), "tasks/step": result.stats.tasks / steps}


def paired_rounds(make: Callable[[int], nn.Module], data: list, hand: Callable[[list[nn.Module], list], float],
                  rounds: int) -> tuple[dict[str, list[float]], dict[str, dict[str, object]], dict[str, list[float]]]:
    """Harmony (fuse=True, fuse="auto") on one device worker, each run between two runs of the hand-fused loop
    on that same worker: a small shared machine's speed drifts by tens of percent between minutes, so each
    Harmony run is compared with what the hand-fused loop did just before and just after it. The two fuse
    settings take turns going first, round by round.

    Returns seconds per sweep step of every run by way, the arrays and tasks of each Harmony way, and each
    Harmony run's ratio to the mean of the hand-fused runs around it (in percent), in run order by way."""
    handle = start_embedded([DeviceSpec("cpu-0", "cpu", 0, cpu_count())], dashboard_address=":0")
    seconds: dict[str, list[float]] = {HAND_IN_WORKER: [], "harmony fuse=True": [], "harmony fuse=auto": []}
    ratios: dict[str, list[float]] = {"harmony fuse=True": [], "harmony fuse=auto": []}
    shapes: dict[str, dict[str, object]] = {}
    try:
        handle.client.run(wait_for_warmup)  # as a run's setup does: the worker's background import is done
        worker = list(handle.workers.values())
        batches = [(x.clone(), y.clone()) for x, y in data]  # own storage: a pickled view carries its whole base
        [shipped] = handle.client.scatter([batches], workers=worker)  # the data goes once, not inside the task
        base = [make(seed) for seed in range(MODELS)]

        def hand_in_worker() -> float:
            run = handle.client.submit(_timed, hand, base, shipped, workers=worker, pure=False)
            per_step = run.result() / len(data)
            seconds[HAND_IN_WORKER].append(per_step)
            return per_step

        before = hand_in_worker()
        for round_index in range(rounds):
            for fuse in (True, "auto") if round_index % 2 == 0 else ("auto", True):
                label = f"harmony fuse={fuse}"
                result, _ = train_sweep(make, data, fuse, cluster=handle.client)
                per_step = all_models_steady(result.stats.step_seconds)
                after = hand_in_worker()
                seconds[label].append(per_step)
                ratios[label].append(100 * (before + after) / 2 / per_step)
                shapes[label] = _shape(result, len(data))
                before = after
    finally:
        handle.close()
    return seconds, shapes, ratios


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    logging.getLogger("distributed").setLevel(logging.ERROR)
    mlp_steps, cnn_steps = (60, 60) if args.quick else (MLP_STEPS, CNN_STEPS)
    rows = []
    raw: dict[str, object] = {}
    used_rounds: dict[str, int] = {}
    sweeps = (
        ("MLP 3x128", small_mlp, classification(mlp_steps, (128,)), hand_fused_mlp),
        ("CNN 2 conv", small_cnn, classification(cnn_steps, (3, 16, 16)), hand_fused_cnn),
    )
    for name, make, data, hand in sweeps:
        base = [make(seed) for seed in range(MODELS)]
        loops = {"plain sequential": plain_sequential, "plain lockstep": plain_lockstep, "hand-fused": hand}
        best = {label: _best_of(loop, base, data) / len(data) for label, loop in loops.items()}
        rounds = used_rounds[name] = 2 if args.quick else ROUNDS[name]
        paired, shapes, ratios = paired_rounds(make, data, hand, rounds)
        raw[name] = {"ms/step of every run, in run order": {label: [s * 1e3 for s in runs] for label, runs in
                                                             paired.items()},
                     "% of hand-fused of every run": ratios}
        end_to_end: dict[str, float] = {}
        for fuse in (False, True, "auto"):
            result, seconds = train_sweep(make, data, fuse)
            label = f"harmony fuse={fuse}"
            end_to_end[label] = seconds / len(data)
            if fuse is False:
                best[label] = all_models_steady(result.stats.step_seconds)
                shapes[label] = _shape(result, len(data))
        plain = min(best["plain sequential"], best["plain lockstep"])
        for label, per_step in best.items():
            rows.append(_row(name, label, per_step, plain, 100 * best["hand-fused"] / per_step, "-",
                             end_to_end.get(label, per_step), shapes.get(label, {})))
        for label, per_run in paired.items():
            of_hand = ratios.get(label, [100.0])
            spread = f"{min(of_hand):.0f}-{max(of_hand):.0f}" if label in ratios else "-"
            rows.append(_row(name, label, statistics.median(per_run), plain, statistics.median(of_hand), spread,
                             end_to_end.get(label, statistics.median(per_run)), shapes.get(label, {})))
    report("fusion", f"Fusion: {MODELS} models, batch {BATCH}, SGD with {MODELS} learning rates, 1 CPU device", rows,
           args.out, notes="x plain loop: against the faster of the two plain loops. Harmony fuse=True/auto ran "
           f"{', '.join(f'{rounds} times each ({name})' for name, rounds in used_rounds.items())} on one worker, "
           "every run between two runs of the hand-fused loop in that worker: "
           "their ms/step is the median over runs and their % of hand-fused the median (range) of each run's "
           "ratio to the mean of the hand-fused runs before and after it; other rows: best of 3, % against the "
           "hand-fused loop in the driver. Harmony's ms/step is its steady state (from a fifth of all models' steps "
           "to the last); "
           "end-to-end is one fresh train() with its own cluster, start-up included. "
           "Goals: harmony fuse=auto >= 3x plain loop and >= 90% of hand-fused.", raw=raw)


def _row(sweep: str, way: str, per_step: float, plain: float, of_hand: float, spread: str, end_to_end: float,
         shape: dict[str, object]) -> dict[str, object]:
    return {
        "sweep": sweep,
        "way": way,
        "ms/step (16 models)": per_step * 1e3,
        "samples/s per model": BATCH / per_step,
        "x plain loop": plain / per_step,
        "% of hand-fused": of_hand,
        "% range over rounds": spread,
        "end-to-end ms/step": end_to_end * 1e3,
        "arrays": shape.get("arrays", "-"),
        "tasks/step": shape.get("tasks/step", "-"),
    }


if __name__ == "__main__":
    main()
