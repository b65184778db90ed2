"""Fusion choices: which models form groups, the sizes tried, the splits, the size chosen."""

from __future__ import annotations

from harmony.tasks.fusion import candidate_sizes, choose_size, fusion_groups, split, trial_bytes
from harmony.tasks.layout import TensorSpec
from harmony.tasks.profile import LayerProfile, ModelProfile


def test_fusion_groups_sizes_and_splits() -> None:
    assert fusion_groups(["a", "b", "a", None, "b", "c", None]) == [[0, 2], [1, 4]]
    assert candidate_sizes(1) == [1]
    assert candidate_sizes(6) == [1, 2, 4, 6]
    assert candidate_sizes(16) == [1, 2, 4, 8, 16]
    assert split(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert split(list(range(4)), 4) == [[0, 1, 2, 3]]
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
