"""OffloadingConnector (vLLM's name): blocks leave the paged pool for slower
tiers instead of being lost, and come back instead of being prefilled again.

It composes two tiers, each optional:
- host memory (host_tier.py): a block is saved there when the pool hands
  it out afresh (evicts it), in the step that does so, before that step's
  forward overwrites it;
- disk (disk_tier.py): a request's computed full blocks that the tier does
  not hold are written when it ends, so they outlive the engine.

A new request's blocks past its device prefix hits are looked up block by
block, host first, then disk, and loaded into fresh blocks before the
forward reads them; its prefill starts after them. On the CPU every move
is made at the start of a step (a disk write's file is written later, on
its own thread, but its blocks are copied out then): a load is never
pending across steps, and no request waits for one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from shoal.workers.core.sequence import Sequence
from shoal.workers.kv_transfer.base import (
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVLoadError,
)
from shoal.workers.kv_transfer.disk_tier import DiskTierIndex, DiskTierStorage, tier_folder
from shoal.workers.kv_transfer.host_tier import HostTierIndex, HostTierStorage, block_shape, num_host_slots
from shoal.workers.kv_transfer.keys import tier_key

OFFLOAD_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class OffloadingMetadata(KVConnectorMetadata):
    """One step's moves, made in this order: saves, deletes, loads."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (paged block, host slot)
    disk_saves: list[tuple[str, list[int], list[bytes]]] = field(default_factory=list)  # (path, blocks, keys)
    disk_deletes: list[str] = field(default_factory=list)  # paths
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, paged block)
    disk_loads: list[tuple[str, int, bytes, int]] = field(default_factory=list)  # (path, index, key, paged block)

    @property
    def is_empty(self) -> bool:
        return not (self.saves or self.disk_saves or self.disk_deletes or self.loads or self.disk_loads)


@dataclass(slots=True)
class TierStats:
    """One tier's counters since the engine started (vLLM's offloading metrics' quantities)."""

    hit_tokens: int = 0  # prompt tokens served from the tier
    query_tokens: int = 0  # prompt tokens past the device hits, looked up
    loaded_blocks: int = 0
    saved_blocks: int = 0
    evicted_blocks: int = 0  # dropped from the tier to make room
    failed_blocks: int = 0  # loads that failed (computed instead)
    used_blocks: int = 0
    total_blocks: int = 0
    bytes_per_block: int = 0


