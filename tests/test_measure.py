"""What the simulator measures of this machine: copy speed, the host optimizer's rate, a GPU's speed and link."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harmony.runtime.measure import accelerator_speed, optimizer_rate, this_machine, with_accelerator
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
