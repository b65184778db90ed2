"""No shared-memory file outlives its run: owner records, the sweep of runs whose driver is gone, the watchdog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from distributed import Client, LocalCluster
from torch import nn

import harmony
from harmony.runtime import orphans
from harmony.runtime.hoststore import HostStore
from harmony.runtime.orphans import claim, ending, owner_alive, sweep
from tests.conftest import deep_mlp, regression_batches


def dead_pid() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    return int(finished.stdout)


def stale_run(name: str) -> HostStore:
    """The files of a run whose driver was killed: an owner record naming a process that has ended."""
    store = HostStore(name)
    store.write_bytes("owner", json.dumps({"pid": dead_pid(), "started": 1.0}).encode())
    store.create("m0-p0-weights", 64)
    store.create("batch-0", 64)
    return store


def test_a_run_whose_owner_is_gone_is_swept_and_a_live_one_is_not() -> None:
    stale = stale_run("stale-unit")
    live = HostStore("live-unit")
    claim(live)
    live.create("m0-p0-weights", 64)
    try:
        assert owner_alive(live.read_bytes("owner") or b"") and not owner_alive(stale.read_bytes("owner") or b"")
        assert "stale-unit" in sweep()
        assert not list(stale.directory.glob("harmony-stale-unit-*"))
        assert len(list(live.directory.glob("harmony-live-unit-*"))) == 2
    finally:
        live.unlink_all()
        stale.unlink_all()


def fake_stat(proc: Path, pid: int, flags: int) -> None:
    """A /proc/<pid>/stat line of a process whose name has a parenthesis and spaces in it, with these flags."""
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(f"{pid} (a) b (c) R 1 {pid} {pid} 0 -1 {flags} 0 0 0 0 1 2 0 0 20 0 9\n")


def test_a_driver_that_is_ending_counts_as_gone_before_it_is_a_zombie(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed driver closes its sockets while still ending (PF_EXITING set, not yet a zombie); a worker closing
    on that and sweeping then must not take it for alive: it ends next, and no one else would sweep (the suite once
    left a killed run's 71 files so)."""
    me = psutil.Process()
    record = json.dumps({"pid": me.pid, "started": me.create_time()}).encode()
    assert owner_alive(record) and not ending(me.pid), "this process, read from the real /proc"
    monkeypatch.setattr(orphans, "PROC", tmp_path)
    fake_stat(tmp_path, me.pid, 0x400000)
    assert owner_alive(record) and not ending(me.pid)
    fake_stat(tmp_path, me.pid, 0x400000 | 0x400 | 0x4)  # as read from the killed driver: signalled, exiting
    assert ending(me.pid) and not owner_alive(record)
    assert not ending(me.pid + 1), "a process /proc does not show: not said to be ending"


def test_a_sweep_cut_short_leaves_the_owner_record_by_which_the_next_sweep_removes_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's watchdog sweeping its dead driver's files dies with its process when the worker's own close ends
    first (that close sweeps too, but finds no run whose owner record the watchdog already removed): the record
    goes last, so the files it leaves are still found."""
    stale = stale_run("stale-cut")
    for index in range(1, 8):
        stale.create(f"batch-{index}", 64)
    unlink = os.unlink
    removed: list[str] = []

    def cut_short(path: object) -> None:
        if len(removed) == 3:
            raise SystemExit("the worker's process ends")
        unlink(path)  # type: ignore[arg-type]
        removed.append(str(path))

    monkeypatch.setattr(os, "unlink", cut_short)
    with pytest.raises(SystemExit):
        sweep()
    monkeypatch.setattr(os, "unlink", unlink)
    try:
        left = sorted(path.name for path in stale.directory.glob("harmony-stale-cut-*"))
        assert len(left) == 7 and "harmony-stale-cut-owner" in left
        assert "stale-cut" in sweep() and not list(stale.directory.glob("harmony-stale-cut-*"))
    finally:
        stale.unlink_all()


@pytest.mark.filterwarnings("ignore:Port 8787 is already in use")
def test_a_run_on_a_users_cluster_sweeps_the_files_of_runs_whose_drivers_were_killed(no_leaks: None) -> None:
    stale = stale_run("stale-cluster")
    try:
        with (
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster,
            Client(cluster) as client,
        ):
            harmony.train(deep_mlp(depth=2), regression_batches(32, 16), loss_fn=nn.functional.mse_loss,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), cluster=client, progress=False)
        assert not list(stale.directory.glob("harmony-stale-cluster-*"))
    finally:
        stale.unlink_all()


ORPHANED_AT_BIRTH = """
import subprocess, sys, os
from harmony.runtime.orphans import driver_environment
worker = '''
import time
from pathlib import Path
time.sleep(1.0)  # its driver has ended by now: this process belongs to another parent
from harmony.runtime.orphans import watch_parent
watch_parent(0.05)
time.sleep(120)
'''
child = subprocess.Popen([sys.executable, "-c", worker], env={**os.environ, **driver_environment()},
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
"""


def test_a_worker_whose_driver_ended_before_its_watchdog_started_ends_at_once() -> None:
    """A driver killed while its embedded workers start: each worker's watchdog starts after the worker was handed
    to another parent, and watches the driver the environment names, not that parent."""
    import psutil

    started = subprocess.run([sys.executable, "-c", ORPHANED_AT_BIRTH], capture_output=True, text=True, check=True)
    worker = psutil.Process(int(started.stdout))

    def running() -> bool:
        try:
            return worker.status() != psutil.STATUS_ZOMBIE  # a zombie has ended, whether or not it is reaped yet
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 30  # its 1 s sleep, its imports (torch), a watch interval; not its 120 s
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = running()
    if alive:
        worker.kill()
    assert not alive, "the worker outlived its driver by 30 s"
