"""The members a swapped fused array's step computes (runtime.rows): which, and their rows of the stacks as views or
copies, gradients and buffers back in the stacks' rows; who trains at a step (runtime.divergence.Members).
Through harmony.train: tests/test_pruning.py."""

from __future__ import annotations

import math

import pytest
import torch

from harmony.runtime.divergence import TRAINING, Members
from harmony.runtime.files import diverged_name, pruned_name
from harmony.runtime.hoststore import HostStore
from harmony.runtime.rows import Rows, computed_rows, gaps, member_spans
from harmony.tasks.layout import TensorSpec, lay_out

ROOMY = [(100, 200), (40, 200)]  # per pack: weights' bytes, workspace


@pytest.mark.parametrize(("training", "packs", "computing"), [
    ([1, 2], ROOMY, (1, 2)),  # following one another: views, whatever the room
    ([1, 2], [(100, 1)], (1, 2)),
    ([0, 3], ROOMY, (0, 3)),  # copies of half the rows fit the half of the workspace freed, in every pack
    ([0, 3], [(100, 100)], (0, 3)),
    ([0, 3], [*ROOMY, (100, 99)], (0, 1, 2, 3)),  # not in the last pack: every member from the first to the last
    ([0, 1, 3], ROOMY, (0, 1, 2, 3)),  # three quarters of the rows, a quarter of the workspace
    ([0, 2], [(100, 99)], (0, 1, 2)),
])
def test_a_step_computes_its_training_members_alone_where_they_follow_one_another_or_their_copies_fit(
    training: list[int], packs: list[tuple[int, int]], computing: tuple[int, ...]
) -> None:
    rows = computed_rows(training, 4, packs)
    assert rows is not None
    assert rows.computing == computing and rows.training == tuple(training) and rows.members == 4
    assert rows.viewed == (computing == tuple(range(computing[0], computing[-1] + 1)))


def test_every_member_training_or_none_leaves_the_step_as_it_is() -> None:
    assert computed_rows([0, 1, 2, 3], 4, ROOMY) is None
    assert computed_rows([], 4, ROOMY) is None


def stacks() -> dict[str, torch.Tensor]:
    return {"weight": torch.arange(24.0).reshape(4, 3, 2), "running_mean": torch.zeros(4, 2)}


def test_views_are_the_computed_members_rows_and_gradients_accumulate_into_them() -> None:
    rows = Rows((1, 2), (1, 2), 4)
    tensors = stacks()
    grads = {"weight": torch.zeros(4, 3, 2)}
    viewed, viewed_grads = rows.views(tensors), rows.views(grads)
    assert torch.equal(viewed["weight"], tensors["weight"][1:3])
    leaf = viewed["weight"].detach().requires_grad_()
    leaf.grad = viewed_grads["weight"]
    with rows.selected({"weight": leaf, "running_mean": viewed["running_mean"]}, ["running_mean"]) as chosen:
        assert chosen["weight"] is leaf, "views need no copies"
        (chosen["weight"].sum() * 2).backward()
        chosen["running_mean"].add_(1)
    assert torch.equal(grads["weight"][1:3], torch.full((2, 3, 2), 2.0)) and not grads["weight"][[0, 3]].any()
    assert torch.equal(tensors["running_mean"][1:3], torch.ones(2, 2)) and not tensors["running_mean"][[0, 3]].any()


def test_copies_of_rows_send_their_gradients_to_the_stacks_rows_and_their_buffers_back() -> None:
    rows = Rows((0, 3), (0, 3), 4)
    tensors = stacks()
    assert rows.views(tensors) is tensors, "rows that do not follow one another are selected per call"
    leaf = tensors["weight"].detach().requires_grad_()
    leaf.grad = torch.ones(4, 3, 2)
    with rows.selected({"weight": leaf, "running_mean": tensors["running_mean"]}, ["running_mean"]) as chosen:
        assert torch.equal(chosen["weight"], tensors["weight"][[0, 3]])
        (chosen["weight"] * torch.tensor([1.0, 5.0])[:, None, None]).sum().backward()
        chosen["running_mean"].add_(torch.tensor([[1.0], [2.0]]))
    assert leaf.grad[:, 0, 0].tolist() == [2.0, 1.0, 1.0, 6.0]
    assert tensors["running_mean"][:, 0].tolist() == [1.0, 0.0, 0.0, 2.0]


