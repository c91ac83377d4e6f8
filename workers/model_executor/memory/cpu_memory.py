"""Keep a step's freed memory for the next step, within a bound, on glibc.

glibc's default serves allocations over 128 KiB with mmap and returns them
to the kernel on free; a step that allocates tens of megabytes (gathered
keys and values, activations) then pays a page fault per 4 KiB, which on
CPU costs more than the copy itself. Raising the mmap and trim thresholds
keeps that memory in the heap for reuse.

Raised without bound (as this module once did: 1 GiB and 2 GiB) every malloc
arena kept the high-water mark of whatever ran on its threads, and a thread
other than the main one (the engine core, a Ray replica's) allocates from an
arena of 64 MiB heaps, where each of the sampler's vocabulary-wide buffers
(max_num_seqs x vocab floats: 50 MB on the default model at 256 rows) took a
heap of its own, kept for good. A served worker's RSS so rose by hundreds of
megabytes in its first minute under load, by an amount nothing in its
settings predicted. Now chunks of MMAP_THRESHOLD and more are mapped per use
(a page fault per 4 KiB of such a buffer, small beside the step that needs
it) and an arena keeps at most TRIM_THRESHOLD free at its top, so what stays
after a step is bounded by the settings; release_free_heap() hands back what
loading the weights left free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 64 << 20  # free memory an arena keeps at its top between steps
_done = False


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def keep_freed_memory_mapped() -> bool:
    """Returns True when the thresholds were set (glibc on Linux only)."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = _libc()
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        )
    except (OSError, AttributeError):
        ok = False  # not glibc (musl, macOS): nothing to tune
    _done = ok
    return ok


def release_free_heap() -> bool:
    """Give the kernel back the free pages of every arena (malloc_trim): once
    the weights and KV cache are in place, what loading left free (about
    200 MB on the default model) is not the steps' to keep. True when glibc
    released any."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return _libc().malloc_trim(0) == 1
    except (OSError, AttributeError):
        return False
