"""A step's small inputs, gathered on the host and sent in one copy.

Every step has a dozen little tensors (token ids, positions, slots, block
tables, sequence lengths, sampling settings). Made one by one with
torch.tensor(..., device="cuda") each is its own pageable copy and sync;
here they are packed into one pinned host buffer, copied with one
non-blocking transfer, and handed out as views of the device buffer.

The pinned buffers are reused: two, in turn. A step's copy is done once
its sampled tokens are fetched; under async scheduling the next step is
staged while this one computes, so it writes the other buffer, and the
one after is staged only once this step's tokens are back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch

from shoal.proto.utils import cdiv

_ALIGN = 16  # bytes: every view starts aligned for any dtype used here


class StagingBuffer:
    """One per model runner. Use: batch = buf.begin(); batch.add(...) for
    each input; tensors = batch.upload()."""

    def __init__(self, device: torch.device, initial_bytes: int = 1 << 16):
        self.device = device
        self.pinned = device.type == "cuda"
        self._host = self._new_host(initial_bytes)
        self._dev = torch.empty(initial_bytes, dtype=torch.uint8, device=device) if self.pinned else None
        self._other: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the second pair, made on first use
        self.num_uploads = 0  # host-to-device copies made: one per step (tests count them)

    def _new_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def begin(self) -> StagedBatch:
        return StagedBatch(self)

    def _swap(self) -> None:
        """Take the other pair of buffers (a step's are left alone while it computes)."""
        if self._other is None:
            n = self._host.numel()
            self._other = (self._new_host(n), torch.empty(n, dtype=torch.uint8, device=self.device))
        (self._host, self._dev), self._other = self._other, (self._host, self._dev)

    def _reserve(self, nbytes: int) -> None:
        if self._host.numel() < nbytes:
            size = max(nbytes, 2 * self._host.numel())
            self._host = self._new_host(size)
            if self.pinned:
                self._dev = torch.empty(size, dtype=torch.uint8, device=self.device)


class StagedBatch:
    """The named arrays of one step, laid out back to back."""

    def __init__(self, buffer: StagingBuffer):
        self._buffer = buffer
        self._arrays: dict[str, tuple[np.ndarray, torch.dtype, tuple[int, ...]]] = {}
        self.device_bytes: torch.Tensor | None = None  # set by upload()

    def add(
        self, name: str, values: Sequence | np.ndarray, dtype: torch.dtype, shape: tuple[int, ...] | None = None
    ) -> None:
        """values: a flat list (or array) of numbers; shape, when given,
        reshapes the device view (a block table's [rows, width])."""
        assert name not in self._arrays, f"{name!r} staged twice"
        arr = np.asarray(values, dtype=torch.empty(0, dtype=dtype).numpy().dtype).reshape(-1)
        self._arrays[name] = (arr, dtype, shape if shape is not None else (arr.size,))

    @property
    def nbytes(self) -> int:
        """The layout's size so far: the arrays added up to now fill [0, nbytes)."""
        return self._layout()[1]

    def _layout(self) -> tuple[list[int], int]:
        offsets, end = [], 0
        for arr, _, _ in self._arrays.values():
            offsets.append(end)
            end += cdiv(arr.nbytes, _ALIGN) * _ALIGN
        return offsets, end

    def views(self, device_bytes: torch.Tensor) -> dict[str, torch.Tensor]:
        """The arrays' places in another uint8 buffer laid out like this batch
        (a CUDA graph's static inputs)."""
        offsets, _ = self._layout()
        out = {}
        for (name, (arr, dtype, shape)), off in zip(self._arrays.items(), offsets):
            out[name] = device_bytes[off : off + arr.nbytes].view(dtype).view(shape)
        return out

    def upload(self) -> dict[str, torch.Tensor]:
        """Device tensors by name, after one host-to-device copy (none on the
        CPU). The whole uploaded buffer stays in `device_bytes`."""
        buf = self._buffer
        offsets, end = self._layout()
        if buf.pinned:
            buf._swap()
            buf._reserve(end)
            host = buf._host
        else:
            # On the CPU the views are the step's tensors themselves: a fresh
            # buffer per step, so nothing a step still holds is overwritten.
            host = torch.empty(max(end, _ALIGN), dtype=torch.uint8)
        host_np = host.numpy()
        for (arr, _, _), off in zip(self._arrays.values(), offsets):
            host_np[off : off + arr.nbytes] = arr.view(np.uint8)
        if buf.pinned:
            dev = cast(torch.Tensor, buf._dev)  # pinned: on the device
            dev[:end].copy_(host[:end], non_blocking=True)
            buf.num_uploads += 1
        else:
            dev = host
        self.device_bytes = dev
        return self.views(dev)
