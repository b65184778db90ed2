"""The host store: shared-memory files every process of a machine maps without copies."""

from __future__ import annotations

import pytest

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.hoststore import HostStore


def test_host_store_buffers_are_shared_between_mappings(store: HostStore) -> None:
    a = store.create("x", 16)
    other = HostStore("unittest").attach("x", 16)
    a[3] = 9
    assert other[3] == 9
    assert store.unlink_all() == 1
    assert not store.path("x").exists()


def test_a_closed_host_store_creates_no_file(store: HostStore) -> None:
    """What a worker's store does once its run is torn down: a late task fails instead of leaving a file."""
    late = HostStore("unittest")
    late.create("kept", 8)
    late.close()
    for touch in (lambda: late.create("new", 8), lambda: late.attach("kept", 8), lambda: late.write_bytes("m", b"")):
        with pytest.raises(RuntimeError, match="closed"):
            touch()
    assert sorted(path.name for path in late.directory.glob("harmony-unittest-*")) == ["harmony-unittest-kept"]
