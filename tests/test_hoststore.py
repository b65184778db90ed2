"""The host store: shared-memory files every process of a machine maps without copies."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_host_store_files_are_the_users_alone_and_their_bytes_are_allocated_up_front(store: HostStore) -> None:
    import os
    import stat

    store.create("private", 1 << 20)
    store.write_bytes("meta", b"x")
    for name in ("private", "meta"):
        assert stat.S_IMODE(os.stat(store.path(name)).st_mode) == 0o600
    assert os.stat(store.path("private")).st_blocks * 512 >= 1 << 20, "a sparse file would SIGBUS when /dev/shm fills"


def test_a_host_store_over_its_budget_says_so_instead_of_creating_the_file() -> None:
    from harmony.runtime.hoststore import HostStoreFull

    budgeted = HostStore("unittest-budget", budget=10_000)
    try:
        budgeted.create("a", 6_000)
        with pytest.raises(HostStoreFull, match="host_memory is 10,000 bytes"):
            budgeted.create("b", 6_000)
        assert not budgeted.path("b").exists()
    finally:
        budgeted.unlink_all()


FULL_SHM = """
import os, sys
from harmony.runtime.hoststore import HostStore, HostStoreFull
store = HostStore("fills")
try:
    for index in range(100):
        store.create(f"block{index}", 16 << 20)
except HostStoreFull as error:
    print("FULL", index, error)
print("LEFT", len([name for name in os.listdir("/dev/shm") if name.startswith("harmony-fills-")]))
store.unlink_all()
"""


def test_a_full_dev_shm_is_a_clear_error_never_a_sigbus(tmp_path: Path) -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root to give the test a private 64 MiB /dev/shm")
    script = tmp_path / "fill.py"
    script.write_text(FULL_SHM)
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {script}"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path},
    )
    assert done.returncode == 0, done.stderr
    assert "FULL 4 could not allocate 16,777,216 bytes" in done.stdout and "/dev/shm has" in done.stdout
    assert "LEFT 4" in done.stdout, "the file that did not fit is not left half-made"


def test_a_file_others_could_have_written_is_refused(store: HostStore) -> None:
    """A file under the run's name that the run's stores did not make (readable or writable by others, or
    another user's) is never mapped: a worker reads only what its run wrote."""
    path = store.path("planted")
    path.write_bytes(b"\0" * 64)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="not a file this run made"):
        HostStore("unittest").attach("planted", 64)
    os.chmod(path, 0o600)
    assert HostStore("unittest").attach("planted", 64).numel() == 64
    if os.getuid() == 0:
        os.chown(path, 65534, 65534)
        with pytest.raises(PermissionError, match="owned by uid 65534"):
            HostStore("unittest").attach("planted", 64)
    store.unlink_all()
