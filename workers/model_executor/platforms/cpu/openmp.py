"""One OpenMP team per engine: release a thread's team when it stops computing.

torch's CPU ops and shoal's kernels run their parallel regions on libgomp,
which keeps a team of threads for every thread that ever entered one. A
thread that built the engine (loading, profiling, warm-up) keeps its team
after handing the steps to another thread (AsyncEngine's engine core), and
libgomp then counts more OpenMP threads than cores. When it does, a thread
that reaches a barrier spins about 100 times instead of 300,000 before it
sleeps in the kernel, so every parallel region of a step ends in a futex
wake-up. On 2 cores the engine core and its partner each idled about a
tenth of the time: an AsyncEngine made 12% fewer tokens a second than with
one team, and a served worker 27% fewer (docs/benchmarks/2026-12-07-overlap.md).

release_thread_team() ends the calling thread's team (OpenMP 5's
omp_pause_resource_all, soft); the thread gets a new one if it computes
again. Elsewhere (another OpenMP runtime, none) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch  # noqa: F401  (its ops' libgomp is loaded before _libgomp looks, and caches it)

_OMP_PAUSE_SOFT = 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process runs on (torch's wheel bundles its own), if any."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)  # the loaded copy, never a second one
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):  # OpenMP 5 (GCC 9 on)
            return lib
    return None


def release_thread_team() -> bool:
    """End the calling thread's OpenMP team, if it has one; True when the
    runtime did (libgomp), False where there is nothing to do it with."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