class OffloadingConnector(KVConnectorBase):
    def __init__(self, role: KVConnectorRole, spec: KVCacheSpec, options):
        super().__init__(role, spec, options)
        self.dtype = OFFLOAD_DTYPES[options.kv_offload_dtype] or spec.dtype
        self.block_bytes = torch.Size(block_shape(spec)).numel() * self.dtype.itemsize
        self.num_slots = num_host_slots(spec, options.kv_offload_host_bytes, self.dtype)
        disk_path, disk_bytes = options.kv_offload_disk_path, options.kv_offload_disk_bytes
        if options.kv_offload_host_bytes and self.num_slots < 1:
            raise ValueError(
                f"kv_offload_host_bytes {options.kv_offload_host_bytes} holds no block "
                f"of this model ({self.block_bytes} bytes each in {self.dtype})"
            )
        if disk_path and disk_bytes < self.block_bytes:
            raise ValueError(
                f"kv_offload_disk_bytes {disk_bytes} holds no block of this model "
                f"({self.block_bytes} bytes each in {self.dtype})"
            )
        folder = tier_folder(disk_path, spec.fingerprint, self.dtype) if disk_path else None
        if role is KVConnectorRole.SCHEDULER:
            self.host = HostTierIndex(self.num_slots) if self.num_slots else None
            self.disk = DiskTierIndex(folder, disk_bytes, self.block_bytes, self.dtype) if folder else None
            self._meta = OffloadingMetadata()
            self._sources: dict[int, list[tuple[str, bytes]]] = {}  # id(seq) -> each matched block's tier and key
            self.tiers = {}
            if self.host is not None:
                self.tiers["host"] = TierStats(total_blocks=self.num_slots, bytes_per_block=self.block_bytes)
            if self.disk is not None:
                self.tiers["disk"] = TierStats(
                    total_blocks=disk_bytes // self.block_bytes, bytes_per_block=self.block_bytes
                )
        else:
            self.host_storage = HostTierStorage(spec, self.num_slots, self.dtype) if self.num_slots else None
            self.disk_storage = DiskTierStorage(block_shape(spec), self.dtype) if folder else None
            self.kv_cache: torch.Tensor | None = None

    def _key(self, block_hash: bytes) -> bytes:
        return tier_key(self.spec.fingerprint, block_hash)

    # ---- scheduler side ----------------------------------------------

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.spec.block_size
        first, last = num_computed_tokens // bs, (seq.num_tokens - 1) // bs
        sources: list[tuple[str, bytes]] = []
        if last > first:
            hashes = seq.prefix_keys(self.spec.block_size, last)
            for i in range(first, last):
                # Each match is held for this step (build_connector_meta lets go): the allocation
                # that follows may evict pool blocks, whose saves must not take its slot or file.
                key = self._key(hashes[i])
                if self.host is not None and key in self.host:
                    self.host.pin(key)
                    sources.append(("host", key))
                elif self.disk is not None and key in self.disk:
                    self.disk.pin(key)
                    sources.append(("disk", key))
                else:
                    break
        self._sources[id(seq)] = sources
        return len(sources) * bs, False

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        bs = self.spec.block_size
        sources = self._sources.pop(id(seq), [])[: num_external_tokens // bs]
        query = seq.num_tokens - (len(seq.block_table) - len(block_ids)) * bs
        for stats in self.tiers.values():
            stats.query_tokens += query
        for (tier, key), block_id in zip(sources, block_ids, strict=False):
            if tier == "host":
                self._meta.loads.append((cast(HostTierIndex, self.host).pin(key), block_id))
            else:
                disk = cast(DiskTierIndex, self.disk)
                name, index = disk.pin(key)
                self._meta.disk_loads.append((disk.path(name), index, key, block_id))
            self.tiers[tier].hit_tokens += bs
            self.tiers[tier].loaded_blocks += 1

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        if self.host is None:
            return
        key = self._key(block_hash)
        if key in self.host:
            self.host.touch(key)
            return
        before = self.host.num_evictions
        slot = self.host.allocate(key)
        if slot is None:  # every slot feeds this step's loads: the block is lost, as without a tier
            return
        self.tiers["host"].evicted_blocks += self.host.num_evictions - before
        self._meta.saves.append((block_id, slot))
        self.tiers["host"].saved_blocks += 1

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> None:
        if self.disk is None:
            return
        bs = self.spec.block_size
        n = min(seq.num_computed_tokens // bs, len(block_ids))  # full blocks whose keys and values are computed
        if n == 0:
            return
        keys = [self._key(h) for h in seq.prefix_keys(self.spec.block_size, n)[:n]]
        new = [(b, k) for b, k in zip(block_ids[:n], keys, strict=True) if k not in self.disk]
        if not new:
            return
        before = self.disk.num_evicted_blocks
        name, deleted = self.disk.add([k for _, k in new], self.dtype)
        self._meta.disk_saves.append((self.disk.path(name), [b for b, _ in new], [k for _, k in new]))
        self._meta.disk_deletes += [self.disk.path(d) for d in deleted]
        stats = self.tiers["disk"]
        stats.saved_blocks += len(new)
        stats.evicted_blocks += self.disk.num_evicted_blocks - before

    def build_connector_meta(self, scheduler_output) -> OffloadingMetadata:
        meta, self._meta = self._meta, OffloadingMetadata()
        self._sources.clear()
        for index in (self.host, self.disk):
            if index is not None:
                index.unpin_all()  # the next step's saves and deletes come after this step's loads
        return meta

    def discard(self, block_hash: bytes) -> None:
        key = self._key(block_hash)
        if self.host is not None and key in self.host:
            self.host.discard(key)
            self.tiers["host"].failed_blocks += 1
        if self.disk is not None and key in self.disk:
            name = self.disk.where[key][0]
            self.disk.forget(name)  # a file with one bad block is not trusted for the others
            self._meta.disk_deletes.append(self.disk.path(name))
            self.tiers["disk"].failed_blocks += 1

    def stats(self) -> dict:
        if self.host is not None:
            self.tiers["host"].used_blocks = len(self.host)
        if self.disk is not None:
            self.tiers["disk"].used_blocks = len(self.disk)
        return dict(self.tiers)

    # ---- worker side ----------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, OffloadingMetadata) and self.kv_cache is not None
        kv = self.kv_cache
        if metadata.saves and self.host_storage is not None:
            self.host_storage.save(kv, [b for b, _ in metadata.saves], [s for _, s in metadata.saves])
        if self.disk_storage is not None:
            for name, block_ids, keys in metadata.disk_saves:
                self.disk_storage.save(kv, name, block_ids, keys)
            for name in metadata.disk_deletes:
                self.disk_storage.delete(name)
        if metadata.loads and self.host_storage is not None:
            self.host_storage.load(kv, [s for s, _ in metadata.loads], [b for _, b in metadata.loads])
        failed = []
        for name, index, key, block_id in metadata.disk_loads:
            if self.disk_storage is None or not self.disk_storage.load(kv, name, index, key, block_id):
                failed.append(block_id)
        if failed:
            raise KVLoadError(failed, "a disk tier file is missing, or its key or checksum does not match")

    def shutdown(self) -> None:
        self.kv_cache = None
        if self.role is KVConnectorRole.SCHEDULER and self.disk is not None:
            self.disk.release()  # the slot, for the next engine
        if self.role is KVConnectorRole.WORKER:
            if self.disk_storage is not None:
                self.disk_storage.shutdown()  # every write asked for is on disk
            self.host_storage = None
