"""A request as the prefix-reading policies see it: its chain hashes, the
blocks it needs, and how many of its leading blocks a replica holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.proto.utils import cdiv
from shoal.router.routing.replica_stats import ReplicaFigures

# The output a request is expected to need room for: max_tokens is only a
# bound (an OpenAI chat request without one gets the rest of the context),
# and the engine takes decode blocks as it goes, not up front; a few hundred
# tokens is a typical answer.
EXPECTED_OUTPUT_TOKENS = 256


@dataclass(slots=True)
class RequestNeed:
    """One request, as the scoring sees it."""

    hashes: Sequence[bytes]  # the chain keys (block_hash.py) of the prompt's full blocks
    usable: int  # leading blocks a hit may cover: the engine always computes the last prompt token
    prompt_tokens: int
    blocks: int  # prompt + expected output
    block_size: int
    lora: str | None = None  # its LoRA adapter's name


def request_need(
    num_prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    hashes: Sequence[bytes] | None,
    lora: str | None = None,
) -> RequestNeed:
    expected = num_prompt_tokens + min(max_tokens, EXPECTED_OUTPUT_TOKENS)
    return RequestNeed(
        hashes or (),
        max(0, (num_prompt_tokens - 1) // block_size),
        num_prompt_tokens,
        cdiv(expected, block_size),
        block_size,
        lora,
    )


def need_of(request, block_size: int) -> RequestNeed:
    """A GenerateRequest's need, in blocks of the model's `block_size` (WorkerInfo's)."""
    return request_need(
        len(request.prompt_token_ids),
        request.params.max_tokens,
        block_size,
        request.block_hashes,
        getattr(request, "lora_name", None),
    )


def blocks_at(request, f: ReplicaFigures, block_size: int) -> tuple[int, int]:
    """What `request` takes at replica f: KV blocks (its need less what f
    holds) and prompt tokens to prefill."""
    need = need_of(request, block_size)
    hit = prefix_hit(need.hashes, f.held, need.usable)
    return need.blocks - hit, need.prompt_tokens - hit * need.block_size


def prefix_hit(hashes: Sequence[bytes], held, limit: int | None = None) -> int:
    """How many leading hashes (at most `limit`) `held` contains, in
    O(log n) lookups: a binary search for the first one missing.

    It equals a linear scan when what is held is prefix-closed along the
    chain (block i held => blocks 0..i-1 held). A cache nearly always is: a
    block's hash chains its parent's, a sequence holds all its blocks, and
    a freed sequence is evicted tail first. Where it is not (a bounded report
    cut a chain, a parent evicted under another copy) the search returns
    some boundary i with block i-1 held and block i not: a fair estimate.
    """
    n = len(hashes) if limit is None else min(limit, len(hashes))
    if n == 0 or hashes[0] not in held:
        return 0
    if hashes[n - 1] in held:
        return n
    lo, hi = 1, n - 1  # hashes[lo - 1] is held, hashes[hi] is not: the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo
