"""The embedded cluster's calibration kept on disk: taken by a later process with the same devices and by
harmony.plan, measured again for other devices, with no cache directory, or on a user's cluster."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import harmony
from harmony import calibration, fitfiles
from harmony.runtime import calibrate
from harmony.runtime.devices import DeviceSpec
from harmony.tasks.hardware import Hardware
from tests.conftest import deep_mlp, regression_batches


def sgd(parameters: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.01)


def train(devices: list[str]) -> harmony.TrainResult:
    return harmony.train(deep_mlp(depth=4), regression_batches(64, 16), loss_fn=nn.functional.mse_loss,
                         optimizer=sgd, devices=devices, progress=False)


def measurements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The calibrations measured from now on (one entry each), counted."""
    measured: list[int] = []
    task_cost = calibrate.task_cost

    def counted(*args: object, **kwargs: object) -> tuple[float, float, float]:
        measured.append(1)
        return task_cost(*args, **kwargs)

    monkeypatch.setattr(calibrate, "task_cost", counted)
    return measured


LATER_PROCESS = """
import torch
from torch import nn
import harmony
from harmony.runtime import calibrate
from tests.conftest import deep_mlp, regression_batches


def refused(*args, **kwargs):
    raise AssertionError("measured again")


calibrate.task_cost = refused
result = harmony.train(deep_mlp(depth=4), regression_batches(64, 16), loss_fn=nn.functional.mse_loss,
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.01), devices=["cpu", "cpu"], progress=False)
print(repr(result.stats.task_seconds))
"""


def test_a_later_process_with_the_same_devices_takes_the_calibration_kept_and_plan_predicts_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calibrate.MEASURED.clear()  # as a fresh process: nothing measured yet
    measured = measurements(monkeypatch)
    first = train(["cpu", "cpu"])
    assert len(measured) == 1
    [entry] = fitfiles.load("cpu", "calibration")
    assert entry["devices"] == [["cpu-0", "cpu", 1], ["cpu-1", "cpu", 1]]
    assert entry["hardware"]["task_overhead"] == first.stats.task_seconds > 0
    later = subprocess.run([sys.executable, "-c", LATER_PROCESS], capture_output=True, text=True, timeout=300)
    assert later.returncode == 0, later.stderr
    assert float(later.stdout.strip().splitlines()[-1]) == first.stats.task_seconds, "the kept figure, not measured"

    forecast = harmony.plan(deep_mlp(depth=4), regression_batches(64, 16), loss_fn=nn.functional.mse_loss,
                            optimizer=sgd, devices=["cpu", "cpu"])
    kept = Hardware(**entry["hardware"])
    assert (forecast.hardware.task_overhead, forecast.hardware.edge_seconds, forecast.hardware.task_cpu) == (
        kept.task_overhead, kept.edge_seconds, kept.task_cpu)
    alone = harmony.plan(deep_mlp(depth=4), regression_batches(64, 16), loss_fn=nn.functional.mse_loss,
                         optimizer=sgd, devices=["cpu"])
    assert alone.hardware.task_overhead == Hardware().task_overhead, "nothing kept for one device: the default"


def test_other_devices_no_cache_directory_or_an_entry_of_another_layout_measure_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calibrate.MEASURED.clear()
    measured = measurements(monkeypatch)
    train(["cpu", "cpu"])
    train(["cpu"])
    assert len(measured) == 2, "one device is not two"
    assert [entry["devices"] for entry in fitfiles.load("cpu", "calibration")] == [
        [["cpu-0", "cpu", 1], ["cpu-1", "cpu", 1]], [["cpu-0", "cpu", 2]]]

    calibrate.MEASURED.clear()
    train(["cpu"])
    assert len(measured) == 2, "kept on disk: not measured again"
    entries = fitfiles.load("cpu", "calibration")
    fitfiles.save("cpu", [entries[0], {**entries[1], "hardware": {"speed": 1.0}}], "calibration")
    calibrate.MEASURED.clear()
    train(["cpu"])
    assert len(measured) == 3, "an entry this version cannot read is measured again and replaced"
    assert fitfiles.load("cpu", "calibration")[-1]["hardware"]["task_overhead"] > 0

    monkeypatch.setenv("HARMONY_CACHE_DIR", "")
    calibrate.MEASURED.clear()
    train(["cpu"])
    assert len(measured) == 4, "no cache directory: nothing kept to take"


def test_a_users_cluster_is_measured_in_each_process_and_kept_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [DeviceSpec("gpu-box", "cpu", 10**9, 1)]
    measured = Hardware(task_overhead=0.004)
    fitfiles.save("cpu", [{"devices": calibration.devices_key(specs),
                           "hardware": dataclasses.asdict(Hardware(task_overhead=0.001))}], "calibration")
    given: list[Hardware | None] = []

    def measure(client: object, workers: object, cpu_compute: bool, by_name: bool, stored: Hardware | None
                ) -> Hardware:
        given.append(stored)
        return stored or measured

    monkeypatch.setattr(calibration, "measured_hardware", measure)
    users = SimpleNamespace(embedded=False, client=None, workers={"gpu-box": "tcp://10.0.0.2:1234"})
    assert calibration.hardware(users, specs) == measured and given == [None], "a user's worker may be elsewhere"
    assert fitfiles.load("cpu", "calibration")[0]["hardware"]["task_overhead"] == 0.001, "not written either"
    ours = SimpleNamespace(embedded=True, client=None, workers={"gpu-box": "tcp://127.0.0.1:1234"})
    assert calibration.hardware(ours, specs).task_overhead == 0.001 and given[-1] is not None
