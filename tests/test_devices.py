"""Device specs: names, budgets and each worker's share of the CPU threads."""

from __future__ import annotations

from harmony.runtime import handoff, serialization  # noqa: F401
from harmony.runtime.devices import DeviceSpec, build_specs, cpu_count, shared_threads, threads_per_device
from tests.conftest import one_left_alone


def test_every_device_worker_gets_an_even_share_of_the_cpu_threads() -> None:
    """GPU workers too: they step optimizers on the host store, which one thread made the bottleneck."""
    specs = build_specs(["cpu", "cuda:0"], budget=1_000_000)
    assert [spec.threads for spec in specs] == [threads_per_device(cpu_count(), 2)] * 2
    assert threads_per_device(16, 1) == 16 and threads_per_device(16, 3) == 5 and threads_per_device(2, 4) == 1
    assert [spec.threads for spec in build_specs(["cpu", "cpu", "cuda:0"], 1_000_000, threads=3)] == [3, 3, 3], (
        "threads=3: a count for every device, however many the machine has")


def test_idle_cpu_devices_give_their_threads_to_the_cpu_devices_of_their_machine_that_still_compute() -> None:
    specs = [DeviceSpec("cpu-0", "cpu", 1000, 3), DeviceSpec("cpu-1", "cpu", 1000, 3),
             DeviceSpec("cpu-2", "cpu", 1000, 3), DeviceSpec("cuda-0", "cuda:0", 1000, 3),
             DeviceSpec("cpu-3", "cpu", 1000, 2, machine="other"), DeviceSpec("cpu-4", "cpu", 1000, 2, machine="other")]
    own = {spec.name: spec.threads for spec in specs if spec.kind == "cpu"}
    assert shared_threads(specs, frozenset()) == own
    assert shared_threads(specs, frozenset({"cpu-0"})) == {**own, "cpu-1": 5, "cpu-2": 4}, "3 threads, shared"
    assert shared_threads(specs, frozenset({"cpu-0", "cuda-0", "cpu-3"})) == {**own, "cpu-1": 5, "cpu-2": 4,
                                                                           "cpu-4": 4}, "within each machine"
    assert shared_threads(specs, frozenset({"cpu-0", "cpu-1", "cpu-2"})) == own, "no CPU device left to take them"


def test_a_homed_model_left_alone_computes_with_the_threads_of_the_device_that_finished(no_leaks: None) -> None:
    """Two models homed on two CPU devices, one with far fewer steps: once it ends its device has nothing left to
    compute, and the other's later tasks run with both devices' threads (the first of each task so, as the device
    times its new share both ways, runtime.threads); the weights are still plain PyTorch's."""
    own = threads_per_device(cpu_count(), 2)
    assert [float(model[0].most) for model in one_left_alone()] == [own, 2 * own]
