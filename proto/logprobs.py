"""A sampled token's log-probability and its runners-up, as a delta carries them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float]