def test_members_computed_but_not_training_lose_their_gradients_and_losses() -> None:
    rows = Rows((0, 1, 2, 3), (0, 1, 3), 4)
    grads = {"weight": torch.full((4, 3, 2), math.inf)}
    rows.clear(grads)
    assert not grads["weight"][2].any() and torch.isinf(grads["weight"][[0, 1, 3]]).all()
    spread = Rows((1, 2, 3), (1, 3), 5).spread(torch.tensor([10.0, 20.0, 30.0]))
    assert spread[[1, 3]].tolist() == [10.0, 30.0] and spread[[0, 2, 4]].isnan().all()


def test_a_member_computes_the_step_it_diverged_at_and_none_from_its_pruning_step_after_that_steps_evaluation(
    store: HostStore
) -> None:
    for name in (diverged_name(0), pruned_name(0)):  # as the driver creates them (runtime.files)
        store.create(name, 8 * 4).view(torch.float64).fill_(TRAINING)
    members = Members(store, model=0, members=4)
    assert members.training(5) == [0, 1, 2, 3]
    members.check(torch.tensor([0.1, math.nan, 0.2, 0.3]), step=3)
    members.prune((2,), step=4)
    assert [members.training(step) for step in (3, 4, 5)] == [[0, 1, 2, 3], [0, 3], [0, 3]]
    assert [members.evaluated(step) for step in (3, 4, 5)] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 3]], (
        "ranked by the evaluation of its pruning step, not after; one that diverged is evaluated on")


def test_a_copy_of_the_computed_members_rows_moves_their_rows_of_every_stack_and_the_buffers_whole() -> None:
    """Four members: weight stacks of 4 x 3 float32 (12 bytes a row) and 4 float64 (8 bytes a row), then a buffer.
    Members 0 and 3 are two runs of one row in each stack; members 1 and 2 one run; the buffer from its offset on
    is moved whole; a tensor that is not a stack of the members (here of 2 rows) is moved whole."""
    stacks = lay_out([TensorSpec("w", "float32", (4, 3)), TensorSpec("b", "float64", (4,)),
                     TensorSpec("running", "float32", (4, 2))])
    w, b, running = stacks.slots
    buffers = running.offset
    assert Rows((0, 3), (0, 3), 4).spans(stacks, buffers) == (
        (w.offset, w.offset + 12), (w.offset + 36, b.offset + 8), (b.offset + 24, stacks.nbytes))
    assert Rows((1, 2), (1, 2), 4).spans(stacks, buffers) == (
        (w.offset + 12, w.offset + 36), (b.offset + 8, b.offset + 24), (buffers, stacks.nbytes))
    assert Rows((1, 2), (1, 2), 4).spans(stacks) == (
        (w.offset + 12, w.offset + 36), (b.offset + 8, b.offset + 24), (running.offset + 8, running.offset + 24))
    assert Rows((0, 1, 2, 3), (0, 3), 4).spans(stacks) == ((0, stacks.nbytes),), "every row: one copy"
    assert member_spans(stacks, 4, [3], buffers, shared=False) == (
        (w.offset + 36, w.offset + 48), (b.offset + 24, b.offset + 32)), "a member's rows alone, as a copy lacks them"
    shared = lay_out([TensorSpec("table", "float32", (2, 5)), TensorSpec("w", "float32", (4, 1))])
    table, stacked = shared.slots
    assert Rows((2,), (2,), 4).spans(shared) == ((0, table.spec.nbytes), (stacked.offset + 8, stacked.offset + 12))
    assert member_spans(shared, 4, [2], shared=False) == ((stacked.offset + 8, stacked.offset + 12),)


def test_the_bytes_a_part_leaves_out_are_what_its_spans_do_not_cover() -> None:
    assert gaps([(4, 8), (12, 16)], 20) == [(0, 4), (8, 12), (16, 20)]
    assert gaps([(0, 20)], 20) == [] and gaps([], 6) == [(0, 6)]
