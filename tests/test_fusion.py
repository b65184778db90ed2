"""Fusion choices: which models form groups, the sizes tried, the splits, the size chosen."""

from __future__ import annotations

import pytest

from harmony.tasks.fusion import candidate_sizes, choose_size, fusion_groups, narrowed_cost, split, trial_bytes
from harmony.tasks.layout import TensorSpec
from harmony.tasks.profile import LayerProfile, ModelProfile


def test_fusion_groups_sizes_and_splits() -> None:
    assert fusion_groups(["a", "b", "a", None, "b", "c", None]) == [[0, 2], [1, 4]]
    assert candidate_sizes(1) == [1]
    assert candidate_sizes(6) == [1, 2, 4, 6]
    assert candidate_sizes(16) == [1, 2, 4, 8, 16]
    assert split(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert split(list(range(4)), 4) == [[0, 1, 2, 3]]
    assert split(list(range(10)), 4, interleaved=True) == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert choose_size(range(4), {1: 4.0, 2: 2.0, 4: 2.0}).size == 4
    assert choose_size(range(4), {1: 4.0, 2: 1.0, 4: 2.0}).size == 2
    assert choose_size(range(4), {1: 4.0, 2: None, 4: None}).size == 1
    assert choose_size(range(4), {2: None, 4: None}).size == 1
    assert "does not fit" in choose_size(range(4), {1: 4.0, 2: None}).explain("MLP")
    slow = choose_size(range(4), {1: 22.8, 2: 30.0, 4: 0.002}).explain("GPT2LMHeadModel")
    assert "1: 0.175 model-steps/s, 2: 0.133 model-steps/s, 4: 2,000 model-steps/s" in slow, (
        "a rate under one a second keeps its figures")


def test_a_pruned_sweep_ranks_each_size_by_what_it_is_expected_to_compute() -> None:
    predicted: dict[int, float | None] = {1: 1.0, 2: 0.7, 4: 0.4, 8: None}
    assert choose_size(range(8), predicted).size == 4
    pruned = choose_size(range(8), predicted, shares={1: 0.3, 2: 0.5, 4: 0.8, 8: 1.0})
    assert pruned.size == 1 and pruned.cost(4) == 0.4 * 0.8 and pruned.cost(8) is None
    assert choose_size(range(8), predicted, shares={1: 0.4, 2: 0.5, 4: 1.0}).size == 2
    text = pruned.explain("MLP")
    assert "1: 8 model-steps/s computing 30% of its steps" in text and "does not fit" in text
    assert "as a built-in pruner is expected to leave them" in text
    dealt = choose_size(range(8), predicted, interleaved=True)
    assert dealt.arrays == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert "fused as 4 + 4 (members dealt out in turn: 0,2,4,6 | 1,3,5,7)" in dealt.explain("MLP")


def test_a_trial_arrays_bytes_are_its_members_weights_and_one_layers_backward_each() -> None:
    wide = LayerProfile("wide", params=(TensorSpec("weight", "float32", (64, 64)),), buffers=(),
                        input_bytes_per_sample=256, output_bytes_per_sample=256)
    norm = LayerProfile("norm", params=(TensorSpec("weight", "float32", (64,)),),
                        buffers=(TensorSpec("mean", "float32", (64,)),), input_bytes_per_sample=256,
                        output_bytes_per_sample=256)
    profile = ModelProfile("net", (wide, norm, wide))
    weights = 2 * 64 * 64 * 4 + 2 * 64 * 4
    wide_backward = 2 * (256 + 256) * 8 + 64 * 64 * 4 + 64 * 64 * 4  # activations of 8 samples, largest grad, grads
    assert trial_bytes(profile, 1, 8) == weights + wide_backward
    assert trial_bytes(profile, 4, 8) == 4 * (weights + wide_backward)


def test_a_size_not_tried_for_host_memory_is_never_chosen_and_the_choice_says_why() -> None:
    choice = choose_size(range(8), {1: 8.0, 2: 3.0, 4: None, 8: None}, {8: 12_400_000_000})
    assert choice.size == 2 and choice.unbuilt == {8: 12_400_000_000}
    text = choice.explain("GPT2LMHeadModel")
    assert "8: not tried, its trial array needs 12.4 GB of host memory" in text and "4: does not fit" in text


def test_a_narrowed_arrays_step_costs_what_an_array_of_its_live_members_is_predicted_to() -> None:
    """Eight models on two devices: one array's step is the group's over the arrays, times those that run at once
    (models alone 1 s, arrays of 2 1.5 s, of 4 2 s, of 8 3 s); between the sizes predicted it is interpolated."""
    cost = narrowed_cost(8, {1: 4.0, 2: 3.0, 4: 2.0, 8: 3.0}, devices=2)
    assert cost(0, 4) == 0.0 and cost(4, 4) == 1.0 and cost(8, 8) == 1.0
    assert cost(1, 8) == pytest.approx(1 / 3) and cost(2, 4) == pytest.approx(0.75)
    assert cost(3, 4) == pytest.approx(1.75 / 2) and cost(6, 8) == pytest.approx(2.5 / 3)
    unfit = narrowed_cost(8, {1: 4.0, 2: 3.0, 4: 2.0, 8: None}, devices=2)
    assert unfit(3, 8) == pytest.approx(3 / 8), "a size not predicted: in proportion to its live members"
    assert narrowed_cost(4, {1: 10.0, 4: 1.0}, devices=1)(1, 4) == 1.0, "never more than the whole array's step"
    assert narrowed_cost(4, {2: 2.0, 4: 3.0}, devices=1)(1, 4) == pytest.approx(0.5 / 3), "below: in proportion"
