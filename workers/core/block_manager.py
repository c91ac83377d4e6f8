"""Hands KV blocks to sequences: prefix-cache lookup, growth and release.
It changes only a sequence's blocks (block_table, block_hashes, registered
blocks); its progress is the scheduler's."""

from __future__ import annotations

from typing import cast

from shoal.proto.dynamo_hash import local_block_hashes, sequence_hashes
from shoal.proto.kv_events import BlockStored
from shoal.proto.utils import cdiv
from shoal.workers.core.block_pool import BlockPool
from shoal.workers.core.sequence import Sequence


class BlockManager:
    """Maps each sequence's tokens onto blocks of `block_size` slots.

    A full block's key (block_hash.py) is SHA-256 of its parent's key and its
    own token ids, so equal keys mean equal prefixes: a hit is a hit on the
    whole chain. A sequence's keys are computed once (the prompt's usually
    by the router, see Sequence.block_hashes) and extended as blocks fill.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq (no reference taken yet).

        The last token is always left to compute: its logits are needed.
        """
        if not self.pool.enable_caching:
            return []
        n = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in seq.prefix_keys(self.block_size, n)[:n]:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def shared_blocks(self, seq: Sequence, donor: Sequence, num_ready_tokens: int) -> list[int]:
        """donor's leading full blocks within its first num_ready_tokens
        (computed, or computed in this step: written before any attention
        reads them) that hold seq's leading tokens (a parallel-sampling
        sibling's prompt): seq may take them as it takes prefix hits (no
        reference taken yet), also with prefix caching off. The last token
        is left to compute. Only under the same keys' salts (cache_salt, the
        adapter): a prefix is never shared where the cache would not share it."""
        if (seq.cache_salt, seq.block_hash_extra) != (donor.cache_salt, donor.block_hash_extra):
            return []
        bs = self.block_size
        limit = min((seq.num_tokens - 1) // bs, len(donor.block_table), num_ready_tokens // bs)
        n = 0
        while n < limit and seq.token_ids[n * bs : (n + 1) * bs] == donor.token_ids[n * bs : (n + 1) * bs]:
            n += 1
        return donor.block_table[:n]

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        computed_blocks: list[int] = (),
        num_external_tokens: int = 0,
        external_pending: bool = False,
    ) -> bool:
        """Give seq room for `num_new_tokens` more tokens after its computed
        ones (and after `computed_blocks`, prefix hits for a sequence that has
        no blocks yet, and num_external_tokens past them that a KV connector
        loads into fresh blocks before the step's forward; the scheduler then
        counts both as computed). external_pending: the load is asynchronous,
        so those blocks enter the prefix index only when it lands
        (commit_external). Returns False, changing nothing, if blocks run short."""
        bs = self.block_size
        if not computed_blocks and not num_external_tokens:
            # The common case, a decode inside its last block: nothing to do.
            end = seq.num_computed_tokens + num_new_tokens
            if end <= len(seq.block_table) * bs and end // bs <= seq.num_registered_blocks:
                return True
        num_computed = seq.num_computed_tokens + len(computed_blocks) * bs + num_external_tokens
        num_new_blocks = self.blocks_needed(num_computed + num_new_tokens) - len(seq.block_table) - len(computed_blocks)
        # A hit on a block that sits in the free queue uses up free capacity too.
        num_free_hits = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if max(num_new_blocks, 0) + num_free_hits > self.pool.num_free_blocks:
            return False
        if not seq.block_table:  # an admission: count the prefix-cache query
            self.pool.num_query_tokens += seq.num_tokens
            self.pool.num_hit_tokens += len(computed_blocks) * bs
        if computed_blocks:
            self.pool.touch(list(computed_blocks))
            seq.block_table.extend(computed_blocks)
            seq.num_registered_blocks = len(seq.block_table)
        if num_new_blocks > 0:
            seq.block_table.extend(self.pool.get_new_blocks(num_new_blocks))
        # Blocks that this step fills go into the prefix index now: their
        # keys and values are written before any attention reads them.
        if self.pool.enable_caching:
            num_full = (num_computed + num_new_tokens) // bs
            if external_pending:
                num_full = min(num_full, (num_computed - num_external_tokens) // bs)
            # A block holding a placeholder (async scheduling's token in flight) has no key yet:
            # it enters the index with a later allocation, once its token is in place.
            num_full = min(num_full, (seq.num_tokens - seq.num_output_placeholders) // bs)
            if num_full > seq.num_registered_blocks:
                self._register(seq, num_full)
            seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
        return True

    def _register(self, seq: Sequence, num_full: int) -> None:
        """seq's blocks from its first unregistered one up to num_full into the
        prefix index; with KV events on, those it is the first to hold as one
        BlockStored."""
        hashes = seq.prefix_keys(self.block_size, num_full)
        start, new = seq.num_registered_blocks, []
        for i in range(start, num_full):
            if self.pool.cache_block(seq.block_table[i], hashes[i]):
                new.append(i)
        if self.pool.events is not None and new:
            self._stored_events(seq, hashes, new)

    def _stored_events(self, seq: Sequence, hashes: list[bytes], new: list[int]) -> None:
        """BlockStored for the blocks at indices `new` of seq, which it registered first."""
        bs, lora = self.block_size, getattr(seq.lora_request, "lora_int_id", None)
        names: list = hashes
        if self.pool.dynamo is not None:  # --kv-events-block-hash dynamo
            if seq.cache_salt is not None or seq.block_hash_extra:  # not in Dynamo's default hash: no event
                return
            done, end = len(seq.dynamo_hashes), new[-1] + 1
            if end > done:
                local = local_block_hashes(seq.token_ids[done * bs : end * bs], bs)
                seq.dynamo_hashes += sequence_hashes(local, seq.dynamo_hashes[-1] if done else None)
            names = seq.dynamo_hashes
            for i in new:
                self.pool.dynamo[hashes[i]] = names[i]
        # (a run whose middle another sequence holds already: an event per contiguous part)
        runs: list[list[int]] = []
        for i in new:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1] + 1
            cast(list, self.pool.events).append(
                BlockStored(
                    names[first:last],
                    names[first - 1] if first else None,
                    seq.token_ids[first * bs : last * bs],
                    bs,
                    lora,
                    "device",
                )
            )

    def commit_external(self, seq: Sequence, num_external_tokens: int) -> None:
        """A connector's asynchronous load into seq's blocks past its
        computed tokens landed: they count as computed, and enter the index."""
        seq.num_computed_tokens += num_external_tokens
        num_full = seq.num_computed_tokens // self.block_size
        if self.pool.enable_caching and num_full > seq.num_registered_blocks:
            self._register(seq, num_full)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks at once (finish, abort or preemption)."""
        # Blocks registered for a step that never ran for seq (a failed step's culprit, or a sequence
        # preempted in the schedule that registered them) hold no keys and values: they leave the index.
        for i in range(seq.num_computed_tokens // self.block_size, seq.num_registered_blocks):
            self.pool.uncache_block(seq.block_table[i])
        self.pool.free(list(reversed(seq.block_table)))
        # A new list, never a cleared one: a table is only ever extended, and the model runner's
        # InputBatch mirrors each list object by appending what is new.
        seq.block_table = []
        seq.num_registered_blocks = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.pool.num_query_tokens
        return self.pool.num_hit_tokens / q if q else 0.0
