"""OffloadingConnector (vLLM's name): blocks leave the paged pool for a
slower tier instead of being lost, and come back instead of being
prefilled again.

Today it has the host tier (host_tier.py). A block is saved when the pool
hands it out afresh (evicts it), in the step that does so, before that
step's forward overwrites it; a new request's blocks past its device
prefix hits are looked up in the tier and loaded into fresh blocks before
the forward reads them, so its prefill starts after them. On the CPU both
are memory copies made at the start of the step: a load is never pending
across steps, and no request waits for one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shoal.proto.block_hash import chain_hashes
from shoal.workers.core.scheduler import SchedulerOutput
from shoal.workers.core.sequence import Sequence
from shoal.workers.kv_transfer.base import (
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from shoal.workers.kv_transfer.host_tier import HostTierIndex, HostTierStorage, num_host_slots
from shoal.workers.kv_transfer.keys import tier_key

OFFLOAD_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class OffloadingMetadata(KVConnectorMetadata):
    saves: list[tuple[int, int]] = field(default_factory=list)  # (paged block, host slot), made first
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, paged block), made after

    @property
    def is_empty(self) -> bool:
        return not (self.saves or self.loads)


@dataclass(slots=True)
class TierStats:
    """One tier's counters since the engine started (vLLM's offloading metrics' quantities)."""

    hit_tokens: int = 0  # prompt tokens served from the tier
    query_tokens: int = 0  # prompt tokens past the device hits that were looked up in it
    loaded_blocks: int = 0
    saved_blocks: int = 0
    evicted_blocks: int = 0  # dropped from the tier to make room
    used_blocks: int = 0
    total_blocks: int = 0
    bytes_per_block: int = 0


class OffloadingConnector(KVConnectorBase):
    def __init__(self, role: KVConnectorRole, spec: KVCacheSpec, options):
        super().__init__(role, spec, options)
        self.dtype = OFFLOAD_DTYPES[options.kv_offload_dtype] or spec.dtype
        self.num_slots = num_host_slots(spec, options.kv_offload_host_bytes, self.dtype)
        if self.num_slots < 1:
            raise ValueError(
                f"kv_offload_host_bytes {options.kv_offload_host_bytes} holds no block "
                f"of this model ({self._block_bytes()} bytes each in {self.dtype})"
            )
        if role is KVConnectorRole.SCHEDULER:
            self.index = HostTierIndex(self.num_slots)
            self._meta = OffloadingMetadata()
            self.tier = TierStats(total_blocks=self.num_slots, bytes_per_block=self._block_bytes())
        else:
            self.storage = HostTierStorage(spec, self.num_slots, self.dtype)
            self.kv_cache: torch.Tensor | None = None

    def _block_bytes(self) -> int:
        s = self.spec
        return 2 * s.num_layers * s.block_size * s.num_kv_heads * s.head_dim * self.dtype.itemsize

    def _key(self, block_hash: bytes) -> bytes:
        return tier_key(self.spec.fingerprint, block_hash)

    # ---- scheduler side ----------------------------------------------

    def _hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """seq's first n prefix-cache keys (computed once, kept on the sequence)."""
        hashes = seq.block_hashes
        if len(hashes) < n:
            chain_hashes(seq.token_ids, self.spec.block_size, hashes, seq.block_hash_extra, n, seq.cache_salt)
        return hashes

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.spec.block_size
        first, last = num_computed_tokens // bs, (seq.num_tokens - 1) // bs
        if last <= first:
            return 0, False
        hashes = self._hashes(seq, last)
        n = 0
        while first + n < last and (key := self._key(hashes[first + n])) in self.index:
            # Held for this step (build_connector_meta lets go): the allocation that
            # follows may evict pool blocks, whose saves must not take these slots.
            self.index.pin(key)
            n += 1
        return n * bs, False

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        bs = self.spec.block_size
        first = len(seq.block_table) - len(block_ids)  # the blocks' place in seq's table
        hashes = seq.block_hashes
        self.tier.query_tokens += seq.num_tokens - first * bs
        n = num_external_tokens // bs
        for i, block_id in enumerate(block_ids[:n]):
            self._meta.loads.append((self.index.pin(self._key(hashes[first + i])), block_id))
        self.tier.hit_tokens += n * bs
        self.tier.loaded_blocks += n

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        key = self._key(block_hash)
        if key in self.index:
            self.index.touch(key)
            return
        before = self.index.num_evictions
        slot = self.index.allocate(key)
        if slot is None:  # every slot feeds this step's loads: the block is lost, as without a tier
            return
        self.tier.evicted_blocks += self.index.num_evictions - before
        self._meta.saves.append((block_id, slot))
        self.tier.saved_blocks += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingMetadata:
        meta, self._meta = self._meta, OffloadingMetadata()
        self.index.unpin_all()  # the next step's saves come after this step's loads
        return meta

    def discard(self, block_hash: bytes) -> None:
        """Forget a block whose load failed."""
        self.index.discard(self._key(block_hash))

    def stats(self) -> dict:
        self.tier.used_blocks = len(self.index)
        return {"host": self.tier}

    # ---- worker side ----------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, OffloadingMetadata) and self.kv_cache is not None
        if metadata.saves:
            blocks, slots = zip(*metadata.saves)
            self.storage.save(self.kv_cache, list(blocks), list(slots))
        if metadata.loads:
            slots, blocks = zip(*metadata.loads)
            self.storage.load(self.kv_cache, list(slots), list(blocks))

    def shutdown(self) -> None:
        self.kv_cache = None
        if self.role is KVConnectorRole.WORKER:
            self.storage.data = torch.empty(0)
