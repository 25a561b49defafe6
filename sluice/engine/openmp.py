"""Keep one OpenMP thread pool per process: the engine thread's.

torch's OpenMP runtime on Linux (libgomp) gives every thread that starts a parallel region its
own pool of worker threads, and once it manages more threads than there are CPUs it lets an idle
worker spin ~100 times instead of ~300,000 before it sleeps in the kernel. A server builds the
model on its main thread (leaving that thread a pool) and then computes on the engine thread (a
second pool): on a 2-core machine every parallel region of a step then waited on a futex
wake-up (fork/join measured 20-90 us from the second thread against ~6 us), and a lone decode ran
~1.7x slower than the same engine stepped on the main thread (docs/measured/s27/openmp-pools.md).
"""
from __future__ import annotations

import ctypes
import logging
from typing import Optional

logger = logging.getLogger("sluice.engine")

_OMP_PAUSE_SOFT = 1


def _libgomp() -> Optional[ctypes.CDLL]:
    """The libgomp this process has loaded (torch's), or None (another runtime, or none)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def release_calling_thread_pool() -> bool:
    """Let the calling thread's OpenMP workers exit, and have its later parallel regions (torch
    ops it still runs: small ones, serving HTTP) run on itself alone, so that the engine thread's
    pool is the only one. Other threads keep their thread counts. Returns False where there is no
    libgomp to ask (nothing to do)."""
    lib = _libgomp()
    if lib is None:
        return False
    if lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) != 0:
        logger.warning("could not release this thread's OpenMP workers")
    lib.omp_set_num_threads(1)
    return True
