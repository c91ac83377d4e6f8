"""The cluster tier's clients: what a connector calls to look keys up, fetch
blocks and publish them, each off the engine's thread.

Two stores answer (cluster_store.py holds the index of both):
- in a Serve application with --kv-cluster-tier object-store, its KVStore
  deployment (cluster/kv_store.py). A worker sends it each block, and it
  puts the block into Ray's object store itself, so the block is the
  deployment's and outlives the worker (an object is its creator's: one a
  worker put would die with it, and Ray 2.56 took away ray.put's `_owner`).
  A fetch asks the deployment for references and reads them from the
  object store, without a copy on the store's own node;
- anywhere else (one process, no Serve), the process's own store, which
  every engine of the process shares: what the tests and an in-process
  router with several workers use; under tensor parallelism, whose ranks
  are processes of their own, a KVStore actor of the Ray job (job_store)
  that the ranks of every engine of the job share.

Each block travels as its bytes in the tier's dtype with a CRC-32; a load
checks it, so a block that was evicted, lost with its node, or damaged on
the way is computed again, never used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import zlib
from typing import Any, Protocol

import numpy as np

from shoal.workers.kv_transfer.cluster_store import KVClusterStore, StoredBlock

logger = logging.getLogger(__name__)

STORE_DEPLOYMENT = "KVStore"
FETCH_TIMEOUT_S = 30.0  # a fetch from a node that stopped answering fails, and is computed instead
STATS_PERIOD_S = 5.0  # how stale the store's figures a worker reports may be

Block = np.ndarray  # one block's bytes (uint8), in the tier's dtype


class ClusterTierClient(Protocol):
    def contains(self, keys: list[bytes]) -> concurrent.futures.Future[list[bool]]:
        """Which keys the cluster holds."""

    def fetch(self, keys: list[bytes]) -> concurrent.futures.Future[list[Block | None]]:
        """Each key's block, checked against its CRC-32; None where it is gone or damaged."""

    def publish(self, keys: list[bytes], blocks: list[Block]) -> None:
        """Hold these blocks under these keys (fire and forget: a lost publish
        is a later miss). The arrays are the client's from here on."""

    def stats(self) -> dict[str, int]:
        """The store's figures (cluster_store.py), as last known: never waits."""

    def close(self) -> None: ...


def _checked(block: StoredBlock | None, data) -> Block | None:
    if block is None or data is None:
        return None
    array = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    if array.nbytes != block.nbytes or zlib.crc32(array.data) != block.crc32:
        return None
    return array


def _stored(payload, block: Block) -> StoredBlock:
    return StoredBlock(payload, zlib.crc32(block.data), block.nbytes)


