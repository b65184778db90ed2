"""Task bodies: a homed model's order of steps, a span's losses in their rows."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

import harmony
from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.bodies import homed_span_applied
from tests.conftest import assert_same_weights, regression_batches


def test_a_resident_task_must_start_where_its_model_is() -> None:
    assert not homed_span_applied(next_step=4, first=4, count=1, model=0)
    for first in (3, 6):
        with pytest.raises(RuntimeError, match="skipped or applied twice"):
            homed_span_applied(next_step=4, first=first, count=2, model=0)


def test_a_span_run_again_after_it_was_applied_does_nothing() -> None:
    """Its worker ran it to the end and flushed it, then died before Dask heard: the span runs again."""
    assert homed_span_applied(next_step=8, first=4, count=4, model=0)
    assert homed_span_applied(next_step=12, first=4, count=4, model=0)


def test_a_spans_losses_land_in_their_steps_rows_across_loss_blocks() -> None:
    """A multi-step task writes its steps' per-member losses together; a span that crosses a block boundary
    fills the end of one block and the start of the next."""
    from harmony.runtime.bodies import _record_losses
    from harmony.runtime.files import LOSS_BLOCK, losses_name

    members, first, count = 3, LOSS_BLOCK - 2, 5
    blocks: dict[str, torch.Tensor] = {}

    def attach(name: str, nbytes: int) -> torch.Tensor:
        return blocks.setdefault(name, torch.zeros(nbytes, dtype=torch.uint8))

    ctx = types.SimpleNamespace(store=types.SimpleNamespace(attach=attach),
                                spec=types.SimpleNamespace(models=[None, types.SimpleNamespace(members=members)]))
    totals = torch.arange(count * members, dtype=torch.float64).reshape(count, members) + 1
    _record_losses(ctx, 1, first, 0, totals)  # type: ignore[arg-type]
    rows = {name: block.view(torch.float64).view(LOSS_BLOCK, members) for name, block in blocks.items()}
    assert sorted(rows) == sorted([losses_name(1, 0), losses_name(1, 1)])
    torch.testing.assert_close(rows[losses_name(1, 0)][-2:], totals[:2])
    torch.testing.assert_close(rows[losses_name(1, 1)][:3], totals[2:])
    assert rows[losses_name(1, 0)][:-2].abs().sum() == 0 and rows[losses_name(1, 1)][3:].abs().sum() == 0


class InPlaceScale(nn.Module):
    """Scales its input in place, as an in-place activation writes the layer output before it (torchvision's
    EfficientNet and MobileNet): fine where the input is another layer's output, refused by autograd on a leaf."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.diag(torch.linspace(0.5, 1.5, width)))  # as many bytes as a linear layer's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.weight.diagonal())


@pytest.mark.parametrize("stash", [True, False], ids=["stashed", "recomputed"])
def test_a_pack_that_writes_its_input_in_place_trains_as_plain_pytorch(stash: bool, no_leaks: None) -> None:
    """Layers as large as each other, every other one scaling its input in place: a pack's input is kept for its
    backward and is an autograd leaf there, which such a layer would write (autograd refuses; a stash or a recompute
    would read changed values), so the pilot finds it writing its input and no pack starts at it: it stays with the
    layer whose output it writes. In float64, stashed or recomputed, the weights are plain PyTorch's (micro-batched
    the same way) within 1e-12. A pack that started at one raised in its backward before (torchvision's EfficientNet
    under a third of its bytes, cut before an in-place SiLU)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(3) for layer in (nn.Linear(32, 32), nn.Linear(32, 32),
                                                                 InPlaceScale(32))], nn.Linear(32, 4)).double()
    reference = copy.deepcopy(model)
    batches = [(x.double(), y.double()) for x, y in regression_batches(16 * 4, 16)]
    factory = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
    result = harmony.train(model, batches, loss_fn=nn.functional.mse_loss, optimizer=factory, devices=["cpu"],
                           device_memory=72_000, microbatches=2, stash=stash, packs_per_task=1,
                           progress=False)
    packing = result.plan.jobs[0].packing
    assert result.plan.jobs[0].home is None and len(packing.packs) > 3, [pack.first for pack in packing.packs]
    assert not any(isinstance(model[pack.first], InPlaceScale) for pack in packing.packs), "none starts a pack"
    assert result.stats.stashed > 0 if stash else result.stats.stashed == 0 < result.stats.recomputed
    optimizer = factory(reference.parameters())
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            (nn.functional.mse_loss(reference(xs), ys) / 2).backward()
        optimizer.step()
    assert_same_weights(model, reference, rtol=1e-12, atol=1e-14)
