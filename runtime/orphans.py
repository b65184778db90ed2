"""No shared-memory file outlives the run that made it, however its driver ends.

A run's first file is its owner record: the process that owns the run's files (the driver) and when it started.
``sweep`` removes every file of a run whose owner is gone (a process of that id that started at another time is
another process). It runs when a run starts (on the driver's machine), when a run is set up or torn down on a
worker (a user's cluster outlives the runs that use it), when an embedded worker closes (it closes as soon as
the scheduler in its dead driver stops answering), and in an embedded worker whose driver died: ``watch_parent``,
which every embedded worker starts, sweeps and ends the worker within a second of its parent's death, SIGKILL
included, whichever comes first.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import psutil

from harmony.runtime.hoststore import OWNER, PREFIX, HostStore, freeze, shm_directory

WATCH_INTERVAL = 0.5
DRIVER = "HARMONY_DRIVER_PID"
PF_EXITING = 0x4  # linux/sched.h: the process has begun to end
PROC = Path("/proc")


def claim(store: HostStore) -> None:
    """Record this process as the owner of the store's run (before any other file of the run exists)."""
    me = psutil.Process()
    store.write_bytes(OWNER, json.dumps({"pid": me.pid, "started": me.create_time()}).encode())


def claim_remote(store: HostStore, run: str) -> None:
    """Record, in a machine's store that the driver does not map, that the run's owner is on another machine:
    sweeps there leave its files alone, and the scheduler removes them when the driver's client goes
    (runtime.run.RunOwner)."""
    store.write_bytes(OWNER, json.dumps({"remote": run}).encode())


def owner_alive(record: bytes) -> bool:
    """Whether the process an owner record names still runs (the same process: same id, same start; a process
    that has ended but is not yet reaped by its parent, a zombie, or is ending, has ended). A remote owner counts as
    alive."""
    try:
        owner = json.loads(record)
        if "remote" in owner:
            return True
        process = psutil.Process(int(owner["pid"]))
        same = abs(process.create_time() - float(owner["started"])) < 1e-3
        return same and process.status() != psutil.STATUS_ZOMBIE and not ending(process.pid)
    except (ValueError, KeyError, TypeError, psutil.Error):
        return False


def ending(pid: int) -> bool:
    """Whether a process has begun to end (Linux: the PF_EXITING flag of /proc/<pid>/stat; elsewhere never said).
    A killed driver's sockets close while it is still ending, not yet a zombie: one thread lets go of the files
    while another frees the memory. Its workers, which close as those sockets close and then end, sweep in that
    window, and must see the driver gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return bool(int(fields[6]) & PF_EXITING)
    except (OSError, IndexError, ValueError):
        return False


def gone(run: str, directory: Path | None = None) -> bool:
    """Whether a run's owner is gone (or its owner record, swept with its files)."""
    record = (directory or shm_directory()) / f"{PREFIX}{run}-{OWNER}"
    try:
        return not owner_alive(record.read_bytes())
    except FileNotFoundError:
        return True


def sweep(directory: Path | None = None) -> list[str]:
    """Remove the files of every run whose owner is gone; returns the runs removed."""
    directory = directory or shm_directory()
    removed = []
    for record in directory.glob(f"{PREFIX}*-{OWNER}"):
        run = record.name[len(PREFIX) : -len(OWNER) - 1]
        try:
            alive = owner_alive(record.read_bytes())
        except FileNotFoundError:
            continue  # removed by its run, or by another sweep
        if not alive:
            HostStore(run, directory).unlink_all()
            removed.append(run)
    return removed


def driver_environment() -> dict[str, str]:
    """The environment by which an embedded worker knows its driver (watch_parent)."""
    return {DRIVER: str(os.getpid())}


def watch_parent(interval: float = WATCH_INTERVAL) -> threading.Thread:
    """In an embedded worker: a thread that, once the process that started this one is gone, removes the files
    of runs whose owner is gone and ends this process. That process is the driver its environment names: a driver
    that ended while the worker started has left it to another parent before this runs."""
    parent = int(os.environ.get(DRIVER, os.getppid()))

    def watch() -> None:
        while os.getppid() == parent and psutil.pid_exists(parent):
            time.sleep(interval)
        try:
            freeze()  # a task still running makes no file behind the sweep
            sweep()
        finally:
            os._exit(0)

    thread = threading.Thread(target=watch, name="harmony-watchdog", daemon=True)
    thread.start()
    return thread
