"""Micro-batch sizes and their loss weights."""

from __future__ import annotations

import pytest

from harmony.tasks.microbatch import loss_weights, split_sizes


@pytest.mark.parametrize(
    ("batch", "micro", "expected"), [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (3, 4, [1, 1, 1])]
)
def test_split_sizes_are_even_and_cover_the_batch(batch: int, micro: int, expected: list[int]) -> None:
    assert split_sizes(batch, micro) == expected
    assert sum(loss_weights(expected)) == pytest.approx(1.0)


def test_loss_weights_are_sample_fractions() -> None:
    assert loss_weights([3, 1]) == [0.75, 0.25]
