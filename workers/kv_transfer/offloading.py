"""OffloadingConnector (vLLM's name): blocks leave the paged pool for slower
tiers instead of being lost, and come back instead of being prefilled again.

It composes three tiers, each optional:
- host memory (host_tier.py): a block is saved there when the pool hands
  it out afresh (evicts it), in the step that does so, before that step's
  forward overwrites it;
- disk (disk_tier.py): a request's computed full blocks that the tier does
  not hold are written when it ends, so they outlive the engine;
- the cluster (cluster_tier.py): every full block a step computes is
  published after its forward (prompt and generated tokens alike), so any
  worker, or the one that resumes a stream after a failover, finds it.

A new request's blocks past its device prefix hits are looked up block by
block, host first, then disk, then the cluster, and loaded into fresh
blocks before any forward reads them; its prefill starts after them. Host
and disk loads are made at the start of the step that admits the request
(a disk write's file is written later, on its own thread, but its blocks
are copied out then). A request with blocks from the cluster waits for
them instead (WAITING_FOR_REMOTE_KVS), holding its blocks and no step's
budget, while the fetch runs on a thread of its own and other requests'
steps go on; the fetched blocks are written by the first pass after they
arrive, and the request joins the next step.

Under tensor parallelism every rank makes the same moves on its heads'
slice: a host slot or disk file holds each rank's slice (the disk's one
file a rank), and the cluster one entry a rank's slice. A load that failed
on any rank is computed by all of them, and a cluster load lands when it
has landed on every rank: the ranks agree on both by a collective.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from shoal.proto.kv_events import BlockRemoved, BlockStored
from shoal.proto.stats import KV_LOAD_BUCKETS_S
from shoal.workers.core.outputs import KVConnectorOutput
from shoal.workers.core.sequence import Sequence
from shoal.workers.kv_transfer.base import (
    KVCacheSpec,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVLoadError,
)
from shoal.workers.kv_transfer.cluster_tier import Block, ClusterTierClient, cluster_client
from shoal.workers.kv_transfer.disk_tier import DiskTierIndex, DiskTierStorage, tier_folder
from shoal.workers.kv_transfer.host_tier import HostTierIndex, HostTierStorage, block_shape, num_host_slots
from shoal.workers.kv_transfer.keys import tier_key
from shoal.workers.model_executor.layers.parallel_state import get_tp_group

logger = logging.getLogger(__name__)

# fp8: OCP e4m3, cast as vLLM's fp8 KV cache is with its default scale of 1 (saturating at +-448).
OFFLOAD_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.float8_e4m3fn}
LOOKUP_WAIT_S = 0.002  # how long a step waits for a cluster lookup before it lets the request wait a step
_PENDING = object()  # a cluster lookup still on its way
MAX_LOOKUPS = 4096  # lookups kept for requests not yet admitted (a bound, should any never be)
# Chain hashes of the blocks saved to the host and disk tiers, remembered for the
# router's load report (offloaded_hashes), the most recent this many.
MAX_OFFLOADED_HASHES = 4096


def saves_prefills(options) -> bool:
    """Whether the host tier is written through (every finished prefill's
    blocks saved after its forward), as on a GPU, where a copy to the host
    runs beside the compute; on the CPU a block is copied when evicted, as
    the copy takes the cores the step runs on."""
    return options.resolved_device().type == "cuda"


def _loaded_on_every_rank(ok: list[bool], device: torch.device) -> list[bool]:
    """Each load's outcome on every tensor-parallel rank together (each rank
    calls this with the step's same loads)."""
    failed = torch.tensor([0 if good else 1 for good in ok], dtype=torch.int32, device=device)
    get_tp_group().all_reduce(failed)
    return [v == 0 for v in failed.tolist()]


@dataclass(slots=True)
class ClusterLoad:
    """One request's loads, when any of its blocks come from the cluster:
    all of them land together, across steps (get_finished names it)."""

    request_id: str
    host: list[tuple[int, int]] = field(default_factory=list)  # (host slot, paged block)
    disk: list[tuple[str, int, bytes, int]] = field(default_factory=list)  # (path, index, key, paged block)
    cluster: list[tuple[bytes, int]] = field(default_factory=list)  # (cluster key, paged block)


