"""The embedded cluster's calibration kept on disk, so that a later process with the same devices on this machine
plans with it rather than measuring it again, and harmony.plan predicts with it.

What the calibration measures (runtime.calibrate: Dask's cost per task, the host's copy and update rates, a GPU's
speed) is the machine's and the software's, which the file's name holds (harmony.fitfiles: this machine, its
processor and cores, torch's and Harmony's versions), and the devices': their names, kinds and threads, the key of
an entry here. A user's cluster is measured in each process (its workers may be elsewhere). The file is the user's
alone and is removed with the fits (harmony.calls.forget(files=True)); HARMONY_CACHE_DIR="" keeps nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from harmony import fitfiles
from harmony.runtime.calibrate import measured_hardware
from harmony.runtime.cluster import ClusterHandle
from harmony.runtime.devices import DeviceSpec
from harmony.tasks.hardware import Hardware

KEPT = 16  # entries in a file, the latest


def devices_key(specs: list[DeviceSpec]) -> list[list[Any]]:
    """What makes two clusters' calibrations the same: each device's name, torch device and threads."""
    return sorted([spec.name, spec.torch_device, spec.threads] for spec in specs)


def kinds(specs: list[DeviceSpec]) -> str:
    """The device kinds of specs, the kind of file their calibration is kept in ("cpu", "cpu+cuda")."""
    return "+".join(sorted({spec.kind for spec in specs}))


def stored(specs: list[DeviceSpec]) -> Hardware | None:
    """The calibration an earlier process kept for these devices, or None."""
    key = devices_key(specs)
    for entry in reversed(fitfiles.load(kinds(specs), "calibration")):
        if entry.get("devices") == key:
            with contextlib.suppress(KeyError, TypeError):  # an entry of another layout: measured again
                return Hardware(**entry["hardware"])
    return None


def hardware(handle: ClusterHandle, specs: list[DeviceSpec]) -> Hardware:
    """This machine as the simulator sees it, calibrated on handle's cluster: once per cluster in a process, and for
    the embedded one, once on this machine for its devices (kept)."""
    cpu = any(spec.kind == "cpu" for spec in specs)
    kept = stored(specs) if handle.embedded else None
    measured = measured_hardware(handle.client, handle.workers, cpu_compute=cpu, by_name=handle.embedded, stored=kept)
    if handle.embedded and kept is None:
        key = devices_key(specs)
        kind = kinds(specs)  # read again: another process may have kept its own meanwhile
        entries = [entry for entry in fitfiles.load(kind, "calibration") if entry.get("devices") != key]
        entries.append({"devices": key, "hardware": dataclasses.asdict(measured)})
        fitfiles.save(kind, entries[-KEPT:], "calibration")
    return measured
