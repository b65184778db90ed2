"""Host memory reuse in a device worker process: glibc malloc keeps freed tensor memory for the next tensor.

PyTorch's CPU tensors come straight from malloc. Under glibc, a block over the mmap threshold (128 KiB at
start) is a fresh mmap whose every page faults on first touch and is unmapped on free, and the top of the
heap is given back to the system once more than the trim threshold is free. A device worker allocates and
frees the same activation-sized blocks every step, so it pays those page faults every step; Dask's nanny
makes it worse, starting workers with MALLOC_TRIM_THRESHOLD_=65536, which also pins the mmap threshold at
128 KiB (docs/performance.md, "Freed memory kept for reuse"). Raising both thresholds keeps freed blocks for
the next tensor. Elsewhere (other C libraries) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 256 * 2**20


def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MiB from the heap and keep up to 256 MiB of freed heap for reuse, in this process.

    Returns whether it applied (glibc on Linux); idempotent.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
