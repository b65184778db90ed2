"""Where a swapped pack's update runs: which jobs may update on their device, and what that holds there."""

from __future__ import annotations

import dataclasses

from harmony.tasks.layout import TensorSpec
from harmony.tasks.packing import Packing, cut_packs
from harmony.tasks.profile import LayerProfile, ModelProfile
from harmony.tasks.runplan import Job
from harmony.tasks.updates import device_update_need, packs_on_device, why_not_on_device


def packing(budget: int, halved: bool = False) -> Packing:
    layer = LayerProfile("Linear", params=(TensorSpec("weight", "float32", (32, 32)),), buffers=(),
                         input_bytes_per_sample=128, output_bytes_per_sample=128, forward_seconds_per_sample=1e-6,
                         halved=frozenset({"weight"}) if halved else frozenset())
    return cut_packs(ModelProfile("m", (layer,) * 4), budget, samples=4)


def job(budget: int = 20_000, **changes: object) -> Job:
    base = Job(members=(0,), label="model 0", feed=0, seed=0, packing=packing(budget), steps=4, step_seconds=0.0,
               batch_bytes=0, state_ratio=2.0)
    return dataclasses.replace(base, **changes)


def test_a_packs_device_update_holds_its_weights_gradients_state_and_a_neighbours_weights() -> None:
    packs = packing(20_000).packs
    assert packs[0].state_bytes(2.0) == 2 * 4096 and packs[0].state_bytes(0.0) == 0
    assert len(packs) == 4 and all(pack.cost.weights == pack.cost.grads == 4096 for pack in packs)
    assert device_update_need(packs, 0, 2.0) == 3 * 4096 + 2 * 4096, "its weights, gradients, state, the next's weights"
    assert device_update_need(packs, 3, 2.0) == 3 * 4096 + 2 * 4096, "the pack before it, which backward runs next"
    assert device_update_need(packs[:1], 0, 2.0) == 2 * 4096 + 2 * 4096


def test_only_a_swapped_job_whose_bwd_alone_needs_its_gradients_updates_on_its_device() -> None:
    assert why_not_on_device(job()) is None
    assert "homed" in str(why_not_on_device(job(home="cpu-0")))
    assert "vdp" in str(why_not_on_device(job(groups=2)))
    assert "overlap_update" in str(why_not_on_device(job(overlap=True)))
    assert "fp16" in str(why_not_on_device(job(scaled=True)))
    assert "clipping" in str(why_not_on_device(job(clip=(1.0,))))
    assert packs_on_device(job(groups=2), 10**9) == ()


def test_the_packs_whose_state_fits_update_on_the_device_and_the_others_on_the_host() -> None:
    """"For packs whose optimizer state fits the device": each pack on its own, by what it holds while it updates;
    a halved pack's device copy is not the master."""
    packs = job().packing.packs
    need = max(device_update_need(packs, index, 2.0) for index in range(len(packs)))
    assert packs_on_device(job(), need) == (0, 1, 2, 3)
    assert packs_on_device(job(), need - 1) == ()
    assert packs_on_device(job(state_ratio=0.0), need - 1) == (0, 1, 2, 3), "plain SGD has no state to copy"
    assert packs_on_device(job(packing=packing(20_000, halved=True)), 10**9) == ()
    fused = job(members=(0, 1), packing=packing(20_000, halved=True))
    assert packs_on_device(fused, 10**9) == (0, 1, 2, 3), "a fused array's device copies are float32"
    narrow = LayerProfile("Linear", params=(TensorSpec("weight", "float32", (16, 16)),), buffers=(),
                          input_bytes_per_sample=64, output_bytes_per_sample=64, forward_seconds_per_sample=1e-6)
    wide = LayerProfile("Linear", params=(TensorSpec("weight", "float32", (16, 64)),), buffers=(),
                        input_bytes_per_sample=64, output_bytes_per_sample=256, forward_seconds_per_sample=1e-6)
    mixed = job(packing=cut_packs(ModelProfile("m", (narrow, wide, narrow)), 18_000, samples=2))
    packs = mixed.packing.packs
    assert [pack.grad_bytes for pack in packs] == [1024, 4096, 1024]
    fits = [device_update_need(packs, index, 2.0) for index in range(len(packs))]
    assert fits[1] > max(fits[0], fits[2])
    assert packs_on_device(mixed, max(fits[0], fits[2])) == (0, 2), "the wide pack's state does not fit"
    assert packs_on_device(mixed, fits[1]) == (0, 1, 2)
