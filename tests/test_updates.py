"""Where a swapped pack's update runs: which jobs may update on their device, and what that holds there."""

from __future__ import annotations

import dataclasses

from harmony.tasks.layout import TensorSpec
from harmony.tasks.packing import Packing, cut_packs
from harmony.tasks.profile import LayerProfile, ModelProfile
from harmony.tasks.runplan import Job
from harmony.tasks.updates import device_update_need, state_bytes, why_not_on_device


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
    assert state_bytes(packs[0], 2.0) == 2 * 4096 and state_bytes(packs[0], 0.0) == 0
    assert len(packs) == 4 and all(pack.cost.weights == pack.cost.grads == 4096 for pack in packs)
    assert device_update_need(packs, 0, 2.0) == 3 * 4096 + 2 * 4096, "its weights, gradients, state, the next's weights"
    assert device_update_need(packs, 3, 2.0) == 3 * 4096 + 2 * 4096, "the pack before it, which backward runs next"
    assert device_update_need(packs[:1], 0, 2.0) == 2 * 4096 + 2 * 4096


def test_only_a_swapped_job_whose_bwd_alone_needs_its_gradients_and_whose_state_fits_updates_on_its_device() -> None:
    assert why_not_on_device(job(), 30_000) is None
    assert "homed" in str(why_not_on_device(job(home="cpu-0"), 30_000))
    assert "vdp" in str(why_not_on_device(job(groups=2), 30_000))
    assert "overlap_update" in str(why_not_on_device(job(overlap=True), 30_000))
    assert "fp16" in str(why_not_on_device(job(scaled=True), 30_000))
    assert "halved" in str(why_not_on_device(job(packing=packing(20_000, halved=True)), 30_000))
    packs = job().packing.packs
    need = max(device_update_need(packs, index, 2.0) for index in range(len(packs)))
    assert why_not_on_device(job(), need) is None
    assert "does not fit" in str(why_not_on_device(job(), need - 1))
    assert why_not_on_device(job(state_ratio=0.0), need - 1) is None, "plain SGD has no state to copy"
    fused = job(members=(0, 1), packing=packing(20_000, halved=True))
    assert why_not_on_device(fused, 30_000) is None, "a fused array's device copies are float32"
