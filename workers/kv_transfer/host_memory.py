"""Host memory for the KV tiers' buffers: anonymous mappings, so a buffer
starts on a page (as O_DIRECT asks of the disk tier's staging), and
populated when made, so the tier's first pass through it takes no page
fault: on the CPU a fault every 4 KiB costs several times the copy that
touches it (about 3x what populating the same pages at once costs here),
and those faults would fall on the steps, on the cores they compute on.
"""

from __future__ import annotations

import mmap

import torch


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor on a page of its own mapping, its pages present."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=flags)
    return torch.frombuffer(buffer, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
