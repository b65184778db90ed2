"""What the simulator measures of this machine: copy speed, the host optimizer's rate, a GPU's speed and link."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from harmony.runtime.measure import accelerator_speed, optimizer_rate, this_machine, update_rate, with_accelerator
from harmony.tasks.hardware import Hardware


def test_this_machine_measures_its_copies_and_its_host_optimizer() -> None:
    machine = this_machine()
    assert machine.host_link and machine.host_link > 0 and machine.compute_scale == 1.0
    assert machine.optimizer_bytes_per_second != Hardware().optimizer_bytes_per_second, "measured, not the default"
    assert optimizer_rate(1 << 16, repeats=1) > 0


def test_a_gpus_speed_and_link_replace_the_hosts_where_measured() -> None:
    host = Hardware("this machine", host_link=1e10, task_overhead=0.002)
    assert with_accelerator(host, None) is host
    gpu = with_accelerator(host, (80.0, 2.5e10))
    assert (gpu.compute_scale, gpu.host_link, gpu.task_overhead) == (80.0, 2.5e10, 0.002)
    assert gpu.name == "this machine, its GPUs" and dataclasses.replace(gpu, name=host.name, compute_scale=1.0,
                                                                          host_link=1e10) == host


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures the GPU where there is one (test_gpu)")
def test_without_cuda_there_is_no_gpu_speed_to_measure() -> None:
    assert accelerator_speed() is None


class Ticking(torch.optim.SGD):
    """SGD whose every step takes the next of its clock's durations."""

    def __init__(self, params: list[torch.nn.Parameter], clock: SimpleNamespace) -> None:
        super().__init__(params, lr=0.1)
        self.clock = clock

    def step(self, closure: Any = None) -> Any:
        self.clock.now += self.clock.durations.pop(0)
        return super().step(closure)


def test_a_jobs_update_is_timed_on_probes_of_its_parameters_the_fastest_step_after_the_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The step that makes the state is not counted, however long it takes (0.5 s here); of the next three the
    fastest is, per trainable byte (the frozen bias is not stepped). The layers' own weights and gradients are
    untouched."""
    from harmony.runtime import measure

    clock = SimpleNamespace(now=0.0, durations=[0.5, 3.0, 1.0, 2.0])
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    layers = [torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)]
    layers[2].bias.requires_grad_(False)
    before = [param.detach().clone() for layer in layers for param in layer.parameters()]
    rate = update_rate(lambda params: Ticking(params, clock), layers)
    assert rate == 1.0 / (4 * (4 * 3 + 3 + 3 * 2)) and not clock.durations
    after = [param.detach() for layer in layers for param in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(param.grad is None for layer in layers for param in layer.parameters())


def test_an_arrays_update_is_timed_by_its_stacked_optimizer_and_none_where_it_cannot_be(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from harmony.runtime import measure
    from harmony.runtime.array import ArrayLayer
    from harmony.runtime.array_optimizer import ArrayOptimizer

    members = [torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)) for _ in range(3)]
    array = [ArrayLayer([member[position] for member in members], shared_input=position == 0) for position in range(3)]
    adam = ArrayOptimizer([lambda params, lr=lr: torch.optim.Adam(params, lr=lr) for lr in (0.1, 0.01, 0.001)])
    assert update_rate(adam, array) > 0

    def failing(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        raise ValueError("not on probes")

    assert update_rate(failing, list(members[0])) is None
    assert update_rate(lambda params: torch.optim.SGD(params, lr=0.1), [torch.nn.ReLU()]) is None, "nothing to step"
    monkeypatch.setattr(measure, "PROBE_BYTES", 4 * 2 - 1)
    assert update_rate(lambda params: torch.optim.SGD(params, lr=0.1), list(members[0])) is None, "none fits"


def test_a_large_models_update_is_timed_on_the_parameters_that_fit_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Of weights 48, bias 12, weights 24 and bias 8 bytes, under 35 bytes of probes: the first bias, then the bias
    that still fits (either weights would pass); the rate is per byte of those."""
    from harmony.runtime import measure

    clock = SimpleNamespace(now=0.0, durations=[0.5, 3.0, 1.0, 2.0])
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(measure, "PROBE_BYTES", 35)
    shapes: list[list[tuple[int, ...]]] = []

    def recorded(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        shapes.append([tuple(param.shape) for param in params])
        return Ticking(params, clock)

    rate = update_rate(recorded, [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)])
    assert shapes == [[(3,), (2,)]] and rate == 1.0 / (4 * (3 + 2))
