"""The cluster tier's index: which block keys the cluster holds, and where.

One KVClusterStore serves every worker of a cluster (hosted by the KVStore
Serve deployment, cluster/kv_store.py) or every engine of one process (the
tests, a cluster without Ray). It maps a key to a payload: an ObjectRef of
the block in Ray's object store, owned by the deployment's actor so that it
outlives the worker that computed it, or the block's bytes themselves in the
one-process case. It is bounded in bytes and evicts the least recently used
keys; an evicted ObjectRef is dropped, and Ray frees the block.

It does no I/O and holds no lock of its own beyond one mutex, so its methods
are cheap enough to run on an actor's event loop.

KVStore puts the blocks it is sent into the object store and indexes them:
the application's KVStore Serve deployment (cluster/kv_store.py), or, for
tensor-parallel ranks outside Serve, a plain actor of the Ray job
(cluster_tier.job_store).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class StoredBlock:
    payload: Any  # an ObjectRef (kept in a one-item list, so Serve never resolves it), or the bytes
    crc32: int  # of the block's bytes, checked by whoever loads it
    nbytes: int


class KVClusterStore:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 1:
            raise ValueError(f"kv_cluster_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[bytes, StoredBlock] = OrderedDict()  # least recently used first
        self.used_bytes = 0
        self.num_evicted = self.num_stored = self.num_hits = self.num_queries = 0
        self._lock = threading.Lock()

    def contains(self, keys: list[bytes]) -> list[bool]:
        """Which keys are held (each found one counts as used now)."""
        with self._lock:
            found = []
            for key in keys:
                held = key in self.entries
                if held:
                    self.entries.move_to_end(key)
                found.append(held)
            return found

    def put(self, keys: list[bytes], blocks: list[StoredBlock]) -> int:
        """Hold each block under its key (a key held already keeps its block,
        now most recent); evict the least recently used past the capacity.
        A block larger than the whole store is not kept. Returns how many were added."""
        added = 0
        with self._lock:
            for key, block in zip(keys, blocks, strict=True):
                if key in self.entries:
                    self.entries.move_to_end(key)
                    continue
                if block.nbytes > self.capacity_bytes:
                    continue
                self.entries[key] = block
                self.used_bytes += block.nbytes
                added += 1
            while self.used_bytes > self.capacity_bytes:
                _, old = self.entries.popitem(last=False)
                self.used_bytes -= old.nbytes
                self.num_evicted += 1
            self.num_stored += added
        return added

    def get(self, keys: list[bytes]) -> list[StoredBlock | None]:
        """Each key's block, None where it is gone (evicted, or never held)."""
        with self._lock:
            out = []
            for key in keys:
                block = self.entries.get(key)
                if block is not None:
                    self.entries.move_to_end(key)
                out.append(block)
            self.num_queries += len(keys)
            self.num_hits += sum(b is not None for b in out)
            return out

    def discard(self, keys: list[bytes]) -> None:
        """Forget keys whose blocks proved bad (a checksum that did not match, a lost object)."""
        with self._lock:
            for key in keys:
                block = self.entries.pop(key, None)
                if block is not None:
                    self.used_bytes -= block.nbytes

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "used_blocks": len(self.entries),
                "used_bytes": self.used_bytes,
                "capacity_bytes": self.capacity_bytes,
                "stored_blocks": self.num_stored,
                "evicted_blocks": self.num_evicted,
                "queried_blocks": self.num_queries,
                "hit_blocks": self.num_hits,
            }


class KVStore:
    """The index, holding each block as an ObjectRef this actor put (so the
    block is the store's, and outlives the worker that sent it)."""

    def __init__(self, capacity_bytes: int):
        self.store = KVClusterStore(capacity_bytes)

    def contains(self, keys: list[bytes]) -> list[bool]:
        return self.store.contains(keys)

    def put_blocks(self, keys: list[bytes], crcs: list[int], blocks: list) -> int:
        """Hold each block (its bytes) under its key, in the object store; a key held already keeps its block."""
        import ray

        held = self.store.contains(keys)
        new = [i for i, h in enumerate(held) if not h]
        stored = [StoredBlock([ray.put(blocks[i])], crcs[i], blocks[i].nbytes) for i in new]
        return self.store.put([keys[i] for i in new], stored)

    def get(self, keys: list[bytes]) -> list[StoredBlock | None]:
        return self.store.get(keys)

    def stats(self) -> dict[str, int]:
        return self.store.stats()
