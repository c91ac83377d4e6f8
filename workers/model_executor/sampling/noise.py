"""Counter-based sampling noise. A token's one uniform is a hash of (its
request's seed, its output index) and nothing else, so a seeded stream gives
the same tokens whatever shares the batch, after a preemption, or resumed on
another worker: no generator state to carry.

All in int64 tensor ops over the whole batch; every value stays in
[0, 2**32) and every product below 2**63, so nothing overflows."""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: added before each stage, so 0 does not hash to 0
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97  # hash-prospector's low-bias 32-bit mixer; < 2**30, < 2**31


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MUL1) & M32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & M32
    return x ^ (x >> 15)


def hash32(seeds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2**32): seeds are int64 (a seed mod 2**64, as signed),
    index the output token's index; elementwise."""
    h = torch.zeros_like(index)
    for word in (seeds & M32, (seeds >> 32) & M32, index & M32):  # >> is arithmetic: & M32 keeps the high word
        h = _mix(((h ^ word) + GOLDEN) & M32)
    return h


def uniforms(seeds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float64 in (0, 1), exact: the hash's top 24 bits, centred in their bin."""
    return ((hash32(seeds, index) >> 8).double() + 0.5) / 2**24


def as_int64_seed(seed: int) -> int:
    """Any Python int seed as the signed int64 with the same low 64 bits."""
    return (seed + 2**63) % 2**64 - 2**63
