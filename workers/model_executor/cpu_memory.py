"""Keep freed memory mapped on glibc, so large per-step tensors do not
page-fault afresh every time.

glibc serves allocations over 128 KiB with mmap and returns them to the
kernel on free; a step that allocates tens of megabytes (gathered keys and
values, activations) then pays a page fault per 4 KiB, which on CPU costs
more than the copy itself. Raising the mmap and trim thresholds keeps that
memory in the heap for reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory_mapped() -> bool:
    """Returns True when the thresholds were set (glibc on Linux only)."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
    except (OSError, AttributeError):
        ok = False  # not glibc (musl, macOS): nothing to tune
    _done = ok
    return ok
