"""Cutting a layer chain into packs that fit a budget, balanced by compute."""

from __future__ import annotations

import dataclasses

import pytest

from harmony.tasks.layout import TensorSpec
from harmony.tasks.packing import LayerTooLarge, cut_packs, minimal_budget
from harmony.tasks.profile import LayerProfile, ModelProfile


def linear(width: int, seconds: float = 1e-6, cut: bool = True) -> LayerProfile:
    return LayerProfile(
        description=f"Linear({width})",
        params=(TensorSpec("weight", "float32", (width, width)), TensorSpec("bias", "float32", (width,))),
        buffers=(),
        input_bytes_per_sample=4 * width,
        output_bytes_per_sample=4 * width,
        forward_seconds_per_sample=seconds,
        cut_before=cut,
    )


def profile(layers: list[LayerProfile]) -> ModelProfile:
    return ModelProfile("model 0 (Test)", tuple(layers))


def test_everything_in_one_pack_when_the_budget_is_large() -> None:
    plan = cut_packs(profile([linear(16)] * 4), budget=10**9, samples=8)
    assert [(p.first, p.stop) for p in plan.packs] == [(0, 4)]


def test_packs_fit_the_budget_with_their_prefetch_buffer() -> None:
    layers = [linear(16)] * 10
    budget = 6000
    plan = cut_packs(profile(layers), budget=budget, samples=4)
    assert len(plan.packs) > 1
    assert plan.packs[0].first == 0 and plan.packs[-1].stop == 10
    assert all(a.stop == b.first for a, b in zip(plan.packs, plan.packs[1:]))
    for pack in plan.packs:
        assert pack.cost.total <= budget
        neighbours = [plan.packs[i].weight_bytes for i in (pack.index - 1, pack.index + 1) if 0 <= i < len(plan.packs)]
        assert pack.cost.prefetch == max(neighbours, default=0)


def test_where_values_are_copied_ahead_packs_leave_room_for_the_next_micro_batchs_beside_the_next_weights() -> None:
    """With ahead (a GPU, or a link) the prefetch buffer also holds the next micro-batch's input and its output's
    gradient (runtime.cache.DeviceCache.ahead): packs are cut smaller where that room is needed, each within the
    budget."""
    layers = [linear(16)] * 10
    budget, samples = 13_000, 4
    plain = cut_packs(profile(layers), budget=budget, samples=samples)
    ahead = cut_packs(profile(layers), budget=budget, samples=samples, ahead=True)
    assert ahead.ahead and not plain.ahead and ahead.prefetch
    assert "the prefetch room also holds the next micro-batch's values" in ahead.explain()
    assert "micro-batch's values" not in plain.explain()
    values = 2 * 4 * 16 * samples  # the input and the output's gradient of 4 samples of 16 floats
    for pack in ahead.packs:
        assert pack.cost.total <= budget
        neighbours = [ahead.packs[i].weight_bytes for i in (pack.index - 1, pack.index + 1)
                      if 0 <= i < len(ahead.packs)]
        assert pack.cost.prefetch == max(neighbours, default=0) + values
    assert len(ahead.packs) > len(plain.packs), "the plain cut has no room for them"
    assert any(pack.cost.total + values > budget for pack in plain.packs)


def test_packs_are_balanced_by_profiled_time() -> None:
    slow, fast = linear(16, seconds=1e-3), linear(16, seconds=1e-6)
    plan = cut_packs(profile([slow, fast, fast, fast, slow, fast]), budget=8000, samples=1)
    times = [p.forward_seconds_per_sample for p in plan.packs]
    assert max(times) < 2.5e-3


def test_no_cut_where_a_layer_input_is_not_a_single_tensor() -> None:
    layers = [linear(16), linear(16, cut=False), linear(16), linear(16, cut=False)]
    plan = cut_packs(profile(layers), budget=9000, samples=1)
    cuts = {p.first for p in plan.packs}
    assert 1 not in cuts and 3 not in cuts


def test_a_pack_lists_its_drawing_layers_by_their_index_in_the_chain() -> None:
    layers = [dataclasses.replace(linear(16), draws=index in (2, 3, 7)) for index in range(10)]
    plan = cut_packs(profile(layers), budget=6000, samples=4)
    assert len(plan.packs) > 2
    assert [layer for pack in plan.packs for layer in pack.drawing] == [2, 3, 7]
    assert all(pack.first <= layer < pack.stop for pack in plan.packs for layer in pack.drawing)


def test_layer_too_large_says_how_many_bytes_it_needs() -> None:
    with pytest.raises(LayerTooLarge) as raised:
        cut_packs(profile([linear(16), linear(64)]), budget=20000, samples=8)
    error = raised.value
    assert error.first == 1
    assert error.need.total > 20000
    assert f"needs {error.alone:,} bytes" in str(error) and f"{error.need.total:,} to prefetch" in str(error)
    assert error.alone == error.need.total - error.need.prefetch
    assert error.largest_microbatch() is None, "its weights and gradients alone outgrow 20,000 bytes"


def test_layer_too_large_says_at_how_many_samples_a_micro_batch_fits() -> None:
    model = profile([linear(16), linear(64)])
    with pytest.raises(LayerTooLarge) as raised:
        cut_packs(model, budget=54000, samples=8)
    largest = raised.value.largest_microbatch()  # the most samples at which it fits alone, as cutting again finds
    assert largest is not None and 1 <= largest < 8
    cut_packs(model, budget=54000, samples=largest)
    with pytest.raises(LayerTooLarge) as again:
        cut_packs(model, budget=54000, samples=largest + 1)
    assert again.value.largest_microbatch() == largest
    one = raised.value.one_sample  # the least budget at micro-batches of one sample, to the byte
    cut_packs(model, budget=one, samples=1)
    with pytest.raises(LayerTooLarge) as none:
        cut_packs(model, budget=one - 1, samples=8)
    assert none.value.largest_microbatch() is None and none.value.one_sample == one


