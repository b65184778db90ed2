"""Byte layouts of a pack's tensors in one flat buffer."""

from __future__ import annotations

from harmony.tasks.layout import TensorSpec, lay_out


def test_layout_packs_tensors_at_natural_alignment_without_padding_between_same_dtypes() -> None:
    layout = lay_out([TensorSpec("a", "float32", (3,)), TensorSpec("b", "float32", (2, 2))])
    assert [slot.offset for slot in layout.slots] == [0, 12]
    assert layout.nbytes == layout.payload_bytes == 28
    mixed = lay_out([TensorSpec("x", "uint8", (3,)), TensorSpec("y", "float64", ())])
    assert [slot.offset for slot in mixed.slots] == [0, 8]
    assert mixed.nbytes == 16
