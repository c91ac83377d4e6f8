"""The pool of fixed-size KV blocks: reference counts, the free queue and
the prefix-cache index. It knows nothing of sequences (see block_manager)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from shoal.proto.kv_events import BlockRemoved


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and cached: its prefix-cache key (block_hash.py), which covers its
    # tokens and its whole parent chain, so a hit needs nothing else compared.
    block_hash: bytes | None = None


class BlockPool:
    """Blocks with ref_cnt 0 sit in `free_queue`, least recently freed first.

    A freed block keeps its hash, so a later request with the same prefix can
    take it back (a prefix-cache hit); it loses the hash only when it is
    handed out again as a fresh block (eviction).
    """

    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # OrderedDict: O(1) append, pop-oldest and removal from the middle
        # (a cached free block taken back by a hit).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block_hash -> block_id
        # Blocks in use that hold a cached hash, in the order they became so
        # (for cached_hashes_mru: what the request router is told).
        self.in_use_cached: dict[int, None] = {}
        self.num_hit_tokens = 0
        self.num_query_tokens = 0
        # Called with (block_id, block_hash) as a cached block is handed out afresh, before
        # anything overwrites it: a KV connector saves it to a slower tier (kv_transfer/).
        self.on_evict: Callable[[int, bytes], None] | None = None
        # KV events (--enable-kv-cache-events; None: off): what the step changed in the index,
        # taken by the engine after each step (BlockManager adds the BlockStored).
        self.events: list | None = None
        # --kv-events-block-hash dynamo: each cached block's key -> its Dynamo sequence hash, the
        # name its events carry (None: events name blocks by their keys).
        self.dynamo: dict[bytes, int] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[int]:
        """Take n blocks off the free queue, evicting their cached contents."""
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                    if self.on_evict is not None:
                        self.on_evict(block_id, block.block_hash)
                    if self.events is not None:
                        self._removed(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def lookup(self, block_hash: bytes) -> int | None:
        """The cached block with this key: the same tokens after the same prefix."""
        return self.cached.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks found by lookup()."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
                if block.block_hash is not None:
                    self.in_use_cached[block_id] = None
            block.ref_cnt += 1

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Record a just-filled block in the prefix index (first one wins:
        True when this block is the one the index now names)."""
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return False
        block.block_hash = block_hash
        first = self.cached.setdefault(block_hash, block_id) == block_id
        if block.ref_cnt:
            self.in_use_cached[block_id] = None
        return first

    def uncache_block(self, block_id: int) -> None:
        """Take a block out of the prefix index: its contents were never written."""
        block = self.blocks[block_id]
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) == block_id:
            del self.cached[block.block_hash]
            if self.events is not None:
                self._removed(block.block_hash)
        block.block_hash = None
        self.in_use_cached.pop(block_id, None)

    def _removed(self, block_hash: bytes) -> None:
        """A BlockRemoved event for the block keyed block_hash (under its Dynamo name, if it has one)."""
        if self.dynamo is None:
            cast(list, self.events).append(BlockRemoved([block_hash], "device"))
        elif (name := self.dynamo.pop(block_hash, None)) is not None:
            cast(list, self.events).append(BlockRemoved([name], "device"))

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; list tail blocks first so the
        prefix blocks, more likely shared, are evicted last."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed twice"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # Nothing to keep: reuse it before blocks that hold a prefix.
                    self.free_queue[block_id] = None
                    self.free_queue.move_to_end(block_id, last=False)
                else:
                    self.free_queue[block_id] = None
                    self.in_use_cached.pop(block_id, None)

    def cached_hashes_mru(self, limit: int) -> list[bytes]:
        """Up to `limit` hashes of cached blocks, most recently used first
        (what a worker tells the request router it holds): those of blocks
        in use, in the order they came into use (a sequence's parents before
        its children), then those of free blocks, most recently freed first
        (a sequence is freed tail first, so its prefix comes first here too).
        A cut at `limit` so keeps each chain's prefix. O(limit).

        May be called from a thread other than the engine's: a walk that the
        engine's changes interrupt starts over (keeping what it found), up to
        three times; a slightly stale answer is a fair hint.
        """
        if not self.enable_caching or limit <= 0:
            return []
        blocks = self.blocks
        out: dict[bytes, None] = {}
        for in_use, source in ((True, lambda: self.in_use_cached), (False, lambda: reversed(self.free_queue))):
            for _ in range(3):
                try:
                    for block_id in source():
                        h = blocks[block_id].block_hash
                        if h is None:
                            if in_use:  # its hash dropped meanwhile
                                continue
                            break  # uncached free blocks sit at the queue's front: none cached past here
                        out[h] = None
                        if len(out) >= limit:
                            return list(out)
                    break
                except RuntimeError:  # changed mid-walk
                    continue
        return list(out)
