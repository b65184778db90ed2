"""Fusion choices: which models form groups, the sizes tried, the splits, the size chosen."""

from __future__ import annotations

from harmony.tasks.fusion import candidate_sizes, choose_size, fusion_groups, split


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
