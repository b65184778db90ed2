"""Gradient clipping by the total norm: clip_grad_norm_'s, for models updated pack by pack and fused arrays."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from torch import nn

import harmony
from harmony.runtime.array import member_layout
from harmony.runtime.clipping import Norms, clip_in_place
from harmony.runtime.hoststore import HostStore
from tests.conftest import (
    TiedEnds,
    assert_same_weights,
    clones,
    deep_mlp,
    regression_batches,
    train_plain_scaled,
    train_plain_scheduled,
)

STEPS = 6
MICROBATCHES = 2


def adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)  # type: ignore[arg-type]


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def plain(model: nn.Module, batches: list, factory: object, clip: float | None) -> list[float]:
    """The plain loop Harmony must match: micro-batched backward, clip_grad_norm_, step; the total norms."""
    return train_plain_scheduled(model, batches, factory, MICROBATCHES, clip=clip)[1]  # type: ignore[arg-type]


def distance(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_clipping_in_place_is_clip_grad_norm_and_an_arrays_members_are_each_clipped_alone() -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = {"0.weight": (5, 3), "0.bias": (5,), "2.weight": (2, 5)}
    grads = [(name, torch.randn(shape, generator=generator)) for name, shape in shapes.items()]
    params = [nn.Parameter(torch.zeros(shape)) for shape in shapes.values()]
    for param, (_, grad) in zip(params, grads):
        param.grad = grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, 0.5)
    (total,) = clip_in_place(grads, (0.5,))
    assert torch.equal(total, expected), "the same norms, stacked the same way"
    assert all(torch.equal(grad, param.grad) for (_, grad), param in zip(grads, params))

    limits = (0.5, math.inf, 100.0)  # clipped, not clipped, a norm under its limit
    stacked = [(name, torch.randn(len(limits), *shape, generator=generator)) for name, shape in shapes.items()]
    members = []
    for member in range(len(limits)):
        views = [nn.Parameter(torch.zeros(shape)) for shape in shapes.values()]
        for view, (name, grad) in zip(views, stacked):
            view.grad = member_layout(name, grad)[member].clone()
        members.append(views)
    totals = clip_in_place(stacked, limits)
    for member, (limit, views) in enumerate(zip(limits, members)):
        norm = torch.nn.utils.clip_grad_norm_(views, limit)
        torch.testing.assert_close(totals[member], norm, rtol=1e-6, atol=0)
        for view, (name, grad) in zip(views, stacked):
            torch.testing.assert_close(member_layout(name, grad)[member], view.grad, rtol=1e-6, atol=1e-7)
    assert float(totals[0]) > 0.5 and float(totals[2]) < 100.0


def test_a_steps_norms_are_computed_once_and_kept_until_the_step_after_next(store: HostStore) -> None:
    Norms.create(store, 0, 2, [3, 1])
    norms = Norms(store, 0, 2, [3, 1])
    calls: list[int] = []

    def compute(values: tuple[float, float]) -> list[torch.Tensor]:
        calls.append(1)
        return [torch.tensor(value) for value in values]

    threads = [threading.Thread(target=norms.totals, args=(4, torch.float32, lambda: compute((1.5, 2.5))))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1, "the first caller of the step computes it, under the file's lock"
    assert Norms(store, 0, 2, [3, 1]).totals(4, torch.float64, lambda: compute((9.0, 9.0))) == [
        torch.tensor(1.5, dtype=torch.float64), torch.tensor(2.5, dtype=torch.float64)]
    assert [float(t) for t in norms.totals(5, torch.float32, lambda: compute((3.0, 4.0)))] == [3.0, 4.0]
    assert [float(t) for t in norms.totals(6, torch.float32, lambda: compute((5.0, 6.0)))] == [5.0, 6.0]
    assert len(calls) == 3
    assert [float(t) for t in norms.totals(5, torch.float32, lambda: compute((0.0, 0.0)))] == [3.0, 4.0]


def test_a_packs_norms_recorded_by_its_bwd_are_read_back_per_member_for_their_step_only(store: HostStore) -> None:
    """Each pack's row holds the norms its bwd recorded (members x its stepped gradients, in their dtypes) for
    that step; a step whose norms a pack never recorded is an error, not another step's norms."""
    Norms.create(store, 1, 2, [3, 1, 0])
    norms = Norms(store, 1, 2, [3, 1, 0])
    def taken(rows: list[list[float]], dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
        return [[torch.tensor(value, dtype=dtype) for value in row] for row in rows]

    norms.record(4, 0, taken([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    norms.record(4, 1, taken([[7.0], [8.0]], torch.float64))
    norms.record(4, 2, [[], []])
    norms.record(5, 0, taken([[9.0, 9.0, 9.0], [9.0, 9.0, 9.0]]))
    read = Norms(store, 1, 2, [3, 1, 0])  # another process maps the same file
    first = read.recorded(4, 0, [torch.float32, torch.float32, torch.float64])
    assert [[float(value) for value in each] for each in first] == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert [value.dtype for value in first[1]] == [torch.float32, torch.float32, torch.float64]
    assert [[float(value) for value in each] for each in read.recorded(4, 1, [torch.float64])] == [[7.0], [8.0]]
    assert read.recorded(4, 2, []) == [[], []]
    assert float(read.recorded(5, 0, [torch.float32] * 3)[1][2]) == 9.0
    with pytest.raises(RuntimeError, match="pack 1's gradient norms of step 5 were never recorded"):
        read.recorded(5, 1, [torch.float64])
    with pytest.raises(RuntimeError, match="step 6 were never recorded"):
        read.recorded(6, 0, [torch.float32] * 3)  # slot 0 holds step 4's


CASES = {  # one device, then two (the embedded cluster starts once for each)
    "swapped": ({"resident": False, "device_memory": 48_000}, False),
    "sections": ({"resident": False, "device_memory": 48_000, "packs_per_task": 3}, False),
    "homed": ({}, False),
    "fused-swapped": ({"resident": False, "device_memory": 200_000}, True),
    "fused-homed": ({}, True),
    "vdp": ({"resident": False, "device_memory": 48_000, "devices": 2, "mode": "vdp"}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_clipped_training_equals_a_plain_loop_with_clip_grad_norm(case: str, no_leaks: None) -> None:
    """In float64, models clipped to their own norms (one not clipped) train as plain loops with clip_grad_norm_
    within 1e-9, whether swapped (the packs' updates in upd tasks after the whole backward, which the plan chooses,
    also in sections and with micro-batch groups on two devices), homed, or fused in one array; the clipped ones
    were clipped at every step and end far from the unclipped loop."""
    options, fused = CASES[case]
    count = 4 if fused else 2
    models = [deep_mlp(seed=seed).double() for seed in range(count)]
    references = clones(models)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * STEPS, batch=16)]
    clips = [0.05, None, 0.2, 0.01][:count]
    factories = [adam] * count if fused else [sgd, adam]
    result = harmony.train(models, batches, nn.functional.mse_loss, factories, microbatches=MICROBATCHES,
                           clip_grad_norm=clips, fuse=fused, progress=False, **{"devices": 1, **options})
    assert result.arrays == ([[0, 1, 2, 3]] if fused else [[0], [1]])
    for job in result.plan.jobs:
        limits = tuple(math.inf if clips[m] is None else clips[m] for m in job.members)
        assert job.clip == (limits if any(clips[m] is not None for m in job.members) else ())
        if job.home is None:
            assert job.overlap and len(job.packing.packs) > 2, "upd tasks, once the whole backward is done"
        assert (job.home is None) == (case not in ("homed", "fused-homed"))
    for index, (model, reference, factory, clip) in enumerate(zip(models, references, factories, clips)):
        unclipped = copy.deepcopy(reference)
        norms = plain(reference, batches, factory, clip)
        assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
        assert result.grad_norms[index] == pytest.approx(norms, rel=1e-9), "the norms clip_grad_norm_ returned"
        if clip is not None:
            plain(unclipped, batches, factory, None)
            assert min(norms) > clip, "every step was clipped"
            assert distance(model, unclipped) > 1e-3


def test_a_weight_tied_across_packs_counts_once_in_the_norm(no_leaks: None) -> None:
    """A tie that spans packs: the holder's gradient (with the borrower's added) is in the norm once, as the one
    parameter clip_grad_norm_ sees; the weights are the plain loop's and the tie holds."""
    model = TiedEnds().double()
    reference = copy.deepcopy(model)
    batches = [(x.double(), y.double()) for x, y in regression_batches(samples=16 * STEPS, batch=16)]
    result = harmony.train(model, batches, nn.functional.mse_loss, sgd, devices=1, device_memory=60_000,
                           resident=False, clip_grad_norm=0.05, progress=False)
    assert len(result.packings[0].packs) > 2 and any(pack.borrowed for pack in result.packings[0].packs)
    _, norms = train_plain_scheduled(reference, batches, sgd, clip=0.05)
    assert min(norms) > 0.05, "every step is clipped"
    assert_same_weights(model, reference, rtol=1e-9, atol=1e-12)
    assert model.last.weight is model.first.weight


@pytest.mark.parametrize("case", ["swapped", "vdp", "homed"])
def test_fp16_clips_the_unscaled_gradients_as_a_plain_loop_between_unscale_and_step(case: str,
                                                                                     no_leaks: None) -> None:
    """Under fp16's loss scaler the norm is of the unscaled gradients and a skipped step clips nothing, as a plain
    loop that calls clip_grad_norm_ between GradScaler.unscale_ and GradScaler.step: within that loop's own
    micro-batching noise, and farther than that from the loop without clipping. The recorded norms are the plain
    loop's: not finite at the steps the scaler skips, equal at the others."""
    scaler_arguments = {"init_scale": 2.0**24, "growth_interval": 3}
    model = deep_mlp(seed=0)
    reference = copy.deepcopy(model)
    batches = regression_batches(samples=16 * 12, batch=16)

    def scaled_plain(microbatches: int, clip: float | None) -> tuple[nn.Module, int, list[float]]:
        model = copy.deepcopy(reference)
        _, skipped, norms = train_plain_scaled(model, batches, sgd, microbatches, scaler_arguments, clip=clip)
        return model, skipped, norms

    options = {"homed": {}, "swapped": {"resident": False, "device_memory": 24_000},
               "vdp": {"resident": False, "device_memory": 24_000, "devices": 2, "mode": "vdp"}}[case]
    result = harmony.train(model, batches, nn.functional.mse_loss, sgd, microbatches=MICROBATCHES,
                           precision="fp16", grad_scaler=scaler_arguments, clip_grad_norm=0.05, progress=False,
                           **{"devices": 1, **options})
    assert (result.plan.jobs[0].home is None) == (case != "homed")
    assert result.plan.jobs[0].groups == (2 if case == "vdp" else 1)
    micro, skipped, norms = scaled_plain(MICROBATCHES, 0.05)
    whole, _, _ = scaled_plain(1, 0.05)
    unclipped, _, _ = scaled_plain(MICROBATCHES, None)
    finite = [math.isfinite(norm) for norm in norms]
    assert [math.isfinite(norm) for norm in result.grad_norms[0]] == finite, "a skipped step's norm is not finite"
    kept = [(ours, theirs) for ours, theirs, ok in zip(result.grad_norms[0], norms, finite) if ok]
    assert kept and [ours for ours, _ in kept] == pytest.approx([theirs for _, theirs in kept], rel=1e-6)
    assert skipped >= 2, "the scale overflowed and backed off"
    noise = distance(micro, whole)
    assert noise > 0
    assert distance(model, micro) <= noise, (distance(model, micro), noise)
    assert distance(model, unclipped) > noise, (distance(model, unclipped), noise)
