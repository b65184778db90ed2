"""Task bodies: a homed model's order of steps, a span's losses in their rows."""

from __future__ import annotations

import types

import pytest
import torch

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.bodies import homed_span_applied


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
