"""KV cache events: what a worker's cache and tiers gained and lost, in
vLLM's event shapes (vllm/distributed/kv_events.py), so that a router, or
an indexer such as Dynamo's or llm-d's, can follow a worker's cache from
its stream instead of polling it (--enable-kv-cache-events).

A block is named by its prefix-cache key (proto/block_hash.py: chained,
salted, the same in every process). `medium` is the tier that holds it:
"device" (the paged cache), "host", "disk".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MEDIA = ("device", "host", "disk")


@dataclass(slots=True)
class BlockStored:
    """Full blocks now held in `medium`, in chain order: block_hashes[0]'s
    parent is parent_block_hash (None: the first block of a prompt)."""

    block_hashes: list[Any]  # of bytes (the prefix-cache keys), or of int (--kv-events-block-hash dynamo)
    parent_block_hash: bytes | int | None
    token_ids: list[int]  # the blocks' tokens, block_size each ([] where the tier did not see them)
    block_size: int
    lora_id: int | None
    medium: str


@dataclass(slots=True)
class BlockRemoved:
    """Blocks `medium` no longer holds (evicted, or found bad)."""

    block_hashes: list[Any]  # as BlockStored's
    medium: str


@dataclass(slots=True)
class AllBlocksCleared:
    """The worker's cache holds nothing any more (a restart, or a reset)."""


@dataclass(slots=True)
class KVEventBatch:
    """One engine step's events, in order. `seq` counts batches from 1 in
    this worker's life: a subscriber passes the last it has to get the next."""

    seq: int
    ts: float  # wall time the step ended
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = field(default_factory=list)
