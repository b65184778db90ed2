"""Learning-rate schedules: every update's learning rate from its step number, as a plain loop with LambdaLR."""

from __future__ import annotations

import copy
import functools
import json
import math

import pytest
import torch
from torch import nn

import harmony
from harmony.errors import InputError
from harmony.runtime.array_optimizer import ArrayOptimizer, step_optimizer
from harmony.runtime.schedule import Scheduled, at_step
from tests.conftest import (
    assert_same_weights,
    clones,
    deep_mlp,
    regression_batches,
    train_plain_scaled,
    train_plain_scheduled,
)

STEPS = 6


def warmup_decay(step: int, warmup: int = 3, decay: float = 0.7) -> float:
    """A linear warm-up, then an exponential decay: a schedule whose factor changes every step."""
    return min(1.0, (step + 1) / warmup) * decay ** max(0, step - warmup)


def cosine(step: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * step / STEPS))


def adamw(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)  # type: ignore[arg-type]


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


def scheduled_plain(model: nn.Module, batches: list, factory: object, schedule: object) -> nn.Module:
    """The plain loop Harmony must match: optimizer.step(), then LambdaLR.step(), once per mini-batch."""
    lambda_lr = None if schedule is None else lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    train_plain_scheduled(model, batches, factory, scheduler=lambda_lr)  # type: ignore[arg-type]
    return model


def distance(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_each_step_sets_every_groups_lr_from_its_initial_one_as_lambda_lr_does() -> None:
    weight, bias = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(1))

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD([{"params": params[:1], "lr": 0.1}, {"params": params[1:], "lr": 0.3}])

    ours = Scheduled(factory, warmup_decay)([weight, bias])
    plain = factory([nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(1))])
    scheduler = torch.optim.lr_scheduler.LambdaLR(plain, warmup_decay)
    for step in (0, 1, 2, 3, 4, 5):  # a fresh optimizer (a new slot, a resume) needs no history: only the step
        at_step(ours, step)
        assert [group["lr"] for group in ours.param_groups] == [group["lr"] for group in plain.param_groups]
        assert [group["initial_lr"] for group in ours.param_groups] == [0.1, 0.3]
        plain.step()
        scheduler.step()
    unscheduled = factory([weight, bias])
    at_step(unscheduled, 4)
    assert [group["lr"] for group in unscheduled.param_groups] == [0.1, 0.3]


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "merged"])
def test_an_arrays_members_each_keep_their_own_schedule(stack: bool) -> None:
    """A fused array's optimizer steps every member on its own schedule (one unscheduled), whether the members are
    stepped as one stacked optimizer or merged into one torch optimizer: in float64, each member's slice is its
    own optimizer's under LambdaLR."""
    factories = [Scheduled(adamw, warmup_decay), Scheduled(functools.partial(torch.optim.AdamW, lr=5e-3), cosine),
                 functools.partial(torch.optim.AdamW, lr=1e-2)]
    schedules = [warmup_decay, cosine, None]
    shapes = [(4, 3), (3,)]
    stacked = [nn.Parameter(torch.randn(len(factories), *shape, dtype=torch.float64)) for shape in shapes]
    for param in stacked:
        param.grad = torch.zeros_like(param)
    array = ArrayOptimizer(factories, stack=stack).build(stacked, ["0.weight", "0.bias"])
    assert (type(array).__name__ == "StackedOptimizer") == stack
    members = [[nn.Parameter(stack[index].detach().clone()) for stack in stacked] for index in range(len(factories))]
    plains = [factory(params) for factory, params in zip([adamw, functools.partial(torch.optim.AdamW, lr=5e-3),
                                                         functools.partial(torch.optim.AdamW, lr=1e-2)], members)]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule else None
                  for optimizer, schedule in zip(plains, schedules)]
    generator = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        grads = [torch.randn(len(factories), *shape, generator=generator, dtype=torch.float64) for shape in shapes]
        for param, grad in zip(stacked, grads):
            param.grad.copy_(grad)
        for index, params in enumerate(members):
            for param, grad in zip(params, grads):
                param.grad = grad[index].clone()
        step_optimizer(array, step)
        for optimizer, scheduler in zip(plains, schedulers):
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        for index, params in enumerate(members):
            for param, stack in zip(params, stacked):
                torch.testing.assert_close(stack.detach()[index], param.detach(), rtol=1e-12, atol=1e-14)


CASES = {
    "host": {"resident": False, "device_memory": 48_000, "update_on": "host", "overlap_update": False},
    "overlapped": {"resident": False, "device_memory": 48_000, "update_on": "host", "overlap_update": True,
                   "packs_per_task": 3},
    "device": {"resident": False, "device_memory": 48_000, "update_on": "device"},
    "homed": {},
    "vdp": {"resident": False, "device_memory": 48_000, "devices": 2, "mode": "vdp"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_scheduled_training_equals_a_plain_loop_with_lambda_lr(case: str, no_leaks: None) -> None:
    """Wherever the update runs (a swapped pack's on the host store, in its bwd task or an upd task beside the
    device, on the device, a homed model's, with micro-batch groups on two devices), in float64 with per-model
    schedules the weights are a plain loop's with LambdaLR within 1e-9; the same loop with a constant learning rate
    is far from them."""
    models = [deep_mlp(seed=seed).double() for seed in range(2)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * STEPS, batch=16)]
    factories, schedules = [adamw, sgd], [warmup_decay, cosine]
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=factories, microbatches=2,
                           lr_schedule=schedules, fuse=False, progress=False, **{"devices": 1, **CASES[case]})
    for job, packing in zip(result.plan.jobs, result.packings):
        assert (job.home is not None) == (case == "homed")
        if case != "homed":
            assert len(packing.packs) > 2
    for model, reference, factory, schedule in zip(models, references, factories, schedules):
        constant = scheduled_plain(copy.deepcopy(reference), batches, factory, None)
        scheduled_plain(reference, batches, factory, schedule)
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
        assert distance(model, constant) > 1e-4, "the schedule changed the training"


def test_a_fused_array_trains_each_member_on_its_own_schedule(no_leaks: None) -> None:
    """Four members of one array, swapped, each on its own schedule (one constant): each is a plain loop's with
    LambdaLR, in float64."""
    models = [deep_mlp(seed=seed).double() for seed in range(4)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * STEPS, batch=16)]
    schedules = [warmup_decay, cosine, None, functools.partial(warmup_decay, warmup=2, decay=0.5)]
    result = harmony.train(models, batches, loss_fn=nn.functional.mse_loss, optimizer=adamw, microbatches=2,
                           lr_schedule=schedules, fuse=True, resident=False, device_memory=200_000, progress=False)
    assert result.arrays == [[0, 1, 2, 3]] and len(result.packings[0].packs) > 2
    for model, reference, schedule in zip(models, references, schedules):
        scheduled_plain(reference, batches, adamw, schedule)
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)


def test_a_transformers_schedule_is_taken_as_its_lr_lambda_and_equals_its_scheduler(no_leaks: None) -> None:
    """transformers' get_cosine_schedule_with_warmup, given as its lr_lambdas[0] (a functools.partial), trains a
    swapped model as a plain loop stepping that scheduler does, in float64."""
    transformers = pytest.importorskip("transformers")
    model = deep_mlp(seed=3).double()
    reference = copy.deepcopy(model)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * STEPS, batch=16)]
    probe = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = transformers.get_cosine_schedule_with_warmup(probe, 2, STEPS).lr_lambdas[0]
    harmony.train(model, batches, nn.functional.mse_loss, adamw, microbatches=2, resident=False,
                  device_memory=48_000, lr_schedule=schedule, progress=False)
    train_plain_scheduled(reference, batches, adamw,
                          scheduler=lambda optimizer: transformers.get_cosine_schedule_with_warmup(optimizer, 2, STEPS))
    assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_fp16_on_a_schedule_is_a_plain_scaled_loop_with_lambda_lr(no_leaks: None) -> None:
    """Under fp16's loss scaler a homed model's skipped steps still advance the schedule, as a plain loop that calls
    LambdaLR.step() after GradScaler.step() (torch warns when the first step is skipped): within that loop's own
    micro-batching noise, and farther than that from the same loop without the schedule."""
    scaler_arguments = {"init_scale": 2.0**24, "growth_interval": 3}
    schedule = functools.partial(warmup_decay, warmup=2, decay=0.5)
    model = deep_mlp(seed=0)
    reference = copy.deepcopy(model)
    batches = regression_batches(samples=16 * 12, batch=16)

    def plain(microbatches: int, schedule: object) -> tuple[nn.Module, int]:
        model = copy.deepcopy(reference)
        _, skipped, _ = train_plain_scaled(model, batches, adamw, microbatches, scaler_arguments, schedule=schedule)
        return model, skipped

    result = harmony.train(model, batches, nn.functional.mse_loss, adamw, microbatches=2, devices=1,
                           precision="fp16", grad_scaler=scaler_arguments, lr_schedule=schedule, progress=False)
    assert result.plan.jobs[0].home is not None
    micro, skipped = plain(2, schedule)
    whole, _ = plain(1, schedule)
    constant, _ = plain(2, lambda step: 1.0)
    assert skipped >= 2, "the scale overflowed and backed off"
    noise = distance(micro, whole)
    assert noise > 0
    assert distance(model, micro) <= noise, (distance(model, micro), noise)
    assert distance(model, constant) > noise, (distance(model, constant), noise)


def test_checkpoints_and_metrics_hold_the_scheduled_learning_rate_and_a_resume_keeps_the_schedule(
    tmp_path, no_leaks: None
) -> None:
    """The checkpoint's plain optimizer holds the learning rate and initial_lr a plain loop's optimizer has after
    as many steps and LambdaLR.step()s; every step's metrics record has the lr its update used; a resume with another
    schedule is another run, refused."""
    model = deep_mlp(seed=0).double()
    reference = copy.deepcopy(model)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * STEPS, batch=16)]
    harmony.train(model, batches, nn.functional.mse_loss, sgd, resident=False, device_memory=48_000,
                  lr_schedule=warmup_decay, checkpoint_dir=tmp_path / "checkpoints", log_dir=tmp_path / "logs",
                  progress=False)
    optimizer, _ = train_plain_scheduled(
        reference, batches, sgd, scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay))
    saved = torch.load(tmp_path / "checkpoints" / "model-0.pt", weights_only=False)["optimizer"]
    plain = optimizer.state_dict()
    assert [(g["lr"], g["initial_lr"]) for g in saved["param_groups"]] == \
        [(g["lr"], g["initial_lr"]) for g in plain["param_groups"]]
    (log,) = (tmp_path / "logs").glob("harmony-*.jsonl")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    lrs = {record["step"]: record["lr"] for record in records if record["kind"] == "step"}
    assert lrs == {step + 1: 0.05 * warmup_decay(step) for step in range(STEPS)}
    with pytest.raises((InputError, ValueError), match="another run"):
        harmony.train(deep_mlp(seed=0).double(), batches, nn.functional.mse_loss, sgd, resident=False,
                      device_memory=48_000, lr_schedule=cosine, checkpoint_dir=tmp_path / "checkpoints", resume=True,
                      progress=False)
