"""Device workers keep freed tensor memory for reuse, even under the nanny's malloc setting."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from harmony.runtime import handoff, serialization  # noqa: F401

FAULTS_PER_ALLOCATION = '''
import resource, torch
torch.set_num_threads(1)
from harmony.runtime.allocator import keep_freed_memory
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        torch.empty(2**20, dtype=torch.uint8).fill_(1)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 40
faults()
before = faults()
applied = keep_freed_memory()
faults()  # the heap grows once to hold the block
print(before, applied, faults())
'''


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc thresholds are glibc's")
def test_a_device_worker_reuses_freed_tensor_memory_even_under_the_nannys_malloc_setting() -> None:
    environment = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"}  # what Dask's nanny gives its workers
    output = subprocess.run([sys.executable, "-c", FAULTS_PER_ALLOCATION], env=environment, capture_output=True,
                            text=True, check=True).stdout.split()
    before, applied, after = float(output[0]), output[1], float(output[2])
    assert before > 200, f"a fresh mmap per 1 MiB tensor faults on each of its 256 pages (got {before})"
    assert applied == "True" and after < 10, f"after keep_freed_memory a freed block is reused ({after} faults)"