@dataclass(slots=True)
class OffloadingMetadata(KVConnectorMetadata):
    """One step's moves, made in this order: saves, deletes, loads."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (paged block, host slot)
    saves_after: list[tuple[int, int]] = field(default_factory=list)  # (paged block, host slot): after the forward
    disk_saves: list[tuple[str, list[int], list[bytes]]] = field(default_factory=list)  # (path, blocks, keys)
    disk_deletes: list[str] = field(default_factory=list)  # paths
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, paged block)
    disk_loads: list[tuple[str, int, bytes, int]] = field(default_factory=list)  # (path, index, key, paged block)
    cluster_loads: list[ClusterLoad] = field(default_factory=list)  # started now, landing in a later pass
    cluster_saves: list[tuple[int, bytes]] = field(default_factory=list)  # (paged block, key): after the forward

    @property
    def is_empty(self) -> bool:
        return not (
            self.saves
            or self.saves_after
            or self.disk_saves
            or self.disk_deletes
            or self.loads
            or self.disk_loads
            or self.cluster_loads
        )


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
    load_us: int = 0  # time its loads took, in all: load_us / loaded_blocks is what a block costs
    # its loads by time taken: a count per bucket of KV_LOAD_BUCKETS_S, and one past the last
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(KV_LOAD_BUCKETS_S) + 1))


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
        self.cluster: ClusterTierClient | None = None
        if options.kv_cluster_tier:
            self.cluster = cluster_client(options.kv_cluster_bytes, tensor_parallel=spec.num_ranks > 1)
        # The cluster's blocks are in the storage dtype: engines that store another one never share them.
        self._cluster_tag = str(self.dtype).encode() + b":"
        if role is KVConnectorRole.SCHEDULER:
            self.host = HostTierIndex(self.num_slots) if self.num_slots else None
            self.saves_prefills = self.host is not None and saves_prefills(options)
            # Under tensor parallelism each rank writes its heads' slice of a file (disk_tier.rank_path): the
            # bytes are all ranks' together, as the host tier's.
            disk_bytes //= spec.num_ranks
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
            if self.cluster is not None:  # each rank's slice of a block is an entry of its own
                self.tiers["cluster"] = TierStats(
                    total_blocks=options.kv_cluster_bytes // (self.block_bytes * spec.num_ranks),
                    bytes_per_block=self.block_bytes,
                )
            # request_id -> ((first block, blocks), presence of each in the cluster, on its way)
            self._lookups: dict[str, tuple[tuple[int, int], concurrent.futures.Future]] = {}
            self._published: dict[str, int] = {}  # request_id -> its blocks the cluster holds from the start
            self._async_sources: dict[str, list[tuple[str, bytes]]] = {}  # request_id -> its loading blocks' sources
            # tier key -> chain hash of the blocks saved to the host or disk tier, least recent first
            self._offloaded: OrderedDict[bytes, bytes] = OrderedDict()
            # KV events of the tiers (--enable-kv-cache-events; None: off), taken by the engine each step
            # (Dynamo's names cover the paged cache's blocks alone: a tier sees keys, not tokens)
            events = getattr(options, "enable_kv_cache_events", False)
            self._events: list | None = [] if events and options.kv_events_block_hash == "shoal" else None
        else:
            self.host_storage: HostTierStorage | None = None  # made beside the cache (register_kv_caches)
            rank = self.rank = get_tp_group().rank if spec.num_ranks > 1 else 0
            self.disk_storage = DiskTierStorage(block_shape(spec), self.dtype, rank) if folder else None
            self.kv_cache: torch.Tensor | None = None
            # request_id -> (its blocks' fetch, the paged blocks they go to, when it began)
            self._fetches: dict[str, tuple[concurrent.futures.Future, list[int], float]] = {}
            self._fetched_at: dict[concurrent.futures.Future, float] = {}  # when each fetch came back
            self._timings: dict[str, list[tuple[int, float]]] = {}  # tier -> loads since get_finished
            self._saves: list[tuple[int, bytes]] = []  # the step's cluster saves, made after its forward
            self._host_saves: list[tuple[int, int]] = []  # the step's host saves made after its forward
            self._copies_queued = False  # host saves queued without the compute stream waiting for them

    def _key(self, block_hash: bytes) -> bytes:
        return tier_key(self.spec.fingerprint, block_hash)

    def _cluster_key(self, key: bytes) -> bytes:
        return self._cluster_tag + key

    def _slice_key(self, cluster_key: bytes, rank: int) -> bytes:
        """Under tensor parallelism each rank publishes and fetches its heads' slice of a block on its own."""
        return cluster_key if self.spec.num_ranks == 1 else cluster_key + b"#%d" % rank

    # ---- scheduler side ----------------------------------------------

    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int | None, bool]:
        bs = self.spec.block_size
        first, last = num_computed_tokens // bs, (seq.num_tokens - 1) // bs
        sources: list[tuple[str, bytes]] = []
        if last > first:
            hashes = seq.prefix_keys(self.spec.block_size, last)
            keys = [self._key(hashes[i]) for i in range(first, last)]
            in_cluster = self._in_cluster(seq.request_id, first, keys)
            if in_cluster is _PENDING:
                return None, False
            for j, key in enumerate(keys):
                # Each match is held for this step (build_connector_meta lets go): the allocation
                # that follows may evict pool blocks, whose saves must not take its slot or file.
                if self.host is not None and key in self.host:
                    self.host.pin(key)
                    sources.append(("host", key))
                elif self.disk is not None and key in self.disk:
                    self.disk.pin(key)
                    sources.append(("disk", key))
                elif in_cluster[j]:
                    sources.append(("cluster", key))
                else:
                    break
        self._sources[id(seq)] = sources
        return len(sources) * bs, any(tier == "cluster" for tier, _ in sources)

    def _in_cluster(self, request_id: str, first: int, keys: list[bytes]):
        """Whether the cluster holds each key ([False...] without a cluster
        tier), or _PENDING while its answer is on the way."""
        if self.cluster is None:
            return [False] * len(keys)
        entry = self._lookups.get(request_id)
        ranks = self.spec.num_ranks
        if entry is None or entry[0] != (first, len(keys)):
            if len(self._lookups) >= MAX_LOOKUPS:
                self._lookups.clear()
            slices = [self._slice_key(self._cluster_key(k), r) for k in keys for r in range(ranks)]
            entry = ((first, len(keys)), self.cluster.contains(slices))
            self._lookups[request_id] = entry
        try:
            held = entry[1].result(timeout=LOOKUP_WAIT_S)
            return [all(held[j * ranks : (j + 1) * ranks]) for j in range(len(keys))]  # a block: every rank's slice
        except concurrent.futures.TimeoutError:
            return _PENDING
        except Exception as e:  # the store is gone or restarting: a miss
            logger.warning("cluster-tier lookup failed: %s", e)
            self._lookups.pop(request_id, None)
            return [False] * len(keys)

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        bs = self.spec.block_size
        sources = self._sources.pop(id(seq), [])[: num_external_tokens // bs]
        self._lookups.pop(seq.request_id, None)
        num_hits = len(seq.block_table) - len(block_ids)
        query = seq.num_tokens - num_hits * bs
        for stats in self.tiers.values():
            stats.query_tokens += query
        # Blocks from the device's cache or a tier were published when first computed.
        self._published[seq.request_id] = max(self._published.get(seq.request_id, 0), num_hits + len(sources))
        load = ClusterLoad(seq.request_id) if any(tier == "cluster" for tier, _ in sources) else None
        for (tier, key), block_id in zip(sources, block_ids, strict=False):
            if tier == "host":
                item = (cast(HostTierIndex, self.host).pin(key), block_id)
                (load.host if load is not None else self._meta.loads).append(item)
            elif tier == "disk":
                disk = cast(DiskTierIndex, self.disk)
                name, index = disk.pin(key)
                disk_item = (disk.path(name), index, key, block_id)
                (load.disk if load is not None else self._meta.disk_loads).append(disk_item)
            else:
                cast(ClusterLoad, load).cluster.append((self._cluster_key(key), block_id))
            self.tiers[tier].hit_tokens += bs
            self.tiers[tier].loaded_blocks += 1
        if load is not None:
            self._meta.cluster_loads.append(load)
            self._async_sources[seq.request_id] = sources

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        if self.host is None:
            return
        key = self._key(block_hash)
        if key in self.host:
            self.host.touch(key)
            return
        self._save_to_host(block_id, key, block_hash, self._meta.saves)

    def _save_to_host(self, block_id: int, key: bytes, block_hash: bytes, saves: list[tuple[int, int]]) -> None:
        host = cast(HostTierIndex, self.host)
        before = host.num_evictions
        slot = host.allocate(key)
        if slot is None:  # every slot feeds this step's loads: the block is lost, as without a tier
            return
        self.tiers["host"].evicted_blocks += host.num_evictions - before
        saves.append((block_id, slot))
        self._stored("host", [block_hash])
        self._removed("host", host)
        self._remember_offloaded([(key, block_hash)])
        self.tiers["host"].saved_blocks += 1

    def _save_prefills(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """The full prompt blocks of each prefill the step finishes, saved to
        the host tier after its forward (write-through): copied beside the
        step's sampling and the next step's scheduling, so evicting them
        later costs no copy on the step that evicts."""
        host, bs = cast(HostTierIndex, self.host), self.spec.block_size
        for seq, n in scheduled:
            if not seq.num_computed_tokens < seq.num_prompt_tokens <= seq.num_computed_tokens + n:
                continue
            end = seq.num_prompt_tokens // bs
            hashes = seq.prefix_keys(bs, end)
            for i in range(end):
                key = self._key(hashes[i])
                if key in host:
                    host.touch(key)
                else:
                    self._save_to_host(seq.block_table[i], key, hashes[i], self._meta.saves_after)

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._lookups.pop(seq.request_id, None)
        self._published.pop(seq.request_id, None)
        if self.disk is not None:
            self._save_to_disk(seq, block_ids)
        return False, None  # a disk save copies its blocks out before the pool hands them out again

    def _save_to_disk(self, seq: Sequence, block_ids: list[int]) -> None:
        """The full blocks seq computed that the disk tier lacks, as one new file."""
        assert self.disk is not None
        bs = self.spec.block_size
        n = min(seq.num_computed_tokens // bs, len(block_ids))  # full blocks whose keys and values are computed
        if n == 0:
            return
        hashes = seq.prefix_keys(self.spec.block_size, n)[:n]
        keys = [self._key(h) for h in hashes]
        self._remember_offloaded(zip(keys, hashes, strict=True))
        new = [(b, k) for b, k in zip(block_ids[:n], keys, strict=True) if k not in self.disk]
        if not new:
            return
        before = self.disk.num_evicted_blocks
        name, deleted = self.disk.add([k for _, k in new], self.dtype)
        stored = {k for _, k in new}
        self._stored("disk", [h for h, k in zip(hashes, keys, strict=True) if k in stored])
        self._removed("disk", self.disk)
        self._meta.disk_saves.append((self.disk.path(name), [b for b, _ in new], [k for _, k in new]))
        self._meta.disk_deletes += [self.disk.path(d) for d in deleted]
        stats = self.tiers["disk"]
        stats.saved_blocks += len(new)
        stats.evicted_blocks += self.disk.num_evicted_blocks - before

    def build_connector_meta(self, scheduler_output) -> OffloadingMetadata:
        if scheduler_output is not None and self.cluster is not None:
            self._publish_computed(scheduler_output.scheduled)
        if scheduler_output is not None and self.saves_prefills:
            self._save_prefills(scheduler_output.scheduled)
        meta, self._meta = self._meta, OffloadingMetadata()
        self._sources.clear()
        for index in (self.host, self.disk):
            if index is not None:
                index.unpin_all()  # the next step's saves and deletes come after this step's loads
        return meta

    def _publish_computed(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """The full blocks the step computes that the cluster has not been
        given: saved after its forward writes them."""
        bs = self.spec.block_size
        saves = self._meta.cluster_saves
        for seq, n in scheduled:
            end = (seq.num_computed_tokens + n) // bs
            start = self._published.get(seq.request_id, seq.num_computed_tokens // bs)
            if end > start:
                hashes = seq.prefix_keys(bs, end)
                saves += [(seq.block_table[i], self._cluster_key(self._key(hashes[i]))) for i in range(start, end)]
                self._published[seq.request_id] = end
        self.tiers["cluster"].saved_blocks += len(saves)

    def _remember_offloaded(self, pairs) -> None:
        seen = self._offloaded
        for key, block_hash in pairs:
            seen[key] = block_hash
            seen.move_to_end(key)
        while len(seen) > MAX_OFFLOADED_HASHES:
            seen.popitem(last=False)

    def offloaded_hashes(self, n: int) -> list[bytes]:
        """The chain hashes of up to n blocks the host and disk tiers hold,
        most recently saved first (those saved by this engine: a restarted
        one's old files are found on lookup, not reported)."""
        out = []
        for key, block_hash in reversed(self._offloaded.items()):
            if (self.host is not None and key in self.host) or (self.disk is not None and key in self.disk):
                out.append(block_hash)
                if len(out) >= n:
                    break
        return out

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for tier, loads in connector_output.kv_connector_stats.items():
            stats = self.tiers.get(tier)
            if stats is None:
                continue
            for _, seconds in loads:
                stats.load_us += int(seconds * 1e6)
                stats.load_buckets[bisect.bisect_left(KV_LOAD_BUCKETS_S, seconds)] += 1
        for request_id in connector_output.finished_recving:
            self._async_sources.pop(request_id, None)
        for request_id in connector_output.failed_recving:
            sources = self._async_sources.pop(request_id, [])
            self._published.pop(request_id, None)  # its prefill computes, and publishes, them again
            for tier, key in sources:
                if tier == "cluster":
                    self.tiers["cluster"].failed_blocks += 1
                else:
                    self._discard_key(key)

    def discard(self, block_hash: bytes) -> None:
        self._discard_key(self._key(block_hash))

    def _discard_key(self, key: bytes) -> None:
        if self.host is not None and key in self.host:
            self.host.discard(key)
            self.host.evicted.append(key)
            self._removed("host", self.host)
            self.tiers["host"].failed_blocks += 1
        if self.disk is not None and key in self.disk:
            name = self.disk.locate(key)[0]
            if self.disk.owns(name):  # another slot's file is its owner's to delete
                self._meta.disk_deletes.append(self.disk.path(name))
                self.disk.evicted += self.disk.files[name].keys
            else:
                self.disk.evicted.append(key)
            self.disk.forget(name)  # a file with one bad block is not trusted for the others
            self._removed("disk", self.disk)
            self.tiers["disk"].failed_blocks += 1

    # ---- KV events (--enable-kv-cache-events) -----------------------------

    def _stored(self, medium: str, hashes: list[bytes]) -> None:
        if self._events is not None and hashes:  # (a tier sees keys, not tokens: hashes alone)
            self._events.append(BlockStored(hashes, None, [], self.spec.block_size, None, medium))

    def _removed(self, medium: str, index: HostTierIndex | DiskTierIndex) -> None:
        """The keys the index evicted or dropped since last asked: BlockRemoved,
        for those whose chain hash is known here."""
        keys, index.evicted = index.evicted, []
        if self._events is not None and keys:
            hashes = [h for k in keys if (h := self._offloaded.get(k)) is not None]
            if hashes:
                self._events.append(BlockRemoved(hashes, medium))

    def take_events(self) -> list:
        """The tiers' events since last taken, in order (vLLM's name)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def stats(self) -> dict:
        if self.host is not None:
            self.tiers["host"].used_blocks = len(self.host)
        if self.disk is not None:
            self.tiers["disk"].used_blocks = len(self.disk)
        if self.cluster is not None:  # the whole cluster's, in blocks of this engine's size
            used = self.cluster.stats().get("used_bytes", 0)
            self.tiers["cluster"].used_blocks = used // (self.block_bytes * self.spec.num_ranks)
        return dict(self.tiers)

    # ---- worker side ----------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        if self.num_slots:  # on the cache's device: a GPU's tier is pinned, its copies on a stream of their own
            self.host_storage = HostTierStorage(self.spec, self.num_slots, self.dtype, kv_cache.device)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, OffloadingMetadata) and self.kv_cache is not None
        kv = self.kv_cache
        if self._copies_queued and self.host_storage is not None:
            # The step before's write-through copies ran beside its sampling and this step's scheduling; this
            # forward may write into any block freed since (it knows not which), so they end first.
            self.host_storage.barrier(kv.device)
            self._copies_queued = False
        if metadata.saves and self.host_storage is not None:
            self.host_storage.save(kv, [b for b, _ in metadata.saves], [s for _, s in metadata.saves])
        if self.disk_storage is not None:
            for name, block_ids, keys in metadata.disk_saves:
                self.disk_storage.save(kv, name, block_ids, keys)
            for name in metadata.disk_deletes:
                self.disk_storage.delete(name)
        if metadata.loads and self.host_storage is not None:
            t0 = time.perf_counter()
            self.host_storage.load(kv, [s for s, _ in metadata.loads], [b for _, b in metadata.loads])
            self._timed("host", len(metadata.loads), t0)
        t0 = time.perf_counter()
        ok = [
            self.disk_storage is not None and self.disk_storage.load(kv, name, index, key, block_id)
            for name, index, key, block_id in metadata.disk_loads
        ]
        if self.spec.num_ranks > 1 and ok:  # a block any rank lacks is computed by all: they must read alike
            ok = _loaded_on_every_rank(ok, kv.device)
        failed = [load[3] for load, good in zip(metadata.disk_loads, ok, strict=True) if not good]
        if metadata.disk_loads and not failed:
            self._timed("disk", len(metadata.disk_loads), t0)
        for load in metadata.cluster_loads:
            self._start_cluster_load(load)
        self._saves = metadata.cluster_saves
        self._host_saves = metadata.saves_after
        if failed:
            raise KVLoadError(failed, "a disk tier file is missing, or its key or checksum does not match")

    def _start_cluster_load(self, load: ClusterLoad) -> None:
        """A request's host and disk blocks now (their slots and files are
        held for this step only), its cluster blocks' fetch on its way."""
        kv = cast(torch.Tensor, self.kv_cache)
        if load.host and self.host_storage is not None:
            t0 = time.perf_counter()
            self.host_storage.load(kv, [s for s, _ in load.host], [b for _, b in load.host])
            self._timed("host", len(load.host), t0)
        t0 = time.perf_counter()
        disk_ok = all(
            self.disk_storage is not None and self.disk_storage.load(kv, name, index, key, block_id)
            for name, index, key, block_id in load.disk
        )
        block_ids = [b for _, b in load.cluster]
        if not disk_ok or self.cluster is None:  # a fetch that failed before it began
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_result([None])
            self._fetches[load.request_id] = (failed, block_ids, time.perf_counter())
            return
        if load.disk:
            self._timed("disk", len(load.disk), t0)
        t0 = time.perf_counter()
        fetch = self.cluster.fetch([self._slice_key(k, self.rank) for k, _ in load.cluster])
        # (on the fetch's thread: a dict's item set is atomic)
        fetch.add_done_callback(lambda f: self._fetched_at.__setitem__(f, time.perf_counter()))
        self._fetches[load.request_id] = (fetch, block_ids, t0)

    def _timed(self, tier: str, blocks: int, t0: float) -> None:
        self._timings.setdefault(tier, []).append((blocks, time.perf_counter() - t0))

    def wait_for_save(self) -> None:
        """The step's computed blocks, saved to the host tier and published
        now that its forward wrote them."""
        host_saves, self._host_saves = self._host_saves, []
        if host_saves and self.host_storage is not None and self.kv_cache is not None:
            paged, slots = [b for b, _ in host_saves], [s for _, s in host_saves]
            self.host_storage.save(self.kv_cache, paged, slots, wait=False)
            self._copies_queued = True
        saves, self._saves = self._saves, []
        if not saves or self.cluster is None or self.kv_cache is None:
            return
        ids = torch.tensor([b for b, _ in saves], device=self.kv_cache.device)
        blocks = self.kv_cache[:, :, ids].permute(2, 0, 1, 3, 4, 5).to("cpu", self.dtype).contiguous()
        raw = blocks.view(torch.uint8).reshape(len(saves), -1).numpy()
        self.cluster.publish([self._slice_key(k, self.rank) for _, k in saves], list(raw))

    def get_finished(self, timeout_s: float = 0.0) -> KVConnectorOutput | None:
        # Every rank holds the same fetches (started by the same steps, ended by agreement below): under
        # tensor parallelism all of them take the collective, or none does.
        if not self._fetches and not self._timings:
            return None
        if timeout_s > 0 and not any(f.done() for f, _, _ in self._fetches.values()):
            futures = [f for f, _, _ in self._fetches.values()]
            concurrent.futures.wait(futures, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
        out = KVConnectorOutput(kv_connector_stats=self._timings)
        self._timings = {}
        landed = self._landed()
        if self.spec.num_ranks > 1 and self._fetches:
            landed = self._landed_on_every_rank(landed)
        for request_id, blocks in landed.items():
            fetch, block_ids, t0 = self._fetches.pop(request_id)
            fetched_at = self._fetched_at.pop(fetch, None) or time.perf_counter()
            if blocks is None:
                out.failed_recving.add(request_id)
                continue
            self._write_blocks(np.stack(blocks), block_ids)
            out.finished_recving.add(request_id)
            out.kv_connector_stats.setdefault("cluster", []).append((len(block_ids), fetched_at - t0))
        if len(self._fetched_at) > len(self._fetches):  # a callback that came after its fetch was taken
            live = {f for f, _, _ in self._fetches.values()}
            for f in [f for f in list(self._fetched_at) if f not in live]:
                self._fetched_at.pop(f, None)
        return out

    def _landed(self) -> dict[str, list[Block] | None]:
        """The fetches that came back, by request: their blocks, or None
        where any is missing or damaged, or the fetch failed."""
        landed: dict[str, list[Block] | None] = {}
        for request_id, (fetch, _, _) in self._fetches.items():
            if not fetch.done():
                continue
            try:
                blocks = fetch.result()
            except Exception as e:  # the store or the block's node is gone: computed instead
                logger.warning("request %s: cluster-tier fetch failed: %s", request_id, e)
                blocks = [None]
            good = all(b is not None and b.nbytes == self.block_bytes for b in blocks)
            landed[request_id] = cast(list[Block], blocks) if good else None
        return landed

    def _landed_on_every_rank(self, landed: dict[str, list[Block] | None]) -> dict[str, list[Block] | None]:
        """What landed on every rank: a request fails when its fetch failed on
        any rank, and lands when it landed whole on all of them; the rest wait."""
        ids = list(self._fetches)
        flags = torch.tensor(
            [int(r in landed) for r in ids] + [int(r in landed and landed[r] is None) for r in ids],
            dtype=torch.int32,
            device=cast(torch.Tensor, self.kv_cache).device,
        )
        get_tp_group().all_reduce(flags)
        done, failed = flags[: len(ids)].tolist(), flags[len(ids) :].tolist()
        out: dict[str, list[Block] | None] = {}
        for r, n_done, n_failed in zip(ids, done, failed, strict=True):
            if n_failed:
                out[r] = None  # this rank's blocks, landed or still on their way, are dropped
            elif n_done == self.spec.num_ranks:
                out[r] = landed[r]
        return out

    def _write_blocks(self, raw: np.ndarray, block_ids: list[int]) -> None:
        """Fetched blocks (bytes, one row each) into the paged cache, in its dtype."""
        kv = cast(torch.Tensor, self.kv_cache)
        data = torch.from_numpy(raw).view(self.dtype).reshape(len(block_ids), *block_shape(self.spec))
        kv[:, :, torch.tensor(block_ids, device=kv.device)] = data.permute(1, 2, 0, 3, 4, 5).to(kv.device, kv.dtype)

    def shutdown(self) -> None:
        self.kv_cache = None
        if self.role is KVConnectorRole.SCHEDULER and self.disk is not None:
            self.disk.release()  # the slot, for the next engine
        if self.role is KVConnectorRole.WORKER:
            if self.disk_storage is not None:
                self.disk_storage.shutdown()  # every write asked for is on disk
            self.host_storage = None
        if self.cluster is not None:
            self.cluster.close()  # every publish asked for is made
