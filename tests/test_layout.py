"""Byte layouts of a pack's tensors in one flat buffer."""

from __future__ import annotations

from harmony.tasks.layout import TensorSpec, halve, lay_out


def test_layout_packs_tensors_at_natural_alignment_without_padding_between_same_dtypes() -> None:
    layout = lay_out([TensorSpec("a", "float32", (3,)), TensorSpec("b", "float32", (2, 2))])
    assert [slot.offset for slot in layout.slots] == [0, 12]
    assert layout.nbytes == layout.payload_bytes == 28
    mixed = lay_out([TensorSpec("x", "uint8", (3,)), TensorSpec("y", "float64", ())])
    assert [slot.offset for slot in mixed.slots] == [0, 8]
    assert mixed.nbytes == 16


def test_a_halved_layout_puts_the_halved_tensors_first_and_lines_the_rest_up_with_the_host_slot() -> None:
    specs = [TensorSpec("norm.weight", "float32", (5,)), TensorSpec("a.weight", "float32", (3, 3)),
             TensorSpec("steps", "int64", ()), TensorSpec("a.bias", "float32", (3,))]
    halved = halve(specs, frozenset({"a.weight", "a.bias"}), "bfloat16")
    host = {slot.spec.name: slot for slot in halved.host.slots}
    device = {slot.spec.name: slot for slot in halved.device.slots}
    assert [slot.spec.name for slot in halved.host.slots] == ["a.weight", "a.bias", "norm.weight", "steps"]
    assert host["a.weight"].spec.dtype == "float32" and device["a.weight"].spec.dtype == "bfloat16"
    assert (host["a.bias"].offset, device["a.bias"].offset) == (36, 18)
    assert halved.host_split == 48 and halved.device_split == 32  # 48 and 24 bytes, aligned to 16
    for name in ("norm.weight", "steps"):  # the rest: one copy from the host slot's split on
        assert host[name].spec == device[name].spec
        assert host[name].offset - halved.host_split == device[name].offset - halved.device_split
    assert device["steps"].offset % 8 == 0
    assert halved.host.nbytes - halved.host_split == halved.device.nbytes - halved.device_split
    assert halved.device.nbytes < halved.host.nbytes