def test_pack_tensor_names_match_a_sequential_of_its_layers() -> None:
    plan = cut_packs(profile([linear(4)] * 3), budget=10**9, samples=1)
    names = [spec.name for spec in plan.packs[0].weights]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]


def test_a_model_that_fits_whole_is_one_pack_with_no_prefetch_buffer() -> None:
    """One layer (a model that cannot be cut) needs its own bytes alone: there is no other pack to fetch."""
    from harmony.tasks.packing import minimal_budget

    whole = profile([linear(64)])
    alone = minimal_budget(whole, 8)
    assert minimal_budget(whole, 8, prefetch=True) == alone + 64 * 64 * 4 + 64 * 4
    packing = cut_packs(whole, budget=alone, samples=8)
    assert len(packing.packs) == 1 and packing.packs[0].cost.prefetch == 0
    assert packing.packs[0].cost.total == alone
    with pytest.raises(LayerTooLarge):
        cut_packs(whole, budget=alone - 1, samples=8)


def test_a_budget_with_no_room_to_prefetch_cuts_packs_that_fit_alone_and_says_so() -> None:
    from harmony.tasks.packing import minimal_budget

    layers = profile([linear(32)] * 6)
    alone, beside = minimal_budget(layers, 4), minimal_budget(layers, 4, prefetch=True)
    assert alone < beside
    packing = cut_packs(layers, budget=alone, samples=4)
    assert not packing.prefetch and "no room to prefetch" in packing.explain()
    assert all(pack.cost.prefetch == 0 and pack.cost.total <= alone for pack in packing.packs)
    assert cut_packs(layers, budget=beside, samples=4).prefetch


def test_a_tied_weight_counts_once_in_the_pack_that_holds_it_and_is_borrowed_across_a_cut() -> None:
    embedding = linear(16)
    head = LayerProfile(description="head", params=(), buffers=(), input_bytes_per_sample=64,
                        output_bytes_per_sample=64, borrowed=(TensorSpec("tied", "float32", (16, 16)),),
                        lenders=((0, "weight"),))
    layers = [embedding, linear(16), linear(16), head]
    whole = cut_packs(profile(layers), budget=10**9, samples=8)
    [pack] = whole.packs
    assert not pack.borrowed and pack.cost.weights == 3 * (16 * 16 + 16) * 4, "the tied weight counted once"
    assert "3.tied" not in {spec.name for spec in pack.trainable}
    split = cut_packs(profile(layers), budget=6_400, samples=8)
    assert len(split.packs) == 4
    last = split.packs[-1]
    assert last.borrowed == (("0.tied", 0, "0.weight"),) and not last.weights
    assert [spec.name for spec in last.trainable] == ["0.tied"], "its gradient is computed there, for the lender"
    assert last.cost.weights == last.cost.grads == 16 * 16 * 4


def test_halved_weights_count_at_two_bytes_so_packs_hold_more_layers_and_a_smaller_budget_fits() -> None:
    halved = dataclasses.replace(linear(16), halved=frozenset({"weight", "bias"}))
    full, half = profile([linear(16)] * 10), profile([halved] * 10)
    float_plan, half_plan = cut_packs(full, budget=8000, samples=4), cut_packs(half, budget=8000, samples=4)
    assert len(half_plan.packs) < len(float_plan.packs)
    for pack in half_plan.packs:
        layers = pack.stop - pack.first
        assert pack.float_bytes == pack.halved_bytes == layers * 1088 and pack.weight_bytes == layers * 544
        assert pack.cost.total <= 8000 and pack.cost.grads == layers * 1088  # gradients stay float32
    assert half_plan.explain().split(" weight bytes")[0] == float_plan.explain().split(" weight bytes")[0]
    assert minimal_budget(half, 4, prefetch=True) == minimal_budget(full, 4, prefetch=True) - 2 * 544


def test_a_workspace_counts_autocasts_weight_copies_and_the_largest_backward_beyond_its_reserve_once() -> None:
    """Three Linears 16 wide on 4 samples: inputs and outputs of 64 bytes a sample, the first weight copied by
    autocast where the device does not hold it halved, the second's backward allocating 100 bytes a sample more than
    its reserve, the third's 40. A stash holds neither a backward's allocation nor a gradient, and the weight's copy
    whole."""
    copied = dataclasses.replace(linear(16), copied=frozenset({"weight", "bias"}))
    halved = dataclasses.replace(copied, halved=frozenset({"weight", "bias"}))
    layers = [copied, dataclasses.replace(linear(16), transient_bytes_per_sample=100.0),
              dataclasses.replace(linear(16), transient_bytes_per_sample=40.0)]
    pack = cut_packs(profile(layers), budget=1 << 20, samples=4).packs[0]
    activations = (2 * 64 + 2 * 3 * 64) * 4
    assert pack.cost.workspace == activations + 100 * 4 + 1024 + 1088 // 2  # + the largest fresh weight gradient
    assert pack.transient == 400 and pack.copies == 1088 // 2 and pack.stash_bytes == activations // 2 + 1088 // 2
    assert pack.float_workspace == pack.cost.workspace
    swapped = cut_packs(profile([halved, *layers[1:]]), budget=1 << 20, samples=4).packs[0]
    assert swapped.cost.workspace == activations + 100 * 4 + 1024, "the device holds the first weight halved"
    assert swapped.float_workspace == pack.cost.workspace, "unless the job holds its weights in float32"
