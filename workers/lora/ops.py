"""The grouped LoRA update of a linear layer's output, in torch (the CPU's
path; Punica's SGMV, vLLM's sgmv_shrink + sgmv_expand).

The base layer computes y = x W^T once for the whole step; then each run of
consecutive rows that share an adapter (a segment) adds
scaling * (x_seg A) B from the adapter's slot: two matmuls a segment, never
a loop over rows. Adapters live in fixed slots of padded tensors,
A [slots, in, max_rank] and B [slots, max_rank, out], whose rows and
columns past an adapter's own rank are zero: a slot is filled by a copy,
and the padding adds exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_LORA = -1  # a row of the base model


@dataclass(frozen=True)
class Segment:
    start: int
    length: int
    slot: int


def lora_segments(row_slots: torch.Tensor) -> list[Segment]:
    """The runs of consecutive rows under one adapter slot, base rows (NO_LORA) left out."""
    if row_slots.numel() == 0:
        return []
    slots, counts = torch.unique_consecutive(row_slots.cpu(), return_counts=True)
    out, start = [], 0
    for slot, n in zip(slots.tolist(), counts.tolist()):
        if slot != NO_LORA:
            out.append(Segment(start, n, slot))
        start += n
    return out


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scalings: torch.Tensor,
    segments: list[Segment],
    out_offset: int = 0,
) -> torch.Tensor:
    """y[rows, out_offset : out_offset + out] += scalings[slot] * (x[rows] @ lora_a[slot]) @ lora_b[slot]
    for each segment's rows, in place; returns y.

    x [T, in]; y [T, >= out_offset + out]; lora_a [slots, in, R];
    lora_b [slots, R, out]; scalings [slots] float32. The update is
    computed in float32 and added in y's dtype."""
    if not segments:
        return y
    out = lora_b.shape[2]
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.shape[1] != lora_a.shape[1]:
        raise ValueError(f"add_lora: x {tuple(x.shape)}, y {tuple(y.shape)} and A {tuple(lora_a.shape)} disagree")
    if out_offset < 0 or out_offset + out > y.shape[1]:
        raise ValueError(f"add_lora: output columns {out_offset}..{out_offset + out} outside y's {y.shape[1]}")
    for seg in segments:
        rows = slice(seg.start, seg.start + seg.length)
        shrunk = x[rows].float() @ lora_a[seg.slot].float()
        delta = (shrunk @ lora_b[seg.slot].float()).mul_(scalings[seg.slot])
        y[rows, out_offset : out_offset + out] += delta.to(y.dtype)
    return y