class LocalClusterClient:
    """The process's own store, shared by its engines; fetches and publishes
    run on a thread of their own, as a remote store's would."""

    def __init__(self, store: KVClusterStore):
        self.store = store
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-cluster")

    def contains(self, keys: list[bytes]) -> concurrent.futures.Future[list[bool]]:
        done: concurrent.futures.Future[list[bool]] = concurrent.futures.Future()
        done.set_result(self.store.contains(keys))
        return done

    def fetch(self, keys: list[bytes]) -> concurrent.futures.Future[list[Block | None]]:
        def get() -> list[Block | None]:
            return [_checked(b, None if b is None else b.payload) for b in self.store.get(keys)]

        return self._pool.submit(get)

    def publish(self, keys: list[bytes], blocks: list[Block]) -> None:
        # Copies: one block's eviction must free its bytes, not wait for the rest of its batch.
        self._pool.submit(self.store.put, keys, [_stored(b.copy(), b) for b in blocks])

    def stats(self) -> dict[str, int]:
        return self.store.stats()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class ServeClusterClient:
    """The application's KVStore deployment, or the job's KVStore actor;
    blocks in Ray's object store.

    The replicas run their handles' routers on their own event loop
    (cluster/app.py): a call is made there, from this client's threads,
    when the replica gave its loop (use_store_handle)."""

    def __init__(self, handle, loop: asyncio.AbstractEventLoop | None = None):
        self.handle = handle
        self.loop = loop
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-cluster-fetch")
        self._publisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-cluster-publish")
        self._stats: dict[str, int] = {}
        self._stats_at = float("-inf")

    def contains(self, keys: list[bytes]) -> concurrent.futures.Future[list[bool]]:
        return self._pool.submit(self._call, "contains", keys)

    def _call(self, method: str, *args):
        """handle.method.remote(*args)'s result, waited for on this (non-loop) thread."""
        if self.loop is None:
            import ray

            response = getattr(self.handle, method).remote(*args)
            if isinstance(response, ray.ObjectRef):  # an actor's (job_store)
                return ray.get(response, timeout=FETCH_TIMEOUT_S)
            return response.result(timeout_s=FETCH_TIMEOUT_S)

        async def call():
            return await getattr(self.handle, method).remote(*args)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(FETCH_TIMEOUT_S)

    def fetch(self, keys: list[bytes]) -> concurrent.futures.Future[list[Block | None]]:
        return self._pool.submit(self._fetch, keys)

    def _fetch(self, keys: list[bytes]) -> list[Block | None]:
        import ray

        blocks = self._call("get", keys)
        out: list[Block | None] = []
        for block in blocks:
            data = None
            if block is not None:
                try:
                    data = ray.get(block.payload[0], timeout=FETCH_TIMEOUT_S)
                except Exception as e:  # lost with its node, or the owner restarted: a miss
                    logger.warning("a cluster-tier block could not be read: %s", type(e).__name__)
            out.append(_checked(block, data))
        return out

    def publish(self, keys: list[bytes], blocks: list[Block]) -> None:
        self._publisher.submit(self._publish, keys, blocks)

    def _publish(self, keys: list[bytes], blocks: list[Block]) -> None:
        try:
            held = self._call("contains", keys)  # what the store has already is not sent again
            new = [i for i, h in enumerate(held) if not h]
            if new:
                blocks = [blocks[i] for i in new]
                self._call("put_blocks", [keys[i] for i in new], [zlib.crc32(b.data) for b in blocks], blocks)
        except Exception as e:  # the store is gone or restarting: a later miss
            logger.warning("cluster-tier publish of %d block(s) failed: %s", len(keys), e)

    def stats(self) -> dict[str, int]:
        now = time.monotonic()
        if now - self._stats_at > STATS_PERIOD_S:  # refreshed on the publisher's thread, off the caller's
            self._stats_at = now
            self._publisher.submit(self._refresh_stats)
        return self._stats

    def _refresh_stats(self) -> None:
        try:
            self._stats = self._call("stats")
        except Exception as e:
            logger.debug("cluster-tier stats: %s", e)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._publisher.shutdown(wait=True)


_process_store: KVClusterStore | None = None
_process_lock = threading.Lock()


def process_store(capacity_bytes: int) -> KVClusterStore:
    """The store this process's engines share (the first engine sizes it)."""
    global _process_store
    with _process_lock:
        if _process_store is None:
            _process_store = KVClusterStore(capacity_bytes)
        return _process_store


def reset_process_store() -> None:
    """Forget the process's store, and end the job's (tests: a fresh cluster tier)."""
    global _process_store, _job_store
    with _process_lock:
        _process_store = None
        if _job_store is not None:
            import ray

            try:
                ray.kill(_job_store[1])
            except Exception:  # the cluster went first
                pass
            _job_store = None


_job_store: tuple[str, Any] | None = None  # (the Ray job, its store's handle: an ActorHandle)


def job_store(capacity_bytes: int):
    """The KVStore actor of this Ray job, made by the first caller (the
    first caller sizes it): where the ranks of tensor-parallel engines
    outside Serve keep their slices. The engine's process makes it before
    its ranks start and hands it to them, and keeps the handle that made
    it: the actor is that process's, and lives as long as it (or until
    reset_process_store), through the engines that come and go."""
    global _job_store
    import ray

    from shoal.workers.kv_transfer.cluster_store import KVStore

    with _process_lock:
        job = ray.get_runtime_context().get_job_id()
        if _job_store is None or _job_store[0] != job:  # none yet, or one of a cluster since shut down
            actor = ray.remote(KVStore).options(name=f"shoal-kv-cluster-{job}", get_if_exists=True, num_cpus=0)
            _job_store = (job, actor.remote(capacity_bytes))
        return _job_store[1]


_store_handle = None
_store_loop: asyncio.AbstractEventLoop | None = None


def use_store_handle(handle, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """The application's KVStore deployment, for this process's engines (a
    Worker replica is given it by the application: cluster/app.py), and the
    event loop its calls are made on (the replica's)."""
    global _store_handle, _store_loop
    _store_handle, _store_loop = handle, loop


def store_handle():
    """The KVStore deployment this process was given (use_store_handle), or None."""
    return _store_handle


def cluster_client(capacity_bytes: int, tensor_parallel: bool = False) -> ClusterTierClient:
    """The KVStore deployment's client where this process was given one;
    else, for a rank of a tensor-parallel engine, the job's KVStore actor's;
    else the process's store's."""
    if _store_handle is not None:
        return ServeClusterClient(_store_handle, _store_loop)
    if tensor_parallel:
        return ServeClusterClient(job_store(capacity_bytes))
    return LocalClusterClient(process_store(capacity_bytes))
